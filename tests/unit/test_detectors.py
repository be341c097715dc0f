"""Detectors as tables: (window of samples, probe observation, state, now) -> findings."""

from __future__ import annotations

import time

import pytest

from dflashctl.config import Expect
from dflashctl.core import contract
from dflashctl.supervise.detectors import (
    Finding,
    Sample,
    baseline_from_history,
    detect,
    detect_crash,
    detect_unreachable,
    env_drift,
    fmt_duration,
    fmt_tok_s,
)
from tests.harness.observations import DAY, EXPECT, HEALTHY, NOW, OOM, TRACEBACK, gpu, obs, steps


@pytest.fixture(autouse=True)
def utc(monkeypatch):
    """Messages show HH:MM:SS in local time: pin the zone."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


# (id, samples, observation, run state, keyword args of detect, expected [(kind, severity, message)])
CASES = [
    ("healthy", HEALTHY, obs(), "running", {}, []),
    ("no-observation-no-crash", HEALTHY, None, "running", {}, []),
    (
        "session-gone",
        HEALTHY,
        obs(session_alive=False, alive=False, state=None),
        "running",
        {},
        [("crash", "error", "trainer process 4242 is gone")],
    ),
    (
        "exit-code-and-log-traceback",
        HEALTHY,
        obs(contract.PHASE_FAILED, session_alive=False, alive=False, exit_code=1, error=OOM, log=TRACEBACK),
        "running",
        {},
        [("crash", "error", f"the trainer reported failure: {OOM}")],
    ),
    (
        "exit-code-only",
        HEALTHY,
        obs(session_alive=False, alive=False, exit_code=139, log="step 5\n"),
        "running",
        {},
        [("crash", "error", "the trainer exited with code 139 (killed by signal 11)")],
    ),
    (
        "zombie",
        HEALTHY,
        obs(alive=False, state="Z"),
        "running",
        {},
        [("crash", "error", "trainer process 4242 is a zombie (exited, not reaped)")],
    ),
    (
        "pane-exited-remain-on-exit",
        HEALTHY,
        obs(pane_dead=True, alive=False, exit_code=None, pane="step 9\n" + TRACEBACK + "\n"),
        "running",
        {},
        [("crash", "error", f"trainer process 4242 is gone; last error: {OOM}")],
    ),
    (
        "traceback-ends-output-while-alive",
        HEALTHY,
        obs(pane="step 1200 ok\nException in thread drafter-0:\n" + TRACEBACK),
        "running",
        {},
        [("crash", "error", f"a traceback ends the output while the process is alive: {OOM}")],
    ),
    ("traceback-then-progress", HEALTHY, obs(pane=TRACEBACK + "\nstep 1210 ok\nstep 1220 ok"), "running", {}, []),
    (
        "old-traceback-in-log-only",
        HEALTHY,
        obs(contract.PHASE_STARTING, log=TRACEBACK, pane="loading target", started=NOW - 60),
        "launching",
        {},
        [],
    ),
    (
        "gpus-at-zero-while-training",
        HEALTHY,
        obs(gpus=[gpu(0, 100.0, 0), gpu(0, 0.0, 1), gpu(81000, 90.0, 2)]),
        "running",
        {"assigned_gpus": [0, 1]},
        # One reading against a live process: reported, never a crash.
        [("conflict", "warning", "GPU 0,1 at 0 MiB while trainer process 4242 is alive and training: the GPU "
          "readings and the process disagree")],
    ),
    (
        "gpus-at-zero-back-up-a-crash",
        HEALTHY,
        obs(session_alive=False, alive=False, state=None, gpus=[gpu(0, 0.0, 0)]),
        "running",
        {"assigned_gpus": [0]},
        [("crash", "error", "trainer process 4242 is gone")],
    ),
    (
        "done-claimed-while-alive",
        HEALTHY,
        obs(contract.PHASE_DONE, step=100),
        "running",
        {},
        [("conflict", "warning", "status.json says done but trainer process 4242 is alive: not taken as the end "
          "of the run; still watching it")],
    ),
    (
        "exit-code-0-written-while-alive",
        HEALTHY,
        obs(exit_code=0),
        "running",
        {},
        [("conflict", "warning", "exit_code says 0 but trainer process 4242 is alive: not taken as the end of the "
          "run; still watching it")],
    ),
    (
        "exit-code-1-written-while-alive",
        HEALTHY,
        obs(exit_code=1),
        "running",
        {},
        [("conflict", "warning", "exit_code says 1 but trainer process 4242 is alive: not taken as the end of the "
          "run; still watching it")],
    ),
    (
        "pid-not-visible-while-the-pane-lives",
        HEALTHY,
        obs(alive=False, state=None),
        "running",
        {},
        [("conflict", "warning", "trainer pid 4242 is not visible to the probe, but its tmux pane is alive: the "
          "probe and the trainer see different pid namespaces (a container wrapper whose commands land in another "
          "one?); not taken as a crash")],
    ),
    (
        "session-gone-while-alive",
        HEALTHY,
        obs(session_alive=False),
        "running",
        {},
        [("conflict", "warning", "tmux session 'r' is gone but trainer process 4242 is alive: watching it by its pid")],
    ),
    ("gpus-at-zero-while-starting", [], obs(contract.PHASE_STARTING, gpus=[gpu(0)], started=NOW - 60), "launching", {"assigned_gpus": [0]}, []),
    ("one-gpu-in-use", HEALTHY, obs(gpus=[gpu(0), gpu(500, index=1)]), "running", {"assigned_gpus": [0, 1]}, []),
    ("not-alive-states", HEALTHY, obs(session_alive=False, alive=False), "restarting", {}, []),
    ("failed-state", HEALTHY, obs(session_alive=False, alive=False), "failed", {}, []),
    (
        "done",
        HEALTHY,
        obs(contract.PHASE_DONE, session_alive=False, alive=False, exit_code=0, step=100000),
        "running",
        {},
        [("finished", "info", "training finished at step 100000")],
    ),
    (
        "stopped-on-request",
        HEALTHY,
        obs(contract.PHASE_CHECKPOINTING, session_alive=False, alive=False, exit_code=contract.EXIT_STOPPED),
        "running",
        {},
        [("finished", "info", "the trainer stopped on request (checkpoint written)")],
    ),
    (
        "stall",
        steps(900, 840, 780, 400),
        obs(gpus=[gpu(81000, 100.0)]),
        "running",
        {},
        [
            (
                "stall",
                "error",
                "no new step for 6.7 m while training (stall window 5 m); last step 130 at 07:53:20; "
                "GPU utilisation 100% is not progress",
            )
        ],
    ),
    (
        "stall-from-repeated-step",
        [Sample(NOW - 700, 50), Sample(NOW - 400, 60), Sample(NOW - 100, 60)],
        obs(),
        "running",
        {},
        [("stall", "error", "no new step for 6.7 m while training (stall window 5 m); last step 60 at 07:53:20")],
    ),
    ("status-step-is-progress", steps(900, 400), obs(step=500, updated=NOW - 20), "running", {}, []),
    ("just-started-training", [], obs(), "running", {"phase_since": NOW - 100}, []),
    ("old-samples-new-phase", steps(2000, 1900), obs(), "running", {"phase_since": NOW - 60}, []),
    ("compiling-in-budget", [], obs(contract.PHASE_COMPILING), "running", {"phase_since": NOW - 1700}, []),
    (
        "compiling-over-budget",
        [],
        obs(contract.PHASE_COMPILING),
        "running",
        {"phase_since": NOW - 2000},
        [("stall", "error", "still compiling after 33.3 m (budget 30 m)")],
    ),
    (
        "starting-over-budget",
        [],
        obs(contract.PHASE_STARTING, started=NOW - 660),
        "launching",
        {},
        [("stall", "error", "still starting after 11 m (budget 10 m)")],
    ),
    ("no-status-yet", [], obs(no_status=True), "launching", {"phase_since": NOW - 300}, []),
    # The target writing the data for hours: judged by its sign of life, not by the start budget.
    ("regenerating-for-hours", [], obs(contract.PHASE_REGENERATING, started=NOW - 3 * 3600, updated=NOW - 20),
     "running", {"phase_since": NOW - 3 * 3600 + 30}, []),
    (
        "regenerating-silent",
        [],
        obs(contract.PHASE_REGENERATING, started=NOW - 3600, updated=NOW - 400),
        "running",
        {"phase_since": NOW - 3500},
        [("stall", "error", "regeneration wrote no progress for 6.7 m (stall window 5 m)")],
    ),
    # The first scan of a large corpus in worker processes: judged the same way.
    ("indexing-for-long", [], obs(contract.PHASE_INDEXING, started=NOW - 3600, updated=NOW - 20),
     "launching", {"phase_since": NOW - 3500}, []),
    (
        "indexing-silent",
        [],
        obs(contract.PHASE_INDEXING, started=NOW - 3600, updated=NOW - 400,
            detail={"data": {"shards_done": 3, "shards": 40, "bytes_done": 1, "bytes": 9}}),
        "launching",
        {"phase_since": NOW - 3500},
        [("stall", "error", "the data scan wrote no progress for 6.7 m (stall window 5 m); 3/40 shards scanned")],
    ),
    (
        "no-status-past-startup-budget",
        [],
        obs(no_status=True),
        "launching",
        {"phase_since": NOW - 700},
        [("stall", "error", "still starting after 11.7 m (budget 10 m)")],
    ),
    (
        "process-stopped",
        HEALTHY,
        obs(state="T"),
        "running",
        {},
        [("stall", "error", "trainer process 4242 is stopped (state T: SIGSTOP or a debugger); it makes no progress")],
    ),
    (
        "process-in-a-debugger",
        HEALTHY,
        obs(state="t"),
        "running",
        {},
        [("stall", "error", "trainer process 4242 is stopped (state t: SIGSTOP or a debugger); it makes no progress")],
    ),
    # Stopped 10 minutes (twice the window), running again since 4 minutes: its last
    # step is 11 minutes old, but the quiet time counts from when it ran again.
    ("resumed-after-a-stop-longer-than-the-window", steps(660), obs(), "running", {"held_until": NOW - 240}, []),
    (
        "resumed-and-quiet-for-a-whole-window",
        steps(960),
        obs(),
        "running",
        {"held_until": NOW - 310},
        [("stall", "error", "no new step for 5.2 m while training (stall window 5 m); last step 100 at 07:44:00; "
          "counted from 07:54:50, when its process ran again")],
    ),
    ("held-before-the-last-step", steps(400, 320), obs(), "running", {"held_until": NOW - 900},
     [("stall", "error", "no new step for 5.3 m while training (stall window 5 m); last step 110 at 07:54:40")]),
    # A compile budget: a stop in the middle of compiling is not compile time.
    ("compiling-resumed", [], obs(contract.PHASE_COMPILING), "running",
     {"phase_since": NOW - 2000, "held_until": NOW - 600}, []),
    ("compiling-resumed-over-budget", [], obs(contract.PHASE_COMPILING), "running",
     {"phase_since": NOW - 4000, "held_until": NOW - 1900},
     [("stall", "error", "still compiling after 31.7 m since its process ran again (budget 30 m)")]),
    (
        "regression-and-eta",
        steps(240, 180, 120, 60, tok_s=4300.0, eta_s=38.2 * DAY),
        obs(),
        "running",
        {"baseline_tok_s": 12800.0},
        [("regression", "warning", "4.3 Ktok/s = 34% of baseline 12.8 Ktok/s; ETA 38.2 d > 7 d")],
    ),
    (
        "regression-from-playbook-baseline",
        steps(180, 120, 60, tok_s=4300.0),
        obs(),
        "running",
        {"expect": Expect(baseline_tok_s=12800)},
        [("regression", "warning", "4.3 Ktok/s = 34% of baseline 12.8 Ktok/s")],
    ),
    (
        "regression-not-k-in-a-row",
        steps(180, 60, tok_s=4300.0) + steps(0, tok_s=12000.0, first=200),
        obs(),
        "running",
        {"baseline_tok_s": 12800.0},
        [],
    ),
    ("regression-too-few-windows", steps(120, 60, tok_s=4300.0), obs(), "running", {"baseline_tok_s": 12800.0}, []),
    (
        "eta-only-no-baseline",
        steps(180, 120, 60, tok_s=12500.0, eta_s=38.2 * DAY),
        obs(),
        "running",
        {},
        [("regression", "warning", "ETA 38.2 d > 7 d at 12.5 Ktok/s")],
    ),
    (
        "eta-from-step-rate",
        [Sample(NOW - 60 - 3600 * (2 - i), 1000 * i, 9000.0, total_steps=1_000_000) for i in range(3)],
        obs(),
        "running",
        {},
        [("regression", "warning", "ETA 41.6 d > 7 d at 9.0 Ktok/s")],
    ),
    (
        "regression-with-host-down",
        steps(240, 180, 120, tok_s=4300.0),
        None,
        "running",
        {"baseline_tok_s": 12800.0},
        [("regression", "warning", "4.3 Ktok/s = 34% of baseline 12.8 Ktok/s")],
    ),
    (
        "stall-and-regression",
        steps(900, 840, 780, tok_s=4000.0, eta_s=None),
        obs(),
        "running",
        {"baseline_tok_s": 12800.0},
        [
            ("stall", "error", "no new step for 13 m while training (stall window 5 m); last step 120 at 07:47:00"),
            ("regression", "warning", "4.0 Ktok/s = 31% of baseline 12.8 Ktok/s"),
        ],
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_detect(case) -> None:
    _, samples, observation, state, kwargs, expected = case
    kwargs = dict(kwargs)
    expect = kwargs.pop("expect", EXPECT)
    findings = detect(samples, observation, state, expect, NOW, **kwargs)
    assert [(f.kind, f.severity, f.message) for f in findings] == expected
    assert all(isinstance(f.detail, dict) for f in findings)


def test_crash_detail_lists_all_evidence() -> None:
    [f] = detect(HEALTHY, obs(contract.PHASE_FAILED, session_alive=False, alive=False, exit_code=1, error=OOM, log=TRACEBACK),
                 "running", EXPECT, NOW)  # fmt: skip
    assert f.detail["evidence"] == [
        f"the trainer reported failure: {OOM}",
        "the trainer exited with code 1 (crash)",
        "tmux session 'r' is gone",
    ]
    assert f.detail["exception"] == OOM and f.detail["status_error"] == OOM and f.detail["exit_code"] == 1


def test_regression_detail() -> None:
    [f] = detect(steps(180, 120, 60, tok_s=4300.0, eta_s=38.2 * DAY), obs(), "running", EXPECT, NOW, baseline_tok_s=12800.0)
    assert f.detail["fraction"] == pytest.approx(4300 / 12800)
    assert f.detail["eta_s"] == pytest.approx(38.2 * DAY) and f.detail["max_eta_s"] == 7 * DAY


def test_unreachable() -> None:
    f = detect_unreachable("gpu1", NOW - 125, 9, NOW, error="ssh: connect to host 10.0.0.5 port 22: Connection refused\n")
    assert f == Finding(
        "unreachable",
        "warning",
        "host gpu1 unreachable since 07:57:55 (9 polls): ssh: connect to host 10.0.0.5 port 22: Connection refused",
        {"host": "gpu1", "since": NOW - 125, "polls": 9, "error": "ssh: connect to host 10.0.0.5 port 22: Connection refused\n"},
    )
    later = detect_unreachable("gpu1", NOW - 600, 1, NOW)
    assert (later.severity, later.message) == ("error", "host gpu1 unreachable since 07:50:00 (1 poll)")
    why = ("gpu1: host key CHANGED: ssh-ed25519 SHA256:abc does not match /k; this may be an attack, or the host was "
           "reinstalled; if the change is expected: `ssh-keygen -f /k -R gpu1`, then `dflashctl trust gpu1`")
    changed = detect_unreachable("gpu1", NOW, 1, NOW, error=why)  # its first poll: an error, waiting never helps
    assert changed.severity == "error" and changed.detail["host_key"] == "changed"
    assert changed.message.endswith("then `dflashctl trust gpu1`")  # the fix, whole


def test_env_drift() -> None:
    good = {"torch": "2.11.0", "flash_attn": "2.7.4", "triton": "3.3.0", "numpy": "2.1.0"}
    now = {"torch": "2.12.0", "Triton": "3.3.0", "numpy": "2.1.0", "sglang": "0.5.1", "flashinfer-python": "0.2.5"}
    f = env_drift(good, now)
    assert f.kind == "drift" and f.severity == "warning"
    assert f.message == (
        "environment changed since the last good run: added flashinfer-python 0.2.5, sglang 0.5.1; "
        "removed flash_attn 2.7.4; changed torch 2.11.0 -> 2.12.0"
    )
    assert f.detail == {
        "added": {"flashinfer-python": "0.2.5", "sglang": "0.5.1"},
        "removed": {"flash_attn": "2.7.4"},
        "changed": {"torch": ["2.11.0", "2.12.0"]},
    }
    assert env_drift(good, dict(good)) is None
    many = env_drift({}, {f"p{i}": "1" for i in range(8)}, shown=3)
    assert many.message.endswith("added p0 1, p1 1, p2 1 (+5 more)")


def test_baseline_from_history() -> None:
    assert baseline_from_history([12000.0, 12800.0, 13100.0, None, 0.0]) == 12800.0
    assert baseline_from_history([12000.0, 13000.0]) == 12500.0
    assert baseline_from_history([]) is None and baseline_from_history([None]) is None


@pytest.mark.parametrize(
    "seconds,text",
    [(0, "0 s"), (45, "45 s"), (59.6, "60 s"), (60, "1 m"), (750, "12.5 m"), (3600, "1 h"), (5400, "1.5 h"),
     (7 * DAY, "7 d"), (38.2 * DAY, "38.2 d"), (None, "n/a"), (float("inf"), "n/a")],
)  # fmt: skip
def test_fmt_duration(seconds, text) -> None:
    assert fmt_duration(seconds) == text


@pytest.mark.parametrize(
    "value,text", [(950, "950 tok/s"), (4300, "4.3 Ktok/s"), (12800, "12.8 Ktok/s"), (2.5e6, "2.5 Mtok/s"), (None, "n/a")]
)
def test_fmt_tok_s(value, text) -> None:
    assert fmt_tok_s(value) == text


def test_a_crash_quotes_only_the_error_its_own_attempt_wrote():
    """trainer.log holds every attempt of the run: the error an earlier one ended
    with (before the restart marker) is never this crash's last error."""
    earlier = ("step 306\nTraceback (most recent call last):\n  File \"x.py\", line 1, in f\n"
               "DistributedError: all_reduce failed on rank 0 after step 306: rank 1 on gpu2 failed first\n")
    marker = "--- dflashctl: restart 1 at 2026-01-01 00:00:00 (rank_failed) ---\n"
    killed = obs(session_alive=False, alive=False, exit_code=137, log=earlier + marker + "step 700\nstep 760\n")
    finding = detect_crash(killed)
    assert finding is not None and "306" not in finding.message and finding.detail["exception"] is None, finding
    assert finding.message == "the trainer exited with code 137 (killed by signal 9)"
    # The attempt's own error is quoted as before.
    own = obs(session_alive=False, alive=False, exit_code=1, log=earlier + marker + "step 760\n" + TRACEBACK + "\n")
    assert f"last error: {OOM}" in detect_crash(own).message


# --------------------------------------------------------------------------- hysteresis, learning


def test_hold_raises_after_the_hold_time_through_short_gaps_and_clears_after_the_clear_time():
    from dflashctl.supervise.detectors import hold

    slow = Finding("regression", "warning", "4.3 Ktok/s = 34% of baseline 12.8 Ktok/s", {})
    held, shown = None, []
    # present 0-40 s, gone 45-50 s (shorter than the clear time), present 55-70 s, then gone
    for t, present in [(0, 1), (20, 1), (40, 1), (45, 0), (50, 0), (55, 1), (60, 1), (70, 1), (80, 0), (100, 0),
                       (139, 0), (140, 0)]:
        held, out = hold(slow if present else None, held, float(t), raise_after=60.0, clear_after=60.0)
        shown.append((t, out is not None))
    assert shown == [(0, False), (20, False), (40, False), (45, False), (50, False), (55, False), (60, True),
                     (70, True), (80, True), (100, True), (139, True), (140, False)]
    assert held is None
    # Never raised, gone longer than the clear time: forgotten, the next one counts afresh.
    held, _ = hold(slow, None, 0.0, 60.0, 30.0)
    held, _ = hold(None, held, 10.0, 60.0, 30.0)
    held, _ = hold(None, held, 40.0, 60.0, 30.0)
    assert held is None
    assert hold(slow, None, 0.0, 0.0, 0.0)[1] is slow and hold(None, hold(slow, None, 0.0, 0.0, 0.0)[0], 1.0, 0.0,
                                                                 0.0) == (None, None)  # no hysteresis asked


def test_a_run_learns_nothing_only_when_its_loss_is_flat_and_its_accuracy_zero_after_the_warm_up():
    from dflashctl.supervise.detectors import LEARNING, Sample, detect_not_learning

    expect = Expect(learn_after_steps=100, regression_windows=3)

    def lines(losses, accs, first=80):
        return [Sample(NOW + i, first + 10 * i, 1000.0, loss=loss, acc=acc) for i, (loss, acc) in
                enumerate(zip(losses, accs))]

    flat = lines([6.2383] * 8, [0.0] * 8)
    found = detect_not_learning(flat, expect)
    assert found.kind == LEARNING and found.severity == "warning" and "from step 100 to 150" in found.message
    assert detect_not_learning(lines([6.2383] * 5, [0.0] * 5), expect) is None  # 3 lines past the warm-up: too few
    assert detect_not_learning(lines([6.2, 6.1, 6.0, 5.9, 5.8, 5.7, 5.6, 5.5], [0.0] * 8), expect) is None  # learning
    assert detect_not_learning(lines([6.2383] * 8, [0.0] * 7 + [0.01]), expect) is None  # it accepts something
    assert detect_not_learning(lines([6.2383] * 8, [None] * 8), expect) is None  # no accuracy: nothing said
    nan = detect_not_learning(lines([float("nan")] * 8, [0.0] * 8), expect)
    assert nan is not None and nan.message.startswith("loss not finite")
