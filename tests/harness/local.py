"""The local host as a run host, for controller tests with the fake trainer
(tests/harness/fake_trainer.py, the trainer's run-directory contract without
torch): ``LocalEnv`` (an inventory whose one host is this machine, a real SQLite
store, playbooks, runs started by the launcher's own run.sh in tmux), a
supervisor looping on a thread (``Background``), a webhook on 127.0.0.1, and the
readers of run files and store rows the tests assert on.

Every tmux server here is on a socket private to this test process (``SOCKET``),
never a user's ``dflash`` one, and is ended by its pid (``kill_tmux_servers``).

Fixtures (offered by the integration and e2e lanes' conftest.py):
``private_tmux_socket`` (module scope: DFLASHCTL_TMUX_SOCKET is ``SOCKET``; a module
asks for it with ``pytestmark = pytest.mark.usefixtures("private_tmux_socket")``),
``local_env`` (module scope: one ``LocalEnv``, its tmux server ended after the
module) and ``webhook``.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import yaml

from dflashctl.config import load_inventory, load_playbook
from dflashctl.core import contract
from dflashctl.hosts.bundle import build_bundle
from dflashctl.hosts.tmux import SOCKET_ENV, Tmux
from dflashctl.store import Store
from dflashctl.supervise.supervisor import Supervisor
from tests.harness import environ
from tests.harness.fake_trainer import start_fake_run
from tests.harness.waiting import wait_for

SOCKET = f"dflash-sup-{os.getpid()}"
REPO = Path(__file__).resolve().parents[2]

__all__ = ["REPO", "SOCKET", "Background", "LocalEnv", "Webhook", "end_trainer", "issued", "kill_tmux_servers",
           "kinds", "local_env", "metrics_lines", "private_tmux_socket", "read_status", "states", "wait_for",
           "timeline", "webhook", "write_playbook"]


# --------------------------------------------------------------------------- store rows and run files


def issued(store: Store, run_id: str) -> list:
    """Restart rows whose restart was issued (a row is written before, as "issuing"; then
    issued, resumed at its first step or failed before it)."""
    return [r for r in store.restarts(run_id) if r.issued]


def kinds(store: Store, run_id: str, kind: str | None = None) -> list:
    return store.events(run_id, kind=kind)


def timeline(store: Store, run_id: str) -> str:
    """Every event of the run, a line each: what a failed assertion prints to say why."""
    return "\n".join(f"{e.time:.2f} {e.kind} {e.severity}: {e.message} {e.detail}" for e in store.events(run_id))


def states(store: Store, run_id: str) -> list[str]:
    return [e.detail["to"] for e in store.events(run_id, kind="state")]


def read_status(run_dir: str) -> contract.Status | None:
    try:
        return contract.parse_status(Path(run_dir, contract.STATUS_FILE).read_text())
    except FileNotFoundError:
        return None


def metrics_lines(run_dir: str) -> list[contract.Metrics]:
    path = Path(run_dir, contract.METRICS_FILE)
    if not path.exists():
        return []
    return [contract.parse_metrics_line(line) for line in path.read_text().splitlines() if line.strip()]


def write_playbook(directory: Path, name: str, host: str, trainer: dict, **settings) -> Path:
    raw = {
        "host": host,
        "trainer": {
            "model": {"preset": "tiny"},
            "data": {"buckets": [256], "batch_size": 1, "max_anchors": 16},
            "placement": {"device": "cpu", "target": [0], "drafter": [0]},
            **trainer,
        },
        "compile_cache": None,
        **settings,
    }
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


# --------------------------------------------------------------------------- a webhook, a supervisor thread


class Webhook:
    """A real HTTP server on 127.0.0.1 recording the JSON bodies POSTed to it."""

    def __init__(self):
        self.received: list[dict] = []
        received = self.received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/alerts"
        self.thread = threading.Thread(target=self.server.serve_forever, name="test-webhook", daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


class Background:
    """A supervisor looping on a thread (as `dflashctl watch` does in its own process)."""

    def __init__(self, sup: Supervisor):
        self.sup = sup
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="test-supervisor", daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self.sup.run(self.stop)
        except BaseException as e:  # noqa: BLE001  (re-raised by close in the test's thread)
            self.error = e

    def close(self, timeout: float = 60.0):
        self.stop.set()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the supervisor did not stop"
        if self.error is not None:
            raise self.error


# --------------------------------------------------------------------------- ending what a test started


def kill_tmux_servers(servers) -> None:
    for host, inventory, socket in servers:
        try:
            pid = Tmux(host, inventory, socket).server_pid()
        except Exception:  # noqa: BLE001  (the host may already be gone)
            continue
        if pid:  # test hosts are this machine: the pid is ours to end
            os.kill(pid, signal.SIGTERM)


def end_trainer(run_dir: str) -> None:
    """Kill the trainer its status.json names (continued first, in case a test stopped it)."""
    status = read_status(run_dir)
    if status and status.pid:  # test hosts are this machine: the pid is ours to end
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(status.pid, sig)
            except ProcessLookupError:
                pass


# --------------------------------------------------------------------------- the local host


class LocalEnv:
    """The local host, a store, playbooks; ``start`` launches a fake-trainer run the
    way the launcher does (run.sh in a tmux session)."""

    def __init__(self, root: Path):
        self.root = root
        self.workdir = str(root / "work")
        self.inventory_path = root / "inventory.yaml"
        self.inventory_path.write_text(yaml.safe_dump({"hosts": {"local": {"transport": "local", "workdir": self.workdir}}}))
        self.inventory = load_inventory(str(self.inventory_path))
        self.host = self.inventory.get("local")
        self.playbooks = root / "playbooks"
        self.store_path = str(root / "runs.db")
        self.store = Store(self.store_path)
        self.bundle = build_bundle()
        self.tmux = Tmux(self.host, self.inventory, SOCKET)

    def playbook(self, name: str, trainer: dict | None = None, **settings):
        trainer = {"train": {"steps": 100000, "log_every": 2, "checkpoint_every": 4}, **(trainer or {})}
        settings.setdefault("poll_interval", 0.2)
        settings.setdefault("restart", {"backoff_initial": 0.05, "backoff_max": 0.1, "jitter": 0})
        return load_playbook(str(write_playbook(self.playbooks, name, "local", trainer, **settings)),
                             inventory=self.inventory)

    def start(self, pb, step_s: float = 0.05, tokens: int = 256, env: dict[str, str] | None = None) -> str:
        return start_fake_run(self.store, self.inventory, "local", pb.trainer.to_dict(), playbook=pb.name,
                              playbook_source=pb.source, socket=SOCKET, step_s=step_s, tokens=tokens,
                              bundle=self.bundle, env=env)

    def run_dir(self, run_id: str) -> str:
        return self.store.get_run(run_id).run_dir

    def trainer_pid(self, run_id: str, other_than: int | None = None) -> int:
        def pid():
            status = read_status(self.run_dir(run_id))
            return status.pid if status and status.pid and status.pid != other_than else None

        return wait_for(pid, 20, "the trainer's pid in status.json")

    def supervisor(self, **kw) -> Supervisor:
        kw.setdefault("interval", 0.2)
        kw.setdefault("playbooks_dir", str(self.playbooks))
        return Supervisor(self.store, self.inventory, **kw)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def private_tmux_socket():
    with environ(**{SOCKET_ENV: SOCKET}):
        yield


@pytest.fixture(scope="module")
def local_env(tmp_path_factory):
    env = LocalEnv(tmp_path_factory.mktemp("supervisor"))
    yield env
    kill_tmux_servers([(env.host, env.inventory, SOCKET)])


@pytest.fixture
def webhook():
    hook = Webhook()
    yield hook
    hook.close()
