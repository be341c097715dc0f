"""The contract between the trainer and the controller.

Stdlib only, never torch: the trainer imports it on the GPU host and the
controller imports it on the operator's machine. Everything either side reads
from the other's files is defined here.

Run directory layout (written by the trainer):

    config.json        the resolved trainer configuration (written by the controller)
    status.json        current phase, pid, start time, last error signature
    metrics.jsonl      one JSON object per logging interval (see ``Metrics``)
    trainer.log        stdout and stderr of the trainer (tmux pipe-pane)
    checkpoints/       step-NNNNNNNN/ directories, newest is resumed
    exit_code          the trainer's exit status (written by the launcher's wrapper)
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

SCHEMA_VERSION = 1

CONFIG_FILE = "config.json"
STATUS_FILE = "status.json"
METRICS_FILE = "metrics.jsonl"
LOG_FILE = "trainer.log"
CHECKPOINT_DIR = "checkpoints"
EXIT_CODE_FILE = "exit_code"  # the trainer's exit status, written by the launcher's wrapper

# --------------------------------------------------------------------------- phases

PHASE_STARTING = "starting"
PHASE_COMPILING = "compiling"
PHASE_TRAINING = "training"
PHASE_CHECKPOINTING = "checkpointing"
PHASE_DONE = "done"
PHASE_STOPPED = "stopped"
PHASE_FAILED = "failed"
PHASES = (
    PHASE_STARTING,
    PHASE_COMPILING,
    PHASE_TRAINING,
    PHASE_CHECKPOINTING,
    PHASE_DONE,
    PHASE_STOPPED,
    PHASE_FAILED,
)
FINAL_PHASES = (PHASE_DONE, PHASE_STOPPED, PHASE_FAILED)

# --------------------------------------------------------------------------- exit codes

EXIT_DONE = 0
EXIT_CRASH = 1
EXIT_CONFIG_ERROR = 2
EXIT_DATA_ERROR = 3
EXIT_STOPPED = 4  # stopped by SIGINT/SIGTERM after writing a checkpoint

EXIT_MEANINGS = {
    EXIT_DONE: "done",
    EXIT_CRASH: "crash",
    EXIT_CONFIG_ERROR: "configuration error",
    EXIT_DATA_ERROR: "data error",
    EXIT_STOPPED: "stopped on request",
}


def describe_exit(code: int | None) -> str:
    """Operator words for a trainer exit code (negative: killed by that signal)."""
    if code is None:
        return "unknown exit"
    if code < 0 or code > 128:
        sig = -code if code < 0 else code - 128
        return f"killed by signal {sig}"
    return EXIT_MEANINGS.get(code, f"exit code {code}")


# --------------------------------------------------------------------------- metrics


@dataclass
class Metrics:
    """One line of metrics.jsonl. Unknown keys are kept in ``extra`` when parsing."""

    time: float
    step: int
    total_steps: int
    phase: str = PHASE_TRAINING
    tokens: int = 0  # tokens seen so far (query tokens of the drafter)
    tok_s: float | None = None  # whole pipeline, over the logging window
    loss: float | None = None
    acc: float | None = None  # mean per-slot accuracy
    accept_len: float | None = None  # expected acceptance length
    eta_s: float | None = None
    v: int = SCHEMA_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def to_line(self) -> str:
        d = asdict(self)
        extra = d.pop("extra")
        d.update(extra)
        return json.dumps(_finite(d), separators=(",", ":"), sort_keys=True)


_METRIC_FIELDS = {f.name for f in fields(Metrics)} - {"extra"}


def _finite(obj: Any) -> Any:
    """JSON has no NaN/inf: write them as null so every reader can parse the line."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def parse_metrics_line(line: str) -> Metrics | None:
    """Parse one metrics.jsonl line; None when it is malformed.

    Future fields are tolerated (kept in ``extra``); a line missing ``time`` or
    ``step`` is malformed.
    """
    line = line.strip()
    if not line:
        return None
    try:
        raw = json.loads(line)
    except ValueError:
        return None
    if not isinstance(raw, dict):
        return None
    try:
        known = {k: raw[k] for k in _METRIC_FIELDS if k in raw}
        extra = {k: v for k, v in raw.items() if k not in _METRIC_FIELDS}
        m = Metrics(**known, extra=extra)
        m.time = float(m.time)
        m.step = int(m.step)
        m.total_steps = int(m.total_steps)
    except (TypeError, ValueError):
        return None
    return m


# --------------------------------------------------------------------------- status


@dataclass
class Status:
    phase: str
    pid: int | None = None
    started: float | None = None  # unix time the process started
    updated: float | None = None
    step: int = 0
    error: str | None = None  # error signature, one line
    detail: dict[str, Any] = field(default_factory=dict)  # e.g. compile progress
    v: int = SCHEMA_VERSION

    def to_json(self) -> str:
        return json.dumps(_finite(asdict(self)), sort_keys=True)


def parse_status(text: str) -> Status | None:
    try:
        raw = json.loads(text)
        known = {f.name for f in fields(Status)}
        return Status(**{k: v for k, v in raw.items() if k in known})
    except (TypeError, ValueError, AttributeError):
        return None


def atomic_write_text(path: str, text: str) -> None:
    """Write then rename, so a reader never sees half a file."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_status(run_dir: str, status: Status) -> None:
    status.updated = time.time()
    atomic_write_text(os.path.join(run_dir, STATUS_FILE), status.to_json())


# --------------------------------------------------------------------------- errors

_ADDR = re.compile(r"0x[0-9a-fA-F]+")
_NUM = re.compile(r"\b\d+\b")


def error_signature(exc_type: str, message: str) -> str:
    """A stable one-line signature: the exception type and the first message line,
    with addresses and numbers blanked so repeats of one failure compare equal."""
    first = (message or "").strip().splitlines()[0] if (message or "").strip() else ""
    first = _NUM.sub("N", _ADDR.sub("0x?", first))[:200]
    return f"{exc_type}: {first}" if first else exc_type


def did_you_mean(name: str, choices) -> str:
    """' (did you mean 'x'?)' for the closest valid name, or ''."""
    import difflib

    close = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""
