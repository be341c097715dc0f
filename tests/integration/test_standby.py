"""A standby counts as ready only while the pid its standby.json names is that
standby (a live process of another kind, a reused pid, or none is not). No trainer
runs here: a sleeping process stands in, in a real tmux session. (The standby as a
process: tests/trainer/test_standby.py; woken by the supervisor:
tests/e2e/test_standby.py.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dflashctl.core import contract
from dflashctl.hosts.tmux import SOCKET_ENV
from dflashctl.runs.runhost import standby_session
from tests.harness import environ
from tests.harness.local import SOCKET, LocalEnv, kill_tmux_servers


@pytest.fixture
def local_env(tmp_path):
    with environ(**{SOCKET_ENV: SOCKET}):
        env = LocalEnv(tmp_path)
        yield env
        kill_tmux_servers([(env.host, env.inventory, SOCKET)])


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


def _stand_in(env, run_dir: str, token: str = "ab12"):
    """A process whose command line is a standby's, named in standby.json, in its tmux session."""
    import subprocess
    import sys

    env.tmux.start(standby_session("r"), "sleep 60")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--run-dir", run_dir,
                             "--standby", token])
    Path(run_dir, contract.STANDBY_FILE).write_text(json.dumps({"pid": proc.pid, "token": token}))
    return proc


def _run(run_dir: str):
    from dflashctl.store import Run

    return Run(id="r", playbook="pb", host="local", state="running", created=0.0, run_dir=run_dir,
               tmux_session="r", tmux_socket=SOCKET)


def test_a_stopped_standby_is_not_ready_and_one_that_does_not_answer_is_replaced(local_env, tmp_path):
    """SIGSTOP on the standby (by anyone who may signal it): a restart must not wake
    it and wait out the start-up budget. Stopped, it is not ready (the restart starts
    afresh); stopped after it was found ready, it does not take its go file within
    seconds, and its session is ended for a fresh start."""
    import signal
    import time

    from dflashctl.runs.runhost import _on_hosts, _ready_standby

    env, run_dir = local_env, str(tmp_path / "runs" / "r")
    os.makedirs(run_dir)
    run = _run(run_dir)
    standby = _stand_in(env, run_dir)
    try:
        assert _ready_standby(run, _on_hosts(run, env.inventory)) == "ab12"
        os.kill(standby.pid, signal.SIGSTOP)
        assert _ready_standby(run, _on_hosts(run, env.inventory)) is None

        # Found ready, then woken: it never takes the go file (this one never looks).
        from dflashctl.runs.standby import STANDBY_ANSWER_S, wake_standby

        os.kill(standby.pid, signal.SIGCONT)
        start = time.monotonic()
        assert wake_standby(_on_hosts(run, env.inventory), "ab12") is False
        assert time.monotonic() - start < STANDBY_ANSWER_S + 10  # seconds, not the start-up budget
        assert not env.tmux.has_session("r") and not env.tmux.has_session(standby_session("r"))
        assert not Path(run_dir, contract.standby_go("ab12")).exists()  # nothing left to wake it later
    finally:
        standby.kill()
        standby.wait()


# A standby's stand-in that takes its go file at once and begins as the trainer would:
# its status names its pid (its command line names the run directory, as the
# trainer's does). It outlives its session's end, as a process that ignores SIGHUP.
_TAKES_ITS_GO = r"""
import json, os, signal, sys, time
run_dir, status, go, went = sys.argv[1:5]
signal.signal(signal.SIGHUP, signal.SIG_IGN)
while not os.path.exists(os.path.join(run_dir, go)):
    time.sleep(0.05)
os.rename(os.path.join(run_dir, go), os.path.join(run_dir, went))
with open(os.path.join(run_dir, status + ".tmp"), "w") as f:
    json.dump({"phase": "starting", "pid": os.getpid(), "step": 0}, f)
os.rename(os.path.join(run_dir, status + ".tmp"), os.path.join(run_dir, status))
time.sleep(120)
"""


def test_a_standby_that_took_over_on_one_host_only_is_ended_with_its_status_before_a_fresh_start(local_env, tmp_path):
    """Rank 1's standby takes its go file and begins as the trainer; rank 0's never
    answers. The restart starts afresh on both hosts: rank 1's process must be gone
    first and its status with it, or the supervisor, probing between the restart and
    the fresh process's own status, reads that process's end as the new one's."""
    import shlex
    import sys

    from dflashctl.runs.runhost import _end_woken, _on_hosts
    from dflashctl.runs.standby import wake_standby
    from dflashctl.store import Run

    env, token = local_env, "ab12"
    dirs = [str(tmp_path / "runs" / f"r{rank}") for rank in (0, 1)]
    for d in dirs:
        os.makedirs(d)
    run = Run(id="r", playbook="pb", host="local", state="restarting", created=0.0, run_dir=dirs[0],
              tmux_session="r", tmux_socket=SOCKET,
              hosts=[{"rank": r, "host": "local", "run_dir": dirs[r], "tmux_session": f"r-r{r}"} for r in (0, 1)])
    env.tmux.start(standby_session("r-r0"), "sleep 120")  # never looks for its go file
    status = contract.status_file(1)
    env.tmux.start(standby_session("r-r1"), shlex.join(
        [sys.executable, "-c", _TAKES_ITS_GO, dirs[1], status, contract.standby_go(token), contract.standby_went(token)]))
    parts = _on_hosts(run, env.inventory)
    assert wake_standby(parts, token, answer_s=2.0) is False
    taken = json.loads(Path(dirs[1], status).read_text())  # it began as rank 1's trainer, and outlived its session
    assert os.path.exists(f"/proc/{taken['pid']}")
    _end_woken(run, parts, lambda *a: None)
    assert not os.path.exists(f"/proc/{taken['pid']}") or "Z" in Path(f"/proc/{taken['pid']}/stat").read_text().split()[2]
    assert not Path(dirs[1], status).exists() and not Path(dirs[1], contract.EXIT_CODE_FILE).exists()
