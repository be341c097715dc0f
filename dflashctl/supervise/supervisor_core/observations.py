"""What happened to a run since the last tick: the observations ``step`` takes.

The host answered (``Probed``) or did not (``Unreachable``), a restart or kill
finished (``JobDone``), or only time passed (``Clock``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from dflashctl.core import contract
from dflashctl.hosts.parsers import Rejected
from dflashctl.hosts.probe import ProbeResult
from dflashctl.supervise.detectors import Finding


@dataclass(frozen=True)
class Member:
    """A multi-host run's process on another host (rank > 0), as this tick saw it."""

    rank: int
    host: str
    result: ProbeResult | None  # None: its host did not answer (``error`` says why)
    error: str | None = None


@dataclass(frozen=True)
class Probed:
    """The host answered: this run's part of the probe, its new metrics lines parsed.
    A multi-host run: ``result`` is rank 0's (its metrics are the run's global
    figures) and ``members`` the other hosts' processes."""

    result: ProbeResult
    skew: float = 0.0  # host clock - local clock
    lines: tuple[contract.Metrics, ...] = ()
    rejected: tuple[Rejected, ...] = ()  # bad lines of the chunk (line numbers within it), skipped
    host_back: tuple[float, int] | None = None  # (down since, failed polls) when the host was unreachable until now
    members: tuple[Member, ...] = ()


@dataclass(frozen=True)
class Unreachable:
    """The host did not answer this poll (``detectors.detect_unreachable``'s finding)."""

    host: str
    finding: Finding
    polls: int  # failed polls in a row
    since: float
    worse: bool  # a new or worse severity for the host: written and alerted
    members: tuple["Member", ...] = ()  # a multi-host run: its other ranks, whose hosts may have answered


@dataclass(frozen=True)
class JobDone:
    """A restart or kill issued by an earlier step has finished."""

    kind: str  # restart | kill
    issued: float | None = None  # restart: when it was issued (local)
    error: str | None = None
    cancelled: bool = False  # the run ended (an operator's stop) before the restart was issued
    retry: bool = True  # False: the error is not one a retry can fix
    skew: float = 0.0  # the host's clock - local clock, as last measured


@dataclass(frozen=True)
class Clock:
    """Only time passed: a restart whose backoff is over is issued (when its host is up)."""

    host_up: bool = True


Observation = Union[Probed, Unreachable, JobDone, Clock]
