"""Detectors: pure functions of (samples, the latest probe result, run state,
expectations, now) -> findings said in the operator's terms.

The clock is always an argument. Sample times, ``now`` and the probe's readings
must be on one clock: the host's (the trainer stamps metrics with it), so the
caller passes ``now`` as local time plus ``probe.estimate_skew``.

Evidence, not claims: a finding that ends or kills a run (crash, finished) needs
agreeing evidence (``trainer_gone``); a lone signal that disagrees with the rest is
a ``conflict`` finding, said and never acted on. Never here: I/O, or a clock read.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from dflashctl.core import contract
from dflashctl.core.errors import HOST_KEY_CHANGED
from dflashctl.core.logtext import last_traceback, this_attempt
from dflashctl.core.states import ALIVE_STATES
from dflashctl.core.terminal import one_line
from dflashctl.core.units import fmt_clock, fmt_duration, fmt_tok_s

if TYPE_CHECKING:
    from dflashctl.config import Expect
    from dflashctl.hosts.probe import ProbeResult

CRASH = "crash"
STALL = "stall"
REGRESSION = "regression"
UNREACHABLE = "unreachable"
DRIFT = "drift"
LEARNING = "learning"  # training runs but the drafter learns nothing (loss flat, accuracy 0)
FINISHED = "finished"  # done or stopped on request: not a failure, the loop closes the run
# The evidence disagrees (an end claimed while the process lives, a pid the probe
# cannot see while its pane runs, GPUs at 0 MiB under a live trainer): reported,
# never acted on. Nothing destructive happens on one signal that was not cross-checked.
CONFLICT = "conflict"

# Process states (/proc/PID/stat) of a trainer stopped on purpose: by a signal (T)
# or a debugger (t, tracing stop). Left alone, never restarted.
STOPPED_STATES = ("T", "t")
# Phases in which the trainer holds GPU memory.
GPU_PHASES = (contract.PHASE_COMPILING, contract.PHASE_TRAINING, contract.PHASE_CHECKPOINTING)


@dataclass
class Finding:
    kind: str  # crash | stall | regression | unreachable | drift | finished
    severity: str  # info | warning | error | critical
    message: str  # one line, operator terms
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class Sample:
    """One point of a run's history (a metrics line, or a stored sample row)."""

    time: float
    step: int
    tok_s: float | None = None
    phase: str = contract.PHASE_TRAINING
    eta_s: float | None = None
    total_steps: int | None = None
    loss: float | None = None
    acc: float | None = None

    @classmethod
    def from_metrics(cls, m: contract.Metrics) -> "Sample":
        return cls(time=m.time, step=m.step, tok_s=m.tok_s, phase=m.phase, eta_s=m.eta_s, total_steps=m.total_steps,
                   loss=m.loss, acc=m.acc)


# --------------------------------------------------------------------------- baseline


def baseline_from_history(tok_s_medians: Iterable[float | None], min_runs: int = 1) -> float | None:
    """The baseline learnt from earlier healthy runs: the median of their median
    tok/s. None when fewer than ``min_runs`` are usable (``store.BASELINE_MIN_RUNS``
    is the supervisor's: one earlier run is an anecdote)."""
    values = [v for v in tok_s_medians if v is not None and math.isfinite(v) and v > 0]
    return statistics.median(values) if len(values) >= max(1, min_runs) else None


# --------------------------------------------------------------------------- all detectors


def detect(
    samples: Sequence[Sample],
    probe: "ProbeResult | None",
    state: str,
    expect: "Expect",
    now: float,
    *,
    baseline_tok_s: float | None = None,
    assigned_gpus: Sequence[int] | None = None,
    phase_since: float | None = None,
    held_until: float | None = None,
) -> list[Finding]:
    """Every finding for one run at ``now``.

    samples: the recent window, oldest first. probe: the latest observation (None
    when the host could not be probed: see ``detect_unreachable``). state: the
    run's store state. baseline_tok_s: the effective baseline (the playbook's, or
    ``baseline_from_history``); defaults to ``expect.baseline_tok_s``.
    assigned_gpus: the run's GPU indices on its host. phase_since: when the
    current phase was first seen (the supervisor tracks it; status.json has no
    phase start time); before status.json exists, the launch time. held_until:
    the end of the latest episode in which the detectors held back (see
    ``detect_stall``).
    """
    findings: list[Finding] = []
    if state in ALIVE_STATES and probe is not None:
        finished = detect_finished(probe)
        if finished is not None:
            return [finished]
        crash = detect_crash(probe, assigned_gpus)
        if crash is not None:
            return [crash]
        conflict = detect_conflict(probe, assigned_gpus)
        if conflict is not None:
            findings.append(conflict)
        stall = detect_stall(samples, probe, expect, now, phase_since, held_until)
        if stall is not None:
            findings.append(stall)
    baseline = baseline_tok_s if baseline_tok_s is not None else expect.baseline_tok_s
    regression = detect_regression(samples, expect, baseline)
    if regression is not None:
        findings.append(regression)
    learning = detect_not_learning(samples, expect)
    if learning is not None and state in ALIVE_STATES:
        findings.append(learning)
    return findings


# --------------------------------------------------------------------------- finished / crash


def trainer_gone(probe: "ProbeResult") -> bool:
    """Whether the evidence agrees that the trainer's process has ended: its process
    is not alive (or a zombie) AND no live tmux pane runs it. A pid the probe cannot
    see while the pane lives is not enough (another pid namespace sees the trainer),
    and neither is a file that claims an end (status.json, exit_code)."""
    proc = probe.process
    if proc is not None and proc.state == "Z":
        return True
    if proc is not None and proc.alive:
        return False
    return not (probe.session_alive is True and not probe.pane_dead)


def detect_finished(probe: "ProbeResult") -> Finding | None:
    """The trainer ended on purpose: phase done/stopped, or exit code done/stopped,
    and its process is gone (a claim while it lives is a ``detect_conflict``)."""
    phase = probe.status.phase if probe.status else None
    code = probe.exit_code
    if not trainer_gone(probe):
        return None
    if phase == contract.PHASE_DONE or code == contract.EXIT_DONE:
        outcome, message = "done", "training finished"
    elif phase == contract.PHASE_STOPPED or code == contract.EXIT_STOPPED:
        outcome, message = "stopped", "the trainer stopped on request (checkpoint written)"
    else:
        return None
    step = probe.status.step if probe.status else None
    if step:
        message += f" at step {step}"
    return Finding(FINISHED, "info", message, {"outcome": outcome, "exit_code": code, "step": step})


def detect_crash(probe: "ProbeResult", assigned_gpus: Sequence[int] | None = None) -> Finding | None:
    """One crash finding gathering every piece of evidence, the strongest first. The
    trainer's own word (status ``failed``, an exit code) and a vanished pid count
    only once its process is gone (``trainer_gone``); GPUs at 0 MiB only back other
    evidence up."""
    evidence: list[str] = []
    status = probe.status
    proc = probe.process
    gone = trainer_gone(probe)
    if gone and status is not None and status.phase == contract.PHASE_FAILED:
        said = failure_text(status)
        evidence.append(f"the trainer reported failure: {said}" if said else "the trainer reported failure")
    if gone and probe.exit_code is not None:
        evidence.append(f"the trainer exited with code {probe.exit_code} ({contract.describe_exit(probe.exit_code)})")
    if gone and proc is not None and not proc.alive:
        if proc.state == "Z":
            evidence.append(f"trainer process {proc.pid} is a zombie (exited, not reaped)")
        elif probe.exit_code is None:
            evidence.append(f"trainer process {proc.pid} is gone")
    if gone and probe.session_alive is False:
        evidence.append(f"tmux session '{probe.session}' is gone")
    elif gone and probe.pane_dead:
        code = probe.pane_dead_status
        evidence.append("the trainer's tmux pane exited" + (f" (status {code})" if code is not None else ""))
    pane_tb = last_traceback(probe.pane_tail)
    tb = pane_tb or last_traceback(this_attempt(probe.log_tail))  # never an earlier attempt's error
    exception = (tb.exception or None) if tb is not None else None
    # Only the pane counts here: trainer.log may still end with an earlier attempt's error.
    if not evidence and pane_tb is not None and pane_tb.lines_after == 0 and pane_tb.exception:
        # Nothing printed since: the main thread is likely waiting on a dead worker.
        evidence.append(f"a traceback ends the output while the process is alive: {pane_tb.exception[:200]}")
    if not evidence:
        return None
    zero = _zero_mib_gpus(probe, assigned_gpus)
    if zero:
        evidence.append(f"GPU {','.join(map(str, zero))} at 0 MiB while the run should hold memory")
    message = evidence[0]
    if exception and exception not in message:
        message += f"; last error: {exception[:200]}"
    detail = {
        "evidence": evidence,
        "exception": exception,
        "exit_code": probe.exit_code,
        "status_error": status.error if status else None,  # the signature (numbers blanked): for matching
        # The trainer's own words for it (status.json's detail.message), numbers kept: for the operator.
        "status_message": (status.detail or {}).get("message") if status else None,
        "phase": status.phase if status else None,
        "step": status.step if status else None,
    }
    return Finding(CRASH, "error", message, detail)


ERROR_SHOWN_CHARS = 500
"""The most of a trainer's error shown in one event, status line or runs row."""


def failure_text(status: contract.Status | None, limit: int = ERROR_SHOWN_CHARS) -> str | None:
    """The trainer's failure as it said it in status.json, numbers kept (``said_error``),
    on one line, control characters escaped, at most ``limit`` characters."""
    if status is None:
        return None
    text = said_error(status.error, (status.detail or {}).get("message"))
    return one_line(text, limit) if text else None


def said_error(signature: object, message: object) -> str | None:
    """``Type: message``: the trainer's own words (status.json's ``detail.message``),
    its type taken from the signature (``error``, numbers blanked). The signature
    alone only when no message was written: it is a grouping key, never the text
    shown when the words are there."""
    signature = signature.strip() if isinstance(signature, str) and signature.strip() else None
    if isinstance(message, str) and message.strip():
        kind = signature.split(":", 1)[0].strip() if signature and ":" in signature else None
        return f"{kind}: {message.strip()}" if kind and not message.strip().startswith(kind) else message.strip()
    return signature


def detect_conflict(probe: "ProbeResult", assigned_gpus: Sequence[int] | None = None) -> Finding | None:
    """Evidence that disagrees with itself, said as such (never a crash, never an end)."""
    proc = probe.process
    status = probe.status
    said = []
    if status is not None and status.phase in contract.FINAL_PHASES:
        said.append(f"status.json says {status.phase}")
    if probe.exit_code is not None:
        said.append(f"exit_code says {probe.exit_code}")
    if said and proc is not None and proc.alive:
        return Finding(CONFLICT, "warning", f"{' and '.join(said)} but trainer process {proc.pid} is alive: "
                       "not taken as the end of the run; still watching it",
                       {"conflict": "end_claimed_while_alive", "pid": proc.pid, "claims": said})
    if proc is not None and not proc.alive and proc.state is None and probe.session_alive and not probe.pane_dead:
        return Finding(CONFLICT, "warning", f"trainer pid {proc.pid} is not visible to the probe, but its tmux pane "
                       "is alive: the probe and the trainer see different pid namespaces (a container wrapper "
                       "whose commands land in another one?); not taken as a crash",
                       {"conflict": "pid_not_visible", "pid": proc.pid})
    if proc is not None and proc.alive and probe.session_alive is False:
        return Finding(CONFLICT, "warning", f"tmux session '{probe.session}' is gone but trainer process {proc.pid} "
                       "is alive: watching it by its pid", {"conflict": "session_gone_while_alive", "pid": proc.pid})
    zero = _zero_mib_gpus(probe, assigned_gpus)
    if zero:
        return Finding(CONFLICT, "warning", f"GPU {','.join(map(str, zero))} at 0 MiB while trainer process "
                       f"{proc.pid if proc else '?'} is alive and {status.phase if status else 'running'}: the GPU "
                       "readings and the process disagree", {"conflict": "gpus_at_zero", "gpus": zero})
    return None


def _zero_mib_gpus(probe: "ProbeResult", assigned_gpus: Sequence[int] | None) -> list[int]:
    """The assigned GPUs when every one reads exactly 0 MiB in a GPU phase, else []."""
    phase = probe.status.phase if probe.status else None
    if not assigned_gpus or not probe.gpus or phase not in GPU_PHASES:
        return []
    used = {g.index: g.memory_used_mib for g in probe.gpus}
    readings = [used.get(i) for i in assigned_gpus]
    if all(r == 0 for r in readings):
        return list(assigned_gpus)
    return []


# --------------------------------------------------------------------------- stall


def last_progress(samples: Sequence[Sample], status: contract.Status | None = None) -> tuple[int, float] | None:
    """(highest step, time it was first seen), from the samples and status.json."""
    best: tuple[int, float] | None = None
    for s in samples:
        if best is None or s.step > best[0]:
            best = (s.step, s.time)
    if status is not None and status.updated is not None and status.step and (best is None or status.step > best[0]):
        best = (status.step, status.updated)
    return best


def holds_back(findings: Iterable[Finding]) -> bool:
    """Whether these findings hold the stall detector back: a process stopped on
    purpose (state T) is reported, not judged by its quiet time. Once it runs again,
    the quiet time counts from the end of that episode (``held_until``), never from
    a step made before it: a trainer resumed with SIGCONT after a stop longer than the
    stall window has a whole window to write its next line."""
    return any(f.kind == STALL and f.detail.get("process_state") in STOPPED_STATES for f in findings)


def detect_stall(
    samples: Sequence[Sample],
    probe: "ProbeResult",
    expect: "Expect",
    now: float,
    phase_since: float | None = None,
    held_until: float | None = None,
) -> Finding | None:
    """No progress where progress is due. GPU utilisation is never taken as a
    sign of life: hung runs have been seen at 100%.

    ``held_until``: when the latest episode in which the detector held back ended
    (its process stopped, its host not answering), as first seen. Quiet time and
    the phase budgets count from no earlier than that: what the trainer did not do
    while it could not is not held against it."""
    proc = probe.process
    if proc is not None and proc.state in STOPPED_STATES:
        return Finding(
            STALL,
            "error",
            f"trainer process {proc.pid} is stopped (state {proc.state}: SIGSTOP or a debugger); it makes no progress",
            {"process_state": proc.state, "pid": proc.pid},
        )
    status = probe.status
    # Nothing written yet: the trainer is still starting (its import may be what hangs).
    phase = status.phase if status else (samples[-1].phase if samples else contract.PHASE_STARTING)
    since = phase_since if phase_since is not None else (status.started if status else None)
    resumed = held_until is not None and (since is None or held_until > since)
    budgets = {contract.PHASE_STARTING: expect.startup_budget, contract.PHASE_COMPILING: expect.compile_budget}
    if phase in budgets:
        if resumed:
            since = held_until
        if since is None or now - since <= budgets[phase]:
            return None
        return Finding(
            STALL,
            "error",
            f"still {phase} after {fmt_duration(now - since)}" + (" since its process ran again" if resumed else "")
            + f" (budget {fmt_duration(budgets[phase])})",
            {"phase": phase, "elapsed_s": now - since, "budget_s": budgets[phase]},
        )
    if phase in BEAT_PHASES:
        return _beat_stall(phase, status, expect, now, since, held_until)
    if phase not in (contract.PHASE_TRAINING, contract.PHASE_CHECKPOINTING):
        return None
    progress = last_progress(samples, status)
    marks = [t for t in (progress[1] if progress else None, phase_since, held_until) if t is not None]
    if not marks:
        return None
    quiet = now - max(marks)
    if quiet <= expect.stall_window:
        return None
    message = f"no new step for {fmt_duration(quiet)} while {phase} (stall window {fmt_duration(expect.stall_window)})"
    if progress:
        message += f"; last step {progress[0]} at {fmt_clock(progress[1])}"
    if held_until is not None and held_until == max(marks):
        message += f"; counted from {fmt_clock(held_until)}, when its process ran again"
    busy = [g.utilization_pct for g in probe.gpus or [] if g.utilization_pct]
    if busy:
        message += f"; GPU utilisation {max(busy):.0f}% is not progress"
    return Finding(
        STALL,
        "error",
        message,
        {"phase": phase, "quiet_s": quiet, "stall_window_s": expect.stall_window, "last_step": progress[0] if progress else None},
    )


# Phases judged by their sign of life, not by a start budget: (what is silent, the
# progress in status.json's detail, its done and total counts, what they count).
BEAT_PHASES = {
    contract.PHASE_REGENERATING: ("regeneration", "regenerate", "prompts_done", "prompts", "prompts written"),
    contract.PHASE_INDEXING: ("the data scan", "data", "shards_done", "shards", "shards scanned"),
}


def _beat_stall(phase: str, status: contract.Status | None, expect: "Expect", now: float, since: float | None,
                held_until: float | None) -> Finding | None:
    """Work of unknown length before training (the target writing the training data:
    hours for a real corpus; the first scan of a large one) is judged by its sign of
    life: status.json rewritten every few seconds while it goes
    (contract.REGENERATE_BEAT_S); a stall is a silence longer than the stall window."""
    marks = [t for t in (status.updated if status else None, since, held_until) if t is not None]
    if not marks:
        return None
    quiet = now - max(marks)
    if quiet <= expect.stall_window:
        return None
    what, key, done_key, total_key, counted = BEAT_PHASES[phase]
    progress = (status.detail or {}).get(key) if status else None
    done = progress.get(done_key) if isinstance(progress, dict) else None
    total = progress.get(total_key) if isinstance(progress, dict) else None
    where = f"; {done}/{total} {counted}" if type(done) is int and type(total) is int else ""
    return Finding(
        STALL,
        "error",
        f"{what} wrote no progress for {fmt_duration(quiet)} (stall window {fmt_duration(expect.stall_window)}){where}",
        {"phase": phase, "quiet_s": quiet, "stall_window_s": expect.stall_window, done_key: done},
    )


# --------------------------------------------------------------------------- throughput


def detect_regression(samples: Sequence[Sample], expect: "Expect", baseline_tok_s: float | None) -> Finding | None:
    """Training throughput under ``regression_fraction`` x baseline for
    ``regression_windows`` windows in a row, and/or an ETA over ``max_eta``."""
    k = expect.regression_windows
    training = [s for s in samples if s.phase == contract.PHASE_TRAINING and s.tok_s is not None]
    if len(training) < k:
        return None
    recent = training[-k:]
    current = statistics.median(s.tok_s for s in recent)
    parts: list[str] = []
    detail: dict[str, Any] = {"tok_s": current, "baseline_tok_s": baseline_tok_s, "windows": k}
    if baseline_tok_s and all(s.tok_s < expect.regression_fraction * baseline_tok_s for s in recent):
        ratio = current / baseline_tok_s
        parts.append(f"{fmt_tok_s(current)} = {ratio * 100:.0f}% of baseline {fmt_tok_s(baseline_tok_s)}")
        detail["fraction"] = ratio
    eta = _eta(recent, training)
    if expect.max_eta and eta is not None and eta > expect.max_eta:
        eta_text = f"ETA {fmt_duration(eta)} > {fmt_duration(expect.max_eta)}"
        parts.append(eta_text if parts else f"{eta_text} at {fmt_tok_s(current)}")
        detail.update(eta_s=eta, max_eta_s=expect.max_eta)
    if not parts:
        return None
    return Finding(REGRESSION, "warning", "; ".join(parts), detail)


# --------------------------------------------------------------------------- learning


LOSS_FLAT_FRACTION = 0.002
"""Loss that moved less than this fraction of itself over the window is flat."""


def detect_not_learning(samples: Sequence[Sample], expect: "Expect") -> Finding | None:
    """A run that trains and learns nothing: after ``expect.learn_after_steps`` steps
    of warm-up, at least ``expect.regression_windows`` + 1 training lines past the
    warm-up whose loss stays flat (its range under ``LOSS_FLAT_FRACTION`` of its
    median, or not finite) and whose accuracy is 0 on every line. A learning rate
    1e6 times too large reads that way (loss 6.2383, accuracy 0.000, for ever)."""
    warm = [s for s in samples if s.phase == contract.PHASE_TRAINING and s.step >= expect.learn_after_steps
            and s.loss is not None]
    if len(warm) < expect.regression_windows + 1 or warm[-1].step <= warm[0].step:
        return None
    if any(s.acc is None or s.acc > 0 for s in warm):
        return None
    losses = [s.loss for s in warm]
    finite = [v for v in losses if math.isfinite(v)]
    if len(finite) == len(losses):
        middle = statistics.median(finite)
        if max(finite) - min(finite) > LOSS_FLAT_FRACTION * max(abs(middle), 1e-9):
            return None
        said = f"loss flat at {middle:.4g}"
    else:
        said = "loss not finite"
    return Finding(
        LEARNING,
        "warning",
        f"{said} and accuracy 0 from step {warm[0].step} to {warm[-1].step} (after a warm-up of "
        f"{expect.learn_after_steps} steps): the drafter learns nothing; check train.lr and the data",
        {"loss": losses[-1] if math.isfinite(losses[-1]) else None, "from_step": warm[0].step,
         "to_step": warm[-1].step, "learn_after_steps": expect.learn_after_steps},
    )


# --------------------------------------------------------------------------- hysteresis


@dataclass(frozen=True)
class Held:
    """A finding kept back or kept open by ``hold``: since when its condition was
    seen (gaps shorter than the clear time included), whether it was raised, the
    finding last seen, and since when the condition has been away (None: present)."""

    since: float
    finding: Finding
    raised: bool = False
    away_since: float | None = None


def hold(finding: Finding | None, held: Held | None, now: float, raise_after: float,
         clear_after: float) -> tuple[Held | None, Finding | None]:
    """Hysteresis for a finding that may flap (a throughput regression on a busy
    host): -> (what to keep for the next call, the finding to report now or None).

    It is raised once its condition has held for ``raise_after`` seconds, counting
    through absences shorter than ``clear_after``; once raised it is cleared only
    after ``clear_after`` seconds without it, and reported (as last seen) meanwhile.
    A throughput that is slow 20 s, fine 5 s, slow 20 s ... is one finding, raised
    once. Pure: ``now`` is the caller's clock (the same one on every call)."""
    if finding is not None:
        if held is None:
            held = Held(now, finding)
        held = replace(held, finding=finding, away_since=None)
        if not held.raised and now - held.since >= raise_after:
            held = replace(held, raised=True)
        return held, finding if held.raised else None
    if held is None:
        return None, None
    away = held.away_since if held.away_since is not None else now
    if now - away >= clear_after:
        return None, None
    return replace(held, away_since=away), held.finding if held.raised else None


def _eta(recent: Sequence[Sample], training: Sequence[Sample]) -> float | None:
    """The trainer's ETA when every recent window has one (the smallest, so one
    slow window does not raise it), else from the step rate over the window."""
    etas = [s.eta_s for s in recent]
    if all(e is not None for e in etas):
        return min(etas)
    first, last = training[0], training[-1]
    if last.total_steps is None or last.time <= first.time or last.step <= first.step:
        return None
    rate = (last.step - first.step) / (last.time - first.time)
    return max(0.0, last.total_steps - last.step) / rate


# --------------------------------------------------------------------------- host / environment


def detect_unreachable(
    host: str, since: float, polls: int, now: float, *, error: str | None = None, escalate_after: float = 300.0
) -> Finding:
    """A host that failed ``polls`` polls in a row since ``since``: a warning,
    then an error once it has lasted ``escalate_after`` seconds. A changed host key
    is an error at once, its fix said: waiting never makes it answer."""
    message = f"host {host} unreachable since {fmt_clock(since)} ({polls} poll{'s' if polls != 1 else ''})"
    changed = bool(error) and HOST_KEY_CHANGED in error
    if error and error.strip():
        message += f": {error.strip().splitlines()[0][:600 if changed else 200]}"
    severity = "error" if changed or now - since >= escalate_after else "warning"
    detail = {"host": host, "since": since, "polls": polls, "error": error, **({"host_key": "changed"} if changed else {})}
    return Finding(UNREACHABLE, severity, message, detail)


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def env_drift(previous: dict[str, str], current: dict[str, str], *, shown: int = 5) -> Finding | None:
    """Package set (name -> version) changed since the last good run? Names
    compare the way pip does (case and -/_ insensitive)."""
    before = {_norm(k): (k, v) for k, v in previous.items()}
    after = {_norm(k): (k, v) for k, v in current.items()}
    added = {after[n][0]: after[n][1] for n in sorted(after.keys() - before.keys())}
    removed = {before[n][0]: before[n][1] for n in sorted(before.keys() - after.keys())}
    changed = {
        after[n][0]: [before[n][1], after[n][1]]
        for n in sorted(after.keys() & before.keys())
        if before[n][1] != after[n][1]
    }
    if not (added or removed or changed):
        return None
    parts = []
    for label, items in (
        ("added", [f"{k} {v}" for k, v in added.items()]),
        ("removed", [f"{k} {v}" for k, v in removed.items()]),
        ("changed", [f"{k} {a} -> {b}" for k, (a, b) in changed.items()]),
    ):
        if items:
            more = f" (+{len(items) - shown} more)" if len(items) > shown else ""
            parts.append(f"{label} {', '.join(items[:shown])}{more}")
    message = "environment changed since the last good run: " + "; ".join(parts)
    return Finding(DRIFT, "warning", message, {"added": added, "removed": removed, "changed": changed})
