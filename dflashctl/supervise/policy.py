"""The restart policy: findings + classification + restart history -> actions.

Pure: the clock (``now``) and the randomness (``rng``, for backoff jitter) are
arguments. Every action carries the reason it was taken, in operator terms.
Never here: I/O, a clock read, or an action taken (the supervisor acts).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Sequence

from dflashctl.core.signatures import RESTART, STOP, UNKNOWN, Classification
from dflashctl.core.states import most_severe
from dflashctl.core.units import fmt_duration
from dflashctl.supervise import detectors
from dflashctl.supervise.detectors import Finding

if TYPE_CHECKING:
    from dflashctl.config import RestartPolicy

NONE = "none"
ALERT = "alert"
# A restart is due for these findings; the others (regression, unreachable,
# drift) only alert: restarting cannot fix a slow kernel or a dead network.
RESTART_TRIGGERS = (detectors.CRASH, detectors.STALL)
STALL_SIGNATURE = "stall"  # the name restart.actions uses for hung runs


@dataclass(frozen=True)
class Restart:
    """One earlier restart of the run."""

    time: float
    step_before: int | None  # highest step before the failure that caused it
    step_after: int | None  # highest step the restarted attempt reached (None: never stepped)

    @property
    def progressed(self) -> bool:
        before = self.step_before if self.step_before is not None else -1
        return self.step_after is not None and self.step_after > before


@dataclass
class Action:
    kind: str  # restart | restart_serialized | stop | alert | none
    reason: str
    delay: float = 0.0  # seconds to wait before restarting (backoff)
    severity: str = "info"
    signature: str | None = None  # the crash signature (or 'stall') behind a restart/stop
    finding: str | None = None  # the finding kind an alert is about (alerts rate-limit per kind)
    detail: dict[str, Any] = field(default_factory=dict)


def backoff(policy: "RestartPolicy", attempt: int, rng: random.Random) -> float:
    """Seconds before restart number ``attempt`` (0-based), exponential with
    +-jitter so many runs failing together do not restart in lockstep."""
    base = min(policy.backoff_max, policy.backoff_initial * policy.backoff_factor**attempt)
    return max(0.0, base * (1.0 + policy.jitter * rng.uniform(-1.0, 1.0)))


def counted_restarts(
    history: Sequence[Restart], policy: "RestartPolicy", now: float, healthy_since: float | None = None
) -> list[Restart]:
    """Restarts that count against ``max_restarts``: those that made no progress (the
    attempt they started never passed the step where the one before it failed), inside
    the window, and after the last stretch of healthy training that lasted
    ``healthy_after``. A restart that got further than any attempt before it costs
    nothing: a run of days that crashes now and then is never given up on, while a
    crash loop still ends fast (``crash_loop_k``)."""
    counted = [r for r in history if r.time > now - policy.window and not r.progressed]
    if healthy_since is not None and now - healthy_since >= policy.healthy_after:
        counted = [r for r in counted if r.time >= healthy_since]
    return counted


def decide(
    findings: Sequence[Finding],
    classification: Classification | None,
    policy: "RestartPolicy",
    history: Sequence[Restart],
    now: float,
    rng: random.Random,
    *,
    healthy_since: float | None = None,
) -> list[Action]:
    """What to do about one run's findings. The first action is the decision
    (restart, restart_serialized, stop or none); alert actions follow, one per
    finding.

    classification: of the crash (``signatures.classify``), None for a stall.
    history: earlier restarts, oldest first; the last one's ``step_after`` is the
    highest step the current attempt reached. healthy_since: when the current
    attempt's steady training began (None if it never trained); once it has
    lasted ``policy.healthy_after`` the restart counter starts again at zero.
    """
    finished = next((f for f in findings if f.kind == detectors.FINISHED), None)
    if finished is not None:
        return [Action(NONE, finished.message, finding=finished.kind)]
    trigger = next((f for k in RESTART_TRIGGERS for f in findings if f.kind == k), None)
    alerts = [
        Action(ALERT, f.message, severity=f.severity, finding=f.kind, detail=f.detail) for f in findings if f is not trigger
    ]
    if trigger is None:
        reason = "healthy" if not findings else "nothing a restart would fix: " + "; ".join(f.message for f in findings)
        return [Action(NONE, reason), *alerts]
    decision = with_advice(_decide_trigger(trigger, classification, policy, history, now, rng, healthy_since))
    alert = Action(
        ALERT,
        decision.reason,
        severity=most_severe((trigger.severity, decision.severity)),
        finding=trigger.kind,
        detail={**trigger.detail, "decision": decision.kind, "signature": decision.signature,
                "advice": decision.detail.get("advice")},
    )
    return [decision, alert, *alerts]


def with_advice(decision: Action) -> Action:
    """The signature's advice (its hint) said with every decision, whatever its action:
    in the reason (the event, the console, the alert's message) unless already there,
    and as ``detail["advice"]`` (the alert's payload). A restarted crash needs it as
    much as a stopped one: an illegal memory access restarted five times still wants
    its one run with CUDA_LAUNCH_BLOCKING=1."""
    hint = decision.detail.get("hint")
    if not hint:
        return decision
    reason = decision.reason if hint in decision.reason else f"{decision.reason}; advice: {hint}"
    return replace(decision, reason=reason, detail={**decision.detail, "advice": hint})


def _decide_trigger(
    trigger: Finding,
    classification: Classification | None,
    policy: "RestartPolicy",
    history: Sequence[Restart],
    now: float,
    rng: random.Random,
    healthy_since: float | None,
) -> Action:
    if detectors.holds_back([trigger]):
        return Action(
            NONE,
            f"{trigger.message}; not restarting a process someone stopped on purpose "
            "(resume it with `kill -CONT`, or `dflashctl restart`)",
            severity="error",
            signature=STALL_SIGNATURE,
        )
    if trigger.kind == detectors.CRASH:
        classification = classification or UNKNOWN
        name, action, severity = classification.name, classification.action, classification.severity
        hint = classification.hint
    else:
        name, action, severity, hint = STALL_SIGNATURE, RESTART, trigger.severity, None
    action = policy.actions.get(name, action)
    what = f"{trigger.kind} ({name}): {trigger.message}"

    def stop(why: str, severity: str) -> Action:
        return Action(STOP, f"{what}; {why}", severity=severity, signature=name, detail={"hint": hint})

    if action == STOP:
        return stop(f"not restarting: {hint}" if hint else "not restarting (signature action: stop)", most_severe((severity, "error")))
    if not policy.enabled:
        return stop("not restarting: restart.enabled is false in the playbook", most_severe((severity, "error")))
    recent = list(history)[-policy.crash_loop_k :]
    if len(recent) >= policy.crash_loop_k and not any(r.progressed for r in recent):
        return stop(
            f"crash loop: {len(recent)} restarts in a row without step progress "
            f"(restart.crash_loop_k {policy.crash_loop_k})",
            "critical",
        )
    counted = counted_restarts(history, policy, now, healthy_since)
    if len(counted) >= policy.max_restarts:
        return stop(
            f"restart limit reached: {len(counted)} restarts without progress in the last {fmt_duration(policy.window)} "
            f"(restart.max_restarts {policy.max_restarts})",
            "critical",
        )
    delay = backoff(policy, len(counted), rng)
    return Action(
        action,
        f"{what}; {action.replace('_', ' ')} {len(counted) + 1}/{policy.max_restarts} in {fmt_duration(delay)}",
        delay=delay,
        severity=severity,
        signature=name,
        detail={"hint": hint, "attempt": len(counted) + 1},
    )
