"""A trainer stopped (SIGSTOP) for longer than its stall window, then continued
(SIGCONT), over and over, through the sshd harness (jump -> `pct exec` container on
`target`), with the real supervisor and store: each stop is a stall left alone,
each continue is running again, and nothing is ever restarted. The quiet time
after a continue counts from when the process ran again, not from its last step
before the stop (which is older than the window).

The trainer is the fake one (tests/harness/fake_trainer.py, started by the
launcher's run.sh in tmux on `target`): what is tested is the supervisor's reading
of a stopped process and of the quiet after it, not the trainer. Its lines come
every half second, so a stall window of seconds holds several polls with no new
line after each continue, as a real run's minutes do; the window is stretched on a
loaded machine (tests/harness/waiting.py), and each stop outlasts it.

The first test does it three times; the slow one ten times (the drill's bar).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from dflashctl.config import load_playbook
from dflashctl.hosts.tmux import SOCKET_ENV
from dflashctl.store import Store
from dflashctl.supervise.supervisor import Supervisor
from tests.harness import environ
from tests.harness.fake_trainer import start_fake_run
from tests.harness.local import (
    SOCKET,
    Background,
    end_trainer,
    kill_tmux_servers,
    kinds,
    read_status,
    states,
    wait_for,
    write_playbook,
)
from tests.harness.waiting import time_scale

INTERVAL = 0.2  # the supervisor's poll
STEP_S = 0.05  # the fake trainer's pace
# A metrics line every 10 steps: half a second, a few polls, so the first polls after
# a continue find no new line yet (a real run logs every 10-60 s), well inside the window.
TRAIN = {"steps": 1_000_000, "log_every": 10, "checkpoint_every": 400}
STALL_WINDOW = 2.0  # on an idle machine: four lines' time


class StoppedRun:
    def __init__(self, ssh_env, root):
        self.inventory = ssh_env.inventory
        self.store = Store(str(root / "runs.db"))
        # The window and the stops, stretched by the load once for the module: each
        # stop must outlast the window the supervisor was given.
        self.window = STALL_WINDOW * time_scale()
        # Longer than the window: the last step before a stop is older than the window after it.
        self.stop_s = self.window + 1.0
        playbooks = root / "playbooks"
        path = write_playbook(playbooks, "stops", "target", {"train": TRAIN}, poll_interval=INTERVAL,
                              expect={"stall_window": self.window, "startup_budget": 180},
                              restart={"backoff_initial": 0.2, "jitter": 0, "standby": False})
        pb = load_playbook(str(path), inventory=self.inventory)
        self.run_id = start_fake_run(self.store, self.inventory, "target", pb.trainer.to_dict(), playbook=pb.name,
                                     playbook_source=pb.source, socket=SOCKET, step_s=STEP_S)
        self.run_dir = self.store.get_run(self.run_id).run_dir
        sup = Supervisor(self.store, self.inventory, interval=INTERVAL, playbooks_dir=str(playbooks))
        sup.attach(self.run_id)
        self.background = Background(sup)

    def step(self) -> int:
        return max([s.step for s in self.store.samples(self.run_id)] or [0])

    def training(self, beyond: int = 0, timeout: float = 180) -> int:
        wait_for(lambda: self.store.get_run(self.run_id).state == "running" and self.step() > beyond, timeout,
                 f"training past step {beyond}", every=0.2)
        return self.step()

    def stop_and_continue(self, pid: int) -> None:
        """SIGSTOP longer than the stall window, SIGCONT, then the next stored step."""
        before = self.training()
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_for(lambda: self.store.get_run(self.run_id).state == "stalled", 10, "the stop seen as a stall")
            time.sleep(self.stop_s)  # the stop itself: longer than the window
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: self.store.restarts(self.run_id) or self.step() > before, self.window * 3,
                 f"a step past {before} after the continue", every=0.2)
        restarts = self.store.restarts(self.run_id)
        assert not restarts, f"a healthy trainer was restarted after SIGCONT: {restarts[0].reason}"


@pytest.fixture(scope="module")
def stopped_run(ssh_env, tmp_path_factory):
    with environ(**{SOCKET_ENV: SOCKET}):
        run = StoppedRun(ssh_env, tmp_path_factory.mktemp("stops"))
        try:
            yield run
        finally:
            if run.background.thread.is_alive():
                run.background.close()
            end_trainer(run.run_dir)
            kill_tmux_servers([(ssh_env.inventory.get("target"), ssh_env.inventory, SOCKET)])


def _stops(run: StoppedRun, times: int) -> None:
    run.training()
    pid = read_status(run.run_dir).pid
    stalls_before = len([e for e in kinds(run.store, run.run_id, "stall") if "is stopped" in e.message])
    for _ in range(times):
        run.stop_and_continue(pid)
    time.sleep(2 * INTERVAL)  # one more poll or two after the last continue
    # Running again once it makes a step past the one it stopped at (status.json may be
    # ahead of the stored lines): "making progress again" is never said before that.
    wait_for(lambda: run.store.get_run(run.run_id).state == "running", run.window * 3, "running again", every=0.2)
    assert run.store.restarts(run.run_id) == []
    assert "restarting" not in states(run.store, run.run_id)
    assert read_status(run.run_dir).pid == pid  # the same process trained on
    assert run.store.get_run(run.run_id).state == "running"
    stops = [e for e in kinds(run.store, run.run_id, "stall") if "is stopped" in e.message]
    assert len(stops) - stalls_before == times
    assert not [e for e in kinds(run.store, run.run_id, "stall") if "no new step" in e.message]


def test_a_trainer_stopped_longer_than_the_stall_window_three_times_is_never_restarted(stopped_run):
    _stops(stopped_run, 3)


@pytest.mark.slow
def test_ten_stops_longer_than_the_stall_window_then_continue_zero_restarts(stopped_run):
    _stops(stopped_run, 10)
