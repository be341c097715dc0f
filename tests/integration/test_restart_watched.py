"""`dflashctl restart` of a running run that a foreground `watch` supervises, through
the jump host and the `pct exec` wrapper (host `target`), the fake trainer with its
standby (tests/harness/fake_trainer.py).

The restart keeps the ready standby through its stop and wakes it: its pid is the
one that trains after. The run is `restarting` from the request to the new
process, never `stopped` on the way, so the watch neither ends the standby nor
exits; it keeps watching the new process (and starts its successor's standby).
A supervisor that re-attaches finds the waiting standby and keeps it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from dflashctl.config import load_playbook
from dflashctl.hosts.tmux import SOCKET_ENV
from dflashctl.store import Store
from dflashctl.supervise.supervisor import Supervisor
from tests.harness import cli
from tests.harness.fake_trainer import start_fake_run
from tests.harness.local import SOCKET, end_trainer, kill_tmux_servers, kinds, wait_for, write_playbook

pytestmark = pytest.mark.slow

INTERVAL = 0.5
TRAIN = {"train": {"steps": 100000, "log_every": 1, "checkpoint_every": 5}}


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@pytest.fixture
def watched(ssh_env, tmp_path):
    """A run of the fake trainer on `target` and the environment a command needs to reach it."""
    playbooks = tmp_path / "playbooks"
    path = write_playbook(playbooks, "warm", "target", TRAIN, poll_interval=INTERVAL,
                          expect={"stall_window": 60, "startup_budget": 60}, restart={"standby": True})
    pb = load_playbook(str(path), inventory=ssh_env.inventory)
    store = Store(str(tmp_path / "runs.db"))
    env = {"DFLASHCTL_INVENTORY": str(ssh_env.inventory_path), "DFLASHCTL_STORE": str(tmp_path / "runs.db"),
           "DFLASHCTL_PLAYBOOKS": str(playbooks), SOCKET_ENV: SOCKET}
    os.environ[SOCKET_ENV] = SOCKET
    run_id = start_fake_run(store, ssh_env.inventory, "target", pb.trainer.to_dict(), playbook=pb.name,
                            playbook_source=pb.source, socket=SOCKET)
    run_dir = Path(ssh_env.workdir("target")) / "runs" / run_id
    try:
        yield store, run_id, run_dir, env, playbooks, ssh_env.inventory
    finally:
        kill_tmux_servers([(ssh_env.inventory.get("target"), ssh_env.inventory, SOCKET)])
        end_trainer(str(run_dir))
        pid = (_json(run_dir / "standby.json") or {}).get("pid")
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.environ.pop(SOCKET_ENV, None)


def _ready_standby(store: Store, run_id: str, run_dir: Path) -> dict:
    token = wait_for(lambda: kinds(store, run_id, "standby"), 60, "the standby's start")[-1].detail["token"]
    return wait_for(lambda: (s := _json(run_dir / "standby.json")) and s.get("token") == token and s, 60,
                    "the standby ready")


def test_restart_under_a_foreground_watch_wakes_the_standby_and_the_watch_goes_on(watched):
    store, run_id, run_dir, env, *_ = watched
    watch = cli.popen("watch", run_id, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: store.get_run(run_id).state == "running", 60, "running")
        ready = _ready_standby(store, run_id, run_dir)
        old = _json(run_dir / "status.json")["pid"]

        out = cli.invoke("restart", run_id, env=env)
        assert out.returncode == 0 and out.stdout.strip().endswith("running"), out.stdout + out.stderr
        assert f"standby {ready['token']} is ready: kept through the stop" in out.stderr, out.stderr
        assert "supervised by pid" in out.stderr  # the watch goes on: no second supervisor
        # Its pid trains: the standby became the trainer, and makes steps.
        status = wait_for(lambda: (s := _json(run_dir / "status.json")) and s.get("pid") == ready["pid"]
                          and (s.get("step") or 0) > 0 and s, 60, "the woken standby training")
        assert status["pid"] != old
        states = [e.detail["to"] for e in kinds(store, run_id, "state")]
        assert "stopped" not in states and states[-2:] == ["restarting", "running"], states
        assert watch.poll() is None, watch.stderr.read() if watch.poll() is not None else ""
        assert (store.get_run(run_id).supervisor or {}).get("pid") == watch.pid
        # The watch starts the next standby for the process that trains now.
        wait_for(lambda: len(kinds(store, run_id, "standby")) >= 2, 60, "the successor's standby")
        assert watch.poll() is None
    finally:
        watch.send_signal(signal.SIGINT)
        try:
            watch.wait(timeout=30)
        except subprocess.TimeoutExpired:
            watch.kill()
            watch.wait()


def test_a_supervisor_that_reattaches_keeps_the_waiting_standby(watched):
    store, run_id, run_dir, _, playbooks, inventory = watched
    first = Supervisor(store, inventory, interval=INTERVAL, playbooks_dir=str(playbooks))
    first.attach(run_id)
    try:
        wait_for(lambda: store.get_run(run_id).state == "running", 60, "running", every=INTERVAL, tick=first.tick)
        ready = wait_for(lambda: kinds(store, run_id, "standby") and _json(run_dir / "standby.json"), 60,
                         "the standby ready", every=INTERVAL, tick=first.tick)
    finally:
        first.close()
    store.set_supervisor(run_id, None)
    again = Supervisor(store, inventory, interval=INTERVAL, playbooks_dir=str(playbooks))
    again.attach(run_id)
    try:
        kept = wait_for(lambda: [e for e in kinds(store, run_id, "standby") if "found waiting" in e.message], 30,
                        "the waiting standby kept", every=INTERVAL, tick=again.tick)
        assert kept[0].detail["pid"] == ready["pid"]
        for _ in range(4):
            again.tick()
        assert len([e for e in kinds(store, run_id, "standby") if "started" in e.message]) == 1
        assert (_json(run_dir / "standby.json") or {}).get("pid") == ready["pid"]
    finally:
        again.close()
