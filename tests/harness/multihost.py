"""One run on two hosts of the sshd harness: rank 0 on ``target2`` (behind two
jump hosts), rank 1 on ``target`` (behind the jump, inside the ``pct exec``
wrapper), the tiny CPU trainer as one torch.distributed process per host (gloo,
env:// rendezvous on rank 0's host). The ``pair`` fixture: a store, the playbook
(loaded) and its directory; at its end every rank's process and the tmux servers on
both hosts are ended by their pids."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import yaml

from dflashctl.config import load_playbook
from dflashctl.core import contract
from dflashctl.hosts.tmux import SOCKET_ENV
from dflashctl.store import Store
from tests.harness import environ, free_port
from tests.harness.local import SOCKET, kill_tmux_servers

HOSTS = ["target2", "target"]
INTERVAL = 0.5
STEPS = 40


def rank_status(run_dir: str, rank: int) -> dict | None:
    try:
        with open(os.path.join(run_dir, contract.status_file(rank))) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def checkpoint_steps(run_dir: str) -> list[int]:
    return sorted(int(p.name[5:]) for p in Path(run_dir, contract.CHECKPOINT_DIR).glob("step-*") if p.name[5:].isdigit())


def pair_playbook(directory: Path, port: int) -> Path:
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
        path = pair_playbook(tmp_path / "playbooks", free_port("127.0.0.1"))
        yield store, load_playbook(str(path), inventory=ssh_env.inventory), str(tmp_path / "playbooks")
        for run in store.list_runs():
            for part in run.hosts:  # test hosts are this machine: these pids are ours
                status = rank_status(part["run_dir"], part["rank"])
                if status and status.get("pid"):
                    try:
                        os.kill(status["pid"], signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        kill_tmux_servers([(ssh_env.inventory.get(h), ssh_env.inventory, SOCKET) for h in HOSTS])
