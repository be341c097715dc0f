"""The standby trainer: a process that has done a start's imports and waits to be
the next restart's trainer (trainer/standby.py), as a real process, then as the
supervisor uses it (local host, real tmux, the tiny CPU trainer)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from dflashctl.core import contract
from dflashctl.hosts.tmux import SOCKET_ENV
from dflashctl.launch import launch_run
from dflashctl.runs.runhost import standby_session
from dflashctl.supervise.supervisor import Supervisor
from tests.harness import environ
from tests.harness.local import SOCKET, Background, LocalEnv, kill_tmux_servers, kinds, wait_for

pytestmark = pytest.mark.slow


def _ready(run_dir: str) -> dict | None:
    try:
        return json.loads(Path(run_dir, contract.STANDBY_FILE).read_text())
    except (OSError, ValueError):
        return None


@pytest.fixture
def local_env(tmp_path):
    with environ(**{SOCKET_ENV: SOCKET}):
        env = LocalEnv(tmp_path)
        yield env
        kill_tmux_servers([(env.host, env.inventory, SOCKET)])


def test_a_crash_is_restarted_by_waking_the_standby(local_env):
    env, store = local_env, local_env.store
    pb = env.playbook("standby", {"train": {"steps": 100000, "log_every": 1, "checkpoint_every": 4}},
                      poll_interval=0.5)
    result = launch_run(pb, env.inventory, store, bundle=env.bundle)
    run = store.get_run(result.run_id)
    sup = Supervisor(store, env.inventory, interval=0.5, playbooks_dir=str(env.playbooks))
    sup.attach(run.id)
    background = Background(sup)
    try:
        started = wait_for(lambda: kinds(store, run.id, "standby"), 120, "the standby's start")[0]
        token = started.detail["token"]
        ready = wait_for(lambda: (_ready(run.run_dir) or {}).get("token") == token and _ready(run.run_dir), 120,
                         "the standby's imports")
        assert env.tmux.has_session(standby_session(run.tmux_session))
        wait_for(lambda: any(p.name.startswith("step-") for p in Path(run.run_dir, contract.CHECKPOINT_DIR).glob("*")),
                 120, "a checkpoint")
        old = json.loads(Path(run.run_dir, contract.STATUS_FILE).read_text())["pid"]
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: store.restarts(run.id) and store.restarts(run.id)[0].time_to_first_step_s is not None, 120,
                 "the restarted trainer's first step")
        woke = [e for e in kinds(store, run.id, "process") if (e.detail or {}).get("standby") == token]
        assert woke, [e.message for e in kinds(store, run.id, "process")]
        status = json.loads(Path(run.run_dir, contract.STATUS_FILE).read_text())
        assert status["pid"] == ready["pid"] != old  # the standby is the trainer now, in the run's own session
        assert status["detail"]["startup_s"]["import"] < 1.0, status["detail"]["startup_s"]
        assert env.tmux.has_session(run.tmux_session)
        # The standby that took over trains: its own successor's standby follows.
        wait_for(lambda: len(kinds(store, run.id, "standby")) >= 2, 120, "the next standby")
    finally:
        background.close()
        env.tmux.kill(run.tmux_session)
        env.tmux.kill(standby_session(run.tmux_session))


