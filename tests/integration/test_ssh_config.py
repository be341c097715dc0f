"""Hosts described by the user's ~/.ssh/config (read through fabric): `ssh: ALIAS` in
the inventory, or a name only the ssh config knows, reached for real through a
ProxyJump to a loopback sshd host that is in no inventory (a temporary $HOME)."""

from __future__ import annotations

import json
import sys

import fabric
import pytest
import yaml

from dflashctl.config import Inventory, load_inventory, load_playbook
from dflashctl.core.errors import ConfigError
from dflashctl.hosts.transport import Pool, SSHTransport, UnknownHostKey
from tests.harness import cli
from tests.harness.sshd import ALIAS, ALIAS_JUMP


def write_inventory(tmp_path, hosts: dict, defaults: dict | None = None) -> str:
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump({"defaults": {"python": sys.executable, **(defaults or {})}, "hosts": hosts}))
    return str(path)


@pytest.fixture
def pool():
    pool = Pool()
    yield pool
    pool.close()


def test_an_ssh_alias_takes_everything_from_the_ssh_config(ssh_env, ssh_home, tmp_path):
    inventory = load_inventory(write_inventory(tmp_path, {"gpu": {"ssh": ALIAS}}))
    aliased, jump = ssh_env.server(ssh_env.aliased_host), ssh_env.server("jump")
    host = inventory.get("gpu")
    assert (host.address, host.port, host.jump) == (aliased.address, aliased.port, ALIAS_JUMP)
    assert host.identity_file == str(ssh_home / ".ssh" / "id_ed25519")
    assert (host.keepalive, host.connect_timeout) == (7.0, 4.0)  # ServerAliveInterval, ConnectTimeout
    assert host.known_hosts == str(ssh_home / ".ssh" / "known_hosts")
    assert [h.name for h in inventory.route("gpu")] == [ALIAS_JUMP, "gpu"]
    gw = inventory.route("gpu")[0]
    assert (gw.address, gw.port, gw.jump) == (jump.address, jump.port, None)


def test_commands_reach_the_alias_through_its_proxyjump_on_fabric_connections(ssh_env, ssh_home, tmp_path, pool):
    inventory = load_inventory(write_inventory(tmp_path, {"gpu": {"ssh": ALIAS}}))
    aliased = ssh_env.server(ssh_env.aliased_host)
    forwards = ssh_env.log("jump").count(f"target {aliased.address} port {aliased.port}")
    t = pool.get("gpu", inventory)
    assert t.describe_route() == f"{ALIAS_JUMP} -> gpu"
    assert t.run(["sh", "-c", "echo $HOME"]).stdout.strip() == str(ssh_env.home(ssh_env.aliased_host))
    assert ssh_env.log("jump").count(f"target {aliased.address} port {aliased.port}") == forwards + 1
    # fabric Connections all the way: the jump's pooled Connection is the gateway.
    connection = t.connection()
    assert isinstance(connection, fabric.Connection)
    assert connection.gateway is pool.get(ALIAS_JUMP, inventory).connection()
    assert connection.transport.packetizer._Packetizer__keepalive_interval == 7  # ServerAliveInterval
    # Host keys are checked on both hops, not accepted as fabric would.
    assert type(connection.client._policy).__name__ == "_Refuse"
    assert type(connection.gateway.client._policy).__name__ == "_Refuse"


def test_the_inventory_wins_over_the_ssh_config_and_the_ssh_config_over_defaults(ssh_env, ssh_home, tmp_path):
    path = write_inventory(tmp_path, {"gpu": {"ssh": ALIAS, "connect_timeout": 2, "keepalive": 0}},
                           defaults={"connect_timeout": 9, "keepalive": 30, "workdir": "~/from-defaults"})
    host = load_inventory(path).get("gpu")
    assert (host.connect_timeout, host.keepalive) == (2.0, 0.0)  # the host's own entry
    assert host.workdir == "~/from-defaults"  # the ssh config has nothing to say about it
    path = write_inventory(tmp_path, {"gpu": {"ssh": ALIAS}}, defaults={"connect_timeout": 9})
    assert load_inventory(path).get("gpu").connect_timeout == 4.0  # ConnectTimeout beats defaults


def test_a_name_only_the_ssh_config_knows_is_a_host(ssh_env, ssh_home, tmp_path):
    path = write_inventory(tmp_path, {"local": {"transport": "local"}})
    inventory = load_inventory(path)
    assert inventory.knows(ALIAS) and not inventory.knows("gpu-alis")
    with pytest.raises(ConfigError, match="unknown host 'gpu-alis'") as caught:
        inventory.get("gpu-alis")
    assert "~/.ssh/config" in caught.value.hint
    # The CLI, as a user types it: the facts come from the aliased host, through gw.
    proc = cli.invoke("--inventory", path, "check", ALIAS, "--json", env={"HOME": str(ssh_home)})
    assert proc.returncode == 0, proc.stderr
    (found,) = json.loads(proc.stdout)["hosts"]
    assert found["route"] == [ALIAS_JUMP, ALIAS] and found["ok"]
    assert found["facts"]["python_path"] == sys.executable  # `defaults:` apply to it too


def test_a_playbook_may_name_an_ssh_config_host(ssh_env, ssh_home, tmp_path):
    inventory = load_inventory(write_inventory(tmp_path, {"local": {"transport": "local"}}))
    playbook = tmp_path / "pb.yaml"
    playbook.write_text(f"host: {ALIAS}\n")
    assert load_playbook(str(playbook), inventory=inventory).host == ALIAS
    playbook.write_text("host: nowhere\n")
    with pytest.raises(ConfigError, match="unknown host 'nowhere'"):
        load_playbook(str(playbook), inventory=inventory)


def test_a_proxyjump_chain_is_followed_hop_by_hop(ssh_env, ssh_home, tmp_path, pool):
    inventory = load_inventory(write_inventory(tmp_path, {"far": {"ssh": "chained"}}))
    assert [h.name for h in inventory.route("far")] == [ALIAS_JUMP, "j2", "far"]
    jump2, target2 = ssh_env.server("jump2"), ssh_env.server("target2")
    assert pool.get("far", inventory).run(["sh", "-c", "echo $HOME"]).stdout.strip() == str(ssh_env.home("target2"))
    assert f"target {jump2.address} port {jump2.port}" in ssh_env.log("jump")
    assert f"target {target2.address} port {target2.port}" in ssh_env.log("jump2")


def test_an_unknown_key_on_a_hop_from_the_ssh_config_is_refused(ssh_env, ssh_home, tmp_path, pool):
    known = ssh_home / ".ssh" / "known_hosts"
    jump = ssh_env.server("jump")
    known.write_text("".join(l + "\n" for l in known.read_text().splitlines() if f":{jump.port} " not in l))
    inventory = load_inventory(write_inventory(tmp_path, {"gpu": {"ssh": ALIAS}}))
    with pytest.raises(UnknownHostKey) as caught:
        pool.get("gpu", inventory).run(["true"])
    assert f"jump host '{ALIAS_JUMP}' unreachable: unknown host key" in str(caught.value)
    assert f"trust {ALIAS_JUMP}`" in caught.value.hint


def test_the_inventory_survives_a_json_round_trip_with_its_ssh_hosts(ssh_env, ssh_home, tmp_path):
    # An inventory written out as JSON and read back routes every host the same way.
    inventory = load_inventory(write_inventory(tmp_path, {"gpu": {"ssh": ALIAS}, "far": {"ssh": "chained"}}))
    again = Inventory.model_validate(json.loads(inventory.model_dump_json()))
    for name in ("gpu", "far"):
        assert again.route(name) == inventory.route(name)


def test_an_alias_the_ssh_config_lacks_connects_to_that_name(ssh_env, ssh_home, tmp_path):
    host = load_inventory(write_inventory(tmp_path, {"plain": {"ssh": "127.0.0.6"}})).get("plain")
    assert (host.address, host.port, host.jump) == ("127.0.0.6", 22, None)  # as `ssh 127.0.0.6` would


def test_a_bad_port_in_the_ssh_config_names_the_alias(ssh_env, ssh_home, tmp_path):
    with open(ssh_home / ".ssh" / "config", "a") as f:
        f.write("Host badport\n  Port nosuchsvc\nHost webport\n  Port http\n")
    # OpenSSH's own words: the file, the line, the value.
    with pytest.raises(ConfigError, match=r"hosts\.x\.ssh: cannot read the ssh config for 'badport': `ssh -G` refuses "
                                          r"it: .*config line \d+: Bad port 'nosuchsvc'"):
        load_inventory(write_inventory(tmp_path, {"x": {"ssh": "badport"}}))
    # A service name is a port to OpenSSH, so to this reader too.
    with open(ssh_home / ".ssh" / "config", "w") as f:
        f.write("Host webport\n  Port http\n")
    assert load_inventory(write_inventory(tmp_path, {"x": {"ssh": "webport"}})).get("x").port == 80


def test_a_variant_of_an_ssh_host_keeps_its_route(ssh_env, ssh_home, tmp_path, pool):
    inventory = load_inventory(write_inventory(tmp_path, {"gpu": {"ssh": ALIAS}}))
    variant = inventory.get("gpu").model_copy(update={"name": "gpu-variant"})
    with SSHTransport(variant, inventory, pool=pool) as t:
        assert t.describe_route() == f"{ALIAS_JUMP} -> gpu-variant"
        assert t.run(["true"]).ok


def test_an_inventory_jump_may_name_a_host_only_the_ssh_config_knows(ssh_env, ssh_home, tmp_path, pool):
    aliased = ssh_env.server(ssh_env.aliased_host)
    inventory = load_inventory(write_inventory(tmp_path, {"gpu": {"address": aliased.address, "port": aliased.port,
                                                                  "jump": ALIAS_JUMP}}))
    assert [h.name for h in inventory.route("gpu")] == [ALIAS_JUMP, "gpu"]
    assert pool.get("gpu", inventory).run(["echo", "via gw"]).stdout == "via gw\n"
    with pytest.raises(ConfigError, match="hosts.gpu.jump: unknown host 'gx'"):
        load_inventory(write_inventory(tmp_path, {"gpu": {"address": aliased.address, "jump": "gx"}}))


def _ssh_g(config, alias: str) -> dict:
    """What `ssh -G` itself says for ``alias`` (the options this reader takes)."""
    import subprocess

    done = subprocess.run(["ssh", "-G", "-F", str(config), alias], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, check=True)
    pairs = [line.split(" ", 1) for line in done.stdout.splitlines() if " " in line]
    return {k: v for k, v in reversed(pairs) if k in ("hostname", "port", "user", "proxyjump", "serveraliveinterval")}


def test_an_alias_from_an_included_file_and_a_match_block_resolves_as_ssh_g_does(ssh_env, ssh_home, tmp_path, pool):
    """Defect: an alias defined in an `Include`d file was taken for a literal hostname on
    port 22 with no jump (paramiko follows no Include), while plain `ssh` reached it."""
    import shutil

    if shutil.which("ssh") is None:
        pytest.skip("OpenSSH's client is not installed: the ssh config is read by paramiko here")
    aliased = ssh_env.server(ssh_env.aliased_host)
    ssh = ssh_home / ".ssh"
    (ssh / "conf.d").mkdir()
    (ssh / "conf.d" / "gpu.conf").write_text(
        f"Host gpu-inc\n  HostName {aliased.address}\n  Port {aliased.port}\n  IdentityFile ~/.ssh/id_ed25519\n"
        f"  ProxyJump {ALIAS_JUMP}\n"
        "Host *.lab\n  HostName %h.invalid\n")
    # The Include first (inside a Host block it would apply to that host only); Match
    # originalhost: the name typed, before HostName applies.
    (ssh / "config").write_text(f"Include {ssh / 'conf.d' / '*.conf'}\n" + (ssh / "config").read_text()
                                + "Match originalhost gpu-inc\n  ServerAliveInterval 9\n")
    inventory = load_inventory(write_inventory(tmp_path, {"gpu": {"ssh": "gpu-inc"}}))
    host, said = inventory.get("gpu"), _ssh_g(ssh / "config", "gpu-inc")
    assert (host.address, str(host.port), host.jump) == (said["hostname"], said["port"], said["proxyjump"])
    assert host.keepalive == float(said["serveraliveinterval"]) == 9.0  # the Match block
    assert host.ssh_config["_read_by"] == "ssh -G"
    assert [h.name for h in inventory.route("gpu")] == [ALIAS_JUMP, "gpu"]
    assert pool.get("gpu", inventory).run(["true"]).ok  # reached for real, through the jump
    # A name only the Include'd file knows is a host too; a HostName token (%h) is expanded.
    assert inventory.knows("gpu-inc") and inventory.get("gpu-inc").address == aliased.address
    assert inventory.knows("box.lab") and inventory.get("box.lab").address == "box.lab.invalid"
    assert not inventory.knows("gpu-inx")
    # `hosts` shows the route and where the options came from.
    env = {"DFLASHCTL_INVENTORY": write_inventory(tmp_path, {"gpu": {"ssh": "gpu-inc"}}), "HOME": str(ssh_home)}
    shown = cli.invoke("hosts", env=env, columns=200)
    assert shown.returncode == 0, shown.stderr
    assert f"{ALIAS_JUMP} -> gpu" in shown.stdout
    assert f"gpu: from the ssh config for gpu-inc (read by ssh -G): hostname {aliased.address}" in shown.stdout
    assert f"proxyjump {ALIAS_JUMP}" in shown.stdout and "serveraliveinterval 9" in shown.stdout
    checked = cli.invoke("check", "gpu", env=env, columns=200)  # `check` says it too, after reaching it
    assert f"gpu: from the ssh config for gpu-inc (read by ssh -G): hostname {aliased.address}" in checked.stdout, \
        checked.stdout + checked.stderr
    doc = json.loads(cli.invoke("hosts", "--json", env=env).stdout)
    [row] = doc["hosts"]
    assert row["ssh_config"]["read_by"] == "ssh -G" and row["ssh_config"]["options"]["port"] == str(aliased.port)
