"""The suite in lanes, each a folder whose tests are marked with its name (so
``-m unit`` works as well as ``pytest tests/unit``):

- ``tests/unit``: pure, in this process: no torch, no child process, no server, no
  SQLite file (under a minute on 2 cores);
- ``tests/integration``: the controller against real parts: loopback sshd hosts,
  tmux, SQLite stores, the fake trainer (tests/harness/fake_trainer.py), the
  host-side scripts run by a real Python, the console driven headless;
- ``tests/e2e``: the real trainer under the controller, and the command line as a
  process (exit statuses, signals, a terminal, start-up imports);
- ``tests/trainer``: the trainer itself (torch).

Shared code is in tests/harness (no test file imports another). torch is imported
only in tests/trainer modules and inside the tests and fixtures that need it:
collecting the unit lane imports no torch (tests/unit/test_lanes.py checks it).
Known slow tests (more than about 15 s alone on an idle 2-core machine) are also
marked ``slow``.

Shared fixtures. ``ssh_env``: real OpenSSH servers on loopback (tests/harness).

    ssh_env.inventory_path      inventory YAML (pass to --inventory / load_inventory)
    ssh_env.inventory           the loaded Inventory
    ssh_env.hosts               ['jump', 'jump2', 'target', 'target2', 'direct', 'lxc', 'fresh'] (+ added)
    ssh_env.unknown_host        'stranger': reachable, host key NOT in known_hosts
    ssh_env.stop(h) / start(h)  take a host down / bring it back (same address, port)
    ssh_env.kill_connections(h) cut its open connections (returns the pids killed)
    ssh_env.sshd_pids           {host: listening sshd pid}
    ssh_env.log(h)              its sshd log (jumps log every direct-tcpip forward)
    ssh_env.workdir(h), home(h), host_dir(h)   paths on this machine
    ssh_env.set_smi_mode(h, 'idle'|'load')     the fake nvidia-smi's state (or env DFLASHCTL_FAKE_SMI)
    ssh_env.add_hosts(n, jump='jump', wrapper=None, fake_gpu=False)   n more hosts; their names
    ssh_env.ssh_argv(h)         OpenSSH client argv reaching h (ssh -F ssh_config h)
    ssh_env.server(h)           its Server: .address, .port, .dir, .pid, .log_path
    ssh_env.known_hosts, .client_key, .ssh_config, .local_workdir   files on this machine
    ssh_env.freeze_connection(h, client_port) / thaw(pids)   wedge one connection (SIGSTOP its sshd)
    ssh_env.aliased_host        'aliased': in no inventory, reached as `gpu-alias` via ~/.ssh/config
    ssh_env.container_pid('lxc')   the init of the lxc host's long-lived container namespace

Each ssh host has its own $HOME (so workdir '~/dflash' differs per host), $TMUX_TMPDIR
and bin/ first on PATH; the inventory's python is this interpreter. `target` runs
commands inside the fake `pct exec 200 --` (hostname ct200, no PID namespace); `lxc`
inside `lxc-attach -n ct300 --` (a long-lived pid namespace: processes persist);
`fresh` inside `docker run --rm ct-fresh` (a new pid namespace per call).

``ssh_home``: this process's $HOME set to a temporary one whose ~/.ssh/config knows
`gw` (jump) and `gpu-alias` (the aliased host, ProxyJump gw), with their keys in
~/.ssh/known_hosts and the client key as ~/.ssh/id_ed25519.

A test that stops a host or cuts connections must leave it up again (try/finally).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.harness import SshEnv

TESTS = Path(__file__).resolve().parent
LANES = ("unit", "integration", "trainer", "e2e")  # also the order files are handed to workers in: fastest last

# Whether torch was imported while the unit lane was collected, before any module of
# another lane: None (not known yet), False, or the first unit module it was seen after.
torch_after_unit_module: str | bool | None = None
_other_lane_collected = False
collected: list = []  # this process's tests, as collected (before -m or -k deselects any)


def pytest_configure(config) -> None:
    # The size of the terminal pytest runs in, or the 80x24 an xdist worker starts
    # with, is no test's business: the commands' output depends on COLUMNS, so a
    # test that wants a width sets it (tests/harness/cli.py: ``columns=``).
    for name in ("COLUMNS", "LINES"):
        os.environ.pop(name, None)


def lane_of(path) -> str | None:
    try:
        parts = Path(path).resolve().relative_to(TESTS).parts
    except ValueError:
        return None
    return parts[0] if len(parts) > 1 and parts[0] in LANES else None


def pytest_collectreport(report) -> None:
    """Note whether collecting the unit lane imported torch (tests/unit/test_lanes.py)."""
    global torch_after_unit_module, _other_lane_collected
    if not report.nodeid.endswith(".py"):
        return
    lane = lane_of(TESTS.parent / report.nodeid)
    if lane != "unit":
        _other_lane_collected = _other_lane_collected or lane is not None
        return
    if _other_lane_collected or torch_after_unit_module:
        return
    torch_after_unit_module = report.nodeid if "torch" in sys.modules else False


def pytest_collection_modifyitems(config, items) -> None:
    """Mark each test with its lane; hand the slower lanes, and in each the files with
    slow tests, to the workers first (a stable sort by file: each file's tests stay
    together and in their order, for its module fixtures)."""
    collected[:] = items
    for item in items:
        lane = lane_of(item.path)
        if lane is None:
            raise pytest.UsageError(f"{item.nodeid}: every test lives in a lane folder: {', '.join(LANES)}")
        item.add_marker(getattr(pytest.mark, lane))
    order = {lane: i for i, lane in enumerate(reversed(LANES))}
    slow_files = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: (order[lane_of(item.path)], item.path not in slow_files))


@pytest.fixture(scope="session", autouse=True)
def _private_dflashctl_home(tmp_path_factory):
    """Keep tests away from the user's ~/.config and ~/.local/share (see dflashctl.core.paths)."""
    if "DFLASHCTL_HOME" in os.environ:
        yield
        return
    os.environ["DFLASHCTL_HOME"] = str(tmp_path_factory.mktemp("dflashctl-home"))
    yield
    os.environ.pop("DFLASHCTL_HOME", None)


@pytest.fixture
def ssh_home(ssh_env, tmp_path, monkeypatch):
    """A temporary $HOME whose ~/.ssh describes the aliased host (see the module docstring)."""
    home = ssh_env.write_ssh_home(tmp_path / "home")
    monkeypatch.setenv("HOME", str(home))
    return home


@pytest.fixture(scope="session")
def ssh_env(tmp_path_factory):
    from dflashctl.hosts import transport

    env = SshEnv(tmp_path_factory.mktemp("ssh"))
    try:
        yield env
    finally:
        transport.default_pool.close()  # before the servers go, so no client waits on them
        env.close()
