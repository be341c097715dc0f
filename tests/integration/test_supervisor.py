"""The supervisor loop for real, fast: trainer-like processes (tests/harness/
fake_trainer.py: the trainer's run-directory contract without torch) started by
the launcher's own run.sh in tmux on the local host, a real SQLite store, the real
probe, the launcher's real restart, a real webhook on 127.0.0.1.

The end-to-end versions with the real tiny trainer over the sshd harness are in
tests/e2e/test_supervisor_e2e.py; `watch` as a process (SIGINT) in
tests/e2e/test_supervisor.py. Every tmux server here is on a socket private to
this test process and is ended by its pid.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from dflashctl.config import load_inventory
from dflashctl.core import contract
from dflashctl.hosts.tmux import SOCKET_ENV
from dflashctl.supervise.supervisor import (
    RESTART_MARKER,
    Supervisor,
    SupervisorConflict,
    live_supervisor,
)
from tests.harness import cli as dflashctl
from tests.harness.local import REPO, SOCKET, issued, kinds, metrics_lines, states, wait_for
from tests.harness.waiting import scaled

pytestmark = pytest.mark.usefixtures("private_tmux_socket")

# --------------------------------------------------------------------------- samples, offsets, states


def test_samples_are_stored_once_with_their_offset_and_the_run_goes_running(local_env):
    pb = local_env.playbook("steady")
    run_id = local_env.start(pb)
    sup = local_env.supervisor()
    sup.attach(run_id)
    store = local_env.store
    try:
        wait_for(lambda: len(store.samples(run_id)) >= 6, 20, "six samples", tick=sup.tick)
        assert store.get_run(run_id).state == "running"
        assert states(store, run_id) == ["launching", "running"]
        assert store.get_run(run_id).supervisor["pid"] == os.getpid()
        # Every complete metrics line the store has is in the file, in order, once.
        local_env.tmux.kill(run_id)
        sup.tick()
        lines = metrics_lines(local_env.run_dir(run_id))
        stored = store.samples(run_id)
        # The trainer is gone and the last tick read to the end of the file: all of it, once, in order.
        assert [(s.time, s.step) for s in stored] == [(m.time, m.step) for m in lines]
        offset, inode = store.metrics_position(run_id)
        written = Path(local_env.run_dir(run_id), contract.METRICS_FILE).read_bytes()
        assert offset == written.rfind(b"\n") + 1  # up to the last complete line (a kill can cut one)
    finally:
        local_env.tmux.kill(run_id)
        sup.close()
    assert store.get_run(run_id).supervisor is None  # released on a clean exit


def test_each_tick_stores_everything_in_one_transaction(local_env):
    """Samples, the metrics offset, the running transition and its event: one
    BEGIN IMMEDIATE per tick on the real SQLite file, however much the tick saw.
    (No standby: its start is a side job on a worker thread that writes its own
    event whenever it is done, inside whichever tick's count that falls.)"""
    pb = local_env.playbook("steady", restart={"backoff_initial": 0.05, "backoff_max": 0.1, "jitter": 0,
                                               "standby": False})
    run_id = local_env.start(pb)
    store = local_env.store
    sup = local_env.supervisor()
    sup.attach(run_id)
    per_tick, samples_before = [], len(store.samples(run_id))
    try:
        wait_for(lambda: metrics_lines(local_env.run_dir(run_id)), 20, "a first metrics line")  # lines to read
        for _ in range(4):
            before = store.write_transactions
            sup.tick()
            per_tick.append(store.write_transactions - before)
            time.sleep(0.3)
    finally:
        local_env.tmux.kill(run_id)
        sup.close()
    assert states(store, run_id)[:2] == ["launching", "running"]
    assert len(store.samples(run_id)) > samples_before + 1
    assert per_tick[0] == 1  # the transition, its event and the first samples together
    assert all(n <= 1 for n in per_tick), per_tick


def test_a_finished_run_ends_done_and_the_loop_ends_with_it(local_env):
    pb = local_env.playbook("short", {"train": {"steps": 12, "log_every": 2, "checkpoint_every": 4}})
    run_id = local_env.start(pb, step_s=0.02)
    sup = local_env.supervisor()
    sup.attach(run_id)
    seen = []
    sup.emit = lambda kind, payload: seen.append((kind, payload))
    done = threading.Event()
    limit = threading.Timer(scaled(30), done.set)  # a deadline, in case it never returns by itself
    limit.start()
    sup.run(done)  # returns by itself: nothing active is left
    limit.cancel()
    assert not done.is_set()
    run = local_env.store.get_run(run_id)
    assert (run.state, run.exit_code, run.exit_reason) == ("done", 0, "done")
    assert run.ended is not None
    assert max(s.step for s in local_env.store.samples(run_id)) == 12
    assert any(k == "event" and e.kind == "state" and "training finished at step 12" in e.message for k, e in seen)
    done.set()


# --------------------------------------------------------------------------- crash, restart, cost


def test_a_killed_trainer_is_restarted_from_its_checkpoint_and_the_cost_recorded(local_env, webhook):
    pb = local_env.playbook("crashy", alerts={"webhook": webhook.url, "min_severity": "error"})
    run_id = local_env.start(pb)
    store = local_env.store
    sup = local_env.supervisor()
    sup.attach(run_id)
    try:
        wait_for(lambda: (store.get_run(run_id).state == "running" and len(store.samples(run_id)) >= 5), 20,
                 "a running run with samples", tick=sup.tick)
        first_pid = local_env.trainer_pid(run_id)
        checkpoint = int(Path(local_env.run_dir(run_id), "checkpoints", "fake-step").read_text())
        killed_at = time.time()
        os.kill(first_pid, signal.SIGKILL)
        wait_for(lambda: issued(store, run_id), 20, "a restart row", tick=sup.tick)
        crash = next(e for e in kinds(store, run_id, "crash"))
        assert crash.time - killed_at < 3 * 0.2 + 2  # within a tick (plus the probe and settling)
        assert crash.detail["signature"] == "killed_by_signal"
        assert "exit" in crash.message and "137" in crash.message
        wait_for(lambda: store.restarts(run_id)[0].time_to_first_step_s is not None, 20, "the first step after the restart",
                 tick=sup.tick)
        restart = store.restarts(run_id)[0]
        assert (restart.action, restart.signature) == ("restart", "killed_by_signal")
        assert 0 <= restart.detect_delay_s < 2.0
        assert restart.downtime_s >= restart.time_to_first_step_s > 0
        assert restart.step_before >= checkpoint
        second_pid = local_env.trainer_pid(run_id, other_than=first_pid)
        assert second_pid != first_pid
        wait_for(lambda: store.restarts(run_id)[0].step_after > restart.step_before, 20, "progress past the crash",
                 tick=sup.tick)
        assert states(store, run_id) == ["launching", "running", "restarting", "running"]
        log = Path(local_env.run_dir(run_id), contract.LOG_FILE).read_text()
        assert f"resumed from checkpoints/fake-step: step {checkpoint}" in log.split(RESTART_MARKER)[-1]
        sup.close()  # delivers the queued alerts
        assert [a["kind"] for a in webhook.received] == ["crash"]
        assert webhook.received[0]["run_id"] == run_id and "restart 1/5" in webhook.received[0]["message"]
    finally:
        local_env.tmux.kill(run_id)
        sup.close()


def test_an_injected_fx_race_is_classified_and_restarted_with_serialized_warmup(local_env):
    message = "Detected that you are using FX to symbolically trace a dynamo-optimized function"
    pb = local_env.playbook("fxrace", {"fault": {"kind": "exit", "after_steps": 3, "message": message},
                                       "compile": {"serialized_warmup": False}})
    run_id = local_env.start(pb)
    store = local_env.store
    sup = local_env.supervisor()
    sup.attach(run_id)
    try:
        wait_for(lambda: issued(store, run_id), 20, "a restart", tick=sup.tick)
        restart = store.restarts(run_id)[0]
        assert (restart.signature, restart.action) == ("fx_race", "restart_serialized")
        crash = kinds(store, run_id, "crash")[0]
        assert crash.detail["signature"] == "fx_race" and message in crash.detail["matched_line"]
        config = json.loads(Path(local_env.run_dir(run_id), contract.CONFIG_FILE).read_text())
        assert config["compile"]["serialized_warmup"] is True
        process = kinds(store, run_id, "process")[-1]
        assert process.detail["serialized_warmup"] is True
        wait_for(lambda: store.get_run(run_id).state == "running" and store.restarts(run_id)[0].step_after, 20,
                 "the restarted process training (the fault fires once)", tick=sup.tick)
    finally:
        local_env.tmux.kill(run_id)
        sup.close()


def test_a_crash_loop_stops_after_k_restarts_with_an_alert(local_env, webhook):
    pb = local_env.playbook(
        "loop", {"fault": {"kind": "exit", "after_steps": 0, "message": "boom", "once": False, "exit_code": 1}},
        restart={"crash_loop_k": 2, "backoff_initial": 0.05, "backoff_max": 0.1, "jitter": 0},
        alerts={"webhook": webhook.url, "min_severity": "error", "min_interval": 60},
    )
    run_id = local_env.start(pb)
    store = local_env.store
    sup = local_env.supervisor()
    sup.attach(run_id)
    stop = threading.Event()
    limit = threading.Timer(scaled(60), stop.set)  # a deadline, in case it never ends by itself
    limit.start()
    sup.run(stop)  # ends by itself once the run is failed
    limit.cancel()
    stop.set()
    run = store.get_run(run_id)
    assert run.state == "failed"
    # The signature, the trainer's words, why no restart.
    assert run.exit_reason.startswith("unknown: the trainer reported failure: InjectedFault: boom; crash loop: "
                                      "2 restarts in a row without step progress")
    assert len(store.restarts(run_id)) == 2
    assert [s for s in states(store, run_id) if s != "running"] == ["launching", "restarting", "failed"]
    assert "restart 2/5" in kinds(store, run_id, "restart")[0].message  # the second decision, while restarting
    critical = [a for a in webhook.received if a["severity"] == "critical"]
    assert len(critical) == 1 and "crash loop" in critical[0]["message"] and critical[0]["kind"] == "crash"
    # the first crash alert went out; the second was rate-limited (same kind, same severity)
    assert [a["severity"] for a in webhook.received] == ["error", "critical"]
    assert critical[0].get("suppressed") == 1


# --------------------------------------------------------------------------- stall, regression


def test_a_stopped_trainer_is_a_stall_left_alone_until_it_continues(local_env):
    pb = local_env.playbook("frozen", expect={"stall_window": 30})
    run_id = local_env.start(pb)
    store = local_env.store
    sup = local_env.supervisor()
    sup.attach(run_id)
    pid = None
    try:
        wait_for(lambda: len(store.samples(run_id)) >= 2, 20, "samples", tick=sup.tick)
        pid = local_env.trainer_pid(run_id)
        stopped_at = time.time()
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: store.get_run(run_id).state == "stalled", 10, "stalled", tick=sup.tick)
        stall = kinds(store, run_id, "stall")[0]
        assert stall.time - stopped_at < 30  # well inside the stall window: state T is seen at once
        assert f"trainer process {pid} is stopped" in stall.message
        assert "not restarting a process someone stopped on purpose" in kinds(store, run_id, "state")[-1].message
        for _ in range(5):
            sup.tick()
        assert not store.restarts(run_id)
        assert len(kinds(store, run_id, "stall")) == 1  # said once, not every poll
        os.kill(pid, signal.SIGCONT)
        wait_for(lambda: store.get_run(run_id).state == "running", 10, "running again", tick=sup.tick)
        assert "stall cleared" in kinds(store, run_id, "stall")[-1].message
    finally:
        if pid:
            os.kill(pid, signal.SIGCONT)
        local_env.tmux.kill(run_id)
        sup.close()


def test_a_hung_trainer_is_restarted_after_the_stall_window_and_reaped_first(local_env):
    # The hung process ignores SIGHUP (as one stuck in a driver call may): killing its
    # tmux session is not enough, and the new process must not start beside it.
    pb = local_env.playbook("hang", {"fault": {"kind": "hang", "after_steps": 4}}, expect={"stall_window": 1.5})
    run_id = local_env.start(pb, env={"FAKE_TRAINER_IGNORE_HUP": "1"})
    store = local_env.store
    old_pid = local_env.trainer_pid(run_id)
    sup = local_env.supervisor()
    sup.attach(run_id)
    try:
        wait_for(lambda: issued(store, run_id), 20, "a restart of the hung trainer", tick=sup.tick)
        stall = kinds(store, run_id, "stall")[0]
        assert "no new step for" in stall.message and "stall window 2 s" in stall.message
        restart = store.restarts(run_id)[0]
        assert restart.signature == "stall" and restart.detect_delay_s >= 1.5
        wait_for(lambda: store.restarts(run_id)[0].step_after, 40, "training again", tick=sup.tick)
        assert not os.path.exists(f"/proc/{old_pid}")  # killed, not left beside the new one
        assert local_env.trainer_pid(run_id) != old_pid
        assert store.get_run(run_id).state == "running"  # no stale exit code read as a new crash
    finally:
        local_env.tmux.kill(run_id)
        sup.close()


def test_a_run_left_restarting_or_lost_by_a_dead_supervisor_is_watched_again(local_env):
    pb = local_env.playbook("orphan")
    store = local_env.store
    for state in ("restarting", "lost"):
        run_id = local_env.start(pb)
        first = local_env.supervisor()
        first.attach(run_id)
        try:
            wait_for(lambda: store.get_run(run_id).state == "running", 20, "running", tick=first.tick)
            # The first supervisor dies holding the run in `state` (a backoff in memory, an outage).
            store.transition(run_id, state, f"left {state} by a supervisor that died", time.time())
            store.set_supervisor(run_id, None)
            second = local_env.supervisor()
            second.attach(run_id)
            wait_for(lambda: store.get_run(run_id).state == "running", 20, f"running again after {state}",
                     tick=second.tick)
            local_env.tmux.kill(run_id)  # and it is watched: the crash is seen and acted on
            wait_for(lambda: issued(store, run_id), 20, f"a restart after {state}", tick=second.tick)
        finally:
            local_env.tmux.kill(run_id)
            first.close()
            second.close()


def test_a_slowdown_is_a_regression_in_the_operators_terms(local_env):
    pb = local_env.playbook(
        "slow", {"fault": {"kind": "slow", "after_steps": 6, "factor": 3}, "train": {"steps": 3000000, "log_every": 2}},
        expect={"baseline_tok_s": 5000, "regression_windows": 2, "max_eta": "3d", "regression_hold": 1},
    )
    run_id = local_env.start(pb, step_s=0.05, tokens=256)  # ~5 Ktok/s, then ~1.7 Ktok/s
    store = local_env.store
    sup = local_env.supervisor()
    sup.attach(run_id)
    try:
        def full():  # tok/s, percent of baseline and ETA (3 x 1.8 d at this pace) in one finding
            return [e for e in kinds(store, run_id, "regression") if "% of baseline" in e.message and "ETA" in e.message]

        found = wait_for(full, 30, "a regression", tick=sup.tick)[0]
        assert found.severity == "warning"
        assert "Ktok/s = " in found.message and "% of baseline 5.0 Ktok/s; ETA " in found.message
        assert 20 <= found.detail["fraction"] * 100 <= 45
        assert found.message.endswith("> 3 d") and 4 * 86400 < found.detail["eta_s"] < 7 * 86400
        assert store.get_run(run_id).state == "running"  # a restart would not fix it
        assert not store.restarts(run_id)
    finally:
        local_env.tmux.kill(run_id)
        sup.close()


# --------------------------------------------------------------------------- hosts


def test_an_unreachable_host_is_a_finding_and_the_loop_goes_on(local_env, tmp_path):
    import socket as socketlib

    with socketlib.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    inventory_path = tmp_path / "inventory.yaml"
    inventory_path.write_text(yaml.safe_dump({"hosts": {
        "local": {"transport": "local", "workdir": local_env.workdir},
        "gone": {"address": "127.0.0.1", "port": port, "known_hosts": str(tmp_path / "known_hosts"),
                 "connect_timeout": 2},
    }}))
    inventory = load_inventory(str(inventory_path))
    store = local_env.store
    far = store.create_run("remote", "gone", {}, time.time(), run_dir="/nonexistent", tmux_session="x")
    store.transition(far.id, "running", "trainer started", time.time())
    pb = local_env.playbook("neighbour")
    near = local_env.start(pb)
    sup = Supervisor(store, inventory, interval=0.2, playbooks_dir=str(local_env.playbooks), escalate_after=0.5)
    sup.attach(far.id)
    sup.attach(near)
    try:
        for _ in range(4):
            report = sup.tick()
            time.sleep(0.2)
        assert "connection refused" in report.hosts["gone"]
        assert isinstance(report.hosts["local"], float)  # the other host is polled as usual
        found = kinds(store, far.id, "unreachable")
        assert [e.severity for e in found] == ["warning", "error"]  # escalated after escalate_after
        assert found[0].message.startswith("host gone unreachable since ")
        assert store.get_run(far.id).state == "lost"
        assert store.get_run(near).state == "running" and store.samples(near)
    finally:
        local_env.tmux.kill(near)
        sup.close()


# --------------------------------------------------------------------------- one supervisor per run


def test_a_new_supervisor_re_attaches_without_restarting_or_storing_twice(local_env):
    pb = local_env.playbook("reattach")
    run_id = local_env.start(pb)
    store = local_env.store
    first = local_env.supervisor()
    first.attach(run_id)
    try:
        wait_for(lambda: len(store.samples(run_id)) >= 4, 20, "samples", tick=first.tick)
        pid = local_env.trainer_pid(run_id)
        # The first supervisor vanishes without a word (as if killed): no close().
        time.sleep(0.5)
        second = local_env.supervisor()
        second.attach(run_id)
        assert "re-attached" in kinds(store, run_id, "supervisor")[-1].message
        before = len(store.samples(run_id))
        wait_for(lambda: len(store.samples(run_id)) >= before + 4, 20, "more samples", tick=second.tick)
        local_env.tmux.kill(run_id)
        second.tick()
        steps = [s.step for s in store.samples(run_id)]
        assert steps == sorted(set(steps))  # no line stored twice, none skipped in between
        assert steps == [m.step for m in metrics_lines(local_env.run_dir(run_id))][: len(steps)]
        assert local_env.trainer_pid(run_id) == pid and not store.restarts(run_id)
    finally:
        local_env.tmux.kill(run_id)
        first.close()
        second.close()


def test_a_run_with_a_live_supervisor_is_refused(local_env):
    pb = local_env.playbook("claimed")
    run_id = local_env.start(pb)
    local_env.tmux.kill(run_id)
    # A live process whose command line says `watch`, recorded as the run's supervisor.
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "watch", run_id])
    try:
        import socket as socketlib

        # Until the child has exec'd, /proc shows the parent's command line.
        wait_for(lambda: b"watch" in open(f"/proc/{other.pid}/cmdline", "rb").read(), 10, "the child's exec")

        local_env.store.set_supervisor(run_id, {"pid": other.pid, "host": socketlib.gethostname(), "kind": "process"})
        assert live_supervisor(local_env.store.get_run(run_id).supervisor)["pid"] == other.pid
        with pytest.raises(SupervisorConflict, match=f"already supervised by pid {other.pid}"):
            local_env.supervisor().attach(run_id)
    finally:
        other.kill()
        other.wait()
    assert live_supervisor(local_env.store.get_run(run_id).supervisor) is None  # gone: free to take


# --------------------------------------------------------------------------- the command


def _cli(args, env_extra):
    """The command in this process (its output, its exit code: tests/harness/cli.py)."""
    return dflashctl.invoke(*args, env=env_extra, cwd=REPO)


def test_watch_once_prints_json_events_and_records_samples(local_env):
    pb = local_env.playbook("cli")
    run_id = local_env.start(pb)
    store = local_env.store
    try:
        wait_for(lambda: metrics_lines(local_env.run_dir(run_id)), 20, "metrics")
        env = {"DFLASHCTL_STORE": local_env.store_path, SOCKET_ENV: SOCKET}
        out = _cli(["-i", str(local_env.inventory_path), "-p", str(local_env.playbooks), "watch", "cli", "--once",
                    "--json"], env)
        assert out.returncode == 0, out.stderr
        events = [json.loads(line) for line in out.stdout.splitlines()]
        [seen] = [e for e in events if e["kind"] == "observation"]
        assert seen["run_id"] == run_id and seen["state"] == "launching" and seen["step"] >= 1
        assert all(e["run_id"] == run_id for e in events)
        assert store.samples(run_id)  # recorded
        assert not store.events(run_id, kind="supervisor")  # looking is not watching: nothing written on the run
        assert store.get_run(run_id).state == "launching"  # --once observes: no state changes
        assert store.get_run(run_id).supervisor is None  # and claims nothing
        plain = _cli(["-i", str(local_env.inventory_path), "watch", run_id[:-1], "--once", "--interval", "1s"], env)
        assert plain.returncode == 0 and plain.stdout.startswith(f"{run_id}  launching (training)  step "), plain.stdout
        missing = _cli(["-i", str(local_env.inventory_path), "watch", "no-such-thing", "--once"], env)
        assert missing.returncode == 2 and "no run or playbook named 'no-such-thing'" in missing.stderr
        assert "Traceback" not in missing.stderr
    finally:
        local_env.tmux.kill(run_id)


