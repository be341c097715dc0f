"""What the operator configures and reaches a shell on a run host is checked before
anything runs there: a tmux socket name or a work directory with a control
character is refused with the value and the fix, a wrapper that gives every call a
fresh pid namespace is refused by `launch` (as `check` refuses it), and `check`
leaves no tmux socket file behind. Through the sshd harness, with the real launcher
and store."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dflashctl.config import load_playbook
from dflashctl.core.errors import ConfigError
from dflashctl.hosts.bundle import build_bundle
from dflashctl.hosts.tmux import SOCKET_ENV, Tmux
from dflashctl.launch import launch_run
from dflashctl.runs.runhost import LaunchError
from dflashctl.store import Store
from tests.harness import cli, environ
from tests.harness.local import write_playbook


def _check_sockets(ssh_env, host: str) -> list[Path]:
    """Files a check's tmux server would leave in the host's tmux directory."""
    root = ssh_env.host_dir(host) / "tmux"
    return [p for p in root.rglob("dflashctl-check-*")] if root.exists() else []


def test_check_leaves_no_tmux_socket_file_on_the_hosts(ssh_env):
    hosts = ("target", "lxc", "fresh")
    before = {h: _check_sockets(ssh_env, h) for h in hosts}
    for _ in range(2):
        cli.invoke("--inventory", ssh_env.inventory_path, "check", *hosts)
    for h in hosts:
        left = [p for p in _check_sockets(ssh_env, h) if p not in before[h]]
        assert left == [], f"{h}: {left}"


@pytest.mark.parametrize("value", ["dflash\ntouch {marker}", "dflash; touch {marker}", "../x", "a b", "\x1b[31m"])
def test_a_tmux_socket_name_that_is_not_plain_is_refused_before_anything_runs(ssh_env, tmp_path, value):
    marker = ssh_env.home("target") / f"marker-{tmp_path.name}"
    store = Store(str(tmp_path / "runs.db"))
    pb = load_playbook(str(write_playbook(tmp_path / "playbooks", "sock", "target", {"train": {"steps": 5}})),
                       inventory=ssh_env.inventory)
    with environ(**{SOCKET_ENV: value.format(marker=marker)}):
        with pytest.raises(ConfigError) as caught:
            launch_run(pb, ssh_env.inventory, store, bundle=build_bundle())
    message = str(caught.value)
    assert f"${SOCKET_ENV} {value.format(marker=marker)!r} is not a tmux socket name" in message
    assert f"unset {SOCKET_ENV}" in caught.value.hint
    assert store.list_runs() == [] and not marker.exists()


def test_a_stored_socket_name_that_is_not_plain_is_refused_by_tmux(ssh_env):
    with pytest.raises(ConfigError, match="the run's tmux socket 'x\\\\ny' is not a tmux socket name"):
        Tmux(ssh_env.inventory.get("target"), ssh_env.inventory, "x\ny")


def test_launch_through_a_fresh_namespace_wrapper_is_refused_like_check_does(ssh_env, tmp_path):
    store = Store(str(tmp_path / "runs.db"))
    pb = load_playbook(str(write_playbook(tmp_path / "playbooks", "fresh", "fresh", {"train": {"steps": 5}})),
                       inventory=ssh_env.inventory)
    with environ(**{SOCKET_ENV: f"fresh-{os.getpid()}"}):
        with pytest.raises(LaunchError) as caught:
            launch_run(pb, ssh_env.inventory, store, bundle=build_bundle())
    message = str(caught.value)
    assert message.startswith("fresh cannot hold a run: this wrapper (`docker run --rm ct-fresh`) runs each command "
                              "in a new pid namespace"), message
    assert "nothing was deployed or recorded" in message
    assert "use a wrapper that enters the running container" in caught.value.hint
    assert "`dflashctl check fresh`" in caught.value.hint
    assert store.list_runs() == []
    assert _check_sockets(ssh_env, "fresh") == []  # the launch's own proof left nothing either
