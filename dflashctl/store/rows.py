"""The store's rows: runs, events, samples and restarts as dataclasses.

Free-form data (configs, event details, GPU readings) live in JSON columns; never
pickles. Here too: how a row's JSON columns are decoded and encoded, and how a
sample's numbers are made finite before they are stored.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from dflashctl.core.states import ACTIVE_STATES

# Event kinds the store itself reads (the supervisor writes them).
EVENT_STATE = "state"
EVENT_REGRESSION = "regression"  # a throughput regression: the run is not a healthy baseline

_JSON_COLUMNS = {"config", "supervisor", "detail", "gpu", "data", "runs", "hosts", "report", "host_reading"}


@dataclass
class Run:
    id: str
    playbook: str
    host: str
    state: str
    created: float
    config: dict[str, Any] = field(default_factory=dict)
    bundle_hash: str | None = None
    started: float | None = None
    ended: float | None = None
    exit_code: int | None = None
    exit_reason: str | None = None
    run_dir: str | None = None
    tmux_session: str | None = None
    tmux_socket: str | None = None
    supervisor: dict[str, Any] | None = None
    metrics_offset: int = 0
    metrics_inode: int | None = None
    updated: float | None = None
    hosts: list[dict[str, Any]] = field(default_factory=list)  # a multi-host run's rows (run_hosts), by rank

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    def parts(self) -> list["Run"]:
        """The run as each of its hosts holds it, rank 0 first: the same run with that
        host's ``host``, ``run_dir`` and ``tmux_session`` (a single-host run: itself)."""
        if not self.hosts:
            return [self]
        return [replace(self, host=h["host"], run_dir=h["run_dir"], tmux_session=h["tmux_session"], hosts=[],
                        config={**self.config, "rank": h["rank"]})
                for h in sorted(self.hosts, key=lambda h: h["rank"])]

    @property
    def rank(self) -> int:
        """Which process of the run this view is (``parts``); 0 for the run itself."""
        return int((self.config or {}).get("rank", 0))

    @property
    def host_names(self) -> list[str]:
        return [h["host"] for h in sorted(self.hosts, key=lambda h: h["rank"])] or [self.host]

    @property
    def gpus(self) -> list[int]:
        """Physical GPU indices this run holds on its host (recorded at launch)."""
        return [int(g) for g in (self.config or {}).get("gpus", [])]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Event:
    id: int
    run_id: str | None
    time: float
    kind: str
    severity: str
    message: str
    detail: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Sample:
    id: int
    run_id: str
    time: float
    step: int
    tok_s: float | None = None
    loss: float | None = None
    acc: float | None = None
    accept_len: float | None = None
    eta_s: float | None = None
    phase: str | None = None
    gpu: Any = None
    mfu: float | None = None
    observed: float | None = None  # local time the supervisor received it (None: stored before this was kept)
    host_reading: Any = None  # its host's CPU and memory at that poll (parsers.HostReading as a dict)
    samples_s: float | None = None  # training samples (sequences) per second
    anchors_s: float | None = None  # anchor blocks per second
    mfu_measured: float | None = None  # MFU against the rate a large matmul reaches on the GPU (mfu: the nominal peak)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Restart:
    id: int
    run_id: str
    time: float
    reason: str
    signature: str | None = None
    action: str | None = None
    detect_delay_s: float | None = None
    downtime_s: float | None = None
    time_to_first_step_s: float | None = None
    step_before: int | None = None
    step_after: int | None = None
    outcome: str | None = None  # issuing | issued, then resumed or failed before its first step | not issued: why
    # | cancelled: why

    @property
    def issued(self) -> bool:
        """Whether its restart was issued: its process started (and maybe trained since)."""
        return self.outcome in ("issued", "resumed", "failed before its first step")

    @property
    def counts(self) -> bool:
        """Whether a process was (or may have been) started by it: the restart
        policy counts it. A restart never issued started nothing."""
        return not (self.outcome or "").startswith(("not issued", "cancelled"))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _decode(row: dict[str, Any]) -> dict[str, Any]:
    out = dict(row)
    for key in _JSON_COLUMNS & out.keys():
        if isinstance(out[key], str):
            out[key] = json.loads(out[key])
    return out


def _row_to(cls, row: dict[str, Any]):
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in _decode(row).items() if k in names})


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True, separators=(",", ":"))


_SAMPLE_NUMBERS = ("tok_s", "loss", "acc", "accept_len", "eta_s", "mfu")
_SAMPLE_EXTRAS = ("samples_s", "anchors_s", "mfu_measured")  # from a metrics line's extra
# An inserted sample row, in order (Store.add_samples builds its rows in this order).
_SAMPLE_COLUMNS = ("run_id", "time", "step", *_SAMPLE_NUMBERS[:5], "phase", "gpu", "mfu", "observed",
                   *_SAMPLE_EXTRAS, "host_reading")


def _number(value: Any) -> float | None:
    """A finite float, or None: a sample's numeric column never holds anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def _int64(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not -(2**63) <= value < 2**63:
        return None
    return value
