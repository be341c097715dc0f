"""What the supervisor knows of one run between two ticks: ``RunState`` and its parts.

A pending restart, the latest restart's cost, the findings already written. ``step``
copies the state and returns the new one; the shell rebuilds it from the store on attach.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from dflashctl.hosts.probe import OomKills, ProbeArgs
from dflashctl.supervise import policy
from dflashctl.supervise.detectors import Held, Sample

if TYPE_CHECKING:
    from dflashctl.store import Run

# The job in flight (``RunState.job``): the run is not probed until it is done.
KILL = "kill"
RESTART = "restart"
STOP = "stop"  # the processes of ranks whose stop is pending (``stopping``)


@dataclass(frozen=True)
class Pending:
    """A restart decided, waiting for its backoff."""

    due: float
    action: str  # restart | restart_serialized
    reason: str
    signature: str | None
    detected_at: float
    failed_at: float | None
    step_before: int | None
    tries: int = 0
    hung: bool = False  # a process that stopped answering is ended by it: its stacks are asked for first


@dataclass(frozen=True)
class Latest:
    """The latest restart: its cost is known once its process has made a step."""

    issued_at: float
    failed_at: float | None
    first_step_at: float | None = None
    step_after: int | None = None


@dataclass(frozen=True)
class Open:
    """A finding already written: since when, how bad, its wording, when last written."""

    severity: str
    since: float
    written: float
    shape: str


@dataclass
class RunState:
    """One run as the supervisor follows it; rebuilt from the store on attach."""

    run: Run
    args: ProbeArgs
    samples: tuple[Sample, ...] = ()  # the current process's, the last WINDOW
    history: tuple[policy.Restart, ...] = ()
    baseline: float | None = None
    phase: str | None = None
    phase_since: float | None = None  # host clock
    phase_said: bool = True  # the current phase was written as an event (a routine one: only once it lasted)
    step_max: int | None = None  # highest step of the current process
    attempt_started: float | None = None  # local: when the current process was started by a restart
    last_ok: float | None = None  # local: the last poll that saw the trainer healthy
    oom_seen: OomKills | None = None  # the kernel's OOM-kill counts at that poll
    healthy_since: float | None = None  # local: first step of the current process
    stalled_at_step: int | None = None  # step_max when the run went stalled: "progress again" needs a newer one
    pending: Pending | None = None
    job: str | None = None  # restart | kill in flight: the run is not probed until it is done
    latest: Latest | None = None
    restart_issued: bool = False  # a restart we issued whose process was not yet seen running
    crash_seen: float | None = None  # local: when the trainer's end (a crash or a finish) was first seen
    conflict_seen: float | None = None  # local: since when the evidence disagrees (reported after SETTLE_S)
    metrics_line: int | None = None  # lines of metrics.jsonl read so far (None: attached mid-file)
    last_line: tuple[float, int] | None = None  # (time, step) of the newest line stored
    probe_errors: tuple[str, ...] = ()  # the per-run problems the probe reported last (each written once)
    bad_times: int = 0  # metrics lines ignored for a timestamp that cannot be true
    bad_times_written: float | None = None  # local: when that was last written as an event
    findings: dict[str, Open] = field(default_factory=dict)
    held: dict[str, Held] = field(default_factory=dict)  # findings under hysteresis (``detectors.hold``), local clock
    state_before_lost: str | None = None
    compile_cache: str | None = None  # the current process's compile_cache outcome, from its metrics lines
    cache_fetch: bool = False  # the current process's compile artifacts were asked for (FetchCompileCache)
    ranks_ended: frozenset = frozenset()  # a multi-host run: (rank, pid) of the processes whose end was written
    standby_for: int | None = None  # pid of the process whose successor's standby was started
    standby_seen: int | None = None  # pid of a standby this supervisor found waiting (kept, not replaced)
    # The stall detector held back (its process stopped on purpose, ``detectors.holds_back``):
    # ``holding`` while it does, ``held_until`` (host clock) the first poll after it,
    # from which quiet time counts (``detectors.detect_stall``). A host that did not
    # answer holds nothing back: the lines its trainer wrote meanwhile are read after.
    holding: bool = False
    held_until: float | None = None
    rank_gone_at: dict = field(default_factory=dict)  # a multi-host run: rank -> local time its end was first seen
    rank_steps: dict = field(default_factory=dict)  # a multi-host run: rank -> (step, local time first seen at it)
    members_down: dict = field(default_factory=dict)  # a multi-host run: rank -> (down since, polls, severity written)
    stop_pending: frozenset = frozenset()  # ranks a stop could not reach: the run is lost until they are gone

    @property
    def id(self) -> str:
        return self.run.id

    def copy(self) -> "RunState":
        return replace(self, findings=dict(self.findings), held=dict(self.held))
