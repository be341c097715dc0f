"""The restart policy as a table: (findings, classification, policy, history, now) -> actions."""

from __future__ import annotations

import random

import pytest

from dflashctl.config import RestartPolicy
from dflashctl.core.signatures import classify
from dflashctl.supervise.detectors import Finding
from dflashctl.supervise.policy import Restart, backoff, counted_restarts, decide

NOW = 1_800_000_000.0
H = 3600.0
CRASH = Finding("crash", "error", "trainer process 4242 is gone", {"evidence": ["trainer process 4242 is gone"]})
STALL = Finding("stall", "error", "no new step for 6.7 m while training (stall window 5 m)", {"phase": "training"})
STOPPED = Finding("stall", "error", "trainer process 4242 is stopped (state T)", {"process_state": "T"})
SLOW = Finding("regression", "warning", "4.3 Ktok/s = 34% of baseline 12.8 Ktok/s", {})
DRIFT = Finding("drift", "warning", "environment changed since the last good run: added sglang 0.5.1", {})
DONE = Finding("finished", "info", "training finished at step 100000", {"outcome": "done"})

UNKNOWN = classify("RuntimeError: boom", None, 1)
OOM = classify("torch.OutOfMemoryError: CUDA out of memory.", None, 1)
FX = classify("Detected that you are using FX to symbolically trace a dynamo-optimized function", None, 1)

P = RestartPolicy(jitter=0)  # exact delays; jitter has its own test


def restarts(*ages_h: float, progressed: bool = True) -> list[Restart]:
    """Restarts ``age`` hours before NOW, oldest first."""
    return [Restart(NOW - a * H, 1000, 1500 if progressed else 1000) for a in ages_h]


def alternating(*ages_h: float) -> list[Restart]:
    """Restarts ``age`` hours before NOW, oldest first: the first, third, ... made no
    progress, the others did (never three in a row without: no crash loop)."""
    return [Restart(NOW - a * H, 1000, 1000 if i % 2 == 0 else 1500) for i, a in enumerate(ages_h)]


# (id, findings, classification, policy, history, healthy_since, expected [(kind, reason, delay)] of the decision)
CASES = [
    ("healthy", [], None, P, [], None, [("none", "healthy", 0.0)]),
    (
        "regression-only-alerts",
        [SLOW],
        None,
        P,
        [],
        None,
        [("none", "nothing a restart would fix: 4.3 Ktok/s = 34% of baseline 12.8 Ktok/s", 0.0)],
    ),
    ("finished", [DONE], None, P, restarts(1), None, [("none", "training finished at step 100000", 0.0)]),
    (
        "first-crash",
        [CRASH],
        UNKNOWN,
        P,
        [],
        None,
        [("restart", "crash (unknown): trainer process 4242 is gone; restart 1/5 in 10 s", 10.0)],
    ),
    ("crash-without-classification-is-unknown", [CRASH], None, P, [], None, [("restart", "crash (unknown): trainer process 4242 is gone; restart 1/5 in 10 s", 10.0)]),
    (
        "backoff-grows",
        [CRASH],
        UNKNOWN,
        P,
        restarts(3, 2, progressed=False),
        None,
        [("restart", "crash (unknown): trainer process 4242 is gone; restart 3/5 in 40 s", 40.0)],
    ),
    (
        "backoff-capped",
        [CRASH],
        UNKNOWN,
        RestartPolicy(jitter=0, max_restarts=20, crash_loop_k=10),
        restarts(5, 4.5, 4, 3.5, 3, 2.5, 2, 1.5, progressed=False),
        None,
        [("restart", "crash (unknown): trainer process 4242 is gone; restart 9/20 in 10 m", 600.0)],
    ),
    (
        "fx-race-serialized",
        [CRASH],
        FX,
        P,
        [],
        None,
        [("restart_serialized", "crash (fx_race): trainer process 4242 is gone; restart serialized 1/5 in 10 s", 10.0)],
    ),
    (
        "oom-stops",
        [CRASH],
        OOM,
        P,
        [],
        None,
        [("stop", f"crash (cuda_oom): trainer process 4242 is gone; not restarting: {OOM.hint}", 0.0)],
    ),
    (
        "playbook-overrides-oom",
        [CRASH],
        OOM,
        RestartPolicy(jitter=0, actions={"cuda_oom": "restart_serialized"}),
        [],
        None,
        [("restart_serialized", "crash (cuda_oom): trainer process 4242 is gone; restart serialized 1/5 in 10 s", 10.0)],
    ),
    (
        "playbook-stops-unknown",
        [CRASH],
        UNKNOWN,
        RestartPolicy(actions={"unknown": "stop"}),
        [],
        None,
        [("stop", f"crash (unknown): trainer process 4242 is gone; not restarting: {UNKNOWN.hint}", 0.0)],
    ),
    (
        "disabled",
        [CRASH],
        UNKNOWN,
        RestartPolicy(enabled=False),
        [],
        None,
        [("stop", "crash (unknown): trainer process 4242 is gone; not restarting: restart.enabled is false in the playbook", 0.0)],
    ),
    (
        "crash-loop",
        [CRASH],
        UNKNOWN,
        P,
        restarts(0.3, 0.2, 0.1, progressed=False),
        None,
        [("stop", "crash (unknown): trainer process 4242 is gone; crash loop: 3 restarts in a row without step progress (restart.crash_loop_k 3)", 0.0)],
    ),
    (
        "progress-breaks-the-loop",
        [CRASH],
        UNKNOWN,
        P,
        [Restart(NOW - 0.3 * H, 1000, 1000), Restart(NOW - 0.2 * H, 1000, 1200), Restart(NOW - 0.1 * H, 1200, None)],
        None,
        [("restart", "crash (unknown): trainer process 4242 is gone; restart 3/5 in 40 s", 40.0)],
    ),
    (
        "never-stepped-is-no-progress",
        [CRASH],
        UNKNOWN,
        RestartPolicy(crash_loop_k=2),
        [Restart(NOW - 600, None, None), Restart(NOW - 300, None, None)],
        None,
        [("stop", "crash (unknown): trainer process 4242 is gone; crash loop: 2 restarts in a row without step progress (restart.crash_loop_k 2)", 0.0)],
    ),
    (
        "restart-limit",
        [CRASH],
        UNKNOWN,
        P,
        alternating(5, 4.5, 4, 3.5, 3, 2.5, 2, 1.5, 1),
        None,
        [("stop", "crash (unknown): trainer process 4242 is gone; restart limit reached: 5 restarts without progress in the last 6 h (restart.max_restarts 5)", 0.0)],
    ),
    (
        "restarts-that-made-progress-cost-nothing",
        [CRASH],
        UNKNOWN,
        RestartPolicy(jitter=0, max_restarts=3),
        restarts(3, 2, 1),
        None,
        [("restart", "crash (unknown): trainer process 4242 is gone; restart 1/3 in 10 s", 10.0)],
    ),
    (
        "three-restarts-without-progress-stop",
        [CRASH],
        UNKNOWN,
        RestartPolicy(jitter=0, max_restarts=3, crash_loop_k=10),
        restarts(3, 2, 1, progressed=False),
        None,
        [("stop", "crash (unknown): trainer process 4242 is gone; restart limit reached: 3 restarts without progress in the last 6 h (restart.max_restarts 3)", 0.0)],
    ),
    (
        "old-restarts-leave-the-window",
        [CRASH],
        UNKNOWN,
        P,
        alternating(9, 8, 7, 6.5, 6.1),
        None,
        [("restart", "crash (unknown): trainer process 4242 is gone; restart 1/5 in 10 s", 10.0)],
    ),
    (
        "healthy-training-resets-the-counter",
        [CRASH],
        UNKNOWN,
        P,
        alternating(2, 1.5, 1, 0.5),
        NOW - 1000,
        [("restart", "crash (unknown): trainer process 4242 is gone; restart 1/5 in 10 s", 10.0)],
    ),
    (
        "short-healthy-stretch-does-not",
        [CRASH],
        UNKNOWN,
        P,
        alternating(2.5, 2, 1.5, 1, 0.5),
        NOW - 500,
        [("restart", "crash (unknown): trainer process 4242 is gone; restart 4/5 in 1.3 m", 80.0)],
    ),
    (
        "no-restarts-allowed",
        [CRASH],
        UNKNOWN,
        RestartPolicy(max_restarts=0),
        [],
        None,
        [("stop", "crash (unknown): trainer process 4242 is gone; restart limit reached: 0 restarts without progress in the last 6 h (restart.max_restarts 0)", 0.0)],
    ),
    (
        "stall-restarts",
        [STALL],
        None,
        P,
        [],
        None,
        [("restart", "stall (stall): no new step for 6.7 m while training (stall window 5 m); restart 1/5 in 10 s", 10.0)],
    ),
    (
        "stall-action-from-playbook",
        [STALL],
        None,
        RestartPolicy(actions={"stall": "stop"}),
        [],
        None,
        [("stop", "stall (stall): no new step for 6.7 m while training (stall window 5 m); not restarting (signature action: stop)", 0.0)],
    ),
    (
        "stopped-process-left-alone",
        [STOPPED],
        None,
        P,
        [],
        None,
        [("none", "trainer process 4242 is stopped (state T); not restarting a process someone stopped on purpose (resume it with `kill -CONT`, or `dflashctl restart`)", 0.0)],
    ),
    (
        "crash-wins-over-stall",
        [STALL, DRIFT, CRASH],
        UNKNOWN,
        P,
        [],
        None,
        [("restart", "crash (unknown): trainer process 4242 is gone; restart 1/5 in 10 s", 10.0)],
    ),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_decide(case) -> None:
    _, findings, classification, policy, history, healthy_since, expected = case
    actions = decide(findings, classification, policy, history, NOW, random.Random(0), healthy_since=healthy_since)
    decision = actions[0]
    # Every crash decision says its signature's advice, whatever its action (a restart's too).
    reason, _, advice = decision.reason.partition("; advice: ")
    assert [(decision.kind, reason, decision.delay)] == expected
    if any(f.kind == "crash" for f in findings):
        hint = (classification or UNKNOWN).hint
        assert decision.detail["advice"] == hint and (advice == hint or hint in reason)
        assert actions[1].detail["advice"] == hint  # and in the alert's payload
    else:
        assert not advice and "advice" not in decision.detail
    alerts = actions[1:]
    assert all(a.kind == "alert" for a in alerts)
    # One alert per finding (none for a finished run): the trigger's says what was decided.
    assert sorted(a.finding for a in alerts) == sorted(f.kind for f in findings if f.kind != "finished")


def test_alerts_carry_the_decision() -> None:
    stop, alert = decide([CRASH], OOM, P, [], NOW, random.Random(0))
    assert (stop.kind, stop.severity, stop.signature) == ("stop", "error", "cuda_oom")
    assert (alert.kind, alert.severity, alert.finding, alert.reason) == ("alert", "error", "crash", stop.reason)
    assert alert.detail["decision"] == "stop" and alert.detail["signature"] == "cuda_oom"

    guard, alert = decide([CRASH], UNKNOWN, P, restarts(0.3, 0.2, 0.1, progressed=False), NOW, random.Random(0))
    assert guard.severity == alert.severity == "critical"

    none, drift = decide([DRIFT], None, P, [], NOW, random.Random(0))
    assert (drift.kind, drift.severity, drift.reason, drift.finding) == ("alert", "warning", DRIFT.message, "drift")


def test_backoff_jitter_uses_the_given_rng() -> None:
    policy = RestartPolicy(backoff_initial=10, jitter=0.2)
    delays = [backoff(policy, 0, random.Random(seed)) for seed in range(200)]
    assert all(8.0 <= d <= 12.0 for d in delays)
    assert len({round(d, 6) for d in delays}) > 100  # spread, not lockstep
    assert backoff(policy, 0, random.Random(7)) == backoff(policy, 0, random.Random(7))
    capped = RestartPolicy(backoff_initial=10, backoff_max=60, jitter=0.0)
    assert [backoff(capped, n, random.Random(0)) for n in range(5)] == [10, 20, 40, 60, 60]


def test_counted_restarts() -> None:
    assert counted_restarts(restarts(3, 2, 1), P, NOW) == []  # each got further than the one before
    history = restarts(7, 3, 1, progressed=False)
    assert counted_restarts(history, P, NOW) == history[1:]
    assert counted_restarts(history, P, NOW, healthy_since=NOW - 2 * H) == history[2:]
    assert counted_restarts(history, P, NOW, healthy_since=NOW - 60) == history[1:]  # not healthy long enough
