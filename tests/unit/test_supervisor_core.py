"""The supervisor's core as tables: a sequence of (time, observation) in, the
transitions, events and actions out. No host, no store, no clock: what the
supervisor decides is a function of what it saw.

The same scenarios run for real (tmux, the probe, a real store) in
tests/integration/test_supervisor.py and tests/e2e/test_supervisor_e2e.py; here
each decision is pinned exactly, including the ones that take minutes of real
time (backoff, budgets, crash loops)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dflashctl.config import Expect
from dflashctl.core import contract
from dflashctl.hosts.probe import OomKills, ProbeResult, ProcessState
from dflashctl.supervise import detectors
from dflashctl.supervise import supervisor_core as core
from tests.harness.observations import PID, T0, healthy, make_policy, make_state, metrics, probe


def run_table(rows, state=None, pol=None):
    """Feed (time, observation) rows through ``step``; return the final state and per
    row (transition targets, event kinds, action kinds)."""
    state = state or make_state()
    pol = pol or make_policy()
    seen = []
    for t, obs in rows:
        state, writes, actions = core.step(state, obs, t, pol)
        seen.append((
            [w.to for w in writes if isinstance(w, core.Transition)],
            [w.kind for w in writes if isinstance(w, core.Event)],
            [type(a).__name__ if not isinstance(a, core.Alert) else f"Alert:{a.kind}" for a in actions],
        ))
    return state, seen


# --------------------------------------------------------------------------- start-up and progress


def test_a_launching_run_goes_running_and_stores_its_samples_with_their_offset():
    obs = core.Probed(replace(probe(T0, step=5), metrics_offset=120, metrics_inode=7), lines=(metrics(T0, 5),))
    state, writes, actions = core.step(make_state("launching"), obs, T0, make_policy())
    assert [type(w).__name__ for w in writes] == ["Samples", "Transition"]
    assert writes[0].offset == 120 and writes[0].inode == 7 and [m.step for m in writes[0].lines] == [5]
    assert writes[1].to == "running" and f"pid {PID}" in writes[1].message
    assert actions == []
    assert state.run.state == "running" and state.step_max == 5 and state.healthy_since == T0
    assert (state.args.metrics_offset, state.args.metrics_inode) == (120, 7)


def test_step_is_pure_the_input_state_is_left_as_it_was():
    before = make_state("launching")
    core.step(before, healthy(T0, 5), T0, make_policy())
    assert before.run.state == "launching" and before.samples == () and before.step_max is None


def test_observing_only_never_transitions_or_restarts():
    rows = [(T0, healthy(T0, 1)), (T0 + 1, core.Probed(probe(T0 + 1, session=False, alive=False, exit_code=1)))]
    state, seen = run_table(rows, make_state("launching"), make_policy(act=False))
    assert all(not transitions for transitions, _, _ in seen)
    assert "decision" in seen[1][1]  # "would restart (observing only)"
    assert not any("IssueRestart" in actions for _, _, actions in seen)
    assert state.run.state == "launching" and state.pending is None


# --------------------------------------------------------------------------- crash


def test_a_crash_is_classified_and_restarted_and_the_restart_row_follows_its_success():
    crash = core.Probed(probe(T0 + 10, session=False, alive=False, exit_code=1,
                              log="Traceback (most recent call last):\nRuntimeError: boom\n"))
    rows = [(T0, healthy(T0, 10)), (T0 + 10, crash)]
    state, seen = run_table(rows)
    assert seen[1] == (["restarting"], ["crash"], ["IssueRestart", "Alert:crash"])
    assert state.job == core.RESTART and state.pending.step_before == 10
    # The restart row is written in the same tick, before the restart is issued.
    _, writes, _ = core.step(run_table(rows[:1])[0], rows[1][1], T0 + 10, make_policy())
    [row] = [w for w in writes if isinstance(w, core.RestartRow)]
    assert (row.step_before, row.time, row.outcome) == (10, T0 + 10, "issuing")
    assert row.detect_delay_s == 10.0  # detected at T0+10, last healthy poll at T0
    # The worker reports the restart issued: the row says so, a new attempt begins.
    state, writes, actions = core.step(state, core.JobDone(core.RESTART, issued=T0 + 11), T0 + 11, make_policy())
    assert [w.changes for w in writes if isinstance(w, core.RestartUpdate)] == [{"outcome": "issued", "time": T0 + 11}]
    assert state.pending is None and state.restart_issued and state.samples == () and state.step_max is None
    # Its first step fills in the cost.
    state, writes, _ = core.step(state, healthy(T0 + 15, 11), T0 + 15, make_policy())
    assert [w.to for w in writes if isinstance(w, core.Transition)] == ["running"]
    update = next(w for w in writes if isinstance(w, core.RestartUpdate))
    # issued at T0+11, first step at T0+15; down since the last healthy poll at T0
    assert update.changes == {"step_after": 11, "outcome": "resumed", "time_to_first_step_s": 4.0, "downtime_s": 15.0}


def test_a_sigkill_after_the_kernel_counted_an_oom_kill_is_host_oom():
    """The kernel's OOM-kill count rose since the last healthy poll: its word names
    the SIGKILL; a count that did not rise leaves it a plain kill."""
    def rows(after: int):
        seen = replace(healthy(T0, 10).result, oom_kills=OomKills(host=3, cgroup=None))
        killed = replace(probe(T0 + 5, session=False, alive=False, exit_code=137), oom_kills=OomKills(after, None))
        return [(T0, core.Probed(seen, lines=(metrics(T0, 10),))), (T0 + 5, core.Probed(killed))]

    for after, name in ((4, "host_oom"), (3, "killed_by_signal")):
        state, seen = run_table(rows(after))
        assert seen[1][1] == ["crash"] and state.pending.signature == name


def test_a_pid_gone_while_its_pane_lives_is_not_a_crash_until_the_pane_agrees():
    """run.sh writes the exit code after the trainer ends, then its pane closes: until
    then the evidence disagrees, and a disagreement that settles is not news."""
    gone = core.Probed(probe(T0 + 1, alive=False, session=True))
    ended = core.Probed(probe(T0 + 5, alive=False, session=False, exit_code=137))
    state, seen = run_table([(T0, healthy(T0, 1)), (T0 + 1, gone), (T0 + 2, gone),
                             (T0 + 1 + core.SETTLE_S, gone), (T0 + 5, ended)])
    assert seen[1] == ([], [], []) and seen[2] == ([], [], [])  # settling
    assert seen[3][1] == ["conflict"] and not seen[3][0]  # it lasted: said, not acted on
    assert seen[4][0] == ["restarting"] and "IssueRestart" in seen[4][2]


def test_a_restart_that_cannot_be_issued_is_tried_again_then_the_run_fails():
    crash = core.Probed(probe(T0 + 1, session=False, alive=False, exit_code=1))
    state, _ = run_table([(T0, healthy(T0, 1)), (T0 + 1, crash)])
    pol = make_policy()
    seen = []
    for i in range(core.RESTART_TRIES):
        t = T0 + 10 * (i + 1)
        state, writes, actions = core.step(state, core.JobDone(core.RESTART, error="host down"), t, pol)
        seen.append(([w.to for w in writes if isinstance(w, core.Transition)], [type(a).__name__ for a in actions]))
        state, _, actions = core.step(state, core.Clock(), t + 5, pol)  # the retry is due after the interval
        if state.pending is not None:
            assert [type(a).__name__ for a in actions] == ["IssueRestart"]
    assert seen[:-1] == [([], [])] * (core.RESTART_TRIES - 1)
    assert seen[-1] == (["failed"], ["Alert"])
    assert state.run.state == "failed"


def test_a_restart_cancelled_by_an_operators_stop_is_dropped():
    crash = core.Probed(probe(T0 + 1, session=False, alive=False, exit_code=1))
    state, _ = run_table([(T0, healthy(T0, 1)), (T0 + 1, crash)])
    state, writes, actions = core.step(state, core.JobDone(core.RESTART, error="the run is stopped meanwhile",
                                                           cancelled=True), T0 + 2, make_policy())
    assert state.pending is None and actions == [] and [w.kind for w in writes if isinstance(w, core.Event)] == ["restart"]
    assert [w.changes for w in writes if isinstance(w, core.RestartUpdate)] == [
        {"outcome": "cancelled: the run is stopped meanwhile"}]


# --------------------------------------------------------------------------- backoff and crash loop


def test_backoff_holds_the_restart_until_it_is_due_and_the_host_is_up():
    pol = make_policy(backoff_initial=30.0, backoff_max=60.0)
    crash = core.Probed(probe(T0 + 1, session=False, alive=False, exit_code=1))
    state, _ = run_table([(T0, healthy(T0, 1)), (T0 + 1, crash)], pol=pol)
    assert state.pending.due == T0 + 31 and state.job is None
    for t, host_up, issued in [(T0 + 10, True, False), (T0 + 31, False, False), (T0 + 32, True, True)]:
        state, _, actions = core.step(state, core.Clock(host_up=host_up), t, pol)
        assert any(isinstance(a, core.IssueRestart) for a in actions) is issued
    # While a restart waits for its backoff, probes of the old process decide nothing new.
    state2, _ = run_table([(T0, healthy(T0, 1)), (T0 + 1, crash), (T0 + 2, crash)], pol=pol)
    assert state2.pending.due == T0 + 31


def test_a_crash_loop_stops_after_k_restarts_without_progress():
    pol = make_policy(crash_loop_k=2, max_restarts=10)
    state = make_state()
    crash = lambda t: core.Probed(probe(t, session=False, alive=False, exit_code=1))  # noqa: E731
    decisions, failed = [], None
    for i in range(3):
        t = T0 + 100 * i
        state, writes, actions = core.step(state, crash(t), t, pol)
        decisions.append([w.to for w in writes if isinstance(w, core.Transition)])
        failed = failed or next((w for w in writes if isinstance(w, core.Transition) and w.to == "failed"), None)
        if state.pending is not None:
            state, _, _ = core.step(state, core.JobDone(core.RESTART, issued=t + 1), t + 1, pol)
    # The restarted process fails before it was seen running: still restarting, one
    # more decision; the K-th restart without progress is not issued.
    assert decisions == [["restarting"], [], ["failed"]]
    assert "crash loop" in failed.message and failed.severity == "critical"
    last = core.step(make_state(), crash(T0), T0, pol)  # a fresh run is restarted again
    assert [w.to for w in last[1] if isinstance(w, core.Transition)] == ["restarting"]


def test_the_stop_action_kills_a_live_session_and_fails_the_run():
    pol = make_policy(max_restarts=0)
    # remain-on-exit: the session outlives the trainer, its pane dead
    crash = core.Probed(replace(probe(T0, session=True, alive=False, phase="failed", error="RuntimeError: x",
                                      exit_code=1), pane_dead=True))
    state, writes, actions = core.step(make_state(), crash, T0, pol)
    transition = [w for w in writes if isinstance(w, core.Transition)][-1]
    assert transition.to == "failed" and transition.exit_reason
    assert [type(a).__name__ for a in actions][0] == "KillSession" and state.job == core.KILL


# --------------------------------------------------------------------------- stall: compiling vs training


@pytest.mark.parametrize("phase,quiet,expect_stall", [
    ("training", 59.0, False),
    ("training", 61.0, True),
    ("compiling", 61.0, False),  # compiling has its own budget (600 s here)
    ("compiling", 601.0, True),
    ("starting", 121.0, True),  # the start-up budget (120 s)
])
def test_stall_windows_by_phase(phase, quiet, expect_stall):
    pol = make_policy()
    state, writes, _ = core.step(make_state(), core.Probed(probe(T0, phase, step=10, started=T0)), T0, pol)
    obs = core.Probed(probe(T0 + quiet, phase, step=10, started=T0))
    obs = replace(obs, result=replace(obs.result, status=replace(obs.result.status, updated=T0)))
    state, writes, actions = core.step(state, obs, T0 + quiet, pol)
    assert any(isinstance(w, core.Event) and w.kind == "stall" for w in writes) is expect_stall
    assert any(isinstance(a, core.IssueRestart) for a in actions) is expect_stall
    if expect_stall:
        assert actions[0].hung  # its stacks are dumped before it is killed


def test_a_stopped_process_is_a_stall_left_alone_then_running_again():
    pol = make_policy()
    stopped = core.Probed(probe(T0 + 1, step=1, state="T"))
    state, seen = run_table([(T0, healthy(T0, 1)), (T0 + 1, stopped), (T0 + 2, stopped), (T0 + 3, healthy(T0 + 3, 2))],
                            pol=pol)
    assert seen[1][0] == ["stalled"] and seen[1][1] == ["stall"]
    assert seen[2] == ([], [], [])  # the same finding is not written twice
    assert seen[3][0] == ["running"] and "stall" in seen[3][1]  # cleared
    assert not any("IssueRestart" in a for _, _, a in seen)


def test_a_stop_longer_than_the_stall_window_then_continue_gets_a_whole_window_for_its_next_line():
    """SIGSTOP for 90 s (the window is 60 s), SIGCONT, the next metrics line 55 s
    later: a stall left alone, then running again, and no restart. The quiet time
    counts from the first poll that saw the process run again, not from its last step."""
    stopped = lambda t: core.Probed(probe(t, step=1, state="T"))  # noqa: E731
    running = lambda t: core.Probed(probe(t, step=1))  # noqa: E731  (alive, no new line yet)
    rows = [(T0, healthy(T0, 1)), (T0 + 5, stopped(T0 + 5)), (T0 + 50, stopped(T0 + 50)),
            (T0 + 95, stopped(T0 + 95)), (T0 + 100, running(T0 + 100)), (T0 + 130, running(T0 + 130)),
            (T0 + 155, running(T0 + 155)), (T0 + 156, healthy(T0 + 156, 2))]
    state, seen = run_table(rows)
    assert seen[1][0] == ["stalled"]
    assert not any("IssueRestart" in actions for _, _, actions in seen), seen
    assert not any(to == ["restarting"] for to, _, _ in seen)
    assert seen[4][0] == [] and "stall" in seen[4][1]  # cleared when it runs again; not yet progress
    assert all(to == [] for to, _, _ in seen[5:7])  # running, but no new step: still stalled
    assert seen[7][0] == ["running"]  # "making progress again" once a new step is made
    assert state.run.state == "running" and state.step_max == 2 and not state.holding
    # Resumed and then silent for a whole window: that is a stall, and it is restarted.
    state, seen = run_table(rows[:5] + [(T0 + 161, running(T0 + 161))])
    assert seen[-1] == (["restarting"], ["stall"], ["IssueRestart", "Alert:stall"])
    assert "counted from" in state.pending.reason and "when its process ran again" in state.pending.reason
    # That stall's failure time is when it ran again, not its last step before the stop.
    assert state.pending.failed_at == T0 + 100


def test_each_of_ten_stops_longer_than_the_window_restarts_nothing():
    rows, t, step = [(T0, healthy(T0, 1))], T0, 1
    for _ in range(10):
        rows += [(t + 10, core.Probed(probe(t + 10, step=step, state="T"))),
                 (t + 80, core.Probed(probe(t + 80, step=step, state="T"))),
                 (t + 85, core.Probed(probe(t + 85, step=step))),
                 (t + 140, healthy(t + 140, step + 1))]
        t, step = t + 140, step + 1
    state, seen = run_table(rows)
    assert not any("IssueRestart" in actions for _, _, actions in seen)
    assert sum(to == ["stalled"] for to, _, _ in seen) == 10 and state.run.state == "running"


def after_a_restart(issued: float = T0 + 11) -> core.RunState:
    crash = core.Probed(probe(T0 + 10, session=False, alive=False, exit_code=1))
    state, _ = run_table([(T0, healthy(T0, 10)), (T0 + 10, crash)])
    state, _, _ = core.step(state, core.JobDone(core.RESTART, issued=issued), issued, make_policy())
    return state


def line(t: float, step: int, elapsed: float | None) -> contract.Metrics:
    m = metrics(t, step)
    return replace(m, extra={"elapsed_s": elapsed}) if elapsed is not None else m


@pytest.mark.parametrize("old", [
    line(T0 + 10.6, 12, 600.0),  # written 0.4 s before the restart was issued
    line(T0 + 11.5, 12, 600.0),  # written while the restart was on its way (its process began 10 m ago)
])
def test_a_line_of_the_previous_process_read_after_the_restart_is_not_the_new_ones_first_step(old):
    state = after_a_restart()
    obs = core.Probed(probe(T0 + 16, step=11), lines=(old, line(T0 + 15, 11, 2.0)))
    state, writes, _ = core.step(state, obs, T0 + 16, make_policy())
    update = next(w for w in writes if isinstance(w, core.RestartUpdate))
    assert update.changes["time_to_first_step_s"] == 4.0, update.changes
    [event] = [w for w in writes if isinstance(w, core.Event) and w.kind == "restart"]
    assert event.message.startswith("training resumed at step 11, 4.0 s after the restart"), event.message
    assert state.healthy_since == T0 + 15


def test_after_a_re_attach_downtime_counts_from_the_last_sign_of_life_not_the_previous_restart():
    """A supervisor re-attached to a run restarted 17 minutes ago; its first poll finds
    the trainer crashed. It was last known alive at its newest stored line (5 s before)."""
    state = make_state()
    state.history = (core.policy.Restart(T0 - 1040, 100, 101),)
    state.attempt_started = T0 - 1040
    state.latest = core.Latest(T0 - 1040, None, T0 - 1030, 101)
    state.samples = (detectors.Sample(T0 - 5, 900),)
    state.last_line = (T0 - 5, 900)
    crash = core.Probed(probe(T0 + 10, step=900, session=False, alive=False, exit_code=1))
    state, writes, _ = core.step(state, crash, T0 + 10, make_policy())
    [row] = [w for w in writes if isinstance(w, core.RestartRow)]
    assert row.detect_delay_s == 15.0
    state, _, _ = core.step(state, core.JobDone(core.RESTART, issued=T0 + 11), T0 + 11, make_policy())
    state, writes, _ = core.step(state, healthy(T0 + 15, 901), T0 + 15, make_policy())
    update = next(w for w in writes if isinstance(w, core.RestartUpdate))
    assert update.changes == {"step_after": 901, "outcome": "resumed", "time_to_first_step_s": 4.0, "downtime_s": 20.0}
    [event] = [w for w in writes if isinstance(w, core.Event) and w.kind == "restart"]
    assert "(20.0 s down in all)" in event.message


# --------------------------------------------------------------------------- regression


def test_a_regression_alerts_in_the_operators_terms_and_never_restarts():
    state = make_state()
    state.baseline = 10_000.0
    pol = make_policy(expect={"regression_hold": 30.0})
    seen = []
    for i in range(8):
        t = T0 + 10 * i
        state, writes, actions = core.step(state, healthy(t, i + 1, tok_s=3_000.0), t, pol)
        seen.append(([w.kind for w in writes if isinstance(w, core.Event)], actions))
    first = next(i for i, (events, _) in enumerate(seen) if "regression" in events)
    events = [w for w in core.step(make_state(), healthy(T0, 1), T0, pol)[1]]  # a healthy run: no finding
    assert not any(isinstance(e, core.Event) and e.kind == "regression" for e in events)
    # Found once regression_windows windows are slow, reported once that has lasted regression_hold.
    assert first == pol.run.expect.regression_windows - 1 + 3
    assert any(isinstance(a, core.Alert) and a.kind == "regression" and "30% of baseline" in a.message
               for a in seen[first][1])
    assert not any(isinstance(a, core.IssueRestart) for _, actions in seen for a in actions)
    assert state.run.state == "running"


def _flapping(pol, minutes: float = 10.0):
    """A busy host's pace: slow for 20 s, fine for 5 s, over and over (a poll every
    5 s), against a baseline of 10 Ktok/s. -> the regression events and alerts."""
    state = make_state()
    state.baseline = 10_000.0
    events, alerts = [], []
    for i in range(int(minutes * 60 / 5)):
        t = T0 + 5 * i
        tok_s = 10_000.0 if i % 5 == 4 else 3_000.0
        state, writes, actions = core.step(state, healthy(t, i + 1, tok_s=tok_s), t, pol)
        events += [w for w in writes if isinstance(w, core.Event) and w.kind == "regression"]
        alerts += [a for a in actions if isinstance(a, core.Alert) and a.kind == "regression"]
    return events, alerts


def test_a_flapping_throughput_raises_one_warning_not_one_per_dip():
    events, alerts = _flapping(make_policy(expect={"regression_windows": 1}))  # the playbook defaults otherwise
    raised = [e for e in events if "cleared" not in e.message]
    assert len(raised) == 1 and len(alerts) == 1 and raised[0].severity == "warning"
    assert not [e for e in events if "cleared" in e.message]  # never 5 s of good pace taken as the end of it
    # Without the hold and the clear time, the same pace is a warning per dip: what the hysteresis prevents.
    events, alerts = _flapping(make_policy(expect={"regression_windows": 1, "regression_hold": 0,
                                                   "regression_clear": 0}))
    assert len([e for e in events if "cleared" not in e.message]) >= 20 and len(alerts) >= 20


def test_a_short_slow_spell_is_never_reported_and_a_lasting_one_clears_after_the_clear_time():
    pol = make_policy(expect={"regression_windows": 1, "regression_hold": 60.0, "regression_clear": 60.0})
    state = make_state()
    state.baseline = 10_000.0
    pace = [3_000.0] * 6 + [10_000.0] * 20 + [3_000.0] * 20 + [10_000.0] * 20  # a poll every 5 s
    kinds = []
    for i, tok_s in enumerate(pace):
        t = T0 + 5 * i
        state, writes, _ = core.step(state, healthy(t, i + 1, tok_s=tok_s), t, pol)
        kinds += [(i, w.message.split(" ")[1] if "cleared" in w.message else "raised") for w in writes
                  if isinstance(w, core.Event) and w.kind == "regression"]
    # 30 s slow: nothing. From i=26, slow: raised at i=38 (60 s on); fine from i=46: cleared at i=58 (60 s on).
    assert kinds == [(38, "raised"), (58, "cleared")]


def test_a_run_that_learns_nothing_is_a_warning_after_its_warm_up():
    pol = make_policy(expect={"learn_after_steps": 100})
    state = make_state()
    found = []
    for i in range(1, 31):
        t = T0 + 2 * i
        state, writes, actions = core.step(state, healthy(t, 10 * i, loss=6.2383, acc=0.0), t, pol)
        found += [(10 * i, w) for w in writes if isinstance(w, core.Event) and w.kind == "learning"]
    [(step, event)] = found
    assert step == 130  # four lines past the warm-up (steps 100-130), all flat at 0 accuracy
    assert event.severity == "warning" and "loss flat at 6.238" in event.message and "accuracy 0" in event.message
    assert state.run.state == "running"  # said, never acted on
    learning = make_state()
    for i in range(1, 31):  # the same run learning: loss falls, accuracy rises
        t = T0 + 2 * i
        learning, writes, _ = core.step(learning, healthy(t, 10 * i, loss=6.0 - 0.1 * i, acc=0.01 * i), t, pol)
        assert not [w for w in writes if isinstance(w, core.Event) and w.kind == "learning"]


# --------------------------------------------------------------------------- unreachable


def test_an_unreachable_host_is_written_when_worse_and_the_run_goes_lost_then_back():
    pol = make_policy()
    state = make_state()
    down = lambda polls, worse, sev="warning": core.Unreachable(  # noqa: E731
        "gpu1", detectors.Finding("unreachable", sev, "host gpu1 unreachable"), polls, T0, worse)
    rows = [(T0, down(1, True)), (T0 + 1, down(2, False)), (T0 + 400, down(3, True, "critical")),
            (T0 + 401, core.Probed(probe(T0 + 401, step=3), host_back=(T0, 3)))]
    state, seen = run_table(rows, state, pol)
    assert seen[0] == ([], ["unreachable"], ["Alert:unreachable"])
    assert seen[1] == (["lost"], [], [])
    assert seen[2] == ([], ["unreachable"], ["Alert:unreachable"])
    assert seen[3][0] == ["running"] and "unreachable" in seen[3][1]
    assert state.run.state == "running"


def test_a_run_lost_under_an_earlier_supervisor_is_running_again_when_its_host_answers():
    state, seen = run_table([(T0, healthy(T0, 1))], make_state("lost"))
    assert seen[0][0] == ["running"]


# --------------------------------------------------------------------------- finished


@pytest.mark.parametrize("phase,code,final", [("done", 0, "done"), ("stopped", 4, "stopped")])
def test_a_finished_trainer_ends_the_run(phase, code, final):
    obs = core.Probed(probe(T0, phase, step=100, session=False, alive=False, exit_code=code))
    state, writes, actions = core.step(make_state(), obs, T0, make_policy())
    t = [w for w in writes if isinstance(w, core.Transition)]
    assert [x.to for x in t] == [final] and t[0].exit_code == code
    assert [a.kind for a in actions] == ["finished"]


def test_a_finish_seen_before_run_sh_wrote_the_exit_code_is_recorded_with_it():
    """The trainer wrote ``done`` and exited; its zombie is not reaped yet, so run.sh has
    not written the exit code: the end waits for it (a run is not recorded done with no
    exit code because one poll came a moment early), and for SETTLE_S at most."""
    early = core.Probed(replace(probe(T0 + 1, "done", step=100, session=True),
                                process=ProcessState(PID, False, "Z")))
    written = core.Probed(probe(T0 + 2, "done", step=100, session=False, alive=False, exit_code=0))
    state, seen = run_table([(T0, healthy(T0, 99)), (T0 + 1, early), (T0 + 2, written)])
    assert seen[1] == ([], [], [])
    _, writes, _ = core.step(run_table([(T0, healthy(T0, 99)), (T0 + 1, early)])[0], written, T0 + 2, make_policy())
    assert [(w.to, w.exit_code) for w in writes if isinstance(w, core.Transition)] == [("done", 0)]
    never = run_table([(T0, healthy(T0, 99)), (T0 + 1, early), (T0 + 1 + core.SETTLE_S, early)])[1]
    assert never[2][0] == ["done"]


# --------------------------------------------------------------------------- evidence, not claims


def test_a_pid_the_probe_cannot_see_while_the_pane_lives_and_metrics_advance_is_never_killed():
    """Probe and trainer in different pid namespaces: 'pid not found' every poll, the
    session alive, the steps advancing. Reported once, never a restart or a kill."""
    state, pol, seen = make_state(), make_policy(), []
    for i in range(40):
        t = T0 + i
        obs = core.Probed(replace(probe(t, step=i), process=ProcessState(PID, False, None)),
                          lines=(metrics(t, i),))
        state, writes, actions = core.step(state, obs, t, pol)
        seen.append((writes, actions))
    assert not any(isinstance(a, (core.IssueRestart, core.KillSession)) for _, actions in seen for a in actions)
    assert not any(isinstance(w, core.Transition) for writes, _ in seen for w in writes)
    conflicts = [w for writes, _ in seen for w in writes if isinstance(w, core.Event) and w.kind == "conflict"]
    assert len(conflicts) == 1 and "different pid namespaces" in conflicts[0].message
    assert state.run.state == "running" and state.step_max == 39


@pytest.mark.parametrize("claim", [{"phase": "done"}, {"exit_code": 0}, {"exit_code": 1}])
def test_an_end_claimed_while_the_trainer_lives_is_a_finding_and_supervision_goes_on(claim):
    state, pol = make_state(), make_policy()
    phase = claim.get("phase", "training")
    for i in range(5):
        t = T0 + i
        state, writes, actions = core.step(state, core.Probed(probe(t, phase, step=i, exit_code=claim.get("exit_code")),
                                                              lines=(metrics(t, i),)), t, pol)
        assert not any(isinstance(w, core.Transition) for w in writes)
        assert not any(isinstance(a, (core.IssueRestart, core.KillSession)) for a in actions)
    assert state.run.state == "running" and "conflict" in state.findings
    # When the process really is gone, the claim is the end.
    gone = core.Probed(probe(T0 + 6, phase, step=5, alive=False, session=False, exit_code=claim.get("exit_code")))
    state, writes, _ = core.step(state, gone, T0 + 6, pol)
    assert [w.to for w in writes if isinstance(w, core.Transition)] == [
        {"done": "done", 0: "done", 1: "restarting"}[claim.get("phase") if "phase" in claim else claim["exit_code"]]]


@pytest.mark.parametrize("line_time,what", [(T0 + 10 * 365 * 86400, "ahead of"), (1000.0, "before")])
def test_a_metrics_line_with_an_impossible_time_steers_no_detector(line_time, what):
    """A line stamped 10 years ahead with step 999999 would switch stall detection off;
    one stamped in 1970 would look like days without progress. Both are ignored,
    not stored, said once; the read position still advances."""
    pol = make_policy()
    state, _, _ = core.step(make_state(), healthy(T0, 10), T0, pol)
    bad = core.Probed(replace(probe(T0 + 5, step=10), metrics_offset=500), lines=(metrics(line_time, 999999),))
    state, writes, actions = core.step(state, bad, T0 + 5, pol)
    samples = next(w for w in writes if isinstance(w, core.Samples))
    assert samples.lines == () and samples.offset == 500
    [event] = [w for w in writes if isinstance(w, core.Event)]
    assert event.kind == "metrics" and what in event.message and "step 999999" in event.message
    assert state.step_max == 10 and not actions
    # A hung trainer is still a stall after the window, the bogus step notwithstanding.
    hung = core.Probed(probe(T0 + 70, step=10))
    hung = replace(hung, result=replace(hung.result, status=replace(hung.result.status, updated=T0)))
    state, writes, actions = core.step(state, hung, T0 + 70, pol)
    assert any(isinstance(a, core.IssueRestart) for a in actions)


def test_a_metrics_file_rewritten_in_place_stores_nothing_twice():
    """Same inode, longer: read as appended data. What repeats the stored lines is skipped."""
    pol = make_policy()
    first = tuple(metrics(T0 + i, i) for i in range(1, 6))
    state, writes, _ = core.step(make_state(), core.Probed(probe(T0 + 5, step=5), lines=first), T0 + 5, pol)
    rewritten = first + tuple(metrics(T0 + 5 + i, 5 + i) for i in range(1, 3))
    state, writes, _ = core.step(state, core.Probed(probe(T0 + 8, step=7), lines=rewritten), T0 + 8, pol)
    [stored] = [w for w in writes if isinstance(w, core.Samples)]
    assert [m.step for m in stored.lines] == [6, 7]
    assert any(isinstance(w, core.Event) and "repeat what is stored" in w.message for w in writes)
    # A process resumed from a checkpoint steps back, its clock does not: stored.
    resumed = (metrics(T0 + 20, 4),)
    state, writes, _ = core.step(state, core.Probed(probe(T0 + 20, step=4), lines=resumed), T0 + 20, pol)
    assert [m.step for w in writes if isinstance(w, core.Samples) for m in w.lines] == [4]


def test_bad_metrics_lines_are_reported_once_with_their_line_numbers_and_the_position_moves_on():
    from dflashctl.hosts.parsers import read_metrics_chunk

    pol = make_policy()
    good = metrics(T0, 1).to_line()
    chunk = "\n".join([good, "[" * 50000, '{"v":1,"time":%r,"step":9223372036854775808}' % T0,
                       '{"v":1,"time":%r,"step":2,"total_steps":Infinity}' % T0, '{"v":1,"time":%r,"step":"x"}' % T0]) + "\n"
    parsed = read_metrics_chunk(chunk)
    assert [m.step for m in parsed.rows] == [1] and [r.line for r in parsed.rejected] == [2, 3, 4, 5]
    result = replace(probe(T0, step=1), metrics_chunk=chunk, metrics_offset=len(chunk.encode()))
    state, writes, _ = core.step(make_state(), core.Probed(result, lines=tuple(parsed.rows),
                                                           rejected=tuple(parsed.rejected)), T0, pol)
    [event] = [w for w in writes if isinstance(w, core.Event) and w.kind == "metrics"]
    assert event.message.startswith("4 bad line(s) of metrics.jsonl skipped: line 2: ")
    assert event.detail["lines"] == [2, 3, 4, 5]
    [stored] = [w for w in writes if isinstance(w, core.Samples)]
    assert stored.offset == len(chunk.encode()) and [m.step for m in stored.lines] == [1]
    # The next read starts after them: line numbers go on counting in the file.
    more = '{"v":1,"time":%r,"step":"y"}\n' % (T0 + 1)
    result = replace(probe(T0 + 1, step=1), metrics_chunk=more, metrics_offset=len(chunk.encode()) + len(more))
    parsed = read_metrics_chunk(more)
    state, writes, _ = core.step(state, core.Probed(result, rejected=tuple(parsed.rejected)), T0 + 1, pol)
    assert [w.detail["lines"] for w in writes if isinstance(w, core.Event)] == [[6]]


def test_per_run_probe_errors_are_written_once():
    pol = make_policy()
    result = replace(probe(T0, step=1), errors=["status.json: ValueError: nested deeper than 32 levels"])
    state, writes, _ = core.step(make_state(), core.Probed(result), T0, pol)
    assert [w.kind for w in writes if isinstance(w, core.Event)] == ["probe"]
    state, writes, _ = core.step(state, core.Probed(replace(result, host_time=T0 + 1)), T0 + 1, pol)
    assert not [w for w in writes if isinstance(w, core.Event)]


# --------------------------------------------------------------------------- compile artifacts copied back


def cached(t: float, step: int, outcome: str | None) -> core.Probed:
    """A healthy poll whose metrics line reports the process's compile_cache outcome."""
    line = replace(metrics(t, step), extra={"compile_cache": outcome} if outcome else {})
    return core.Probed(probe(t, step=step), lines=(line,))


def cache_policy(after: float = 300.0, act: bool = True, restart_delay: float = 0.0) -> core.Policy:
    pol = make_policy(act=act, backoff_initial=restart_delay)
    return replace(pol, run=replace(pol.run, expect=Expect(stall_window=600.0, compile_cache_after=after)))


@pytest.mark.parametrize("outcome,fetch_at", [
    ("miss", 300),  # compiled cold: copied back once it trained for compile_cache_after
    ("mismatch:torch", 300),  # the artifact put there did not fit: what it compiled instead is copied back
    ("hit", None),  # it started from artifacts: nothing new to copy
    ("off", None),  # nothing compiled
    (None, None),  # a trainer that does not report it
])
def test_compile_artifacts_are_fetched_once_per_process_after_its_healthy_minutes(outcome, fetch_at):
    pol = cache_policy(300.0)
    times = [0, 60, 299, 300, 301, 900]
    state, seen = run_table([(T0 + t, cached(T0 + t, i + 1, outcome)) for i, t in enumerate(times)], pol=pol)
    fetched = [t for t, (_, _, actions) in zip(times, seen) if "FetchCompileCache" in actions]
    assert fetched == ([fetch_at] if fetch_at is not None else [])
    events = [kinds for _, kinds, _ in seen]
    said = outcome not in (None, "off")
    assert events[0] == (["compile_cache"] if said else []) and all(e == [] for e in events[1:])


def test_the_outcome_is_written_with_its_severity_and_the_fetch_names_it():
    state, writes, _ = core.step(make_state(), cached(T0, 1, "mismatch:torch"), T0, cache_policy())
    [event] = [w for w in writes if isinstance(w, core.Event)]
    assert event.severity == "warning" and event.message.startswith("compile cache mismatch:torch")
    state, _, actions = core.step(state, cached(T0 + 300, 2, "mismatch:torch"), T0 + 300, cache_policy())
    assert actions == [core.FetchCompileCache("mismatch:torch")]


def test_a_restarted_process_is_fetched_from_again_and_an_observer_never_fetches():
    pol = cache_policy(10.0)
    state, seen = run_table([(T0, cached(T0, 1, "miss")), (T0 + 10, cached(T0 + 10, 2, "miss"))], pol=pol)
    assert seen[1][2] == ["FetchCompileCache"] and state.cache_fetch
    # A crash, a restart: the new process reports its own outcome and is asked for its own artifacts.
    crash = core.Probed(probe(T0 + 20, session=False, alive=False, exit_code=1, log="RuntimeError: boom\n"))
    state, _, _ = core.step(state, crash, T0 + 20, pol)
    state, _, _ = core.step(state, core.JobDone(core.RESTART, issued=T0 + 21), T0 + 21, pol)
    assert (state.compile_cache, state.cache_fetch) == (None, False)
    state, seen = run_table([(T0 + 25, cached(T0 + 25, 3, "miss")), (T0 + 35, cached(T0 + 35, 4, "miss"))],
                            state=state, pol=pol)
    assert seen[0][1] == ["compile_cache", "restart"]  # its outcome, and "training resumed"
    assert seen[1][2] == ["FetchCompileCache"]
    # Observing only (watch --once): nothing is copied.
    _, seen = run_table([(T0, cached(T0, 1, "miss")), (T0 + 10, cached(T0 + 10, 2, "miss"))],
                        pol=cache_policy(10.0, act=False))
    assert not any("FetchCompileCache" in actions for _, _, actions in seen)


def test_no_fetch_while_the_run_is_stalled_or_restarting():
    pol = cache_policy(10.0)
    stopped = core.Probed(probe(T0 + 12, step=1, state="T"))  # a stopped process: a stall, left alone
    _, seen = run_table([(T0, cached(T0, 1, "miss")), (T0 + 12, stopped), (T0 + 13, stopped)], pol=pol)
    assert seen[1][0] == ["stalled"] and not any("FetchCompileCache" in a for _, _, a in seen)
    crash = core.Probed(probe(T0 + 12, session=False, alive=False, exit_code=1, log="RuntimeError: boom\n"))
    _, seen = run_table([(T0, cached(T0, 1, "miss")), (T0 + 12, crash)], pol=cache_policy(10.0, restart_delay=30.0))
    assert seen[1][0] == ["restarting"] and not any("FetchCompileCache" in a for _, _, a in seen)


def test_each_new_phase_but_a_routine_one_is_an_event_for_the_console():
    pol = make_policy()
    rows = [(T0, core.Probed(probe(T0, "starting"))), (T0 + 1, core.Probed(probe(T0 + 1, "compiling"))),
            (T0 + 2, core.Probed(probe(T0 + 2, "compiling"))), (T0 + 3, healthy(T0 + 3, 1)),
            (T0 + 4, core.Probed(probe(T0 + 4, "checkpointing", step=1)))]
    _, seen = run_table(rows, make_state("launching"), pol)
    # A checkpoint is routine: no event unless it lasts (test_a_routine_checkpoint_is_no_event_...).
    assert [kinds for _, kinds, _ in seen] == [["phase"], ["phase"], [], ["phase"], []]
    _, seen = run_table([(T0, healthy(T0, 1))])  # re-attached to a training run: no news
    assert seen[0][1] == []


# --------------------------------------------------------------------------- a run on several hosts


def two_host_state() -> core.RunState:
    s = make_state()
    hosts = [{"rank": 0, "host": "gpu1", "run_dir": "/runs/r1", "tmux_session": "r1"},
             {"rank": 1, "host": "gpu2", "run_dir": "/w2/runs/r1", "tmux_session": "r1-r1"}]
    return replace(s, run=replace(s.run, hosts=hosts))


def with_member(obs: core.Probed, t: float, **member) -> core.Probed:
    result = None if member.pop("down", False) else probe(t, **member)
    return replace(obs, members=(core.Member(1, "gpu2", result, "ssh: timed out" if result is None else None),))


def test_another_hosts_rank_ending_is_written_once_and_restarts_nothing_until_rank_0_confirms():
    failed = core.Probed(probe(T0 + 12, "failed", step=10, session=False, alive=False, exit_code=1,
                               error="DistributedError"))
    failed = replace(failed, result=replace(failed.result, status=replace(
        failed.result.status, detail={"failed_rank": 1, "failed_host": "gpu2"})))
    gone = dict(step=10, session=False, alive=False, exit_code=137)
    rows = [(T0, with_member(healthy(T0, 10), T0, step=10)),
            (T0 + 1, with_member(healthy(T0 + 1, 10), T0 + 1, **gone)),
            (T0 + 2, with_member(healthy(T0 + 2, 10), T0 + 2, **gone)),
            (T0 + 12, with_member(failed, T0 + 12, **gone))]
    state, seen = run_table(rows, two_host_state())
    assert seen[1] == ([], ["rank"], []) and seen[2] == ([], [], [])  # one signal: said once, nothing done
    assert seen[3][0] == ["restarting"] and "IssueRestart" in seen[3][2]  # confirmed by rank 0's own failure
    _, writes, _ = core.step(run_table(rows[:3], two_host_state())[0], rows[3][1], T0 + 12, make_policy())
    [crash] = [w for w in writes if isinstance(w, core.Event) and w.kind == "crash"]
    assert crash.detail["host"] == "gpu2" and crash.detail["rank"] == 1 and "[host gpu2, rank 1" in crash.message
    [rows_written] = [w for w in writes if isinstance(w, core.HostRows)]
    assert [(r["rank"], r["host"], r["exit_code"]) for r in rows_written.rows] == [(0, "gpu1", 1), (1, "gpu2", 137)]


@pytest.mark.parametrize("peer", [dict(exit_code=contract.EXIT_DISK_FULL),  # its own word: a write refused
                                  dict(exit_code=1, disk_free=0, disk_total=1 << 20)])  # its host's word
def test_a_peers_full_disk_stops_the_run_named_instead_of_restarting_every_host(peer):
    """Rank 0's word alone ("rank 1 failed first") is a restart of every host; the
    failed rank's full disk makes it disk_full, the run stopped and the rank named."""
    failed = core.Probed(probe(T0 + 12, "failed", step=10, session=False, alive=False, exit_code=1,
                               error="DistributedError: rank 1 (gpu2) failed first"))
    failed = replace(failed, result=replace(failed.result, status=replace(
        failed.result.status, detail={"failed_rank": 1, "failed_host": "gpu2"})))
    gone = dict(step=10, session=False, alive=False, exit_code=peer["exit_code"])

    def member(t, **kw):
        obs = with_member(failed if t == T0 + 12 else healthy(t, 10), t, **gone)
        full = {k: v for k, v in peer.items() if k.startswith("disk_")}
        return replace(obs, members=(replace(obs.members[0], result=replace(obs.members[0].result, **full)),))

    rows = [(T0, with_member(healthy(T0, 10), T0, step=10)), (T0 + 1, member(T0 + 1)), (T0 + 12, member(T0 + 12))]
    state, seen = run_table(rows, two_host_state())
    assert seen[2][0] == ["failed"] and "IssueRestart" not in seen[2][2], seen
    _, writes, _ = core.step(run_table(rows[:2], two_host_state())[0], rows[2][1], T0 + 12, make_policy())
    [crash] = [w for w in writes if isinstance(w, core.Event) and w.kind == "crash"]
    assert crash.detail["signature"] == "disk_full" and crash.detail["matched_line"].startswith("rank 1 on gpu2")
    [ended] = [w for w in writes if isinstance(w, core.Transition)]
    assert "rank 1 on gpu2" in ended.message and "full" in ended.message, ended.message

    # The same end with the peer's disk not full stays rank 0's restart of every host.
    healthy_peer = [(t, replace(o, members=(replace(o.members[0], result=replace(
        o.members[0].result, exit_code=1, disk_free=None, disk_total=None)),))) for t, o in rows]
    _, seen = run_table(healthy_peer, two_host_state())
    assert seen[2][0] == ["restarting"] and "IssueRestart" in seen[2][2]


@pytest.mark.parametrize("letter, why", [("T", "its process is stopped"),
                                         ("D", "its process waits in uninterruptible I/O")])
def test_a_stall_of_a_run_on_two_hosts_names_the_host_whose_process_is_stuck(letter, why):
    rows = [(T0, with_member(healthy(T0, 10), T0, step=10))]
    rows += [(T0 + 30 * i, with_member(core.Probed(probe(T0 + 30 * i, step=10)), T0 + 30 * i, step=10, state=letter))
             for i in (1, 2, 3)]
    state, stalls = two_host_state(), []
    for t, obs in rows:
        state, writes, _ = core.step(state, obs, t, make_policy())
        stalls += [w for w in writes if isinstance(w, core.Event) and w.kind == "stall"]
    assert stalls, "no stall after 90 s without a step"
    assert stalls[0].detail["host"] == "gpu2" and f"[host gpu2, rank 1: {why}]" in stalls[0].message


def test_each_process_of_a_rank_has_its_end_written_once_and_a_hosts_error_is_bounded():
    gone = dict(step=10, session=False, alive=False, exit_code=137)
    first = with_member(healthy(T0, 10), T0, **gone)
    again = with_member(healthy(T0 + 1, 10), T0 + 1, **gone)
    member = again.members[0]
    other = replace(again, members=(replace(member, result=replace(
        member.result, status=replace(member.result.status, pid=PID + 7))),))  # rank 1 started again by an operator
    _, seen = run_table([(T0, first), (T0 + 1, again), (T0 + 2, other)], two_host_state())
    assert [kinds.count("rank") for _, kinds, _ in seen] == [1, 0, 1]
    _, writes, _ = core.step(two_host_state(), replace(first, members=(core.Member(1, "gpu2", None, "x" * 10_000),)),
                             T0, make_policy())
    [rows] = [w for w in writes if isinstance(w, core.HostRows)]
    assert len(rows.rows[1]["error"]) == core.ROW_ERROR_CHARS


def test_a_rank_whose_session_is_not_made_yet_has_not_ended():
    """Defect: a restart starts the ranks' sessions one host after another; rank 0's new
    process answered (the run is running again) while rank 1's session was not yet made,
    its old status and exit code removed: that was written as rank 1 having ended. No
    status and no exit code is no process yet; one that left either has ended."""
    not_yet = with_member(healthy(T0, 10), T0, phase=None, session=False)
    not_yet = replace(not_yet, members=(replace(not_yet.members[0], result=replace(
        not_yet.members[0].result, process=None)),))  # no status: no pid to look at either
    _, seen = run_table([(T0, not_yet)], two_host_state())
    assert "rank" not in seen[0][1]
    died_early = replace(not_yet, members=(replace(not_yet.members[0], result=replace(
        not_yet.members[0].result, exit_code=1)),))  # ended before it wrote a status: its wrapper says so
    _, seen = run_table([(T0, died_early)], two_host_state())
    assert seen[0][1].count("rank") == 1


def test_a_host_that_does_not_answer_keeps_its_row_age_and_a_finished_rank_is_no_failure():
    done = dict(phase="done", step=10, session=False, alive=False, exit_code=0)
    _, writes, _ = core.step(two_host_state(), with_member(healthy(T0, 10), T0, down=True), T0, make_policy())
    [rows] = [w for w in writes if isinstance(w, core.HostRows)]
    assert rows.rows[1] == {"rank": 1, "host": "gpu2", "answered": False, "error": "ssh: timed out"}
    _, seen = run_table([(T0, with_member(healthy(T0, 10), T0, **done))], two_host_state())
    assert "rank" not in seen[0][1]


# --------------------------------------------------------------------------- the standby


def test_a_standby_is_started_once_per_training_process_and_ended_with_the_run():
    pol = make_policy(standby=True)
    rows = [(T0, healthy(T0, 1)), (T0 + 1, healthy(T0 + 1, 2))]
    state, seen = run_table(rows, make_state(), pol)
    assert [a for _, _, a in seen] == [["StartStandby"], []]  # once for this process
    assert state.standby_for == PID
    other = core.Probed(replace(probe(T0 + 2, step=3), status=replace(probe(T0 + 2, step=3).status, pid=PID + 1)),
                        lines=(metrics(T0 + 2, 3),))
    state, _, actions = core.step(state, other, T0 + 2, pol)  # a new process (the standby took over)
    assert [type(a).__name__ for a in actions] == ["StartStandby"]
    done = core.Probed(probe(T0 + 3, "done", step=3, session=False, alive=False, exit_code=0))
    state, _, actions = core.step(state, done, T0 + 3, pol)
    assert "EndStandby" in [type(a).__name__ for a in actions] and state.run.state == "done"


def test_no_standby_while_starting_or_when_the_playbook_says_so():
    _, seen = run_table([(T0, core.Probed(probe(T0, "compiling")))], make_state(), make_policy(standby=True))
    assert seen[0][2] == []
    _, seen = run_table([(T0, healthy(T0, 1))], make_state(), make_policy(standby=False))
    assert seen[0][2] == []


# --------------------------------------------------------------------------- blame and hung peers, several hosts


def _failed_naming(t: float, culprit: int, claimed_host: str, **kw) -> ProbeResult:
    """A rank's answer after its trainer failed naming ``culprit`` (trainer/train.py report_failure)."""
    pr = probe(t, "failed", session=False, alive=False, exit_code=1, error="DistributedError: watchdog on rank N "
               f"after step N: rank {culprit} on {claimed_host} failed first (its heartbeat stopped)", **kw)
    return replace(pr, status=replace(pr.status, detail={"rank": 1 - culprit, "world_size": 2,
                                                         "failed_rank": culprit, "failed_host": claimed_host}))


def _crash_events(rows, state):
    events = []
    for t, obs in rows:
        state, writes, actions = core.step(state, obs, t, make_policy())
        events += [w for w in writes if isinstance(w, core.Event) and w.kind == "crash"]
    return state, events


def test_a_killed_rank_0_is_blamed_on_rank_0s_host_by_rank_1s_own_record():
    """kill -9 of rank 0: both processes are seen gone in one poll; rank 1's status
    names rank 0 (the host it claims is not believed: the controller's is named)."""
    killed = core.Probed(probe(T0 + 2, step=10, session=False, alive=False, exit_code=137))
    rank1 = _failed_naming(T0 + 2, 0, "somewhere-else", step=10)
    rows = [(T0, with_member(healthy(T0, 10), T0, step=10)),
            (T0 + 2, replace(killed, members=(core.Member(1, "gpu2", rank1),)))]
    _, [crash] = _crash_events(rows, two_host_state())
    assert crash.detail["host"] == "gpu1" and crash.detail["rank"] == 0, crash
    assert "[host gpu1, rank 0: failed first by the record of rank 1]" in crash.message


def test_with_no_record_the_rank_this_controller_saw_end_first_is_blamed_rank_0_included():
    """No status names anyone (both killed): the controller's own receive times say
    who ended first; rank 0's process went first here, its exit code came later."""
    settling = core.Probed(probe(T0 + 1, step=10, alive=False))  # gone, run.sh not done yet
    gone = dict(step=10, session=False, alive=False, exit_code=137)
    rows = [(T0, with_member(healthy(T0, 10), T0, step=10)),
            (T0 + 1, with_member(settling, T0 + 1, step=10)),
            (T0 + 2, with_member(settling, T0 + 2, **gone)),
            (T0 + 5, with_member(core.Probed(probe(T0 + 5, **gone)), T0 + 5, **gone))]
    _, [crash] = _crash_events(rows, two_host_state())
    assert crash.detail["host"] == "gpu1" and crash.detail["rank"] == 0, crash
    assert "[host gpu1, rank 0: its process ended first]" in crash.message


def _hung_state(timeout: float = 20.0) -> core.RunState:
    s = two_host_state()
    return replace(s, run=replace(s.run, config={"trainer": {"distributed": {"timeout": timeout}}}))


def test_a_stopped_rank_0_named_by_the_rank_that_ended_is_ended_and_the_run_restarted():
    stopped = core.Probed(probe(T0, step=10, state="T"))
    rows = [(T0, with_member(healthy(T0, 10), T0, step=10))]
    rows += [(T0 + t, with_member(replace(stopped, result=replace(stopped.result, host_time=T0 + t)), T0 + t, step=10))
             for t in (5, 10, 15)]
    failed = replace(stopped, members=(core.Member(1, "gpu2", _failed_naming(T0 + 24, 0, "gpu1", step=10)),))
    rows.append((T0 + 24, failed))
    state, seen = run_table(rows, _hung_state())
    assert all("IssueRestart" not in acts for _, _, acts in seen[:-1])  # one signal (state T) alone: left alone
    assert seen[-1][0][-1] == "restarting" and "IssueRestart" in seen[-1][2], seen[-1]
    _, _, actions = core.step(run_table(rows[:-1], _hung_state())[0], rows[-1][1], T0 + 24, make_policy())
    [issue] = [a for a in actions if isinstance(a, core.IssueRestart)]
    assert issue.hung  # its stacks are asked for before it is killed (a process in D still dumps them)
    _, [crash] = _crash_events(rows, _hung_state())
    assert crash.detail["host"] == "gpu1" and crash.detail["rank"] == 0 and crash.detail["hung_rank"] == 0
    assert crash.detail["signature"] == "rank_failed" and crash.detail["process_state"] == "T"
    assert "rank 0 on gpu1 stopped answering" in crash.message


def test_a_rank_named_hung_that_still_makes_steps_or_not_for_long_enough_is_not_ended():
    """Two signals or nothing: a record naming rank 0 while this controller sees
    rank 0 step on (or quiet for less than distributed.timeout) changes nothing."""
    failed = lambda t: core.Member(1, "gpu2", _failed_naming(t, 0, "gpu1", step=10))  # noqa: E731
    moving = [(T0 + t, replace(healthy(T0 + t, 10 + t), members=(failed(T0 + t),))) for t in range(0, 40, 5)]
    _, seen = run_table(moving, _hung_state())
    assert not any("IssueRestart" in acts for _, _, acts in seen)
    early = [(T0, with_member(healthy(T0, 10), T0, step=10)),
             (T0 + 10, replace(core.Probed(probe(T0 + 10, step=10, state="T")), members=(failed(T0 + 10),)))]
    _, seen = run_table(early, _hung_state())
    assert not any("IssueRestart" in acts for _, _, acts in seen)


# --------------------------------------------------------------------------- what each host shows, several hosts


def test_another_ranks_host_not_answering_is_an_event_and_an_alert_and_its_return_is_said():
    rows = [(T0, with_member(healthy(T0, 10), T0, step=10)),
            (T0 + 1, with_member(healthy(T0 + 1, 11), T0 + 1, down=True)),
            (T0 + 2, with_member(healthy(T0 + 2, 12), T0 + 2, down=True)),
            (T0 + 400, with_member(healthy(T0 + 400, 13), T0 + 400, down=True)),  # past escalate_after
            (T0 + 401, with_member(healthy(T0 + 401, 14), T0 + 401, step=14))]
    state, seen = two_host_state(), []
    for t, obs in rows:
        state, writes, actions = core.step(state, obs, t, make_policy())
        seen.append(([(w.severity, w.message) for w in writes if isinstance(w, core.Event) and w.kind == "unreachable"],
                     [a.severity for a in actions if isinstance(a, core.Alert) and a.kind == "unreachable"]))
    assert seen[0] == ([], []) and seen[2] == ([], [])  # said when new or worse, not at every poll
    [(severity, message)] = seen[1][0]
    assert severity == "warning" and seen[1][1] == ["warning"] and "host gpu2 unreachable" in message
    assert "rank 1" in message and "ssh: timed out" in message
    assert [s for s, _ in seen[3][0]] == ["error"] and seen[3][1] == ["error"]
    [(severity, message)] = seen[4][0]
    assert severity == "info" and "host gpu2 (rank 1) reachable again after" in message
    assert state.run.state == "running"  # nothing else changes


def test_while_rank_0s_host_is_down_the_ranks_that_answered_are_shown_seen():
    finding = detectors.detect_unreachable("gpu1", T0, 1, T0, error="ssh: connection refused")
    member = core.Member(1, "gpu2", probe(T0, step=12))
    _, writes, _ = core.step(two_host_state(), core.Unreachable("gpu1", finding, 1, T0, True, (member,)), T0,
                             make_policy())
    [rows] = [w for w in writes if isinstance(w, core.HostRows)]
    assert rows.rows[0] == {"rank": 0, "host": "gpu1", "answered": False, "error": "ssh: connection refused"}
    assert rows.rows[1]["rank"] == 1 and rows.rows[1].get("answered", True) and rows.rows[1]["step"] == 12


def test_a_stopped_rank_is_shown_stopped_at_once_not_as_its_last_phase():
    _, writes, _ = core.step(two_host_state(), with_member(healthy(T0, 10), T0, step=10, state="T"), T0, make_policy())
    [rows] = [w for w in writes if isinstance(w, core.HostRows)]
    assert rows.rows[1]["phase"] == "training, process is stopped (state T)" and rows.rows[0]["phase"] == "training"


# --------------------------------------------------------------------------- routine phases


def test_a_routine_checkpoint_is_no_event_unless_it_lasts_longer_than_expected():
    """A checkpoint every few minutes of a run of days would fill the event list with
    checkpointing/training pairs: it is written only once it lasts longer than
    ROUTINE_PHASE_S, and then its end too. A compile is written at once."""
    from dflashctl.supervise.supervisor_core.limits import ROUTINE_PHASE_S

    def phases(rows):
        state, seen = make_state(), []
        for t, phase, step in rows:
            obs = core.Probed(probe(t, phase, step=step), lines=(metrics(t, step),))
            state, writes, _ = core.step(state, obs, t, make_policy())
            seen += [(t - T0, w.severity, w.message) for w in writes if isinstance(w, core.Event) and w.kind == "phase"]
        return seen

    short = [(T0, "compiling", 0), (T0 + 10, "training", 1), (T0 + 20, "checkpointing", 2),
             (T0 + 30, "training", 3), (T0 + 40, "checkpointing", 4), (T0 + 50, "training", 5)]
    assert [m for _, _, m in phases(short)] == ["phase compiling", "phase training"]
    slow = ROUTINE_PHASE_S + 30
    long = [(T0, "training", 1), (T0 + 10, "checkpointing", 2), (T0 + 20, "checkpointing", 2),
            (T0 + 10 + slow, "checkpointing", 2), (T0 + 20 + slow, "checkpointing", 2),
            (T0 + 30 + slow, "training", 3)]
    seen = phases(long)
    assert [(t, sev) for t, sev, _ in seen] == [(10 + slow, "warning"), (30 + slow, "info")]
    assert seen[0][2].startswith("phase checkpointing for 2.5 m (a routine checkpointing takes under 2 m)")
    assert seen[1][2] == "phase training"


def test_a_restart_row_says_how_its_process_did():
    """Its row is `issued`, then `resumed` at the process's first step; a process that
    fails before any step leaves its row `failed before its first step`."""
    state = after_a_restart()
    crash = core.Probed(probe(T0 + 20, session=False, alive=False, exit_code=1, started=T0 + 12))
    _, writes, _ = core.step(state, crash, T0 + 20, make_policy())
    updates = [w.changes for w in writes if isinstance(w, core.RestartUpdate)]
    rows = [w for w in writes if isinstance(w, core.RestartRow)]
    assert updates == [{"outcome": "failed before its first step"}] and len(rows) == 1
    assert writes.index(next(w for w in writes if isinstance(w, core.RestartUpdate))) < writes.index(rows[0])
