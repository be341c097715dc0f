"""`stop` of a run on two hosts while one host's sshd is down: rank 0 on `target2`
(through two jumps), rank 1 on `target` (through the jump and `pct exec`), the fake
trainer on each (tests/harness/fake_trainer.py, ``start_fake_pair``).

The reachable rank is stopped and said; the other is sent nothing, said, and the
record is true: the run is `lost` (a process may still run there), the exit code
says partial (3). Its supervisor keeps trying that host and, once it answers, stops
what runs there; then the run is `stopped`. No host answering: nothing is sent or
recorded."""

from __future__ import annotations

import os
import signal

import pytest

from dflashctl.hosts.tmux import SOCKET_ENV
from dflashctl.store import Store
from dflashctl.supervise.supervisor import Supervisor
from tests.harness import cli, environ
from tests.harness.fake_trainer import start_fake_pair
from tests.harness.local import SOCKET, kill_tmux_servers, kinds, wait_for, write_playbook
from tests.harness.multihost import rank_status

pytestmark = pytest.mark.slow

HOSTS = ["target2", "target"]
INTERVAL = 0.5


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.fixture
def pair_run(ssh_env, tmp_path):
    """A two-host run of the fake trainer, its store and a supervisor attached (not ticking)."""
    with environ(**{SOCKET_ENV: SOCKET}):
        playbooks = tmp_path / "playbooks"
        write_playbook(playbooks, "pair", HOSTS[0], {"train": {"steps": 100000, "log_every": 1}},
                       poll_interval=INTERVAL, expect={"stall_window": 60, "startup_budget": 60})
        store = Store(str(tmp_path / "runs.db"))
        run_id = start_fake_pair(store, ssh_env.inventory, HOSTS, {"train": {"steps": 100000, "log_every": 1}},
                                 playbook="pair", socket=SOCKET)
        sup = Supervisor(store, ssh_env.inventory, interval=INTERVAL, playbooks_dir=str(playbooks))
        sup.attach(run_id)
        dirs = [part.run_dir for part in store.get_run(run_id).parts()]
        try:
            yield store, run_id, sup, dirs, tmp_path
        finally:
            sup.close()
            for name in HOSTS:
                if name not in ssh_env.sshd_pids:
                    ssh_env.start(name)
            kill_tmux_servers([(ssh_env.inventory.get(h), ssh_env.inventory, SOCKET) for h in HOSTS])
            for rank, d in enumerate(dirs):  # test hosts are this machine: these pids are ours
                pid = (rank_status(d, rank) or {}).get("pid")
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)


def _stop(ssh_env, run_id: str, tmp_path) -> object:
    return cli.invoke("stop", run_id, "--timeout", "30",
                      env={"DFLASHCTL_INVENTORY": str(ssh_env.inventory_path),
                           "DFLASHCTL_STORE": str(tmp_path / "runs.db"), SOCKET_ENV: SOCKET})


def test_stop_with_one_rank_host_down_stops_the_other_and_its_supervisor_the_rest(ssh_env, pair_run):
    store, run_id, sup, dirs, tmp_path = pair_run
    wait_for(lambda: store.get_run(run_id).state == "running" and all(rank_status(d, r) for r, d in enumerate(dirs)),
             60, "both ranks running", every=INTERVAL, tick=sup.tick)
    pids = [rank_status(d, r)["pid"] for r, d in enumerate(dirs)]
    ssh_env.stop("target")
    wait_for(lambda: [e for e in kinds(store, run_id, "unreachable") if (e.detail or {}).get("rank") == 1], 30,
             "rank 1's host said unreachable", every=INTERVAL, tick=sup.tick)

    out = _stop(ssh_env, run_id, tmp_path)
    assert out.returncode == 3, out.stdout + out.stderr
    said = out.stdout + out.stderr
    assert "target2 (rank 0): ended: stopped on request" in said, said
    assert "target (rank 1): not stopped, it does not answer" in said and "its supervisor keeps trying" in said
    assert not _alive(pids[0]) and _alive(pids[1])  # only the host that answered was stopped
    run = store.get_run(run_id)
    assert run.state == "lost", run
    [requested] = kinds(store, run_id, "stop_requested")
    assert "not sent to rank 1 on target (it does not answer" in requested.message, requested.message
    lost = [e for e in store.events(run_id) if (e.detail or {}).get("stop_pending") == [1]]
    assert lost and "stopped on target2" in lost[-1].message and lost[-1].severity == "error", lost

    again = cli.invoke("restart", run_id, "--no-watch", env={"DFLASHCTL_INVENTORY": str(ssh_env.inventory_path),
                       "DFLASHCTL_STORE": str(tmp_path / "runs.db"), SOCKET_ENV: SOCKET})
    assert again.returncode == 3 and "not restarted: stopped on the hosts that answer" in again.stderr, again.stderr
    assert store.get_run(run_id).state == "lost" and not _alive(pids[0])  # nothing started while rank 1 may run
    for _ in range(4):  # its host still down: nothing is decided, the run stays lost
        sup.tick()
    assert store.get_run(run_id).state == "lost" and not store.restarts(run_id) and _alive(pids[1])

    ssh_env.start("target")
    wait_for(lambda: store.get_run(run_id).state == "stopped", 90, "the run stopped on every host",
             every=INTERVAL, tick=sup.tick)
    assert not _alive(pids[1])
    messages = [e.message for e in store.events(run_id)]
    assert any("stopping what still runs on the host(s) that answer again: rank 1" in m for m in messages), messages
    assert any("stopped on every host" in m for m in messages)
    assert not store.restarts(run_id)


def test_stop_with_no_host_answering_sends_and_records_nothing(ssh_env, pair_run):
    store, run_id, sup, dirs, tmp_path = pair_run
    wait_for(lambda: store.get_run(run_id).state == "running", 60, "running", every=INTERVAL, tick=sup.tick)
    events_before = len(store.events(run_id))
    ssh_env.stop("target")
    ssh_env.stop("target2")
    out = _stop(ssh_env, run_id, tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "not stopped, nothing was sent: no host of it answers" in out.stderr, out.stderr
    assert store.get_run(run_id).state == "running" and not kinds(store, run_id, "stop_requested")
    assert len(store.events(run_id)) == events_before
    assert all(_alive(rank_status(d, r)["pid"]) for r, d in enumerate(dirs))
