"""Real launches on the local host whose trainer is the fake one
(tests/harness/fake_trainer.py, started through the launcher's own run.sh): the
inventory's python is a small dispatcher that runs the fake trainer for ``-m
trainer`` and the real interpreter for everything else (the probe, the env-audit).

``LocalLaunch``: that inventory, a playbooks directory and a store, with the command
line run in this process (``invoke``) or as a real process (``cli``, ``popen``).
Every tmux server is on a socket private to this test process (``SOCKET``; the
``launch_tmux_socket`` fixture, module scope, ends it by its pid), and every
process a test causes is ended by its pid (``end``).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflashctl.config import load_inventory
from dflashctl.core import contract
from dflashctl.hosts.tmux import SOCKET_ENV, Tmux
from tests.harness import cli as dflashctl
from tests.harness import environ
from tests.harness.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
FAKE_TRAINER = REPO / "tests" / "harness" / "fake_trainer.py"
SOCKET = f"dflash-sig-{os.getpid()}"
_UNSET = ("DFLASHCTL_INVENTORY", "DFLASHCTL_PLAYBOOKS", "DFLASHCTL_DEBUG", "TMUX")


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
    directory, a store, and the environment for `dflashctl`."""

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
        self.changes = {"DFLASHCTL_STORE": self.store_path, SOCKET_ENV: SOCKET, **{name: None for name in _UNSET}}
        self.env = dflashctl.environment(self.changes)

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
        return dflashctl.argv("-i", str(self.inventory_path), "-p", str(self.playbooks), *args)

    def invoke(self, *args: str) -> subprocess.CompletedProcess:
        """The command in this process (tests/harness/cli.py)."""
        return dflashctl.invoke("-i", str(self.inventory_path), "-p", str(self.playbooks), *args, env=self.changes,
                                cwd=REPO)

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """The command as a real process."""
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

    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    try:
        wait_for(gone, 10, f"process {pid} to end after SIGTERM")
    except AssertionError:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def launch_tmux_socket():
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


# --------------------------------------------------------------------------- launches of the real tiny trainer

RUN_SOCKET = f"dflash-test-{os.getpid()}"
_servers: list[tuple] = []  # (host, inventory) whose tmux server on RUN_SOCKET this process may have started


@pytest.fixture(scope="module")
def private_tmux_socket_and_home(tmp_path_factory):
    """A tmux socket of our own (RUN_SOCKET), and a $HOME of our own for the local
    host's runs (the trainer's compile cache under ~/.cache must not land in the
    user's home); the tmux servers ``uses_tmux`` named are ended by their pids after
    the module."""
    with environ(**{SOCKET_ENV: RUN_SOCKET, "HOME": str(tmp_path_factory.mktemp("home"))}):
        yield
        for host, inventory in _servers:
            try:
                pid = Tmux(host, inventory, RUN_SOCKET).server_pid()
            except Exception:  # noqa: BLE001  (the host may already be gone)
                continue
            if pid:  # the test hosts are this machine: the pid is ours to end
                os.kill(pid, signal.SIGTERM)
        # A server ended by a signal leaves its socket file behind.
        local_socket = Path(os.environ.get("TMUX_TMPDIR") or "/tmp") / f"tmux-{os.getuid()}" / RUN_SOCKET
        local_socket.unlink(missing_ok=True)


def uses_tmux(host_name: str, inventory) -> None:
    """Host ``host_name`` may get a tmux server on RUN_SOCKET: end it after the module."""
    _servers.append((inventory.get(host_name), inventory))


def tiny_playbook(tmp_path, inventory, host, name="tiny", **trainer):
    """A playbook of the tiny CPU trainer on ``host`` (loaded), in tmp_path/playbooks."""
    from dflashctl.config import load_playbook

    raw = {
        "host": host,
        "trainer": {
            "model": {"preset": "tiny"},
            "data": {"buckets": [256], "batch_size": 1, "max_anchors": 16},
            "train": {"steps": 5000, "log_every": 2, "checkpoint_every": 1000},
            "placement": {"device": "cpu", "target": [0], "drafter": [0]},
            **trainer,
        },
        "compile_cache": "~/.cache/dflashctl-test/compile",
    }
    path = tmp_path / "playbooks" / f"{name}.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(yaml.safe_dump(raw))
    return load_playbook(str(path), inventory=inventory)
