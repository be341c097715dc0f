"""A multi-host run's ranks: each host's row, ended processes, and who failed first.

Rank 0's answer speaks for the run. The other hosts' processes (``Member``) say
where a crash or stall started, and whether a rank hangs (``_hung_peer``).
"""

from __future__ import annotations

from dataclasses import replace

from dflashctl.core import contract
from dflashctl.core.states import RUNNING, STALLED, more_severe
from dflashctl.core.units import fmt_duration
from dflashctl.hosts.probe import ProbeResult
from dflashctl.supervise import detectors
from dflashctl.supervise.detectors import Finding
from dflashctl.supervise.supervisor_core.limits import DEFAULT_DISTRIBUTED_TIMEOUT_S, ROW_ERROR_CHARS
from dflashctl.supervise.supervisor_core.observations import Member, Probed
from dflashctl.supervise.supervisor_core.run_policy import Policy
from dflashctl.supervise.supervisor_core.state import RunState
from dflashctl.supervise.supervisor_core.wording import _seconds
from dflashctl.supervise.supervisor_core.writes import HostRows, _Out


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
