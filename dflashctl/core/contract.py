"""The contract between the trainer and the controller.

Stdlib only, never torch: the trainer imports it on the GPU host and the
controller imports it on the operator's machine. (One exception, imported where it
is used: ``flash_attn_problem`` compares versions with ``packaging``, a dependency
of the controller that transformers brings to every trainer host.) Everything either side reads
from the other's files is defined here, and what both sides need besides:
directories only their user can write (``private_dir``), text made safe for a
terminal (``printable``).

Run directory layout (written by the trainer):

    config.json        the resolved trainer configuration (written by the controller)
    status.json        current phase, pid, start time, last error signature
    metrics.jsonl      one JSON object per logging interval (see ``Metrics``)
    trainer.log        stdout and stderr of the trainer (tmux pipe-pane)
    checkpoints/       step-NNNNNNNN/ directories, newest is resumed
    exit_code          the trainer's exit status (written by the launcher's wrapper)

The controller reads these files from hosts it does not control, so every reader
here treats its input as untrusted data: a line or file is size- and depth-checked
before it is parsed, every known field is type- and range-checked, and a bad input
gives a ``ContractError`` carrying the reason, never any other exception. Readers
never evaluate, execute or recurse without bound over what they read.
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
STANDBY_FILE = "standby.json"  # a standby trainer's pid and token, once its imports are done (trainer/standby.py)


# The controller's compile-cache generation, in a run's environment: it grows with every
# `dflashctl cache rm`, and a trainer that sees it grow drops the bytecode cache it keeps
# (travelled bytecode unpacked there included) before its imports (trainer/bytecode.py).
ARTIFACT_GENERATION_ENV = "DFLASH_ARTIFACT_GENERATION"


def lock_file(rank: int = 0) -> str:
    """The file whose flock makes one trainer the owner of a run directory (trainer/rundir_lock.py)."""
    return "trainer.lock" if rank == 0 else f"trainer.rank{rank}.lock"


def standby_go(token: str) -> str:
    """Made by the controller: the standby ``token`` is to train now."""
    return f"standby.{token}.go"


def standby_went(token: str) -> str:
    """Made by the standby when it takes over (its exit code is the run's from then on)."""
    return f"standby.{token}.went"


STANDBY_HOLD_S = 600.0  # how long a hold keeps a standby through a stop, at most (a restart that died leaves one)


def standby_hold(token: str) -> str:
    """Made by an operator's restart before it stops the trainer: the standby ``token``
    stays through that stop (exit code 'stopped') to be woken next, while the file is
    younger than ``STANDBY_HOLD_S``."""
    return f"standby.{token}.hold"


# flash-attention 4 (the package `flash-attn-4`, behind `compile.flex_kernel: flash`, and
# `auto` where it can run): its Hopper block-sparse backward gave silent wrong gradients in
# 0.1-1 % of launches before this release; the trainer refuses an older one and `dflashctl
# check` says which a host has.
FLASH_ATTN_PACKAGE = "flash-attn-4"
FLASH_ATTN_FIXED = "4.0.0b26"
FLASH_ATTN_SPEC = f"{FLASH_ATTN_PACKAGE}>={FLASH_ATTN_FIXED}"  # what to install
# nvidia-smi's names of the GPUs its kernels are built for (compute capability 9 or 10):
# Hopper (H100, H200, H800, H20, GH200), datacenter Blackwell (B100, B200, B300, GB200,
# GB300). Not the other Blackwells (RTX, GB10: compute capability 12).
_FLASH_GPU = re.compile(r"(NVIDIA )?(G?H\d{2,3}|G?B\d{3})\b")


def flash_attn_problem(version: str | None) -> str | None:
    """Why the FLASH path cannot run with flash-attn-4 ``version`` (None: it can)."""
    from packaging.version import InvalidVersion, Version

    if version is None:
        return f"{FLASH_ATTN_PACKAGE} is not installed"
    try:
        if Version(version) >= Version(FLASH_ATTN_FIXED):
            return None
    except InvalidVersion:
        return f"{FLASH_ATTN_PACKAGE} {version!r} is not a version this can compare"
    return (f"{FLASH_ATTN_PACKAGE} {version} is older than {FLASH_ATTN_FIXED}, whose Hopper block-sparse backward "
            "gave silent wrong gradients in 0.1-1 % of launches")


def flash_capable_gpu(name: str) -> bool:
    """Whether nvidia-smi's GPU ``name`` ('NVIDIA H100 80GB HBM3') is a Hopper or a
    datacenter Blackwell GPU, where flash-attention 4's kernels run."""
    return _FLASH_GPU.match(name.strip()) is not None


HOST_ENV = "DFLASHCTL_HOST"  # the inventory's name of the host a process runs on (set in run.sh)
# A multi-host run's secret for one start (hex), written by the controller into each
# host's run directory, mode 0600; every rank proves it before it accepts any data.
RENDEZVOUS_KEY_FILE = "rendezvous.key"


def status_file(rank: int = 0) -> str:
    """status.json of one process of a distributed run: rank 0 keeps the plain name."""
    return STATUS_FILE if rank == 0 else f"status.rank{rank}.json"


def metrics_file(rank: int = 0) -> str:
    """metrics.jsonl of one process of a distributed run: rank 0 keeps the plain name
    (and writes the run's global figures there)."""
    return METRICS_FILE if rank == 0 else f"metrics.rank{rank}.jsonl"

# --------------------------------------------------------------------------- phases

PHASE_STARTING = "starting"
# data.regenerate: the target writes the training data before training starts; it
# rewrites status.json (detail "regenerate": prompts done, tok/s, ETA) every
# REGENERATE_BEAT_S / 2 between decoding steps, so a silence longer than the stall
# window is a hang.
PHASE_REGENERATING = "regenerating"
REGENERATE_BEAT_S = 10.0
# A first scan of a large corpus in worker processes (trainer/data/scan_workers.py):
# status.json's detail "data" (shards and bytes scanned) every REGENERATE_BEAT_S / 2,
# judged like the regeneration by that sign of life, not by the start budget; the
# phase is "starting" again after it, and the start budget counts from there.
PHASE_INDEXING = "indexing"
PHASE_COMPILING = "compiling"
PHASE_TRAINING = "training"
PHASE_CHECKPOINTING = "checkpointing"
PHASE_DONE = "done"
PHASE_STOPPED = "stopped"
PHASE_FAILED = "failed"
PHASES = (
    PHASE_STARTING,
    PHASE_REGENERATING,
    PHASE_INDEXING,
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
EXIT_RUN_DIR_BUSY = 5  # another live trainer owns the run directory: this one never started
EXIT_DISK_FULL = 6  # a write failed for want of space (ENOSPC, EDQUOT): the log may be cut, the exit code says it

EXIT_MEANINGS = {
    EXIT_DONE: "done",
    EXIT_CRASH: "crash",
    EXIT_CONFIG_ERROR: "configuration error",
    EXIT_DATA_ERROR: "data error",
    EXIT_STOPPED: "stopped on request",
    EXIT_RUN_DIR_BUSY: "run directory owned by another trainer",
    EXIT_DISK_FULL: "disk full",
}

DISK_FULL_ERRNOS = frozenset({28, 122})  # ENOSPC, EDQUOT (Linux): a write refused for want of space


def disk_full_error(e: BaseException | None) -> bool:
    """Whether ``e`` or an exception it was raised from is a write refused for want
    of space (the trainer then ends with ``EXIT_DISK_FULL``)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            return True
        e = e.__cause__ or e.__context__
    return False


def describe_exit(code: int | None) -> str:
    """Operator words for a trainer exit code (negative: killed by that signal)."""
    if code is None:
        return "unknown exit"
    if code < 0 or code > 128:
        sig = -code if code < 0 else code - 128
        return f"killed by signal {sig}"
    return EXIT_MEANINGS.get(code, f"exit code {code}")


# --------------------------------------------------------------------------- reading untrusted files

MAX_LINE_CHARS = 1 << 20  # a metrics line or status.json longer than this is refused unread
MAX_DEPTH = 32  # JSON nesting deeper than this is refused before it is parsed
MAX_TEXT_CHARS = 4096  # the longest string value kept
INT64_MAX = 2**63 - 1
MAX_MAGNITUDE = 1e18  # the largest number a float field may hold


class ContractError(ValueError):
    """A metrics line or status.json that breaks the contract. ``reason`` says how,
    in words an operator can act on ("step is not an integer ('x')")."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|"|[\[\]{}]', re.DOTALL)


def json_depth_exceeds(text: str, limit: int = MAX_DEPTH) -> bool:
    """Whether JSON ``text`` nests arrays/objects deeper than ``limit``, found
    without parsing it (brackets inside strings do not count). Linear time: an
    unterminated string ends the scan."""
    if text.count("[") + text.count("{") <= limit:
        return False
    depth = 0
    for token in _JSON_TOKEN.finditer(text):
        t = token.group()
        if t == "[" or t == "{":
            depth += 1
            if depth > limit:
                return True
        elif t == "]" or t == "}":
            depth -= 1
        elif t == '"':  # no closing quote: not JSON, and nothing after it nests
            return False
    return False


def load_json_object(text: str, what: str = "text") -> dict[str, Any]:
    """``text`` -> the JSON object it holds, after the size and depth checks.
    Raises ``ContractError`` (only) when it is not one."""
    if not isinstance(text, str):
        raise ContractError(f"{what} is not text ({type(text).__name__})")
    if len(text) > MAX_LINE_CHARS:
        raise ContractError(f"{what} is {len(text)} characters long, over the {MAX_LINE_CHARS} limit")
    if json_depth_exceeds(text):
        raise ContractError(f"{what} nests deeper than {MAX_DEPTH} levels")
    try:
        raw = json.loads(text)
    except RecursionError:  # the depth check makes this unreachable; kept as a second wall
        raise ContractError(f"{what} nests too deep to parse") from None
    except ValueError as e:  # JSONDecodeError, or an integer of more digits than Python converts
        raise ContractError(f"{what} is not JSON: {str(e)[:120]}") from None
    if not isinstance(raw, dict):
        raise ContractError(f"{what} is a JSON {_json_type(raw)}, not an object")
    return raw


def _json_type(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number"
    )


def _show(value: Any) -> str:
    """A short, safe rendering of a bad value for a reason text."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, int):
        return repr(value) if value.bit_length() <= 64 else f"an integer of {value.bit_length()} bits"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return repr(value[:40] + ("..." if len(value) > 40 else ""))
    return f"a JSON {_json_type(value)}"


def check_int(value: Any, name: str, minimum: int = 0, maximum: int = INT64_MAX) -> int:
    """An integer in [minimum, maximum] (booleans and floats are not integers)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ContractError(f"{name} is not an integer ({_show(value)})")
    if not minimum <= value <= maximum:
        raise ContractError(f"{name} is out of range ({_show(value)}; expected {minimum}..{maximum})")
    return value


def check_float(value: Any, name: str, minimum: float = -MAX_MAGNITUDE, maximum: float = MAX_MAGNITUDE) -> float:
    """A finite number in [minimum, maximum], as float (an integer is accepted)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ContractError(f"{name} is not a number ({_show(value)})")
    if isinstance(value, float) and not math.isfinite(value):
        raise ContractError(f"{name} is not a finite number ({_show(value)})")
    if not minimum <= value <= maximum:  # exact for ints of any size: no float() before this
        raise ContractError(f"{name} is out of range ({_show(value)}; expected {minimum:g}..{maximum:g})")
    return float(value)


def check_text(value: Any, name: str, max_chars: int = MAX_TEXT_CHARS) -> str:
    """A string of at most ``max_chars`` characters that encodes as UTF-8 (a lone
    surrogate would break the store's writes later)."""
    if not isinstance(value, str):
        raise ContractError(f"{name} is not a string ({_show(value)})")
    if len(value) > max_chars:
        raise ContractError(f"{name} is {len(value)} characters long, over the {max_chars} limit")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ContractError(f"{name} is not valid UTF-8 text") from None
    return value


def check_phase(value: Any) -> str | None:
    """A known phase, or None for anything else (a newer trainer's phase included)."""
    return value if isinstance(value, str) and value in PHASES else None


def is_plain_json(value: Any, depth: int = MAX_DEPTH) -> bool:
    """Whether ``value`` is safe to keep, store and show: null, a boolean, an int64,
    a finite float, a capped UTF-8 string, or arrays/objects of those nested at
    most ``depth`` levels."""
    if value is None or isinstance(value, bool):
        return True
    if isinstance(value, int):
        return -INT64_MAX - 1 <= value <= INT64_MAX
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, str):
        return _is_text(value)
    if depth <= 0:
        return False
    if isinstance(value, list):
        return all(is_plain_json(v, depth - 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_text(k) and is_plain_json(v, depth - 1) for k, v in value.items())
    return False


def _is_text(value: str) -> bool:
    try:
        check_text(value, "text")
    except ContractError:
        return False
    return True


# --------------------------------------------------------------------------- metrics


@dataclass
class Metrics:
    """One line of metrics.jsonl. Unknown keys are kept in ``extra`` when parsing
    (only those whose values are plain JSON, see ``is_plain_json``)."""

    time: float
    step: int
    total_steps: int
    phase: str | None = PHASE_TRAINING  # None when a line names a phase this controller does not know
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
_METRIC_REQUIRED = ("time", "step", "total_steps")
_METRIC_INTS = ("step", "total_steps", "tokens", "v")
_METRIC_NONNEGATIVE = ("time", "tok_s", "eta_s")  # float fields below zero are nonsense
_METRIC_FLOATS = ("time", "tok_s", "loss", "acc", "accept_len", "eta_s")
_METRIC_OPTIONAL = ("tok_s", "loss", "acc", "accept_len", "eta_s")  # null allowed


def _finite(obj: Any) -> Any:
    """JSON has no NaN/inf: write them as null so every reader can parse the line."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def read_metrics_line(line: str) -> Metrics:
    """One metrics.jsonl line -> ``Metrics``, every field checked.

    Raises ``ContractError`` (and nothing else) with the reason when the line is
    blank, too long, too deep, not a JSON object, misses ``time``, ``step`` or
    ``total_steps``, or holds a known field of the wrong type or out of range.
    Integers are int64 and never booleans; numbers are finite; a phase this
    controller does not know reads as None. Unknown keys whose values are plain
    JSON are kept in ``extra``; others are dropped (the line is still good).
    """
    if not isinstance(line, str):
        raise ContractError(f"line is not text ({type(line).__name__})")
    if len(line) > MAX_LINE_CHARS:  # before strip(): never copy a huge line
        raise ContractError(f"line is {len(line)} characters long, over the {MAX_LINE_CHARS} limit")
    line = line.strip()
    if not line:
        raise ContractError("blank line")
    raw = load_json_object(line, "line")
    missing = [k for k in _METRIC_REQUIRED if k not in raw]
    if missing:
        raise ContractError(f"{', '.join(missing)} missing")
    known: dict[str, Any] = {}
    for name in _METRIC_INTS:
        if name in raw:
            known[name] = check_int(raw[name], name)
    for name in _METRIC_FLOATS:
        if name in raw and not (raw[name] is None and name in _METRIC_OPTIONAL):
            known[name] = check_float(raw[name], name, minimum=0.0 if name in _METRIC_NONNEGATIVE else -MAX_MAGNITUDE)
    if "phase" in raw:
        known["phase"] = check_phase(raw["phase"])
    extra = {k: v for k, v in raw.items() if k not in _METRIC_FIELDS and _is_text(k) and is_plain_json(v)}
    return Metrics(**known, extra=extra)


def parse_metrics_line(line: str) -> Metrics | None:
    """Parse one metrics.jsonl line; None when it is malformed (``read_metrics_line``
    says why). Never raises."""
    try:
        return read_metrics_line(line)
    except ContractError:
        return None


# --------------------------------------------------------------------------- status


@dataclass
class Status:
    phase: str | None  # None: missing, or a phase this controller does not know
    pid: int | None = None
    started: float | None = None  # unix time the process started
    updated: float | None = None
    step: int | None = 0
    error: str | None = None  # error signature, one line
    detail: dict[str, Any] = field(default_factory=dict)  # e.g. compile progress
    v: int | None = SCHEMA_VERSION
    # Set when read: each field that was unusable (and so is None or dropped), and why.
    # Never written to status.json.
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        d = asdict(self)
        d.pop("problems")
        return json.dumps(_finite(d), sort_keys=True)


# field -> check; a field that fails becomes None (``detail``: the bad key is dropped)
_STATUS_CHECKS = {
    "pid": lambda v: check_int(v, "pid", minimum=1),
    "started": lambda v: check_float(v, "started", minimum=0.0),
    "updated": lambda v: check_float(v, "updated", minimum=0.0),
    "step": lambda v: check_int(v, "step"),
    "error": lambda v: check_text(v, "error"),
    "v": lambda v: check_int(v, "v"),
}


# status.json's ``detail`` while a warm-up's helper processes run (trainer/warmup_helpers.py):
# their pids, so that the GPU pane names them as the run's own, not as foreign processes.
STATUS_WARMUP_HELPERS = "warmup_helpers"
MAX_WARMUP_HELPERS = 64


def warmup_helper_pids(status: Status | None) -> list[int]:
    """The pids a status names as its warm-up helpers: positive integers only, at most
    ``MAX_WARMUP_HELPERS``; anything else in their place is ignored (never raises)."""
    pids = (status.detail if status is not None else {}).get(STATUS_WARMUP_HELPERS)
    if not isinstance(pids, list):
        return []
    return [p for p in pids[:MAX_WARMUP_HELPERS] if isinstance(p, int) and not isinstance(p, bool) and 1 <= p <= INT64_MAX]


def read_status(text: str) -> Status:
    """status.json text -> ``Status``, every field checked.

    Raises ``ContractError`` (only) when the text as a whole is unusable: too
    long, too deep, not JSON, not an object. A bad field does not spoil the rest:
    it reads as None (``detail``: the bad key is dropped, a non-object detail is
    empty) and ``problems`` records why. An unknown phase is None with a problem;
    null for an optional field is simply None. Unknown keys are ignored.
    """
    raw = load_json_object(text, "status")
    problems: list[str] = []
    values: dict[str, Any] = {}
    phase = raw.get("phase")
    values["phase"] = check_phase(phase)
    if values["phase"] is None:
        problems.append("phase missing" if phase is None else f"phase {_show(phase)} is not a known phase")
    for name, check in _STATUS_CHECKS.items():
        if name not in raw:
            continue
        if raw[name] is None:
            values[name] = None
            continue
        try:
            values[name] = check(raw[name])
        except ContractError as e:
            values[name] = None
            problems.append(e.reason)
    detail = raw.get("detail")
    if isinstance(detail, dict):
        values["detail"] = {k: v for k, v in detail.items() if _is_text(k) and is_plain_json(v)}
        problems += [f"detail.{k[:40]} dropped: not plain JSON" for k in detail if k not in values["detail"]]
    elif detail is not None:
        problems.append(f"detail is not an object ({_show(detail)})")
    return Status(**values, problems=problems)


def parse_status(text: str) -> Status | None:
    """status.json text -> ``Status`` (bad fields None, see ``read_status``), or None
    when the text is unusable as a whole. Never raises."""
    try:
        return read_status(text)
    except ContractError:
        return None


def atomic_write_text(path: str, text: str) -> None:
    """Write then rename, so a reader never sees half a file."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write then rename (a new temporary file beside it, never through a link)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _visible(char: str) -> str:
    return f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"


# C0 and C1 control characters (ESC starts ANSI sequences; 0x9b is a one-byte CSI)
# but newline and tab, and the invisible bidirectional overrides that reorder text.
_CONTROL = {
    code: _visible(chr(code))
    for code in [*range(0x20), *range(0x7F, 0xA0), 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
    if chr(code) not in "\n\t"
}


def printable(text: object) -> str:
    """Text from a host, a checkpoint or the store as plain text for a terminal:
    control characters (ANSI escape sequences, carriage returns, bidirectional
    overrides) shown as ``\\x1b``-style escapes instead of being interpreted;
    newlines and tabs kept. (The controller's home for it: core/terminal.py.)"""
    return str(text).translate(_CONTROL)


class UnsafeDirectory(ValueError):
    """A directory another user could write into, refused before anything in it is
    used. The message names the path, its owner and the fix."""


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def private_dir(path: str, what: str = "directory") -> str:
    """``path`` (``~`` expanded) as a directory only this user can write: created
    mode 0700 (its missing parents too) when absent; when present, used only if it is
    owned by this user and not group- or world-writable, and every directory above it
    is owned by root or this user and writable by no one else (a sticky one, /tmp,
    excepted). Else ``UnsafeDirectory``: another user who made it first could plant
    code (bytecode, a wheel) or pin what is in it. Returns the absolute path."""
    path = os.path.abspath(os.path.expanduser(path))
    missing = []
    probe = path
    while not os.path.lexists(probe) and probe != os.path.dirname(probe):
        missing.append(probe)
        probe = os.path.dirname(probe)
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:  # a concurrent start made it: checked below like any other
            pass
    me = os.geteuid()
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError as e:
        raise UnsafeDirectory(f"{what} {path}: {e.strerror}") from None
    if not os.path.isdir(real):
        raise UnsafeDirectory(f"{what} {path} is not a directory")
    fix = f"use a directory of your own, or remove {real} (what another user left in it stays otherwise) " \
          "and let it be created again, mode 0700"
    if st.st_uid != me:
        raise UnsafeDirectory(f"{what} {path} is owned by {_owner(st.st_uid)}, not by {_owner(me)} who runs "
                              f"this: another user could have put code in it; {fix}")
    if st.st_mode & 0o022:
        raise UnsafeDirectory(f"{what} {path} is writable by its group or others (mode {st.st_mode & 0o7777:o}): "
                              f"another user could put code in it; {fix} (or, if no one else can have written in "
                              f"it, as with a group of your own: chmod go-w {real})")
    above = os.path.dirname(real)
    while True:
        up = os.stat(above)
        if up.st_uid not in (0, me) or (up.st_mode & 0o022 and not up.st_mode & 0o1000):
            how = (f"owned by {_owner(up.st_uid)}" if up.st_uid not in (0, me)
                   else f"writable by others (mode {up.st_mode & 0o7777:o})")
            raise UnsafeDirectory(f"{what} {path}: the directory above it, {above}, is {how}: another user could "
                                  f"replace {path}; use a directory under one that only you and root can write")
        if above == os.path.dirname(above):
            return path
        above = os.path.dirname(above)


def append_line(path: str, line: str) -> None:
    """Append one line to a run file, never through a symbolic link: a run directory
    is shared with whoever can write into it, and the trainer may run as root."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if os.path.islink(path):
            raise OSError(e.errno, f"{path} is a symbolic link; run files are never written through links") from None
        raise
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        f.write(line.rstrip("\n") + "\n")


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


# --------------------------------------------------------------------------- acceptance (tau)
#
# One meaning of tau everywhere, as published for DFlash and EAGLE: the tokens one
# target forward yields, accepted draft tokens + 1 (the target's own token). The
# trainer logs ``accept_len``, the expected run of correct drafter slots at the
# training anchors (teacher forced on the data): ``tau_estimate`` is that + 1, shown
# as "τ est". The measured tau ("τ") comes from real speculative decoding
# (``python -m trainer eval``). Where the data was written by the target itself the
# two agree; they part when it was not, which is the usual cause of a drafter that
# trains well and accepts little in serving.

TAU_GAP_MARGIN = 0.10
"""Measured tau further than this fraction below ``tau_estimate`` is a gap worth a word."""
TAU_GAP_REASON = ("the training data was usually not written by this target: the drafter learned the data, the "
                  "target decodes otherwise (regenerate the responses with the target: "
                  "python -m trainer.data regenerate, or data.regenerate in the playbook)")


def tau_estimate(accept_len: float | None) -> float | None:
    """The training-time tau: ``accept_len + 1`` (None when there is no accept_len)."""
    return None if accept_len is None else float(accept_len) + 1.0


def tau_gap(tau_est: float | None, tau: float | None, margin: float = TAU_GAP_MARGIN) -> str | None:
    """Why the measured tau is well below the estimate (a sentence), or None when
    either is missing or they agree within ``margin`` of the estimate."""
    if tau_est is None or tau is None or tau_est <= 0:
        return None
    if tau >= tau_est * (1.0 - margin):
        return None
    return (f"measured τ {tau:.2f} is {100 * (1 - tau / tau_est):.0f}% below τ est {tau_est:.2f} "
            f"(more than {100 * margin:.0f}%): {TAU_GAP_REASON}")
