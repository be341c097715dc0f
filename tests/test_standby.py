"""The standby trainer: a process that has done a start's imports and waits to be
the next restart's trainer (trainer/standby.py), as a real process, then as the
supervisor uses it (local host, real tmux, the tiny CPU trainer)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from dflashctl.core import contract
from dflashctl.hosts.tmux import SOCKET_ENV
from dflashctl.launch import launch_run
from dflashctl.runs.runhost import STANDBY_SCRIPT, run_files, standby_session
from dflashctl.supervise.supervisor import Supervisor
from tests.harness import environ
from tests.test_supervisor import SOCKET, Background, LocalEnv, kill_tmux_servers, kinds, wait_for
from tests.test_trainer_run import Trainer, tiny_config

pytestmark = pytest.mark.slow


def _ready(run_dir: str) -> dict | None:
    try:
        return json.loads(Path(run_dir, contract.STANDBY_FILE).read_text())
    except (OSError, ValueError):
        return None


def test_a_standby_imports_waits_and_trains_once_told(tmp_path):
    run_dir = tmp_path / "run"
    t = Trainer(tiny_config(train={"steps": 4, "log_every": 1, "checkpoint_every": 0}), run_dir, "--standby", "t1")
    try:
        ready = wait_for(lambda: _ready(str(run_dir)), 120, "standby.json")
        assert ready["token"] == "t1" and ready["pid"] == t.proc.pid and ready["import_s"] > 0
        time.sleep(1.0)
        assert t.proc.poll() is None and not (run_dir / contract.STATUS_FILE).exists()  # waiting, nothing written
        (run_dir / contract.standby_go("t1")).touch()
        assert t.wait(120) == contract.EXIT_DONE, t.output[-3000:]
    finally:
        if t.proc.poll() is None:
            t.proc.kill()
    assert (run_dir / contract.standby_went("t1")).exists() and "taken over as the trainer" in t.output
    status = json.loads((run_dir / contract.STATUS_FILE).read_text())
    assert status["phase"] == contract.PHASE_DONE and status["pid"] == t.proc.pid
    # Its start counts from the take-over: the imports were paid before.
    assert status["detail"]["startup_s"]["import"] < ready["import_s"]


def test_a_standby_leaves_quietly_when_the_run_is_done_or_it_is_replaced(tmp_path):
    run_dir = tmp_path / "run"
    t = Trainer(tiny_config(), run_dir, "--standby", "t2")
    try:
        wait_for(lambda: _ready(str(run_dir)), 120, "standby.json")
        (run_dir / contract.EXIT_CODE_FILE).write_text(f"{contract.EXIT_DONE}\n")  # the trainer it stood by for finished
        assert t.wait(30) == contract.EXIT_DONE
    finally:
        if t.proc.poll() is None:
            t.proc.kill()
    assert not (run_dir / contract.STATUS_FILE).exists() and not (run_dir / contract.standby_went("t2")).exists()


def test_standby_sh_writes_no_exit_code_unless_its_trainer_took_over():
    config = {"trainer": {"compile": {}}, "python": "python3", "env": {}, "gpus": []}
    script = run_files("r", "/runs/r", config, "sock", session="r", standby="abc")[STANDBY_SCRIPT]
    assert "--standby abc" in script and "rm -f exit_code" not in script
    assert "[ -f standby.abc.went ] && echo $code > exit_code.tmp" in script


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


def test_a_standby_is_ready_only_when_the_pid_it_names_is_that_standby(local_env, tmp_path):
    import subprocess
    import sys

    from dflashctl.runs.runhost import _on_hosts, _ready_standby
    from dflashctl.store import Run

    env, run_dir = local_env, str(tmp_path / "runs" / "r")
    os.makedirs(run_dir)
    run = Run(id="r", playbook="pb", host="local", state="running", created=0.0, run_dir=run_dir,
              tmux_session="r", tmux_socket=SOCKET)
    env.tmux.start(standby_session("r"), "sleep 60")
    standby = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--run-dir", run_dir,
                                "--standby", "ab12"])
    try:
        def claims(pid: int) -> str | None:
            Path(run_dir, contract.STANDBY_FILE).write_text(json.dumps({"pid": pid, "token": "ab12"}))
            return _ready_standby(run, _on_hosts(run, env.inventory))

        assert claims(standby.pid) == "ab12"
        assert claims(os.getpid()) is None  # a live process, but not this run's standby (a reused pid, a lie)
        standby.kill()
        standby.wait()
        assert claims(standby.pid) is None  # gone
    finally:
        if standby.poll() is None:
            standby.kill()
        env.tmux.kill(standby_session("r"))
