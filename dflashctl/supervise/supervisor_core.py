"""The supervisor's decisions for one run, as one pure function.

    step(state, observation, now, policy) -> (state', writes, actions)

``state`` is everything the supervisor knows of a run between two ticks
(``RunState``); ``observation`` is what happened to it since (``Probed``: its
host's probe answer; ``Unreachable``: its host did not answer; ``JobDone``: a
restart or kill issued earlier has finished; ``Clock``: only time passed);
``now`` is the local clock. The result says what to store (``writes``: events,
state transitions, samples, restart rows, all written by the caller in one
transaction) and what to do (``actions``: restart, kill the session, alert,
evaluate, copy compile artifacts back; executed by the caller after the writes).

This module never does I/O, never reads a clock and draws no random number of
its own (the backoff's jitter comes from ``Policy.rng``): the same state and
observation give the same answer, so the supervisor's behaviour is tested as
tables of observations in, writes and actions out (tests/test_supervisor_core.py).
The shell around it (``dflashctl.supervise.supervisor``) probes, stores and acts.

Clocks: events, restart rows and the restart policy use the local clock; samples,
phase tracking and the detectors the host's (host time - skew = local time).

A restart's cost, in its restarts row:

    detect_delay_s        detection - failure. The failure time is the trainer's own
                          when it reported one (status.json ``failed``), else its
                          latest sign of life: the last poll that saw it healthy (an
                          upper bound) or, for a supervisor that re-attached and has
                          seen no such poll, its newest metrics line; for a stall its
                          last step, or the end of a stopped episode when later.
    downtime_s            failure -> first step of the restarted process
    time_to_first_step_s  restart issued -> first step of the restarted process
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Union

from dflashctl.core import contract, logtext, signatures
from dflashctl.core.states import (
    DONE,
    FAILED,
    FINAL_STATES,
    LAUNCHING,
    LOST,
    RESTARTING,
    RUNNING,
    STALLED,
    STOPPED,
    TRANSITIONS,
    more_severe,
)
from dflashctl.core.units import fmt_duration
from dflashctl.hosts.parsers import Rejected
from dflashctl.hosts.probe import ProbeArgs, ProbeResult
from dflashctl.supervise import detectors, policy
from dflashctl.supervise.detectors import Finding, Sample

if TYPE_CHECKING:
    from dflashctl.config import Alerts, EvalSettings, Expect, Playbook, RestartPolicy
    from dflashctl.store import Run

WINDOW = 256  # samples kept per run for the detectors
LOST_AFTER_POLLS = 2  # one failed poll can be a blip; two in a row mark the host's runs lost
RESTART_TRIES = 3  # restarts that could not be issued (host gone) before the run is failed
SETTLE_S = 3.0  # a process found gone: wait this long for run.sh to write its exit code
REPEAT_FINDING_S = 600.0  # a lasting finding is written (and alerted) again this often
# A host timestamp (metrics line, status.json) is believed when, on the local clock
# (host time - measured skew), it lies after the run was created (less this margin)
# and before the answer arrived (plus this margin and two poll intervals).
CLOCK_PAST_MARGIN_S = 600.0
CLOCK_FUTURE_MARGIN_S = 120.0
# A line's own account of when its process began training (time - elapsed_s) may
# be this much before the restart that began it (rounding, the skew's error).
ATTEMPT_SLACK_S = 1.0
RESTART_MARKER = logtext.RESTART_MARKER  # the trainer.log line written before each restart
DEFAULT_DISTRIBUTED_TIMEOUT_S = 300.0  # the trainer's distributed.timeout when a run's config has none
ROW_ERROR_CHARS = 500  # of a host's probe errors kept in its run_hosts row (host text: bounded)

KILL = "kill"
RESTART = "restart"


# --------------------------------------------------------------------------- policy


@dataclass
class RunPolicy:
    """What a run is held to: its playbook's expectations, restart policy, alert hooks
    and signatures, as the playbook file says now."""

    playbook: str
    expect: "Expect"
    restart: "RestartPolicy"
    alerts: "Alerts"
    signatures: list = field(default_factory=list)
    poll_interval: float = 15.0
    eval: "EvalSettings | None" = None  # evaluate the drafter when the run ends done (eval.after_done)

    @classmethod
    def from_playbook(cls, pb: "Playbook") -> "RunPolicy":
        return cls(pb.name, pb.expect, pb.restart, pb.alerts, list(pb.signatures), float(pb.poll_interval),
                   pb.eval)

    @classmethod
    def defaults(cls, playbook: str) -> "RunPolicy":
        from dflashctl.config import Alerts, Expect, RestartPolicy

        return cls(playbook, Expect(), RestartPolicy(), Alerts())


@dataclass
class Policy:
    """The run's playbook policy and how this supervisor acts on it."""

    run: RunPolicy
    act: bool = True  # False: observe only (samples, findings, alerts), never change or restart the run
    interval: float = 15.0  # the supervisor's poll interval: a failed restart is tried again after it
    escalate_after: float = 300.0  # an unreachable host becomes critical after this long
    rng: random.Random = field(default_factory=lambda: random.Random(0))  # the backoff's jitter


# --------------------------------------------------------------------------- state


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
    step_max: int | None = None  # highest step of the current process
    attempt_started: float | None = None  # local: when the current process was started by a restart
    last_ok: float | None = None  # local: the last poll that saw the trainer healthy
    healthy_since: float | None = None  # local: first step of the current process
    pending: Pending | None = None
    job: str | None = None  # restart | kill in flight: the run is not probed until it is done
    latest: Latest | None = None
    restart_issued: bool = False  # a restart we issued whose process was not yet seen running
    crash_seen: float | None = None
    conflict_seen: float | None = None  # local: since when the evidence disagrees (reported after SETTLE_S)
    metrics_line: int | None = None  # lines of metrics.jsonl read so far (None: attached mid-file)
    last_line: tuple[float, int] | None = None  # (time, step) of the newest line stored
    probe_errors: tuple[str, ...] = ()  # the per-run problems the probe reported last (each written once)
    bad_times: int = 0  # metrics lines ignored for a timestamp that cannot be true
    bad_times_written: float | None = None  # local: when that was last written as an event
    findings: dict[str, Open] = field(default_factory=dict)
    state_before_lost: str | None = None
    compile_cache: str | None = None  # the current process's compile_cache outcome, from its metrics lines
    cache_fetch: bool = False  # the current process's compile artifacts were asked for (FetchCompileCache)
    ranks_ended: frozenset = frozenset()  # a multi-host run: (rank, pid) of the processes whose end was written
    standby_for: int | None = None  # pid of the process whose successor's standby was started
    # The stall detector held back (its process stopped on purpose, ``detectors.holds_back``):
    # ``holding`` while it does, ``held_until`` (host clock) the first poll after it,
    # from which quiet time counts (``detectors.detect_stall``). A host that did not
    # answer holds nothing back: the lines its trainer wrote meanwhile are read after.
    holding: bool = False
    held_until: float | None = None
    rank_gone_at: dict = field(default_factory=dict)  # a multi-host run: rank -> local time its end was first seen
    rank_steps: dict = field(default_factory=dict)  # a multi-host run: rank -> (step, local time first seen at it)
    members_down: dict = field(default_factory=dict)  # a multi-host run: rank -> (down since, polls, severity written)

    @property
    def id(self) -> str:
        return self.run.id

    def copy(self) -> "RunState":
        return replace(self, findings=dict(self.findings))


# --------------------------------------------------------------------------- observations


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


# --------------------------------------------------------------------------- writes and actions


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
    gpu: list | None
    offset: int
    inode: int | None
    observed: float | None = None  # local time the lines were received
    host: dict | None = None  # the host's CPU and memory at that poll (parsers.HostReading's fields)


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


Write = Union[Event, Transition, Samples, RestartRow, RestartUpdate, HostRows]
Action = Union[IssueRestart, KillSession, RunEval, FetchCompileCache, StartStandby, EndStandby, Alert]


@dataclass
class _Out:
    writes: list = field(default_factory=list)
    actions: list = field(default_factory=list)

    def event(self, kind: str, severity: str, message: str, detail: dict | None = None) -> None:
        self.writes.append(Event(kind, severity, message, jsonable(detail)))

    def alert(self, kind: str, severity: str, message: str, detail: dict | None = None) -> None:
        self.actions.append(Alert(kind, severity, message, jsonable(detail)))


# --------------------------------------------------------------------------- the step


def step(state: RunState, obs: Observation, now: float, pol: Policy) -> tuple[RunState, list, list]:
    """One observation of one run: (its new state, what to store, what to do)."""
    s, out = state.copy(), _Out()
    if isinstance(obs, Probed):
        if obs.host_back is not None or s.run.state == LOST:
            _host_back(s, obs, now, pol, out)
        _observe(s, obs, now, pol, out)
    elif isinstance(obs, Unreachable):
        _unreachable(s, obs, now, pol, out)
    elif isinstance(obs, JobDone):
        s.job = None
        if obs.kind == RESTART:
            _restarted(s, obs, now, pol, out)
        elif obs.error is not None:
            out.event("stop", "warning", f"could not kill tmux session {s.run.tmux_session}: {obs.error}")
    elif isinstance(obs, Clock):
        if pol.act and s.pending is not None and s.job is None and now >= s.pending.due and obs.host_up:
            _issue_restart(s, now, out)
    else:
        raise TypeError(f"not an observation: {obs!r}")
    return s, out.writes, out.actions


# --------------------------------------------------------------------------- a probe answer


def _observe(s: RunState, obs: Probed, local: float, pol: Policy, out: _Out) -> None:
    skew = obs.skew
    now = local + skew  # the host's clock
    errors = tuple(obs.result.errors or ())
    new = [e for e in errors if e not in s.probe_errors]
    if new:
        out.event("probe", "warning", f"the probe could not read everything of this run: {'; '.join(new[:3])}"
                  + (f"; and {len(new) - 3} more" if len(new) > 3 else ""), {"errors": new[:20]})
    s.probe_errors = errors
    _ingest_metrics(s, obs, local, pol, out)
    pr = _believed_status(s, obs.result, skew, local, pol)
    status = pr.status
    if status is not None and status.step and status.step > (s.step_max or 0):
        s.step_max = status.step
    _track_phase(s, pr, now, skew, out)

    if s.run.hosts:
        _note_ends(s, pr, obs.members, local)
        _note_steps(s, pr, obs.members, local)
        _members(s, obs, local, pol, out)
    started = status is not None and pr.exit_code is None and status.phase not in contract.FINAL_PHASES
    if started and pol.act and s.run.state == LAUNCHING:
        _transition(s, out, RUNNING, f"trainer started (pid {status.pid}, phase {status.phase})")
    elif started and pol.act and s.run.state == RESTARTING and s.restart_issued:
        s.restart_issued = False
        _transition(s, out, RUNNING, f"trainer running again (pid {status.pid}, phase {status.phase})")
    if s.run.state == RESTARTING and (s.pending is not None or not s.restart_issued):
        return  # a restart is coming: ours after its backoff, or an operator's

    if s.holding:
        s.held_until = now  # the first answer since the detector held back: quiet time counts from here
    findings = detectors.detect(
        list(s.samples), pr, LAUNCHING if s.run.state == RESTARTING else s.run.state, pol.run.expect, now,
        baseline_tok_s=s.baseline, assigned_gpus=s.run.gpus or None, phase_since=s.phase_since,
        held_until=s.held_until,
    )
    s.holding = detectors.holds_back(findings)
    if not {f.kind for f in findings} & {detectors.CRASH, detectors.STALL, detectors.FINISHED}:
        s.last_ok, s.crash_seen = local, None
    if not any(f.kind == detectors.CONFLICT for f in findings):
        s.conflict_seen = None
    else:
        # run.sh needs a moment between the trainer's end and its own: a disagreement
        # that lasts is news, one that settles is not.
        s.conflict_seen = s.conflict_seen or local
        if local - s.conflict_seen < SETTLE_S:
            findings = [f for f in findings if f.kind != detectors.CONFLICT]
    if s.run.hosts:
        findings = [_name_host(f, s, pr, obs.members) for f in findings]
        hung = _hung_peer(s, pr, obs.members, local)
        if hung is not None and not any(f.kind == detectors.CRASH for f in findings):
            findings = [hung, *findings]
    _act(s, pr, findings, local, skew, pol, out)
    _fetch_compile_cache(s, local, pol, out)
    _standby(s, status, pol, out)


def _standby(s: RunState, status: contract.Status | None, pol: Policy, out: _Out) -> None:
    """Once a process trains, its successor's standby is started beside it (once per
    process: a standby that took over gets one of its own when it trains)."""
    if not (pol.act and pol.run.restart.standby and pol.run.restart.enabled) or status is None:
        return
    if s.run.state != RUNNING or s.phase != contract.PHASE_TRAINING or s.pending is not None or s.job is not None:
        return
    if status.pid is None or status.pid == s.standby_for:
        return
    s.standby_for = status.pid
    out.actions.append(StartStandby())


# --------------------------------------------------------------------------- several hosts


def _gone(pr: ProbeResult) -> bool:
    return pr.exit_code is not None or pr.session_alive is False or (pr.process is not None and not pr.process.alive)


def _host_row(rank: int, host: str, pr: ProbeResult | None, error: str | None = None) -> dict:
    if pr is None:
        return {"rank": rank, "host": host, "answered": False, "error": (error or "")[:ROW_ERROR_CHARS] or None}
    st = pr.status
    phase = st.phase if st else None
    letter = pr.process.state if pr.process is not None and pr.process.alive else None
    if letter in _STOPPED_STATES and letter != "Z":  # status.json still says what it did before it stopped
        phase = f"{phase or 'process'}, {_STOPPED_STATES[letter].replace('its process ', 'process ')} (state {letter})"
    return {"rank": rank, "host": host, "phase": phase, "step": st.step if st else None,
            "pid": st.pid if st else None, "alive": None if pr.process is None else pr.process.alive,
            "exit_code": pr.exit_code, "error": "; ".join(pr.errors[:2])[:ROW_ERROR_CHARS] or None}


def _member_hosts(s: RunState, members: tuple[Member, ...], local: float, pol: Policy, out: _Out) -> None:
    """Another rank's host that does not answer is an ``unreachable`` event and alert,
    as rank 0's host is (when new or worse: a warning, an error once it lasts
    ``escalate_after``), and its return an event; nothing else changes (its process
    may still be running there; rank 0 says when it is gone)."""
    for m in members:
        down = s.members_down.get(m.rank)
        if m.result is None:
            since, polls, written = down if down is not None else (local, 0, None)
            f = detectors.detect_unreachable(m.host, since, polls + 1, local, error=m.error,
                                             escalate_after=pol.escalate_after)
            worse = written is None or more_severe(f.severity, written)
            s.members_down = {**s.members_down, m.rank: (since, polls + 1, f.severity if worse else written)}
            if worse:
                message = f"{f.message} (rank {m.rank} of this run; its process may still be running there)"
                out.event(detectors.UNREACHABLE, f.severity, message, {**f.detail, "rank": m.rank})
                out.alert(detectors.UNREACHABLE, f.severity, message, {**f.detail, "rank": m.rank})
        elif down is not None:
            s.members_down = {r: v for r, v in s.members_down.items() if r != m.rank}
            message = f"host {m.host} (rank {m.rank}) reachable again after {fmt_duration(local - down[0])} " \
                      f"({down[1]} failed poll(s))"
            out.event(detectors.UNREACHABLE, "info", message, {"host": m.host, "rank": m.rank, "down_s": local - down[0]})


def _members(s: RunState, obs: Probed, local: float, pol: Policy, out: _Out) -> None:
    """Each host's row, and the end of a process on another host, written once. Its
    end alone changes nothing: rank 0 fails within distributed.timeout when a peer is
    gone (and names it), or stops making steps; that confirms it."""
    out.writes.append(HostRows((_host_row(0, s.run.host, obs.result),
                                *(_host_row(m.rank, m.host, m.result, m.error) for m in obs.members))))
    _member_hosts(s, obs.members, local, pol, out)
    for m in obs.members:
        if m.result is None or not _gone(m.result) or s.run.state not in (RUNNING, STALLED):
            continue
        status = m.result.status
        if status is not None and status.phase in (contract.PHASE_DONE, contract.PHASE_STOPPED):
            continue  # it finished (or was stopped) with the others: rank 0 says the run's end
        if status is None and m.result.exit_code is None:
            # No process of this start yet: a (re)start writes its sessions one host after
            # another, rank 0's first, and this one's has not been made. A process that ended
            # left a status or an exit code; one that never starts, rank 0 names.
            continue
        process = (m.rank, status.pid if status is not None else None)
        if process in s.ranks_ended:
            continue
        s.ranks_ended = s.ranks_ended | {process}
        code = m.result.exit_code
        how = contract.describe_exit(code) if code is not None else "its process is gone"
        out.event("rank", "warning", f"rank {m.rank} on {m.host} ended ({how}); rank 0 confirms it within "
                  "distributed.timeout, then the run is restarted on every host",
                  {"rank": m.rank, "host": m.host, "exit_code": code})


_STOPPED_STATES = {"T": "its process is stopped", "t": "its process is stopped",
                   "D": "its process waits in uninterruptible I/O", "Z": "its process is a zombie"}


def _ranks(s: RunState, pr: ProbeResult, members: tuple[Member, ...]) -> list[Member]:
    """Every process of the run as this tick saw it, rank 0 (``pr``) first."""
    return [Member(0, s.run.host, pr), *sorted(members, key=lambda m: m.rank)]


def _step_of(s: RunState, m: Member) -> int:
    if m.rank == 0:
        return max(s.step_max or 0, (m.result.status.step or 0) if m.result.status else 0)
    return (m.result.status.step or 0) if m.result is not None and m.result.status else 0


def _records(s: RunState, ranks: list[Member]) -> tuple[Member, str] | None:
    """The trainer's own word on who failed first, read from each rank's status file:
    a rank whose status says it failed by itself (not in a collective: no
    ``failed_rank`` in it), else the rank the others' failure records name (each
    rank finds it on its own monotonic clock, never by comparing host clocks). The
    named rank's host is the controller's, never the one the record claims."""
    by_rank = {m.rank: m for m in ranks}
    own, named = [], {}
    for m in ranks:
        st = m.result.status if m.result is not None else None
        if st is None or st.phase != contract.PHASE_FAILED:
            continue
        detail = st.detail if isinstance(st.detail, dict) else {}
        if "failed_rank" not in detail:
            own.append(m)
            continue
        culprit = detail.get("failed_rank")
        if isinstance(culprit, int) and not isinstance(culprit, bool) and culprit in by_rank and culprit != m.rank:
            named.setdefault(culprit, []).append(m.rank)
    if own:
        first = min(own, key=lambda m: (s.rank_gone_at.get(m.rank, float("inf")), m.rank))
        return first, "its own status says it failed"
    if named:
        culprit = max(sorted(named), key=lambda r: len(named[r]))
        return by_rank[culprit], (f"failed first by the record of rank {', '.join(map(str, named[culprit]))}")
    return None


def _suspect(s: RunState, pr: ProbeResult, members: tuple[Member, ...]) -> tuple[Member, str] | None:
    """The host a stall or crash of a multi-host run most likely started on, and why,
    rank 0 included: the ranks' own failure records first (``_records``), then the
    controller's own evidence: a host not answering, a process that ended (the one
    this controller saw end first, by its own receive times), a process stopped (T,
    D, Z), the one furthest behind. No host clock is compared with another's."""
    ranks = _ranks(s, pr, members)
    found = _records(s, ranks)
    if found is not None:
        return found
    for m in ranks:
        if m.result is None:
            return m, "not answering"
    ended = [m for m in ranks if _gone(m.result)]
    if ended:
        first = min(ended, key=lambda m: (s.rank_gone_at.get(m.rank, float("inf")), m.rank))
        return first, "its process ended" + (" first" if len(ended) > 1 else "")
    for m in ranks:
        if m.result.process is not None and m.result.process.state in _STOPPED_STATES:
            return m, _STOPPED_STATES[m.result.process.state]
    top = max((_step_of(s, m) for m in ranks), default=0)
    behind = min(ranks, key=lambda m: _step_of(s, m), default=None)
    return (behind, "furthest behind") if behind is not None and _step_of(s, behind) < top else None


def _note_ends(s: RunState, pr: ProbeResult, members: tuple[Member, ...], local: float) -> None:
    """When this controller first saw each rank's process gone (its own clock)."""
    for m in _ranks(s, pr, members):
        if m.result is not None and _gone(m.result) and m.rank not in s.rank_gone_at:
            s.rank_gone_at = {**s.rank_gone_at, m.rank: local}


def _note_steps(s: RunState, pr: ProbeResult, members: tuple[Member, ...], local: float) -> None:
    """Each rank's step and since when this controller sees it there (its own receive
    times: how long a rank has made no progress never depends on a host clock)."""
    for m in _ranks(s, pr, members):
        if m.result is None:
            continue
        step = _step_of(s, m)
        if s.rank_steps.get(m.rank, (None,))[0] != step:
            s.rank_steps = {**s.rank_steps, m.rank: (step, local)}


def distributed_timeout(run) -> float:
    """The run's ``distributed.timeout`` (the trainer's default when its config has none)."""
    trainer = (run.config or {}).get("trainer")
    dist = trainer.get("distributed") if isinstance(trainer, dict) else None
    value = dist.get("timeout") if isinstance(dist, dict) else None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    return float(value) if ok else DEFAULT_DISTRIBUTED_TIMEOUT_S


def _hung_peer(s: RunState, pr: ProbeResult, members: tuple[Member, ...], local: float) -> Finding | None:
    """A rank that stopped answering while the others ended because of it: its end is
    the supervisor's to make (a stopped process never ends by itself, and the run
    would wait on it). Two independent signals, never one: a rank that ended failed
    names it in its own status (its watchdog found it quiet on that rank's monotonic
    clock), AND this controller has seen it make no step for ``distributed.timeout``
    on its own clock while its process still lives. Then it is a crash of the run,
    classified by the survivor's record, named after the hung rank and its host."""
    if s.run.state not in (RUNNING, STALLED):
        return None
    ranks = _ranks(s, pr, members)
    by_rank = {m.rank: m for m in ranks}
    window = distributed_timeout(s.run)
    for m in ranks:
        st = m.result.status if m.result is not None else None
        if st is None or st.phase != contract.PHASE_FAILED or not _gone(m.result):
            continue
        culprit = (st.detail if isinstance(st.detail, dict) else {}).get("failed_rank")
        if not isinstance(culprit, int) or isinstance(culprit, bool) or culprit == m.rank or culprit not in by_rank:
            continue
        hung = by_rank[culprit]
        if hung.result is None or _gone(hung.result):
            continue  # not answering, or gone too: not a process to end (the usual crash path applies)
        quiet = local - s.rank_steps.get(culprit, (None, local))[1]
        if quiet < window:
            continue
        letter = hung.result.process.state if hung.result.process is not None else None
        how = _STOPPED_STATES.get(letter, "its process lives") + (f" (state {letter})" if letter else "")
        message = (f"rank {culprit} on {hung.host} stopped answering: rank {m.rank}'s failure names it and it has "
                   f"made no step for {_seconds(quiet)} (distributed.timeout {window:g}s); {how}: it is ended and "
                   f"the run restarted from its checkpoint [host {hung.host}, rank {culprit}: hung]")
        record = "\n".join(t for t in (st.error, str((st.detail or {}).get("message") or "")[:500]) if t)
        return Finding(detectors.CRASH, "error", message,
                       {"evidence": [f"rank {m.rank}'s status: failed, naming rank {culprit}",
                                     f"no step from rank {culprit} for {quiet:.0f}s", how],
                        "host": hung.host, "rank": culprit, "hung_rank": culprit, "process_state": letter,
                        "quiet_s": round(quiet, 1), "reported_by": m.rank, "record": record,
                        "phase": st.phase, "step": _step_of(s, hung)})
    return None


def _name_host(f: Finding, s: RunState, pr: ProbeResult, members: tuple[Member, ...]) -> Finding:
    """A crash or stall of a multi-host run says which host it started on."""
    if f.kind not in (detectors.CRASH, detectors.STALL):
        return f
    suspect = _suspect(s, pr, members)
    if suspect is None:
        rank, host, why = 0, s.run.host, "rank 0's host; every other host looks healthy"
    else:
        member, why = suspect
        rank, host = member.rank, member.host
    return replace(f, message=f"{f.message} [host {host}, rank {rank}: {why}]",
                   detail={**f.detail, "host": host, "rank": rank})


def _ingest_metrics(s: RunState, obs: Probed, local: float, pol: Policy, out: _Out) -> None:
    pr = obs.result
    if pr.metrics_offset is None:
        return  # metrics.jsonl could not be read this time; the offset stays
    if pr.metrics_reset and s.args.metrics_offset:
        out.event("metrics", "warning", f"{contract.METRICS_FILE} was truncated or replaced; read again from the start")
    if pr.metrics_reset or (s.metrics_line is None and not s.args.metrics_offset):
        s.metrics_line = 0
    if obs.rejected:
        out.event("metrics", "warning", _rejected_message(obs.rejected, s.metrics_line, s.args.metrics_offset),
                  {"lines": [r.line + (s.metrics_line or 0) for r in obs.rejected][:20],
                   "reasons": [r.reason for r in obs.rejected][:20]})
    if s.metrics_line is not None:
        s.metrics_line += pr.metrics_chunk.count("\n")
    believed = [_believable(m.time, s, obs.skew, local, pol) for m in obs.lines]
    lines = tuple(m for m, ok in zip(obs.lines, believed) if ok)
    if len(lines) < len(obs.lines):
        _bad_times(s, [m for m, ok in zip(obs.lines, believed) if not ok], obs.skew, local, out)
    lines = _new_lines(s, lines, out)
    if obs.lines or (pr.metrics_offset, pr.metrics_inode) != (s.args.metrics_offset, s.args.metrics_inode):
        gpu = gpu_rows(pr) if s.run.gpus else None
        host = asdict(pr.host) if pr.host is not None else None  # CPU runs too: the trainer's host is busy or not
        out.writes.append(Samples(lines, gpu, pr.metrics_offset, pr.metrics_inode, local, host))
    s.args = pr.next_args(s.args)
    s.samples = (s.samples + tuple(Sample.from_metrics(m) for m in lines))[-WINDOW:]
    _progress(s, lines, obs.skew, out)


def gpu_rows(pr: ProbeResult) -> list[dict] | None:
    """What a sample stores of nvidia-smi: every GPU of the host (the status console
    shows them all, idle ones too), each with its compute processes (pid, name, MiB;
    ``role`` trainer for the run's own process, standby for its standby, else None)."""
    trainer = {p for p in ((pr.status.pid if pr.status else None), (pr.process.pid if pr.process else None)) if p}
    rows = []
    for g in pr.gpus or []:
        apps = [{"pid": a.pid, "name": a.process_name, "used_memory_mib": a.used_memory_mib,
                 "role": "trainer" if a.pid in trainer else "standby" if a.pid == pr.standby_pid else None}
                for a in pr.compute_apps or [] if a.gpu_uuid and a.gpu_uuid == g.uuid]
        rows.append({**g.__dict__, "apps": apps})
    return rows or None


def _new_lines(s: RunState, lines: tuple, out: _Out) -> tuple:
    """Lines not stored yet. A metrics.jsonl rewritten in place (same inode, longer)
    reads as appended data: its lines that are not newer than the newest stored one,
    in time AND step, are copies of what is stored (a resumed process steps back but
    its clock goes on)."""
    fresh = []
    for m in lines:
        if s.last_line is not None and m.time <= s.last_line[0] and m.step <= s.last_line[1]:
            continue
        fresh.append(m)
        s.last_line = (m.time, m.step)
    if len(fresh) < len(lines):
        out.event("metrics", "warning", f"{len(lines) - len(fresh)} line(s) of {contract.METRICS_FILE} repeat what is "
                  "stored (the file was rewritten in place?): skipped")
    return tuple(fresh)


def _rejected_message(rejected: tuple[Rejected, ...], lines_before: int | None, offset: int) -> str:
    """"2 bad lines of metrics.jsonl skipped: line 17: step is not an integer ('x'); ..."."""
    where = (lambda r: f"line {lines_before + r.line}") if lines_before is not None else (
        lambda r: f"line {r.line} after byte {offset}")
    shown = "; ".join(f"{where(r)}: {r.reason}" for r in rejected[:3])
    more = f"; and {len(rejected) - 3} more" if len(rejected) > 3 else ""
    return f"{len(rejected)} bad line(s) of {contract.METRICS_FILE} skipped: {shown}{more}"


def _believable(host_time: float | None, s: RunState, skew: float, local: float, pol: Policy) -> bool:
    """Whether a host timestamp can be true (see CLOCK_PAST_MARGIN_S)."""
    if host_time is None:
        return False
    t = host_time - skew
    return s.run.created - CLOCK_PAST_MARGIN_S <= t <= local + CLOCK_FUTURE_MARGIN_S + 2 * pol.interval


def _bad_times(s: RunState, ignored: list, skew: float, local: float, out: _Out) -> None:
    """Lines whose timestamps cannot be true steer no detector and are not stored;
    said once, and again after REPEAT_FINDING_S while they keep coming."""
    s.bad_times += len(ignored)
    if s.bad_times_written is not None and local - s.bad_times_written < REPEAT_FINDING_S:
        return
    s.bad_times_written = local
    m = ignored[0]
    off = m.time - skew - local
    when = f"{fmt_duration(off)} ahead of" if off > 0 else f"{fmt_duration(-off)} before"
    out.event("metrics", "warning",
              f"{len(ignored)} line(s) of {contract.METRICS_FILE} ignored: step {m.step} is stamped {when} the "
              f"time it was read (host clock skew {skew:+.1f} s measured); {s.bad_times} ignored so far",
              {"ignored": s.bad_times, "step": m.step, "offset_s": round(off, 1)})


def _believed_status(s: RunState, pr: ProbeResult, skew: float, local: float, pol: Policy) -> ProbeResult:
    """The probe answer with status.json's timestamps dropped when they cannot be true."""
    st = pr.status
    if st is None:
        return pr
    changes = {k: None for k in ("updated", "started")
               if getattr(st, k) is not None and not _believable(getattr(st, k), s, skew, local, pol)}
    return replace(pr, status=replace(st, **changes)) if changes else pr


def _progress(s: RunState, lines, skew: float, out: _Out) -> None:
    """The current process's steps: healthy_since, and its restart's cost and step_after."""
    # Lines an earlier process wrote but that are read only now do not count.
    ours = [m for m in lines if s.attempt_started is None or _of_this_attempt(m, skew, s.attempt_started)]
    if not ours:
        return
    _note_compile_cache(s, ours, out)
    s.step_max = max([s.step_max or 0, *(m.step for m in ours)])
    first = ours[0].time - skew  # local
    if s.healthy_since is None:
        s.healthy_since = first
    r = s.latest
    if r is None or (r.step_after is not None and r.step_after >= s.step_max):
        return
    r = replace(r, step_after=s.step_max)
    last = s.history[-1]
    s.history = s.history[:-1] + (policy.Restart(last.time, last.step_before, s.step_max),)
    changes: dict[str, Any] = {"step_after": s.step_max}
    if r.first_step_at is None:
        r = replace(r, first_step_at=first)
        changes["time_to_first_step_s"] = round(max(0.0, first - r.issued_at), 3)
        if r.failed_at is not None:
            changes["downtime_s"] = round(max(0.0, first - r.failed_at), 3)
        out.event("restart", "info", f"training resumed at step {ours[0].step}, "
                  f"{_seconds(changes['time_to_first_step_s'])} after the restart"
                  + (f" ({_seconds(changes['downtime_s'])} down in all)" if r.failed_at is not None else ""), changes)
    s.latest = r
    out.writes.append(RestartUpdate(changes))


def _of_this_attempt(m: contract.Metrics, skew: float, started: float) -> bool:
    """Whether a metrics line was written by the process a restart at ``started``
    (local) began. Stamped before the restart: an earlier process's. A line that
    says how long its process has trained (``elapsed_s``) is the new process's only
    when that process began training after the restart (the previous one, resumed or
    still writing while the restart was on its way, began long before): its first
    line never makes a restart look negative or instant."""
    if m.time - skew < started:
        return False
    elapsed = m.extra.get("elapsed_s")
    if isinstance(elapsed, (int, float)) and not isinstance(elapsed, bool) and 0 <= elapsed < float("inf"):
        return m.time - elapsed - skew >= started - ATTEMPT_SLACK_S
    return True


def _note_compile_cache(s: RunState, lines, out: _Out) -> None:
    """The current process's compile_cache outcome (its metrics lines say it): written
    once per process, a mismatch as a warning (the trainer refused the artifact that
    was put into its run directory and compiled cold)."""
    for m in lines:
        value = m.extra.get("compile_cache")
        if not isinstance(value, str) or value == s.compile_cache:
            continue
        first, s.compile_cache = s.compile_cache is None, value[:80]
        if not first or value == "off":
            continue
        detail = {"outcome": value, "compile_cache": m.extra.get("compile_cache_detail"),
                  "startup_s": m.extra.get("startup_s")}
        if value == "hit":
            out.event("compile_cache", "info", "compile cache hit: the warm-up started from compiled artifacts", detail)
        elif value.startswith("mismatch"):
            note = (m.extra.get("compile_cache_detail") or {}).get("note") if isinstance(
                m.extra.get("compile_cache_detail"), dict) else None
            out.event("compile_cache", "warning", f"compile cache {value[:80]}: the artifact in the run directory was "
                      "not loaded; this start compiled cold" + (f" ({str(note)[:200]})" if note else ""), detail)
        else:
            out.event("compile_cache", "info", f"compile cache {value[:80]}: this start compiled cold", detail)


def _fetch_compile_cache(s: RunState, local: float, pol: Policy, out: _Out) -> None:
    """A process that compiled cold (it found no artifact, or one that did not fit)
    saved what it compiled; once it has trained for ``expect.compile_cache_after``,
    that is copied back into the local cache store: asked once per process."""
    outcome = s.compile_cache or ""
    if not pol.act or s.cache_fetch or s.run.state != RUNNING or s.pending is not None or s.job is not None:
        return
    if not (outcome == "miss" or outcome.startswith("mismatch")) or s.phase != contract.PHASE_TRAINING:
        return
    if s.healthy_since is None or local - s.healthy_since < pol.run.expect.compile_cache_after:
        return
    s.cache_fetch = True
    out.actions.append(FetchCompileCache(outcome))


def _track_phase(s: RunState, pr: ProbeResult, now: float, skew: float, out: _Out) -> None:
    """When the current phase began (status.json does not say): first seen, or for a
    process still starting, its start time. Each new phase is an event (``phase``),
    so the console can say "compiling 12 m / 45 m" from the store alone."""
    phase = pr.status.phase if pr.status else None
    if phase == s.phase and s.phase_since is not None:
        return
    # A change, or a first sight of anything but plain training (a re-attach to a
    # training run is no news).
    if phase is not None and phase != s.phase and phase not in contract.FINAL_PHASES \
            and (s.phase is not None or phase != contract.PHASE_TRAINING):
        out.event("phase", "info", f"phase {phase}", {"phase": phase, "pid": pr.status.pid})
    since = now
    if pr.status is not None and phase == contract.PHASE_STARTING and pr.status.started:
        since = pr.status.started
    elif pr.status is None and s.phase_since is None:
        since = (s.attempt_started or s.run.created) + skew  # nothing written yet: count from the (re)start
    s.phase, s.phase_since = phase, since


# --------------------------------------------------------------------------- findings -> decision


def _act(s: RunState, pr: ProbeResult, findings: list[Finding], local: float, skew: float, pol: Policy,
         out: _Out) -> None:
    finished = next((f for f in findings if f.kind == detectors.FINISHED), None)
    if finished is not None:
        _finished(s, pr, finished, pol, out)
        return
    crash = next((f for f in findings if f.kind == detectors.CRASH), None)
    classification = None
    if crash is not None:
        s.crash_seen = s.crash_seen or local
        proc = pr.process
        if pr.exit_code is None and pr.session_alive and proc is not None and not proc.alive \
                and local - s.crash_seen < SETTLE_S:
            return  # run.sh is writing the exit code: classify with it at the next poll
        record = crash.detail.get("record")  # a hung peer: the surviving rank's failure names it
        classification = signatures.classify(
            record if record else attempt_output(pr), None if record else (pr.status.error if pr.status else None),
            None if record else pr.exit_code, pol.run.signatures
        )
        crash = replace(crash, detail={**crash.detail, "signature": classification.name,
                                       "matched_line": classification.matched_line})
        findings = [crash if f.kind == detectors.CRASH else f for f in findings]
    actions = policy.decide(findings, classification, pol.run.restart, s.history, local, pol.rng,
                            healthy_since=s.healthy_since)
    decision, alerts = actions[0], actions[1:]
    trigger = crash or next((f for f in findings if f.kind == detectors.STALL), None)
    fresh = _note_findings(s, findings, local, out)
    for f in findings:
        if f.kind in fresh:
            out.event(f.kind, f.severity, f.message, f.detail)
    if trigger is not None:
        _decided(s, pr, trigger, decision, local, skew, pol, out)
    elif s.run.state == STALLED and pol.act:
        _transition(s, out, RUNNING, "making progress again" + (f": step {s.step_max}" if s.step_max else ""))
    for a in alerts:
        one_shot = trigger is not None and a.finding == trigger.kind and decision.kind != policy.NONE
        if one_shot or a.finding in fresh:
            out.alert(a.finding or "finding", a.severity, a.reason, a.detail)


def _note_findings(s: RunState, findings: list[Finding], local: float, out: _Out) -> set[str]:
    """Kinds to write now: new, worse or worded otherwise than when last written, or
    lasting long enough to say again. Kinds that went away are written as cleared."""
    fresh = set()
    for f in findings:
        o = s.findings.get(f.kind)
        worse = o is not None and more_severe(f.severity, o.severity)
        if o is None or worse or o.shape != _shape(f.message) or local - o.written >= REPEAT_FINDING_S:
            fresh.add(f.kind)
            s.findings[f.kind] = Open(f.severity, o.since if o else local, local, _shape(f.message))
    for kind in set(s.findings) - {f.kind for f in findings}:
        o = s.findings.pop(kind)
        if kind != detectors.CRASH:
            out.event(kind, "info", f"{kind} cleared after {fmt_duration(local - o.since)}")
    return fresh


def _decided(s: RunState, pr: ProbeResult, trigger: Finding, decision: policy.Action, local: float, skew: float,
             pol: Policy, out: _Out) -> None:
    detail = {"decision": decision.kind, "signature": decision.signature, "finding": trigger.kind,
              "delay_s": round(decision.delay, 3), **trigger.detail}
    if not pol.act:
        if decision.kind != policy.NONE:
            out.event("decision", "info",
                      f"would {decision.kind.replace('_', ' ')} (observing only): {decision.reason}", detail)
        return
    if decision.kind == policy.NONE:  # e.g. a process someone stopped on purpose
        if s.run.state != STALLED:
            _transition(s, out, STALLED, decision.reason, detail, severity=decision.severity)
        return
    s.findings.pop(trigger.kind, None)  # acted on: the next one is news again
    if decision.kind == signatures.STOP:
        if pr.session_alive or (pr.process is not None and pr.process.alive):
            s.job = KILL
            out.actions.append(KillSession())
        _transition(s, out, FAILED, decision.reason, detail, severity=decision.severity,
                    exit_code=pr.exit_code, exit_reason=_stop_why(trigger, decision))
        return
    s.pending = Pending(
        due=local + decision.delay, action=decision.kind, reason=decision.reason, signature=decision.signature,
        detected_at=s.crash_seen or local, failed_at=_failure_time(s, pr, trigger, skew),
        step_before=s.step_max, hung=trigger.detail.get("hung_rank") is not None,
    )
    s.crash_seen = None
    if not _transition(s, out, RESTARTING, decision.reason, detail, severity=decision.severity):
        # A restarted process that failed before it was seen running: still one decision, one event.
        out.event("restart", decision.severity, decision.reason, detail)
    if decision.delay <= 0:
        _issue_restart(s, local, out)


def _failure_time(s: RunState, pr: ProbeResult, trigger: Finding, skew: float) -> float | None:
    """Local time the failure happened (see the module docstring)."""
    status = pr.status
    seen = _last_alive(s, skew)
    if trigger.kind == detectors.CRASH:
        if status is not None and status.phase == contract.PHASE_FAILED and status.updated:
            return status.updated - skew
        return seen
    if detectors.holds_back([trigger]):
        return seen
    progress = detectors.last_progress(list(s.samples), status)
    marks = [t for t in (progress[1] if progress else None, s.held_until) if t is not None]
    return max(marks) - skew if marks else seen


def _last_alive(s: RunState, skew: float) -> float | None:
    """Local time of the latest sign that the current process was alive: the last
    poll that saw it healthy, its newest metrics line, or its start. A supervisor that
    re-attached has seen no healthy poll yet: its newest line, not the previous
    restart, is when it was last known alive."""
    line = s.last_line[0] - skew if s.last_line is not None else None
    marks = [t for t in (s.last_ok, s.attempt_started, line) if t is not None]
    return max(marks) if marks else None


def _finished(s: RunState, pr: ProbeResult, finding: Finding, pol: Policy, out: _Out) -> None:
    code = pr.exit_code
    if not pol.act:
        out.event(detectors.FINISHED, "info", finding.message, finding.detail)
        return
    state = DONE if finding.detail.get("outcome") == "done" else STOPPED
    reason = contract.describe_exit(code) if code is not None else finding.detail.get("outcome")
    if _transition(s, out, state, finding.message, finding.detail, exit_code=code, exit_reason=reason) \
            and state == DONE and pol.run.eval is not None and pol.run.eval.after_done:
        out.actions.append(RunEval())
    out.alert(detectors.FINISHED, "info", finding.message, finding.detail)


# --------------------------------------------------------------------------- restarts


def _issue_restart(s: RunState, now: float, out: _Out) -> None:
    p = s.pending
    if p.tries == 0:
        delay = p.detected_at - p.failed_at if p.failed_at is not None else None
        out.writes.append(RestartRow(now, p.reason, p.signature, p.action, p.step_before,
                                     round(max(0.0, delay), 3) if delay is not None else None))
    serialized = p.action == signatures.RESTART_SERIALIZED
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
    marker = (f"{RESTART_MARKER} restart {len(s.history) + 1} at {stamp} "
              f"({p.signature or 'unknown'}{', serialized warm-up' if serialized else ''}) ---")
    s.job = RESTART
    out.actions.append(IssueRestart(serialized, marker, hung=p.hung or p.signature == policy.STALL_SIGNATURE))


def _restarted(s: RunState, done: JobDone, now: float, pol: Policy, out: _Out) -> None:
    p = s.pending
    if p is None:
        return
    if done.cancelled:
        s.pending = None
        out.event("restart", "info", done.error or "restart not issued: the run ended meanwhile")
        out.writes.append(RestartUpdate({"outcome": f"cancelled: {done.error or 'the run ended meanwhile'}"}))
        return
    if done.error is not None:
        tries = p.tries + 1
        if tries >= RESTART_TRIES or not done.retry:  # e.g. a bug: no retry
            s.pending = None
            message = f"restart failed ({tries} tries): {done.error}"
            out.writes.append(RestartUpdate({"outcome": f"not issued: {done.error}"[:300]}))
            _transition(s, out, FAILED, message, severity="critical", exit_reason="restart failed")
            out.alert("restart_failed", "critical", message, {"signature": p.signature})
        else:
            s.pending = replace(p, tries=tries, due=now + max(pol.run.restart.backoff_initial, pol.interval))
            out.event("restart", "error", f"restart not issued (try {tries}/{RESTART_TRIES}; again in "
                      f"{fmt_duration(s.pending.due - now)}): {done.error}")
        return
    s.pending = None
    issued = done.issued if done.issued is not None else now
    out.writes.append(RestartUpdate({"outcome": "issued", "time": issued}))
    s.history = s.history + (policy.Restart(issued, p.step_before, None),)
    s.latest = Latest(issued, p.failed_at)
    # A new process: it resumes from a checkpoint, so the old one's steps are not its progress.
    s.restart_issued, s.attempt_started = True, issued
    s.samples = ()
    s.findings = {}
    s.step_max = s.healthy_since = s.last_ok = None
    s.phase, s.phase_since = None, issued + done.skew
    s.compile_cache, s.cache_fetch = None, False
    s.holding, s.held_until = False, None
    s.rank_gone_at, s.rank_steps = {}, {}


# --------------------------------------------------------------------------- hosts


def _unreachable(s: RunState, obs: Unreachable, local: float, pol: Policy, out: _Out) -> None:
    f = obs.finding
    if s.run.hosts and obs.members:  # the ranks whose hosts answered are shown as seen, rank 0's row ages
        out.writes.append(HostRows((_host_row(0, s.run.host, None, f.detail.get("error") or "not answering"),
                                    *(_host_row(m.rank, m.host, m.result, m.error) for m in obs.members))))
        _member_hosts(s, obs.members, local, pol, out)
    if obs.worse:
        out.event(detectors.UNREACHABLE, f.severity, f.message, f.detail)
        out.alert(detectors.UNREACHABLE, f.severity, f.message, f.detail)
    if pol.act and obs.polls >= LOST_AFTER_POLLS and s.run.state in (LAUNCHING, RUNNING, STALLED, RESTARTING):
        s.state_before_lost = s.run.state
        _transition(s, out, LOST, f"host {obs.host} unreachable for {obs.polls} polls; the trainer may still be "
                    "running there", {"host": obs.host, "since": obs.since})


def _host_back(s: RunState, obs: Probed, now: float, pol: Policy, out: _Out) -> None:
    host = s.run.host
    if obs.host_back is None:
        # Lost under an earlier supervisor (the outage and a restart of ours often coincide).
        if pol.act and s.run.state == LOST:
            _transition(s, out, RUNNING, f"host {host} answers again; watching the run")
        return
    since, polls = obs.host_back
    message = f"host {host} reachable again after {fmt_duration(now - since)} ({polls} failed poll(s))"
    out.event(detectors.UNREACHABLE, "info", message, {"host": host, "down_s": now - since})
    if pol.act and s.run.state == LOST:
        back = s.state_before_lost if s.state_before_lost in TRANSITIONS[LOST] else RUNNING
        _transition(s, out, back, message)
        s.state_before_lost = None


# --------------------------------------------------------------------------- state machine


def _transition(s: RunState, out: _Out, to: str, message: str, detail: dict | None = None, **kw) -> bool:
    """Move the run to ``to`` (False when it already is there, or is finished: only an
    operator revives a finished run)."""
    current = s.run.state
    if current == to or current in FINAL_STATES:
        return False
    if to not in TRANSITIONS[current] and to in TRANSITIONS[RUNNING] and RUNNING in TRANSITIONS[current]:
        # e.g. a (re)started process that fails or finishes before it was seen running
        out.writes.append(Transition(RUNNING, "trainer started"))
        current = RUNNING
    if to not in TRANSITIONS[current]:
        return False
    out.writes.append(Transition(to, message, jsonable(detail), **kw))
    s.run = replace(s.run, state=to)
    if to in FINAL_STATES and s.standby_for is not None:
        out.actions.append(EndStandby())
    return True


# --------------------------------------------------------------------------- helpers


def attempt_output(pr: ProbeResult) -> str:
    """The current process's output: trainer.log after the last restart marker, else
    the pane (which holds only this process's output, but is gone once it ended)."""
    log = logtext.this_attempt(pr.log_tail)
    return log if log.strip() else (pr.pane_tail or "")


def _shape(message: str) -> str:
    """A finding's wording without its numbers: a new shape is news ("ETA 9 d > 7 d"
    becoming "4.3 Ktok/s = 34% of baseline ...; ETA ..."), new numbers are not."""
    return re.sub(r"\d+(\.\d+)?", "N", message)


def _stop_why(trigger: Finding, decision: policy.Action) -> str:
    """The short reason a run was not restarted, for the runs table."""
    what = f"{trigger.kind} ({decision.signature}): {trigger.message}; "
    why = decision.reason[len(what) :] if decision.reason.startswith(what) else decision.reason
    return f"{decision.signature or trigger.kind}: {why}"[:300]


def _seconds(value: float) -> str:
    return f"{value:.1f} s" if value < 60 else fmt_duration(value)


def jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
