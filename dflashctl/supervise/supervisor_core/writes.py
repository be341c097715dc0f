"""What a step returns: writes for the store, then actions for the shell.

The caller stores the writes in one transaction, then executes the actions.
``_Out`` collects both while a step runs; ``jsonable`` keeps their details JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from dflashctl.core import contract


@dataclass(frozen=True)
class Event:
    kind: str
    severity: str
    message: str
    detail: dict | None = None


@dataclass(frozen=True)
class Transition:
    to: str
    message: str
    detail: dict | None = None
    severity: str | None = None
    exit_code: int | None = None
    exit_reason: str | None = None


@dataclass(frozen=True)
class Samples:
    """New metrics lines, stored with the metrics.jsonl position after them."""

    lines: tuple[contract.Metrics, ...]
    offset: int
    inode: int | None
    observed: float | None = None  # local time the lines were received


@dataclass(frozen=True)
class Readings:
    """One poll's readings of a host, stored whatever its runs wrote (``readings``)."""

    host: str
    observed: float  # local time of the answer
    gpu: list | None  # every GPU with its compute processes
    reading: dict | None  # its CPU and memory (parsers.HostReading's fields)


@dataclass(frozen=True)
class RestartRow:
    """Written before the restart is issued (outcome "issuing"), so a supervisor that
    dies while issuing it still leaves the row the crash-loop guard counts."""

    time: float
    reason: str
    signature: str | None
    action: str
    step_before: int | None
    detect_delay_s: float | None
    outcome: str = "issuing"


@dataclass(frozen=True)
class HostRows:
    """A multi-host run: what each host's process showed this tick (store.update_run_hosts)."""

    rows: tuple[dict, ...]


@dataclass(frozen=True)
class RestartUpdate:
    """Fill in the run's latest restart row."""

    changes: dict


@dataclass(frozen=True)
class IssueRestart:
    serialized: bool
    marker: str  # written to trainer.log before the new process starts
    hung: bool  # the old process hangs: dump its stacks (SIGUSR1) before it is killed


@dataclass(frozen=True)
class KillSession:
    pass


@dataclass(frozen=True)
class StopParts:
    """Stop the processes of these ranks (a stop that could not reach their hosts before)."""

    ranks: tuple[int, ...]


@dataclass(frozen=True)
class FetchCompileCache:
    """Copy the run's compile artifacts back into the local cache store (the trainer
    compiled them because it found none that fit: ``outcome`` says why)."""

    outcome: str


@dataclass(frozen=True)
class StartStandby:
    """Start the next process's standby beside the one training now (trainer/standby.py)."""


@dataclass(frozen=True)
class EndStandby:
    """The run ended: its standby has nothing to wait for."""


@dataclass(frozen=True)
class RunEval:
    """Evaluate the finished run's drafter (speculative decoding on its host)."""


@dataclass(frozen=True)
class Alert:
    kind: str
    severity: str
    message: str
    detail: dict | None = None


Write = Union[Event, Transition, Samples, Readings, RestartRow, RestartUpdate, HostRows]
Action = Union[IssueRestart, KillSession, StopParts, RunEval, FetchCompileCache, StartStandby, EndStandby, Alert]


@dataclass
class _Out:
    writes: list = field(default_factory=list)
    actions: list = field(default_factory=list)

    def event(self, kind: str, severity: str, message: str, detail: dict | None = None) -> None:
        self.writes.append(Event(kind, severity, message, jsonable(detail)))

    def alert(self, kind: str, severity: str, message: str, detail: dict | None = None) -> None:
        self.actions.append(Alert(kind, severity, message, jsonable(detail)))


def jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
