"""One probe answer, in order: errors, metrics, status, ranks, detectors, the decision.

``_observe`` reads what the host said and hands the findings to ``decide._act``. A
process that trains gets its successor's standby started beside it (``_standby``).
"""

from __future__ import annotations

from dflashctl.core import contract
from dflashctl.core.states import LAUNCHING, RESTARTING, RUNNING
from dflashctl.supervise import detectors
from dflashctl.supervise.supervisor_core.decide import _act
from dflashctl.supervise.supervisor_core.limits import SETTLE_S
from dflashctl.supervise.supervisor_core.machine import _transition
from dflashctl.supervise.supervisor_core.metrics import (
    _believed_status,
    _fetch_compile_cache,
    _ingest_metrics,
    _track_phase,
)
from dflashctl.supervise.supervisor_core.observations import Probed
from dflashctl.supervise.supervisor_core.ranks import _hung_peer, _members, _name_host, _note_ends, _note_steps
from dflashctl.supervise.supervisor_core.run_policy import Policy
from dflashctl.supervise.supervisor_core.state import RunState
from dflashctl.supervise.supervisor_core.writes import StartStandby, _Out


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
    findings = _hysteresis(s, findings, local, pol)
    s.holding = detectors.holds_back(findings)
    if not {f.kind for f in findings} & {detectors.CRASH, detectors.STALL, detectors.FINISHED}:
        s.last_ok, s.crash_seen = local, None
        s.oom_seen = pr.oom_kills or s.oom_seen
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
    _act(s, pr, findings, local, skew, pol, out, obs.members if s.run.hosts else ())
    _fetch_compile_cache(s, local, pol, out)
    _standby(s, status, pol, out, obs.result.standby_pid)


def _hysteresis(s: RunState, findings: list[detectors.Finding], local: float, pol: Policy) -> list[detectors.Finding]:
    """A regression is reported once it has lasted ``expect.regression_hold`` and
    cleared once gone for ``expect.regression_clear`` (``detectors.hold``)."""
    expect = pol.run.expect
    found = next((f for f in findings if f.kind == detectors.REGRESSION), None)
    held, shown = detectors.hold(found, s.held.get(detectors.REGRESSION), local, expect.regression_hold,
                                 expect.regression_clear)
    if held is None:
        s.held.pop(detectors.REGRESSION, None)
    else:
        s.held[detectors.REGRESSION] = held
    rest = [f for f in findings if f.kind != detectors.REGRESSION]
    return rest + [shown] if shown is not None else rest


def _standby(s: RunState, status: contract.Status | None, pol: Policy, out: _Out, waiting: int | None) -> None:
    """Once a process trains, its successor's standby is started beside it (once per
    process: a standby that took over gets one of its own when it trains). One
    already waiting (``waiting``: its pid, alive), as a supervisor that re-attaches
    finds it, is kept: a new one would pay every import again."""
    if not (pol.act and pol.run.restart.standby and pol.run.restart.enabled) or status is None:
        return
    if s.run.state != RUNNING or s.phase != contract.PHASE_TRAINING or s.pending is not None or s.job is not None:
        return
    if status.pid is None or status.pid == s.standby_for:
        return
    s.standby_for = status.pid
    if waiting is not None and waiting != status.pid and s.standby_seen is None:
        s.standby_seen = waiting
        out.event("standby", "info", f"standby pid {waiting} found waiting: kept for the next restart",
                  {"pid": waiting})
        return
    out.actions.append(StartStandby())
