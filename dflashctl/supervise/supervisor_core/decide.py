"""Findings -> a decision: what to write, whether to restart, stop or wait; and the restarts.

``_act`` asks ``policy.decide`` what the findings call for; a restart waits for its
backoff (``Pending``), is issued (``_issue_restart``) and followed (``_restarted``).

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

import time
from dataclasses import replace

from dflashctl.core import contract, signatures
from dflashctl.core.states import DONE, FAILED, RESTARTING, RUNNING, STALLED, STOPPED, more_severe
from dflashctl.core.units import fmt_duration
from dflashctl.hosts.probe import ProbeResult
from dflashctl.supervise import detectors, policy
from dflashctl.supervise.detectors import Finding
from dflashctl.supervise.supervisor_core.limits import REPEAT_FINDING_S, RESTART_MARKER, RESTART_TRIES, SETTLE_S
from dflashctl.supervise.supervisor_core.machine import _transition
from dflashctl.supervise.supervisor_core.observations import JobDone, Member
from dflashctl.supervise.supervisor_core.run_policy import Policy
from dflashctl.supervise.supervisor_core.state import KILL, RESTART, Latest, Open, Pending, RunState
from dflashctl.supervise.supervisor_core.stopping import _lost_with_stop_pending
from dflashctl.supervise.supervisor_core.wording import _shape, _stop_why, attempt_output
from dflashctl.supervise.supervisor_core.writes import (
    IssueRestart,
    KillSession,
    RestartRow,
    RestartUpdate,
    RunEval,
    _Out,
)


def _act(s: RunState, pr: ProbeResult, findings: list[Finding], local: float, skew: float, pol: Policy,
         out: _Out, members: tuple[Member, ...] = ()) -> None:
    finished = next((f for f in findings if f.kind == detectors.FINISHED), None)
    if finished is not None:
        if not _exit_code_due(s, pr, local):
            _finished(s, pr, finished, pol, out)
        return
    crash = next((f for f in findings if f.kind == detectors.CRASH), None)
    classification = None
    if crash is not None:
        if _exit_code_due(s, pr, local):
            return  # run.sh is writing the exit code: classify with it at the next poll
        record = crash.detail.get("record")  # a hung peer: the surviving rank's failure names it
        classification = signatures.classify(
            record if record else attempt_output(pr), None if record else (pr.status.error if pr.status else None),
            None if record else pr.exit_code, pol.run.signatures, _evidence(s, pr)
        )
        if classification.action != signatures.STOP:
            classification = _full_peer(members) or classification
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
    elif s.run.state == STALLED and pol.act and (s.step_max or 0) > (s.stalled_at_step or -1):
        # A new step, not only the finding gone (a process continued, not yet training).
        _transition(s, out, RUNNING, "making progress again" + (f": step {s.step_max}" if s.step_max else ""))
    for a in alerts:
        one_shot = trigger is not None and a.finding == trigger.kind and decision.kind != policy.NONE
        if one_shot or a.finding in fresh:
            out.alert(a.finding or "finding", a.severity, a.reason, a.detail)


def _exit_code_due(s: RunState, pr: ProbeResult, local: float) -> bool:
    """Whether the trainer's process has ended (gone, or a zombie not yet reaped) while
    its pane lives and no exit code is written yet: run.sh writes it in a moment, so
    the end is judged at the next poll, with it (for at most ``SETTLE_S`` from the
    first sight of the end, noted in ``crash_seen``: a wrapper that never writes one
    does not hold the run)."""
    s.crash_seen = s.crash_seen or local
    proc = pr.process
    return pr.exit_code is None and bool(pr.session_alive) and proc is not None and not proc.alive \
        and local - s.crash_seen < SETTLE_S


def _full_peer(members: tuple[Member, ...]) -> signatures.Classification | None:
    """A multi-host run's crash that another rank's full disk explains (its host's free
    space, or its own exit code or output): ``disk_full``, named after that rank, not
    the ``rank_failed`` restart rank 0's word alone would give (every host would be
    restarted into the same full disk)."""
    for m in members:
        pr = m.result
        if pr is None:
            continue
        found = signatures.classify(attempt_output(pr), pr.status.error if pr.status else None, pr.exit_code,
                                    evidence=signatures.Evidence(run_dir=pr.run_dir, disk_free=pr.disk_free,
                                                                 disk_total=pr.disk_total))
        if found.name == "disk_full":
            return replace(found, hint=f"rank {m.rank} on {m.host}: {found.hint}",
                           matched_line=f"rank {m.rank} on {m.host}: {found.matched_line or 'disk full'}")
    return None


def _evidence(s: RunState, pr: ProbeResult) -> signatures.Evidence:
    """What the host said of the crash besides the output: its free disk, the OOM
    kills since the last healthy poll, whether the tmux server went too."""
    oom = pr.oom_kills.since(s.oom_seen) if pr.oom_kills is not None else None
    return signatures.Evidence(run_dir=pr.run_dir, disk_free=pr.disk_free, disk_total=pr.disk_total,
                               oom_kills=oom, tmux_server_gone=pr.tmux_server_gone)


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
    if decision.detail.get("advice"):
        detail["advice"] = decision.detail["advice"]
    if not pol.act:
        if decision.kind != policy.NONE:
            out.event("decision", "info",
                      f"would {decision.kind.replace('_', ' ')} (observing only): {decision.reason}", detail)
        return
    if decision.kind == policy.NONE:  # e.g. a process someone stopped on purpose
        if s.run.state != STALLED:
            _transition(s, out, STALLED, decision.reason, detail, severity=decision.severity)
            s.stalled_at_step = s.step_max
        return
    s.findings.pop(trigger.kind, None)  # acted on: the next one is news again
    if decision.kind == signatures.STOP:
        if pr.session_alive or (pr.process is not None and pr.process.alive):
            s.job = KILL
            out.actions.append(KillSession())
        _transition(s, out, FAILED, decision.reason, detail, severity=decision.severity,
                    exit_code=pr.exit_code, exit_reason=_stop_why(trigger, decision))
        return
    if s.latest is not None and s.latest.first_step_at is None and s.history:
        # The previous restart's process failed before its first step: its row says so
        # (written before this restart's row, so it is still the latest).
        out.writes.append(RestartUpdate({"outcome": "failed before its first step"}))
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
    if s.run.hosts and s.members_down:  # a process may still run where rank 0's end cannot be confirmed
        down = sorted(s.members_down)
        _lost_with_stop_pending(s, out, down, f"{finding.message}; rank(s) {', '.join(map(str, down))} on a host "
                                "that does not answer: their process may still run there, stopped once it answers")
        return
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
    s.restart_issued = True
    new_attempt(s, issued, done.skew)


def new_attempt(s: RunState, started: float, skew: float = 0.0) -> None:
    """A new process of the run begins (a restart, ours or an operator's): it resumes
    from a checkpoint, so the old one's steps, findings and phase are not its own."""
    s.attempt_started = started
    s.samples = ()
    s.findings, s.held = {}, {}
    s.step_max = s.healthy_since = s.last_ok = None
    s.phase, s.phase_since = None, started + skew
    s.compile_cache, s.cache_fetch = None, False
    s.holding, s.held_until = False, None
    s.rank_gone_at, s.rank_steps = {}, {}
