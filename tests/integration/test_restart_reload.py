"""`restart` after the playbook changed: it says that it reuses the config recorded
at launch, and `--reload` takes the playbook's trainer section again (validated,
refused when the model shapes or the GPU placement differ). Real fake-trainer runs
on the local host in real tmux, the real CLI, a real SQLite store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from dflashctl.core import contract
from dflashctl.hosts.tmux import SOCKET_ENV
from dflashctl.runs.recorded import prepare
from tests.harness import cli as dflashctl
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


def _rewrite(path: Path, change) -> None:
    raw = yaml.safe_load(path.read_text())
    change(raw)
    path.write_text(yaml.safe_dump(raw))


def test_a_restart_after_a_playbook_change_says_so_and_reload_takes_it(local_env):
    """Defect: a restart after a playbook change silently reused the recorded config
    (a fix made in the playbook never reached the run), and nothing took it again."""
    env = local_env
    pb = env.playbook("edited", {"train": {"steps": 100000, "log_every": 2, "checkpoint_every": 4}})
    run_id = env.start(pb)
    source = Path(pb.source)
    try:
        wait_for(lambda: metrics_lines(env.run_dir(run_id)), 30, "metrics")
        _rewrite(source, lambda raw: raw["trainer"]["train"].update(steps=200000))
        again = _cli(env, "restart", run_id, "--no-watch")
        assert again.returncode == 0, again.stderr
        assert "changed since the launch (trainer.train.steps: 100000 -> 200000)" in again.stderr
        assert "reuses the config recorded at launch" in again.stderr and f"restart {run_id} --reload" in again.stderr
        on_host = json.loads(Path(env.run_dir(run_id), contract.CONFIG_FILE).read_text())
        assert on_host["train"]["steps"] == 100000

        _rewrite(source, lambda raw: raw["trainer"].setdefault("model", {}).update(drafter_layers=7))
        refused = _cli(env, "restart", run_id, "--no-watch", "--reload")
        assert refused.returncode == 2 and "trainer.model.drafter_layers" in refused.stderr, refused.stderr
        assert env.store.get_run(run_id).config["trainer"]["train"]["steps"] == 100000  # nothing taken
        assert env.store.get_run(run_id).state == "running"  # and nothing stopped

        _rewrite(source, lambda raw: raw["trainer"]["model"].pop("drafter_layers"))
        taken = _cli(env, "restart", run_id, "--no-watch", "--reload")
        assert taken.returncode == 0, taken.stderr
        assert "trainer.train.steps: 100000 -> 200000" in taken.stderr and "took" in taken.stderr
        assert env.store.get_run(run_id).config["trainer"]["train"]["steps"] == 200000
        on_host = json.loads(Path(env.run_dir(run_id), contract.CONFIG_FILE).read_text())
        assert on_host["train"]["steps"] == 200000  # the new process reads it
        [event] = env.store.events(run_id, kind="config")
        assert event.detail["changes"] == [{"key": "train.steps", "from": 100000, "to": 200000}]
        # No secrets in the playbook nor the run: a reload has none to write, so its
        # restart keeps the one-round-trip path and may wake the run's standby.
        assert prepare(env.store.get_run(run_id), env.store, env.inventory, str(env.playbooks), True,
                       lambda *said: None, 0.0) is None
    finally:
        env.tmux.kill(run_id)


def test_after_an_operators_restart_a_crash_quotes_only_its_own_attempts_error(local_env):
    """trainer.log keeps every attempt: the error the process before an operator's
    restart ended with is never quoted as the next crash's (a kill -9 prints nothing)."""
    from dflashctl.runs.runhost import host_transport, probe_run
    from dflashctl.supervise.detectors import detect_crash

    env = local_env
    earlier = "RuntimeError: the earlier attempt failed at step 2"
    pb = env.playbook("quoted", {"train": {"steps": 100000, "log_every": 1, "checkpoint_every": 2},
                                 "fault": {"kind": "exit", "after_steps": 2, "exit_code": 1,
                                           "message": 'Traceback (most recent call last):\n  File "t.py", line 1, '
                                                      f"in step\n{earlier}"}})
    run_id = env.start(pb)
    try:
        wait_for(lambda: Path(env.run_dir(run_id), contract.EXIT_CODE_FILE).exists(), 30, "the injected failure")
        first = env.trainer_pid(run_id)
        again = _cli(env, "restart", run_id, "--no-watch")
        assert again.returncode == 0, again.stderr
        pid = env.trainer_pid(run_id, other_than=first)
        wait_for(lambda: len(metrics_lines(env.run_dir(run_id))) > 3, 30, "the restarted process's steps")
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: Path(env.run_dir(run_id), contract.EXIT_CODE_FILE).exists(), 30, "run.sh's exit code")
        run = env.store.get_run(run_id)
        probe = probe_run(host_transport(run.host, env.inventory), run)
        assert earlier in probe.log_tail  # still in the file
        crash = detect_crash(probe)
        assert crash is not None and "earlier attempt" not in crash.message and crash.detail["exception"] is None, crash
    finally:
        env.tmux.kill(run_id)
