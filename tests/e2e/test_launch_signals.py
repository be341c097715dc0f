"""`dflashctl launch --foreground` as a real process: SIGHUP (the terminal or the
ssh connection closed) and SIGTERM hand the run to a background supervisor, as
Ctrl-C does; while it follows, it holds the run's claim like `watch`; its exit
code says how the run ended.

The runs are real launches on the local host whose trainer is the fake one
(tests/harness/fake_trainer.py, started through the launcher's own run.sh): the
inventory's python is a small dispatcher that runs the fake trainer for
``-m trainer`` and the real interpreter for everything else (the probe, the
env-audit). Every tmux server here is on a socket private to this test process
and every process the tests cause is ended by its pid.
"""

from __future__ import annotations

import os
import signal
import socket as socketlib

import pytest

from dflashctl.hosts.tmux import Tmux
from dflashctl.store import Store
from dflashctl.supervise.supervisor import live_supervisor
from tests.harness.launch import SOCKET, LocalLaunch, end, trainer_pid
from tests.harness.local import wait_for

pytestmark = pytest.mark.usefixtures("launch_tmux_socket")


@pytest.fixture
def local(tmp_path):
    return LocalLaunch(tmp_path)


def _the_run(store: Store):
    runs = store.list_runs()
    return runs[0] if runs else None


# --------------------------------------------------------------------------- hand-over


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGTERM, signal.SIGINT], ids=["SIGHUP", "SIGTERM", "SIGINT"])
def test_a_signal_to_launch_foreground_hands_the_run_to_a_background_supervisor(local, tmp_path, signum):
    name = local.playbook("handed", {"steps": 100000, "log_every": 2, "checkpoint_every": 4})
    output = tmp_path / "launch.out"
    launch = local.popen("launch", name, "--foreground", output=output)
    store = Store(local.store_path)
    watch_pid = run = None
    try:
        run = wait_for(lambda: _the_run(store) if os.path.exists(local.store_path) else None, 60, "the run recorded")
        wait_for(lambda: (store.get_run(run.id).supervisor or {}).get("pid") == launch.pid, 60,
                 "launch --foreground to supervise the run")
        wait_for(lambda: store.get_run(run.id).state == "running", 30, "the run running")

        # While it follows, the launch holds the run's claim: a `watch` is refused.
        claim = store.get_run(run.id).supervisor
        assert live_supervisor(claim) == claim
        second = local.cli("watch", run.id, "--interval", "0.2", timeout=60)
        assert second.returncode != 0 and f"already supervised by pid {launch.pid}" in second.stderr, second.stderr
        assert (store.get_run(run.id).supervisor or {}).get("pid") == launch.pid

        launch.send_signal(signum)
        assert launch.wait(60) == 130, output.read_text()  # interrupted (the run goes on)
        text = output.read_text()
        assert f"detached ({signal.Signals(signum).name}); the run goes on, supervised in local tmux session " \
               f"watch-{run.id}" in text, text
        assert "Traceback" not in text

        # Supervised afterwards: a live `watch` process, recorded on the run.
        def background():
            info = store.get_run(run.id).supervisor or {}
            return info if info.get("pid") not in (None, launch.pid) and live_supervisor(info) else None

        info = wait_for(background, 30, "a background supervisor with a live pid on the run")
        watch_pid = info["pid"]
        assert info["session"] == f"watch-{run.id}" and info["host"] == socketlib.gethostname()
        with open(f"/proc/{watch_pid}/cmdline", "rb") as f:
            assert b"watch" in f.read().split(b"\0")
        assert store.get_run(run.id).state == "running"

        # ... and it acts: a killed trainer is restarted by that supervisor.
        first = wait_for(lambda: trainer_pid(run.run_dir), 20, "the trainer's pid")
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: [r for r in store.restarts(run.id) if r.issued], 30, "a restart issued")
        second_pid = wait_for(lambda: trainer_pid(run.run_dir, other_than=first), 30, "the restarted trainer")
        assert second_pid != first
        wait_for(lambda: store.get_run(run.id).state == "running", 30, "the run running again")
        crash = store.events(run.id, kind="crash")
        assert crash and crash[-1].detail["signature"] == "killed_by_signal"
        assert (store.get_run(run.id).supervisor or {}).get("pid") == watch_pid
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait()
        if watch_pid is None and run is not None:
            watch_pid = (store.get_run(run.id).supervisor or {}).get("pid")
        if watch_pid and watch_pid != launch.pid:
            end(watch_pid)
        if run is not None:
            end(trainer_pid(run.run_dir))
            Tmux(local.inventory.get("local"), local.inventory, SOCKET).kill(run.id)


# --------------------------------------------------------------------------- exit code


@pytest.mark.parametrize("ending, code", [("done", 0), ("failed", 1)])
def test_launch_foreground_exits_non_zero_when_the_run_fails(local, ending, code):
    # Past the launch's own wait (about 2 s of steps): the end is the follower's to see.
    fault = {"kind": "exit", "after_steps": 40, "exit_code": 3, "message": "shard 7 is corrupt"}
    name = local.playbook(f"ends-{ending}", {"steps": 40 if ending == "done" else 1000, "log_every": 1,
                                             "checkpoint_every": 4}, fault=fault if ending == "failed" else None)
    done = local.cli("launch", name, "--foreground", timeout=180)
    store = Store(local.store_path)
    run = store.list_runs()[0]
    assert run.state == ending, done.stdout + done.stderr
    assert "trainer running" in done.stderr  # the launch saw it start: the follower saw it end
    assert done.returncode == code, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert run.supervisor is None  # released at the end
