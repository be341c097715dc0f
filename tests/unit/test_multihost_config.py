"""A run on several hosts, as configured: inventory groups, playbook ``hosts``, the
run files each host's process gets, the probe entries paired with their ranks (no
host is reached here: tests/integration/test_multihost_config.py reads real
answers, tests/e2e/test_multihost.py runs one)."""

from __future__ import annotations

import pytest

from dflashctl.config import load_inventory, load_playbook
from dflashctl.core import contract
from dflashctl.core.errors import ConfigError
from dflashctl.hosts.probe import ProbeArgs
from dflashctl.runs.runhost import part_config, run_files

INVENTORY = """
hosts:
  a: {address: 10.0.0.1}
  b: {address: 10.0.0.2, python: /opt/py/bin/python, env: {NCCL_SOCKET_IFNAME: eth1}}
  c: {address: 10.0.0.3}
groups:
  pair: [a, b]
"""


def playbook(tmp_path, inventory, text: str):
    path = tmp_path / "pb.yaml"
    path.write_text(text)
    return load_playbook(str(path), inventory=inventory)


CONFIG = {
    "trainer": {"compile": {"serialized_warmup": True}, "run_dir": "/w/a/runs/r"},
    "python": "python3", "workdir": "/w/a", "env": {"PYTHONPATH": "/w/a/bundles/h"}, "gpus": [],
    "distributed": {"address": "10.0.0.1", "port": 29511, "hosts": [
        {"rank": 0, "host": "a", "python": "python3", "workdir": "/w/a", "env": {"PYTHONPATH": "/w/a/bundles/h"}},
        {"rank": 1, "host": "b", "python": "/opt/py/bin/python", "workdir": "/w/b",
         "env": {"PYTHONPATH": "/w/b/bundles/h", "NCCL_SOCKET_IFNAME": "eth1"}},
    ]},
}


@pytest.fixture
def inventory(tmp_path):
    path = tmp_path / "inventory.yaml"
    path.write_text(INVENTORY)
    return load_inventory(str(path))


def test_hosts_and_groups_expand_in_rank_order(tmp_path, inventory):
    pb = playbook(tmp_path, inventory, "hosts: [pair, c]\n")
    assert pb.host_names(inventory) == ["a", "b", "c"] and pb.rendezvous.port == 29500
    assert playbook(tmp_path, inventory, "hosts: [c, a]\n").host_names(inventory) == ["c", "a"]
    assert playbook(tmp_path, inventory, "host: a\n").host_names(inventory) == ["a"]


@pytest.mark.parametrize("text, message", [
    ("hosts: [a, x]\n", "hosts[1]: unknown host 'x'"),
    ("host: pair\n", "'pair' is a group of hosts: write hosts: [pair]"),
    ("hosts: [a, a]\n", "a host is listed twice"),
    ("hosts: [a]\n", "a multi-host run needs two or more hosts"),
    ("host: a\nhosts: [b, c]\n", "give host or hosts, not both"),
    ("{}\n", "host: required"),
    ("hosts: [a, b]\nrendezvous: {port: 80}\n", "rendezvous.port"),
])
def test_bad_host_lists_are_named(tmp_path, inventory, text, message):
    with pytest.raises(ConfigError) as e:
        playbook(tmp_path, inventory, text)
    assert message in str(e.value)


def test_a_group_must_list_known_hosts(tmp_path):
    path = tmp_path / "inventory.yaml"
    path.write_text("hosts:\n  a: {address: 10.0.0.1}\ngroups:\n  g: [a, z]\n  a: [a]\n")
    with pytest.raises(ConfigError) as e:
        load_inventory(str(path))
    assert "groups.g[1]: unknown host 'z'" in str(e.value) and "groups.a: a group cannot have the name" in str(e.value)


def test_each_host_gets_its_own_python_environment_and_rank():
    script = run_files("r", "/w/b/runs/r", CONFIG, "sock", rank=1, session="r-r1")["run.sh"]
    for line in ("export RANK=1", "export WORLD_SIZE=2", "export MASTER_ADDR=10.0.0.1", "export MASTER_PORT=29511",
                 "export LOCAL_RANK=0", "export NCCL_SOCKET_IFNAME=eth1", "export PYTHONPATH=/w/b/bundles/h",
                 f"export {contract.HOST_ENV}=b", "rm -f exit_code status.rank1.json"):
        assert line in script, line
    assert "/opt/py/bin/python -m trainer" in script and "tmux session r-r1" in script
    zero = run_files("r", "/w/a/runs/r", CONFIG, "sock", rank=0)["run.sh"]
    assert "export RANK=0" in zero and "rm -f exit_code status.json" in zero and "python3 -m trainer" in zero
    single = {k: v for k, v in CONFIG.items() if k != "distributed"}
    assert part_config(single, 0) is single and "RANK" not in run_files("r", "/w/a/runs/r", single, "s")["run.sh"]


def test_pair_takes_an_entry_only_for_the_run_it_names():
    from dflashctl.hosts.probe import ProbeResult, pair

    asked = [ProbeArgs(run_dir="/r/a"), ProbeArgs(run_dir="/r/b"), ProbeArgs(run_dir="/r/c")]
    answered = [ProbeResult(run_dir="/r/a", session=None, host_time=1.0),
                ProbeResult(run_dir="/r/x", session=None, host_time=1.0)]
    got = pair(asked, answered, "h")
    assert got[0] is answered[0]
    assert "names '/r/x' where '/r/b' was asked" in got[1]
    assert "no entry for this run (2 entries for 3 runs asked)" in got[2]
