"""One run on two hosts, end to end over the sshd harness: rank 0 on ``target2``
(behind two jump hosts), rank 1 on ``target`` (behind the jump, inside the ``pct
exec`` wrapper). The tiny CPU trainer runs as one torch.distributed process per
host (gloo, env:// rendezvous on rank 0's host); a SIGKILL of rank 1's process is
seen on its host, confirmed by rank 0's failure naming it, and the whole run is
restarted on both hosts from the checkpoint and finishes."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import yaml

from dflashctl.config import load_playbook
from dflashctl.core import contract
from dflashctl.hosts.bundle import build_bundle
from dflashctl.hosts.tmux import SOCKET_ENV
from dflashctl.launch import launch_run
from dflashctl.runs.runhost import logs, stop
from dflashctl.store import Store
from dflashctl.supervise.supervisor import Supervisor
from tests.harness import environ, free_port
from tests.test_supervisor import SOCKET, Background, kill_tmux_servers, kinds, states, wait_for

pytestmark = pytest.mark.slow

HOSTS = ["target2", "target"]
INTERVAL = 0.5
STEPS = 40


def _status(run_dir: str, rank: int) -> dict | None:
    try:
        with open(os.path.join(run_dir, contract.status_file(rank))) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _checkpoints(run_dir: str) -> list[int]:
    return sorted(int(p.name[5:]) for p in Path(run_dir, contract.CHECKPOINT_DIR).glob("step-*") if p.name[5:].isdigit())


def _playbook(directory: Path, port: int) -> Path:
    raw = {
        "hosts": HOSTS,
        "rendezvous": {"port": port},
        "trainer": {
            "model": {"preset": "tiny", "drafter_layers": 2, "block_size": 8},
            "data": {"buckets": [128], "batch_size": 1, "max_anchors": 16, "synthetic_samples": 64},
            "placement": {"device": "cpu", "target": [0], "drafter": [0]},
            "train": {"steps": STEPS, "log_every": 1, "checkpoint_every": 5},
            "distributed": {"timeout": 20},
        },
        "compile_cache": None,
        "poll_interval": INTERVAL,
        "expect": {"stall_window": 60, "startup_budget": 120},
        "restart": {"backoff_initial": 0.2, "backoff_max": 1, "jitter": 0},
    }
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "pair.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.fixture
def pair(ssh_env, tmp_path):
    with environ(**{SOCKET_ENV: SOCKET}):
        store = Store(str(tmp_path / "runs.db"))
        path = _playbook(tmp_path / "playbooks", free_port("127.0.0.1"))
        yield store, load_playbook(str(path), inventory=ssh_env.inventory), str(tmp_path / "playbooks")
        for run in store.list_runs():
            for part in run.hosts:  # test hosts are this machine: these pids are ours
                status = _status(part["run_dir"], part["rank"])
                if status and status.get("pid"):
                    try:
                        os.kill(status["pid"], signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        kill_tmux_servers([(ssh_env.inventory.get(h), ssh_env.inventory, SOCKET) for h in HOSTS])


def test_a_run_on_two_hosts_survives_a_killed_rank_and_finishes(ssh_env, pair):
    store, playbook, playbooks_dir = pair
    result = launch_run(playbook, ssh_env.inventory, store, bundle=build_bundle())
    assert result.state == "running", result
    run = store.get_run(result.run_id)
    assert [(h["rank"], h["host"]) for h in run.hosts] == [(0, "target2"), (1, "target")]
    assert run.host == "target2" and run.hosts[1]["tmux_session"] == f"{run.id}-r1"
    dirs = [h["run_dir"] for h in run.hosts]
    assert dirs[0] != dirs[1]  # each host's own workdir

    sup = Supervisor(store, ssh_env.inventory, interval=INTERVAL, playbooks_dir=playbooks_dir)
    sup.attach(run.id)
    background = Background(sup)
    try:
        wait_for(lambda: _checkpoints(dirs[0]) and (_status(dirs[1], 1) or {}).get("step", 0) >= 7, 180,
                 "a checkpoint and rank 1 past it")
        rows = store.get_run(run.id).hosts
        assert all(r["seen"] is not None and r["alive"] for r in rows), rows  # both hosts polled
        pid = _status(dirs[1], 1)["pid"]
        os.kill(pid, signal.SIGKILL)

        ended = wait_for(lambda: kinds(store, run.id, "rank"), 15, "rank 1's end, seen on its host")[0]
        assert ended.detail["host"] == "target" and ended.detail["rank"] == 1
        crash = wait_for(lambda: kinds(store, run.id, "crash"), 60, "rank 0's failure")[0]
        assert crash.detail["host"] == "target" and crash.detail["rank"] == 1, crash
        assert "[host target, rank 1" in crash.message and crash.detail["signature"] == "rank_failed"
        wait_for(lambda: store.restarts(run.id) and store.restarts(run.id)[0].time_to_first_step_s is not None, 180,
                 "the restarted run's first step")
        restart = store.restarts(run.id)[0]
        assert restart.action == "restart" and restart.step_after > _checkpoints(dirs[0])[0] - 1
        assert (_status(dirs[1], 1) or {}).get("pid") != pid  # rank 1 runs again on its host
        wait_for(lambda: store.get_run(run.id).state == "done", 240, "the run to finish")
    finally:
        background.close()
    final = store.get_run(run.id)
    assert states(store, run.id)[-4:] == ["running", "restarting", "running", "done"]
    ranks = kinds(store, run.id, "rank")
    assert len(ranks) == 1, [(e.time, e.message, e.detail) for e in ranks]  # the end of the run is no rank's failure
    assert [(h["host"], h["step"]) for h in final.hosts] == [("target2", STEPS), ("target", STEPS)], final.hosts
    assert max(s.step for s in store.samples(run.id)) == STEPS
    # Both hosts' logs, each line named by its host; one host's alone.
    text = "".join(logs(run.id, store, ssh_env.inventory, n=400))
    assert "[target2] " in text and "[target] " in text and "distributed: rank 1 of 2" in text
    only = "".join(logs(run.id, store, ssh_env.inventory, n=400, host="target"))
    assert "distributed: rank 1 of 2" in only and "[target" not in only


def test_stop_ends_the_process_on_every_host_with_a_checkpoint(ssh_env, pair):
    store, playbook, _ = pair
    result = launch_run(playbook, ssh_env.inventory, store, bundle=build_bundle())
    run = store.get_run(result.run_id)
    dirs = [h["run_dir"] for h in run.hosts]
    wait_for(lambda: all((_status(d, r) or {}).get("step", 0) >= 2 for r, d in enumerate(dirs)), 180,
             "both ranks past step 2")
    said = []
    stopped = stop(run.id, store, ssh_env.inventory, progress=lambda step, message: said.append(message))
    assert stopped.state == "stopped", said
    # Rank 1 stops with rank 0, so by its turn it may be gone already (then its pane gets Ctrl-C).
    assert any("on target2" in m for m in said) and any("on target " in m or "on target;" in m for m in said), said
    for rank, d in enumerate(dirs):  # each host's process checkpointed and exited as stopped
        assert _status(d, rank)["phase"] == contract.PHASE_STOPPED, (
            _status(d, rank), Path(d, contract.LOG_FILE).read_text()[-3000:])
        assert Path(d, contract.EXIT_CODE_FILE).read_text().strip() == str(contract.EXIT_STOPPED)
    assert _checkpoints(dirs[0])[-1] == _status(dirs[0], 0)["step"]  # the last one: where they stopped


def test_a_start_that_fails_on_one_host_leaves_no_process_waiting_on_the_others(tmp_path, monkeypatch):
    from dflashctl.config import load_inventory
    from dflashctl.core.errors import DflashError
    from dflashctl.hosts.tmux import Tmux, TmuxError

    (tmp_path / "inventory.yaml").write_text(yaml.safe_dump({"hosts": {
        "one": {"transport": "local", "workdir": str(tmp_path / "w1")},
        "two": {"transport": "local", "workdir": str(tmp_path / "w2")}}}))
    inventory = load_inventory(str(tmp_path / "inventory.yaml"))
    path = _playbook(tmp_path / "playbooks", free_port("127.0.0.1"))
    path.write_text(path.read_text().replace("- target2\n- target\n", "- one\n- two\n"))
    playbook = load_playbook(str(path), inventory=inventory)
    real_start = Tmux.start

    def start(self, name, command, cwd=None):
        # Stands in for a tmux that fails on the second host only (a real one cannot be
        # made to fail for one of two hosts of this machine): the first start is real.
        if name.endswith("-r1"):
            raise TmuxError("two: could not start tmux session (no server)")
        return real_start(self, name, command, cwd)

    monkeypatch.setattr(Tmux, "start", start)
    store = Store(str(tmp_path / "runs.db"))
    with environ(**{SOCKET_ENV: SOCKET}):
        with pytest.raises(DflashError, match="could not start tmux session"):
            launch_run(playbook, inventory, store, bundle=build_bundle())
        [run] = store.list_runs()
        tmux = Tmux(inventory.get("one"), inventory, SOCKET)
        try:
            assert run.state == "failed" and "launch failed" in run.exit_reason
            assert not tmux.has_session(run.id)  # rank 0's session, started, was ended again
        finally:
            tmux.kill(run.id)


def test_a_dry_run_on_two_hosts_shows_each_hosts_run_files_and_changes_nothing(tmp_path):
    import subprocess
    import sys

    (tmp_path / "inventory.yaml").write_text(yaml.safe_dump({
        "hosts": {"one": {"transport": "local", "workdir": str(tmp_path / "w1")},
                  "two": {"transport": "local", "workdir": str(tmp_path / "w2")}},
        "groups": {"pair": ["one", "two"]}}))
    path = _playbook(tmp_path / "playbooks", 29517)
    path.write_text(path.read_text().replace("- target2\n- target\n", "- pair\n"))
    env = {**{k: v for k, v in os.environ.items() if k not in ("DFLASHCTL_INVENTORY", "DFLASHCTL_PLAYBOOKS")},
           "DFLASHCTL_STORE": str(tmp_path / "runs.db"), SOCKET_ENV: SOCKET}
    out = subprocess.run([sys.executable, "-m", "dflashctl", "launch", "pair", "--dry-run"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    text = out.stderr
    for needle in ("env-audit of one", "env-audit of two", "would check that port 29517 is free on one",
                   "rendezvous at 127.0.0.1:29517 (rank 0 on one); 2 processes", "export RANK=1", "export WORLD_SIZE=2",
                   "export DFLASHCTL_HOST=two", "rm -f exit_code status.rank1.json", "-r1 on two"):
        assert needle in text, needle
    assert not (tmp_path / "runs.db").exists() and not (tmp_path / "w1").exists() and not (tmp_path / "w2").exists()
