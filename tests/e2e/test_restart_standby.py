"""An operator's `restart` of a running run wakes its ready standby after the stop,
as the supervisor's restart of a crash does: the new process pays no import. The
real tiny CPU trainer on the local host, in real tmux; the cold restart against
which this is measured is bench/bench_restart.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from dflashctl.core import contract
from dflashctl.hosts.tmux import SOCKET_ENV
from dflashctl.launch import launch_run
from dflashctl.runs.runhost import restart, standby_session
from dflashctl.supervise.supervisor import Supervisor
from tests.harness import environ
from tests.harness.local import SOCKET, Background, LocalEnv, kill_tmux_servers, kinds, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def local_env(tmp_path):
    """The local host on a private tmux socket."""
    with environ(**{SOCKET_ENV: SOCKET}):
        env = LocalEnv(tmp_path)
        yield env
        kill_tmux_servers([(env.host, env.inventory, SOCKET)])


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def test_an_operator_restart_of_a_running_run_wakes_its_ready_standby(local_env):
    """Defect: `dflashctl restart` of a running run stopped it, and its standby left
    with the stopped trainer (or was killed by the stop), so the new process paid
    the full import (first step 47.8 s against 9.9 s for the supervisor's restart)."""
    env, store = local_env, local_env.store
    pb = env.playbook("warm", {"train": {"steps": 100000, "log_every": 1, "checkpoint_every": 4}}, poll_interval=0.5)
    result = launch_run(pb, env.inventory, store, bundle=env.bundle)
    run = store.get_run(result.run_id)
    run_dir = Path(run.run_dir)
    sup = Supervisor(store, env.inventory, interval=0.5, playbooks_dir=str(env.playbooks))
    sup.attach(run.id)
    background = Background(sup)
    try:
        token = wait_for(lambda: kinds(store, run.id, "standby"), 120, "the standby's start")[0].detail["token"]
        ready = wait_for(lambda: (_json(run_dir / contract.STANDBY_FILE) or {}).get("token") == token
                         and _json(run_dir / contract.STANDBY_FILE), 120, "the standby's imports")
        wait_for(lambda: list((run_dir / contract.CHECKPOINT_DIR).glob("step-*")), 120, "a checkpoint")
        background.close()  # the operator restarts it now
        old = _json(run_dir / contract.STATUS_FILE)["pid"]
        said: list[str] = []
        t0 = time.time()
        assert restart(run.id, store, env.inventory, progress=lambda step, text: said.append(text)) == "running"
        status = wait_for(lambda: (s := _json(run_dir / contract.STATUS_FILE)) and s.get("pid") == ready["pid"]
                          and "startup_s" in (s.get("detail") or {}) and s, 120, "the woken standby's first step")
        first_step_s = time.time() - t0
        assert status["pid"] != old and env.tmux.has_session(run.tmux_session)
        assert not env.tmux.has_session(standby_session(run.tmux_session))  # its session became the run's
        startup = status["detail"]["startup_s"]
        assert startup["import"] < 1.0 < ready["import_s"], (startup, ready)  # the imports were paid before
        [woke] = [e for e in kinds(store, run.id, "process") if (e.detail or {}).get("standby") == token]
        assert any(f"standby {token} is ready" in s for s in said), said
        assert not (run_dir / contract.standby_hold(token)).exists()  # released
        states = [e.detail["to"] for e in kinds(store, run.id, "state")]
        assert states[-2:] == ["restarting", "running"] and "stopped" not in states  # never stopped on the way
        print(f"operator restart with a ready standby: first step after {first_step_s:.1f} s, "
              f"imports {startup['import']:.2f} s (the standby's own imports: {ready['import_s']:.1f} s)")
    finally:
        if background.thread.is_alive():
            background.close()
        env.tmux.kill(run.tmux_session)
        env.tmux.kill(standby_session(run.tmux_session))
