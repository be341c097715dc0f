"""Shared fixtures. ``ssh_env``: real OpenSSH servers on loopback (tests/harness).

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

import pytest

from tests.harness import SshEnv


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
