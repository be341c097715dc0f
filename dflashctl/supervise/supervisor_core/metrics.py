"""A probe answer's metrics lines and status times: what to believe, store and count.

Host timestamps are checked against the local clock and repeated lines dropped. The
current process's progress, its restart's cost, compile cache and phase are noted.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from dflashctl.core import contract
from dflashctl.core.states import RUNNING
from dflashctl.core.units import fmt_duration
from dflashctl.hosts.parsers import Rejected
from dflashctl.hosts.probe import ProbeResult
from dflashctl.supervise import policy
from dflashctl.supervise.detectors import Sample
from dflashctl.supervise.supervisor_core.limits import (
    ATTEMPT_SLACK_S,
    CLOCK_FUTURE_MARGIN_S,
    CLOCK_PAST_MARGIN_S,
    REPEAT_FINDING_S,
    ROUTINE_PHASE_S,
    ROUTINE_PHASES,
    WINDOW,
)
from dflashctl.supervise.supervisor_core.observations import Probed
from dflashctl.supervise.supervisor_core.run_policy import Policy
from dflashctl.supervise.supervisor_core.state import RunState
from dflashctl.supervise.supervisor_core.wording import _seconds
from dflashctl.supervise.supervisor_core.writes import FetchCompileCache, RestartUpdate, Samples, _Out


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
        out.writes.append(Samples(lines, pr.metrics_offset, pr.metrics_inode, local))
    s.args = pr.next_args(s.args)
    s.samples = (s.samples + tuple(Sample.from_metrics(m) for m in lines))[-WINDOW:]
    _progress(s, lines, obs.skew, out)


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
        changes["outcome"] = "resumed"  # its process made a step: the restart worked
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
    so the console can say "compiling 12 m / 45 m" from the store alone; but a
    routine one (a checkpoint, every few minutes of a run of days) is written only
    once it lasts longer than ``ROUTINE_PHASE_S``, and then its end too."""
    phase = pr.status.phase if pr.status else None
    if phase == s.phase and s.phase_since is not None:
        if phase in ROUTINE_PHASES and not s.phase_said and now - s.phase_since > ROUTINE_PHASE_S:
            s.phase_said = True
            out.event("phase", "warning", f"phase {phase} for {fmt_duration(now - s.phase_since)} (a routine "
                      f"{phase} takes under {fmt_duration(ROUTINE_PHASE_S)})",
                      {"phase": phase, "pid": pr.status.pid, "elapsed_s": round(now - s.phase_since, 3)})
        return
    # A change, or a first sight of anything but plain training (a re-attach to a
    # training run is no news); a routine phase and the return from it are not news
    # unless it lasted (said above).
    routine = phase in ROUTINE_PHASES or (s.phase in ROUTINE_PHASES and not s.phase_said)
    said = False
    if phase is not None and phase != s.phase and phase not in contract.FINAL_PHASES \
            and (s.phase is not None or phase != contract.PHASE_TRAINING) and not routine:
        out.event("phase", "info", f"phase {phase}", {"phase": phase, "pid": pr.status.pid})
        said = True
    s.phase_said = said or phase not in ROUTINE_PHASES
    since = now
    if pr.status is not None and phase == contract.PHASE_STARTING and pr.status.started:
        since = pr.status.started
    elif pr.status is None and s.phase_since is None:
        since = (s.attempt_started or s.run.created) + skew  # nothing written yet: count from the (re)start
    s.phase, s.phase_since = phase, since
