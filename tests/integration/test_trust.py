"""`dflashctl trust HOST` and the host-key hints, against the loopback sshd hosts.

Every command a host-key hint prints is run here exactly as printed (through a
shell, the way a user pastes it), and must do what the hint says."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml

from dflashctl.config import load_inventory
from dflashctl.core.errors import UnreachableError
from dflashctl.hosts.transport import Pool, UnknownHostKey

VENV_BIN = os.path.dirname(sys.executable)
COMMAND_PREFIXES = ("dflashctl ", "ssh-keyscan ", "ssh-keygen ")


def printed_commands(hint: str) -> list[str]:
    """The commands a hint shows (each in backticks)."""
    return [c for c in re.findall(r"`([^`]+)`", hint) if c.startswith(COMMAND_PREFIXES)]


def run_as_printed(command: str, cwd, answer: str = "") -> subprocess.CompletedProcess:
    """A printed command, pasted into a shell (dflashctl on the PATH, as after setup)."""
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ['PATH']}", "COLUMNS": "250"}
    return subprocess.run(["sh", "-c", command], input=answer, capture_output=True, text=True, timeout=120,
                          cwd=cwd, env=env)


def fingerprint(ssh_env, name: str) -> str:
    """The host key's fingerprint as `ssh-keygen -l` shows it on the host."""
    pub = ssh_env.server(name).dir / "host_ed25519.pub"
    return subprocess.run(["ssh-keygen", "-lf", str(pub)], capture_output=True, text=True, check=True).stdout.split()[1]


def key_line(ssh_env, name: str) -> str:
    server = ssh_env.server(name)
    key_type, blob = (server.dir / "host_ed25519.pub").read_text().split()[:2]
    return f"[{server.address}]:{server.port} {key_type} {blob}"


@pytest.fixture
def own_inventory(ssh_env, tmp_path):
    """The harness inventory with its own known_hosts file (so trusting writes nowhere
    shared): ``make(known_lines)`` writes both and returns the inventory path."""

    def make(known_lines: list[str]) -> str:
        known = tmp_path / "known_hosts"
        known.write_text("".join(f"{line}\n" for line in known_lines))
        raw = yaml.safe_load(open(ssh_env.inventory_path))
        raw["defaults"]["known_hosts"] = str(known)
        path = tmp_path / "inventory.yaml"
        path.write_text(yaml.safe_dump(raw))
        return str(path)

    return make


def connect_error(inventory_path: str, name: str) -> UnreachableError:
    pool = Pool()
    try:
        with pytest.raises(UnreachableError) as caught:
            pool.get(name, load_inventory(inventory_path)).run(["true"])
        return caught.value
    finally:
        pool.close()


def runs_on(inventory_path: str, name: str) -> str:
    pool = Pool()
    try:
        return pool.get(name, load_inventory(inventory_path)).run(["echo", "in"]).stdout
    finally:
        pool.close()


def test_unknown_key_hint_runs_as_printed_for_a_direct_host(ssh_env, own_inventory, tmp_path):
    everyone = [key_line(ssh_env, n) for n in ssh_env.hosts]
    inventory = own_inventory(everyone)
    error = connect_error(inventory, ssh_env.unknown_host)
    assert isinstance(error, UnknownHostKey) and fingerprint(ssh_env, ssh_env.unknown_host) in str(error)
    trust, keyscan = printed_commands(error.hint)
    assert trust == f"dflashctl --inventory {inventory} trust {ssh_env.unknown_host}"
    assert keyscan.startswith("ssh-keyscan -p ")

    shown = run_as_printed(trust, cwd=tmp_path, answer="y\n")
    assert shown.returncode == 0, shown.stderr
    assert fingerprint(ssh_env, ssh_env.unknown_host) in shown.stdout and "added to" in shown.stdout
    assert runs_on(inventory, ssh_env.unknown_host) == "in\n"

    # The other way the hint offers, on a fresh file.
    inventory = own_inventory(everyone)
    assert run_as_printed(keyscan, cwd=tmp_path).returncode == 0
    assert runs_on(inventory, ssh_env.unknown_host) == "in\n"


def test_trust_through_a_jump_shows_the_fingerprint_and_adds_the_key(ssh_env, own_inventory, tmp_path):
    inventory = own_inventory([key_line(ssh_env, "jump")])  # the jump is known, target is not
    error = connect_error(inventory, "target")
    (trust,) = printed_commands(error.hint)  # no ssh-keyscan: it could not reach target from here
    assert trust == f"dflashctl --inventory {inventory} trust target"
    target = ssh_env.server("target")
    forwards_before = ssh_env.log("jump").count(f"target {target.address} port {target.port}")

    shown = run_as_printed(trust, cwd=tmp_path, answer="y\n")
    assert shown.returncode == 0, shown.stderr
    assert f"jump (direct): ssh-ed25519 {fingerprint(ssh_env, 'jump')}" in shown.stdout
    assert "already trusted" in shown.stdout
    assert f"target (jump -> target): ssh-ed25519 {fingerprint(ssh_env, 'target')}" in shown.stdout
    # Fetched through the jump (its log shows the forward), then trusted for real.
    assert ssh_env.log("jump").count(f"target {target.address} port {target.port}") > forwards_before
    assert key_line(ssh_env, "target") in open(tmp_path / "known_hosts").read().splitlines()
    assert runs_on(inventory, "target") == "in\n"


def test_trust_walks_the_route_from_the_outermost_jump(ssh_env, own_inventory, tmp_path):
    inventory = own_inventory([])  # nothing known: jump, jump2 and target2 all unknown
    proc = run_as_printed(f"dflashctl --inventory {inventory} trust target2 --yes", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = open(tmp_path / "known_hosts").read().splitlines()
    assert lines == [key_line(ssh_env, n) for n in ("jump", "jump2", "target2")]
    assert runs_on(inventory, "target2") == "in\n"


def test_declining_writes_nothing(ssh_env, own_inventory, tmp_path):
    inventory = own_inventory([key_line(ssh_env, "jump")])
    proc = run_as_printed(f"dflashctl --inventory {inventory} trust target", cwd=tmp_path, answer="n\n")
    assert proc.returncode == 1
    assert "key not trusted; nothing written" in proc.stderr
    assert open(tmp_path / "known_hosts").read().splitlines() == [key_line(ssh_env, "jump")]


def test_a_changed_key_is_refused_and_the_hint_fixes_it(ssh_env, own_inventory, tmp_path):
    direct = ssh_env.server("direct")
    wrong = key_line(ssh_env, "jump").split(" ", 1)[1]
    inventory = own_inventory([f"[{direct.address}]:{direct.port} {wrong}"])
    error = connect_error(inventory, "direct")
    assert "host key CHANGED" in str(error)
    forget, trust = printed_commands(error.hint)
    assert forget.startswith("ssh-keygen -f ") and trust.endswith("trust direct")

    refused = run_as_printed(trust + " --yes", cwd=tmp_path)
    assert refused.returncode == 1 and "host key CHANGED" in refused.stderr
    assert forget in refused.stderr  # trust's own hint is the same command

    assert run_as_printed(forget, cwd=tmp_path).returncode == 0
    assert run_as_printed(trust, cwd=tmp_path, answer="y\n").returncode == 0
    assert runs_on(inventory, "direct") == "in\n"


def test_trusting_a_local_host_is_a_clear_error(ssh_env, tmp_path):
    proc = run_as_printed(f"dflashctl --inventory {ssh_env.inventory_path} trust local", cwd=tmp_path)
    assert proc.returncode == 1 and "no host key to trust" in proc.stderr and "Traceback" not in proc.stderr


def test_hint_omits_the_inventory_when_it_is_the_one_found(ssh_env, own_inventory, tmp_path, monkeypatch):
    assert own_inventory([key_line(ssh_env, n) for n in ssh_env.hosts]) == str(tmp_path / "inventory.yaml")
    monkeypatch.chdir(tmp_path)  # ./inventory.yaml is what dflashctl finds by itself here
    error = connect_error("inventory.yaml", ssh_env.unknown_host)
    assert printed_commands(error.hint)[0] == f"dflashctl trust {ssh_env.unknown_host}"
