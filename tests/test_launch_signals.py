"""`dflashctl launch --foreground` as a real process: SIGHUP (the terminal or the
ssh connection closed) and SIGTERM hand the run to a background supervisor, as
Ctrl-C does; while it follows, it holds the run's claim like `watch`; its exit
code says how the run ended.

The runs are real launches on the local host whose trainer is the fake one
(tests/harness/fake_trainer.py, started through the launcher's own run.sh): the
inventory's python is a small dispatcher that runs the fake trainer for
``-m trainer`` and the real interpreter for everything else (the probe, the
env-audit). Every tmux server here is on a socket private to this test process
and every process the tests cause is ended by its pid.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket as socketlib
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dflashctl.config import load_inventory
from dflashctl.core import contract
from dflashctl.hosts.tmux import SOCKET_ENV, Tmux
from dflashctl.store import Store
from dflashctl.supervise.supervisor import live_supervisor
from tests.harness import environ
from tests.test_supervisor import wait_for

REPO = Path(__file__).resolve().parent.parent
FAKE_TRAINER = REPO / "tests" / "harness" / "fake_trainer.py"
SOCKET = f"dflash-sig-{os.getpid()}"


def fake_trainer_python(directory: Path) -> str:
    """A host `python` that runs the fake trainer for ``-m trainer`` and this
    interpreter for anything else (the probe, the env-audit)."""
    path = directory / "python-dispatch"
    path.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = "-m" ] && [ "$2" = "trainer" ]; then shift 2; '
        f"exec {shlex.quote(sys.executable)} {shlex.quote(str(FAKE_TRAINER))} \"$@\"; fi\n"
        f'exec {shlex.quote(sys.executable)} "$@"\n'
    )
    path.chmod(0o755)
    return str(path)


class LocalLaunch:
    """An inventory with the local host (the dispatching python), a playbooks
    directory, a store, and the environment for `dflashctl` subprocesses."""

    def __init__(self, root: Path, workdir: Path | None = None):
        self.root = root
        self.workdir = workdir or root / "work"
        self.inventory_path = root / "inventory.yaml"
        self.inventory_path.write_text(yaml.safe_dump({"hosts": {"local": {
            "transport": "local", "workdir": str(self.workdir), "python": fake_trainer_python(root)}}}))
        self.inventory = load_inventory(str(self.inventory_path))
        self.playbooks = root / "playbooks"
        self.playbooks.mkdir(exist_ok=True)
        self.store_path = str(root / "runs.db")
        self.env = {**os.environ, "DFLASHCTL_STORE": self.store_path, SOCKET_ENV: SOCKET}
        for name in ("DFLASHCTL_INVENTORY", "DFLASHCTL_PLAYBOOKS", "DFLASHCTL_DEBUG", "TMUX"):
            self.env.pop(name, None)

    def playbook(self, name: str, train: dict, fault: dict | None = None) -> str:
        raw = {
            "host": "local",
            "trainer": {
                "model": {"preset": "tiny"},
                "data": {"buckets": [256], "batch_size": 1, "max_anchors": 16},
                "placement": {"device": "cpu", "target": [0], "drafter": [0]},
                "train": train,
                **({"fault": fault} if fault else {}),
            },
            "compile_cache": None,
            "poll_interval": 0.2,
            "restart": {"backoff_initial": 0.05, "backoff_max": 0.1, "jitter": 0},
        }
        (self.playbooks / f"{name}.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
        return name

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "dflashctl", "-i", str(self.inventory_path), "-p", str(self.playbooks), *args]

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(*args), capture_output=True, text=True, env=self.env, cwd=str(REPO),
                              timeout=timeout)

    def popen(self, *args: str, output: Path) -> subprocess.Popen:
        with open(output, "w") as f:
            return subprocess.Popen(self.argv(*args), stdout=f, stderr=subprocess.STDOUT, env=self.env,
                                    cwd=str(REPO), start_new_session=True)


def trainer_pid(run_dir: str, other_than: int | None = None) -> int | None:
    try:
        status = contract.parse_status(Path(run_dir, contract.STATUS_FILE).read_text())  # never raises
    except FileNotFoundError:
        return None
    return status.pid if status and status.pid and status.pid != other_than else None


def end(pid: int | None) -> None:
    """End a process this test caused, by its pid."""
    if not pid:
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module", autouse=True)
def private_tmux_socket():
    with environ(**{SOCKET_ENV: SOCKET}):
        yield
        host = load_inventory(None).get("local")
        try:
            pid = Tmux(host, load_inventory(None), SOCKET).server_pid()
        except Exception:  # noqa: BLE001  (never started)
            pid = None
        if pid:  # this test's own tmux server, on its private socket
            os.kill(pid, signal.SIGTERM)
        local_socket = Path(os.environ.get("TMUX_TMPDIR") or "/tmp") / f"tmux-{os.getuid()}" / SOCKET
        local_socket.unlink(missing_ok=True)


@pytest.fixture
def local(tmp_path):
    return LocalLaunch(tmp_path)


def _the_run(store: Store):
    runs = store.list_runs()
    return runs[0] if runs else None


# --------------------------------------------------------------------------- hand-over


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGTERM, signal.SIGINT], ids=["SIGHUP", "SIGTERM", "SIGINT"])
def test_a_signal_to_launch_foreground_hands_the_run_to_a_background_supervisor(local, tmp_path, signum):
    name = local.playbook("handed", {"steps": 100000, "log_every": 2, "checkpoint_every": 4})
    output = tmp_path / "launch.out"
    launch = local.popen("launch", name, "--foreground", output=output)
    store = Store(local.store_path)
    watch_pid = run = None
    try:
        run = wait_for(lambda: _the_run(store) if os.path.exists(local.store_path) else None, 60, "the run recorded")
        wait_for(lambda: (store.get_run(run.id).supervisor or {}).get("pid") == launch.pid, 60,
                 "launch --foreground to supervise the run")
        wait_for(lambda: store.get_run(run.id).state == "running", 30, "the run running")

        # While it follows, the launch holds the run's claim: a `watch` is refused.
        claim = store.get_run(run.id).supervisor
        assert live_supervisor(claim) == claim
        second = local.cli("watch", run.id, "--interval", "0.2", timeout=60)
        assert second.returncode != 0 and f"already supervised by pid {launch.pid}" in second.stderr, second.stderr
        assert (store.get_run(run.id).supervisor or {}).get("pid") == launch.pid

        launch.send_signal(signum)
        assert launch.wait(60) == 0, output.read_text()
        text = output.read_text()
        assert f"detached ({signal.Signals(signum).name}); the run goes on, supervised in local tmux session " \
               f"watch-{run.id}" in text, text
        assert "Traceback" not in text

        # Supervised afterwards: a live `watch` process, recorded on the run.
        def background():
            info = store.get_run(run.id).supervisor or {}
            return info if info.get("pid") not in (None, launch.pid) and live_supervisor(info) else None

        info = wait_for(background, 30, "a background supervisor with a live pid on the run")
        watch_pid = info["pid"]
        assert info["session"] == f"watch-{run.id}" and info["host"] == socketlib.gethostname()
        with open(f"/proc/{watch_pid}/cmdline", "rb") as f:
            assert b"watch" in f.read().split(b"\0")
        assert store.get_run(run.id).state == "running"

        # ... and it acts: a killed trainer is restarted by that supervisor.
        first = wait_for(lambda: trainer_pid(run.run_dir), 20, "the trainer's pid")
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: [r for r in store.restarts(run.id) if r.outcome == "issued"], 30, "a restart issued")
        second_pid = wait_for(lambda: trainer_pid(run.run_dir, other_than=first), 30, "the restarted trainer")
        assert second_pid != first
        wait_for(lambda: store.get_run(run.id).state == "running", 30, "the run running again")
        crash = store.events(run.id, kind="crash")
        assert crash and crash[-1].detail["signature"] == "killed_by_signal"
        assert (store.get_run(run.id).supervisor or {}).get("pid") == watch_pid
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait()
        if watch_pid is None and run is not None:
            watch_pid = (store.get_run(run.id).supervisor or {}).get("pid")
        if watch_pid and watch_pid != launch.pid:
            end(watch_pid)
        if run is not None:
            end(trainer_pid(run.run_dir))
            Tmux(local.inventory.get("local"), local.inventory, SOCKET).kill(run.id)


# --------------------------------------------------------------------------- exit code


@pytest.mark.parametrize("ending, code", [("done", 0), ("failed", 1)])
def test_launch_foreground_exits_non_zero_when_the_run_fails(local, ending, code):
    # Past the launch's own wait (about 2 s of steps): the end is the follower's to see.
    fault = {"kind": "exit", "after_steps": 40, "exit_code": 3, "message": "shard 7 is corrupt"}
    name = local.playbook(f"ends-{ending}", {"steps": 40 if ending == "done" else 1000, "log_every": 1,
                                             "checkpoint_every": 4}, fault=fault if ending == "failed" else None)
    done = local.cli("launch", name, "--foreground", timeout=180)
    store = Store(local.store_path)
    run = store.list_runs()[0]
    assert run.state == ending, done.stdout + done.stderr
    assert "trainer running" in done.stderr  # the launch saw it start: the follower saw it end
    assert done.returncode == code, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert run.supervisor is None  # released at the end
