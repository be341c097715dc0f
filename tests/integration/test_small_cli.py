"""Smaller defects of the command line, each on real parts: a stop whose end its
supervisor recorded first, `advise` on a CPU run and on a run with no metrics, and
DFLASHCTL_HOME holding a local run's compile cache. Fake-trainer and tiny-trainer
runs on the local host in real tmux; a real SQLite store."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from dflashctl.core import contract
from dflashctl.hosts.tmux import SOCKET_ENV
from dflashctl.runs.runhost import stop
from tests.harness import cli as dflashctl
from tests.harness import environ
from tests.harness.local import REPO, SOCKET, LocalEnv, kill_tmux_servers, metrics_lines, wait_for


@pytest.fixture
def local_env(tmp_path):
    env = LocalEnv(tmp_path)
    yield env
    kill_tmux_servers([(env.host, env.inventory, SOCKET)])


def _cli(env: LocalEnv, *args: str) -> subprocess.CompletedProcess:
    """The command in this process, as an operator runs it on this host (tests/harness/cli.py)."""
    return dflashctl.invoke("-i", str(env.inventory_path), "-p", str(env.playbooks), *args, cwd=REPO,
                            env={"DFLASHCTL_STORE": env.store_path, SOCKET_ENV: SOCKET}, columns=200)


def test_a_stop_whose_end_the_supervisor_recorded_first_says_it_stopped_the_run(local_env):
    """Defect: the console's stop dialog said "was already stopped" for the run it had
    just stopped: a supervisor had seen the trainer's exit and recorded it first."""
    env = local_env
    run_id = env.start(env.playbook("watched", {"train": {"steps": 100000, "log_every": 2, "checkpoint_every": 4}}))
    sup = env.supervisor()
    sup.attach(run_id)
    said: list[str] = []

    def progress(step: str, text: str) -> None:
        said.append(text)
        if text.startswith("sent SIGTERM"):  # the supervisor sees the exit before the stop looks again
            exit_code = Path(env.run_dir(run_id), contract.EXIT_CODE_FILE)
            wait_for(lambda: exit_code.exists(), 30, "the trainer's exit")
            wait_for(lambda: env.store.get_run(run_id).state == "stopped", 30, "the supervisor's record", tick=sup.tick)

    try:
        wait_for(lambda: metrics_lines(env.run_dir(run_id)), 30, "metrics", tick=sup.tick)
        sup.tick()
        assert stop(run_id, env.store, env.inventory, progress=progress).state == "stopped"
        assert not any("already" in s for s in said), said
        assert said[-1] == f"run {run_id} stopped (its supervisor recorded the exit first)"
        again = _cli(env, "stop", run_id)  # a stop of a stopped run: that one is "already"
        assert again.returncode == 0 and f"run {run_id} was already stopped" in again.stderr, again.stderr
    finally:
        sup.close()
        env.tmux.kill(run_id)


def test_advise_on_a_cpu_run_and_on_a_run_without_metrics(local_env):
    """Defect: `advise` on a CPU run gave GPU advice ("share all 1 GPUs"; --gpus 8 ->
    "best split 3+5"), and on a run with no metrics printed a raw `tail: cannot open`."""
    env = local_env
    pb = env.playbook("cpu", {"train": {"steps": 100000, "log_every": 1, "checkpoint_every": 1000}})
    run_id = env.start(pb)
    try:
        run_dir = env.run_dir(run_id)
        wait_for(lambda: metrics_lines(run_dir), 30, "metrics")
        env.tmux.kill(run_id)
        # The trainer's own figures of a CPU run (as trainer/train.py writes them on CPU).
        line = metrics_lines(run_dir)[-1]
        extra = {"target_tok_s": [900.0], "target_busy": [0.9], "tok_s_per_drafter": [800.0], "seq_tok_s": [800.0],
                 "step_ms": [50.0], "time_ms": {"wait": [5.0]}, "gpus": {"target": ["cpu"], "drafter": ["cpu"]}}
        m = contract.Metrics(time=time.time(), step=line.step + 1, total_steps=line.total_steps, tokens=1,
                             tok_s=800.0, loss=1.0, phase=contract.PHASE_TRAINING, extra=extra)
        contract.append_line(os.path.join(run_dir, contract.METRICS_FILE), m.to_line())
        for args in ((), ("--gpus", "8")):
            advised = _cli(env, "advise", run_id, *args)
            assert advised.returncode == 2, advised.stdout + advised.stderr
            assert "trained on CPU" in advised.stderr and "GPUs" not in advised.stdout, advised.stdout
        os.remove(os.path.join(run_dir, contract.METRICS_FILE))
        none = _cli(env, "advise", run_id)
        assert none.returncode == 1 and "tail:" not in none.stderr, none.stderr
        assert f"run {run_id} has no metrics yet" in none.stderr and "dflashctl logs" in none.stderr
    finally:
        env.tmux.kill(run_id)


def test_dflashctl_home_holds_a_local_runs_compile_cache(local_env, tmp_path):
    """Defect: with DFLASHCTL_HOME set, a local run still kept its compile cache in
    ~/.cache/dflashctl/compile (the playbook default)."""
    from dflashctl.config import load_playbook
    from dflashctl.launch import launch_run

    env = local_env
    home = tmp_path / "dflashctl-home"
    env.playbooks.mkdir(exist_ok=True)
    named = env.playbooks / "cached.yaml"  # no compile_cache: the playbook default
    named.write_text(yaml.safe_dump({"host": "local", "trainer": {
        "model": {"preset": "tiny"}, "data": {"buckets": [256], "batch_size": 1, "max_anchors": 16},
        "train": {"steps": 3, "log_every": 1, "checkpoint_every": 0},
        "placement": {"device": "cpu", "target": [0], "drafter": [0]}}}))
    pb = load_playbook(str(named), inventory=env.inventory)
    with environ(DFLASHCTL_HOME=str(home), **{SOCKET_ENV: SOCKET}):
        result = launch_run(pb, env.inventory, env.store, bundle=env.bundle, start_timeout=2)
        try:
            run = env.store.get_run(result.run_id)
            wanted = str(home / "cache" / "compile")
            assert run.config["compile_cache"] == wanted and run.config["trainer"]["compile"]["cache_dir"] == wanted
            script = Path(run.run_dir, "run.sh").read_text()
            assert wanted in script and ".cache/dflashctl" not in script
        finally:
            env.tmux.kill(result.run_id)
        # A playbook that names its cache keeps it.
        named.write_text(named.read_text() + f"compile_cache: {tmp_path / 'mine'}\n")
        explicit = load_playbook(str(named), inventory=env.inventory)
        second = launch_run(explicit, env.inventory, env.store, bundle=env.bundle, start_timeout=2, force=True)  # a second run
        try:
            assert env.store.get_run(second.run_id).config["compile_cache"] == str(tmp_path / "mine")
        finally:
            env.tmux.kill(second.run_id)
