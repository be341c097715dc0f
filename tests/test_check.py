"""`dflashctl hosts` and `dflashctl check`, run as the real CLI against the loopback sshd hosts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from dflashctl.facts import parse_facts
from dflashctl.transport import connect

CAPTURES = os.path.join(os.path.dirname(__file__), "fixtures", "nvidia-smi")


def dflashctl(ssh_env, *args: str, inventory: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dflashctl", "--inventory", inventory or ssh_env.inventory_path, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "250"},
    )


def test_check_reports_route_and_facts_as_json(ssh_env, tmp_path):
    # The same inventory, but a workdir for target that nothing has created yet.
    inventory = yaml.safe_load(open(ssh_env.inventory_path))
    inventory["hosts"]["target"]["workdir"] = f"~/{tmp_path.name}/work"
    inventory_path = tmp_path / "inventory.yaml"
    inventory_path.write_text(yaml.safe_dump(inventory))
    workdir = ssh_env.home("target") / tmp_path.name / "work"
    assert not workdir.exists()
    proc = dflashctl(ssh_env, "check", "target", "target2", "direct", "local", "--json", inventory=str(inventory_path))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is True
    by_name = {h["name"]: h for h in report["hosts"]}
    assert list(by_name) == ["target", "target2", "direct", "local"]

    target = by_name["target"]
    assert target["route"] == ["jump", "target"]
    assert target["route_text"] == "jump -> target [pct exec 200 --]"
    assert target["wrapper"] == ["pct", "exec", "200", "--"]
    facts = target["facts"]
    assert facts["hostname"] == "ct200"  # the facts came from inside the wrapper
    assert facts["os"].startswith("Debian") and facts["kernel"] == os.uname().release
    assert facts["python"] == "%d.%d.%d" % sys.version_info[:3]
    assert facts["tmux"].startswith("tmux ")
    assert facts["gpus"] == [{"index": 0, "name": "NVIDIA H200", "memory_total_mib": 143771.0, "memory_used_mib": 0.0}]
    assert facts["workdir"] == str(workdir) and workdir.is_dir()  # "~" expanded on the host, then created
    assert facts["disk_free"] > 0

    assert by_name["target2"]["route"] == ["jump", "jump2", "target2"]
    assert by_name["target2"]["facts"]["nvidia_smi"] is None and by_name["target2"]["facts"]["gpus"] == []
    assert by_name["direct"]["route_text"] == "direct"
    assert by_name["local"]["route_text"] == "local" and by_name["local"]["address"] is None


def test_check_follows_the_fake_gpu_under_load(ssh_env):
    ssh_env.set_smi_mode("target", "load")
    try:
        proc = dflashctl(ssh_env, "check", "target", "--json")
    finally:
        ssh_env.set_smi_mode("target", "idle")
    gpus = json.loads(proc.stdout)["hosts"][0]["facts"]["gpus"]
    assert [g["memory_used_mib"] for g in gpus] == [1011.0]


def test_check_reports_each_failed_host_and_exits_non_zero(ssh_env):
    unknown = ssh_env.unknown_host
    proc = dflashctl(ssh_env, "check", "direct", unknown, "jump2", "--json")
    assert proc.returncode == 1
    by_name = {h["name"]: h for h in json.loads(proc.stdout)["hosts"]}
    assert by_name["direct"]["ok"] and by_name["jump2"]["ok"]
    failed = by_name[unknown]
    assert failed["ok"] is False and failed["facts"] is None
    assert "unknown host key" in failed["error"] and "ssh-keyscan" in failed["hint"]


def test_check_table_for_humans(ssh_env):
    proc = dflashctl(ssh_env, "check", "target", ssh_env.unknown_host)
    assert proc.returncode == 1
    assert "jump -> target [pct exec 200 --]" in proc.stdout
    assert "ct200" in proc.stdout and "NVIDIA H200" in proc.stdout
    assert "FAIL" in proc.stdout
    assert f"error: {ssh_env.unknown_host}: unknown host key" in proc.stderr
    assert "trust_on_first_use: true" in proc.stderr


def test_check_unknown_host_name_is_a_config_error(ssh_env):
    proc = dflashctl(ssh_env, "check", "targt")
    assert proc.returncode == 2
    assert "unknown host 'targt' (did you mean 'target'?)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_hosts_lists_the_inventory(ssh_env):
    proc = dflashctl(ssh_env, "hosts", "--json")
    assert proc.returncode == 0, proc.stderr
    listed = {h["name"]: h for h in json.loads(proc.stdout)["hosts"]}
    assert set(listed) >= {"local", *ssh_env.hosts, ssh_env.unknown_host}
    target = ssh_env.server("target")
    assert listed["target"]["address"] == f"{target.address}:{target.port}"
    assert listed["target"]["route"] == ["jump", "target"] and listed["target"]["gpus"] == 1
    assert listed["target"]["wrapper"] == ["pct", "exec", "200", "--"]
    assert listed["target2"]["route_text"] == "jump -> jump2 -> target2"
    human = dflashctl(ssh_env, "hosts")
    assert human.returncode == 0 and "pct exec 200 --" in human.stdout and "jump -> jump2 -> target2" in human.stdout


@pytest.mark.parametrize(
    "query, expected",
    [
        ({"exit_code": 0, "stdout": "0, NVIDIA H200, 143771, 0\n1, NVIDIA H200, 143771, [N/A]\n", "stderr": ""}, None),
        ({"exit_code": 9, "stdout": "", "stderr": "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n"}, "nvidia-smi exit 9: NVIDIA-SMI has failed"),
    ],
)
def test_parse_facts_gpu_answers(query, expected):
    raw = {"hostname": "h", "os": "Debian", "kernel": "6", "python": "3.12.3", "python_path": "/usr/bin/python3",
           "workdir": "/w", "tmux": None, "nvidia_smi": "/usr/bin/nvidia-smi", "gpu_query": query, "disk_free": 1}
    facts = parse_facts("some banner line\n" + json.dumps(raw) + "\n")
    if expected is None:
        assert [(g.index, g.memory_used_mib) for g in facts.gpus] == [(0, 0.0), (1, None)]
        assert facts.gpu_error is None
    else:
        assert facts.gpus == [] and facts.gpu_error.startswith(expected)


@pytest.mark.parametrize(
    "mode, args, capture",
    [
        ("idle", [], "h200-idle-plain.txt"),
        ("load", ["-q", "-x"], "h200-load-q.xml"),
        ("idle", ["--query-gpu=index,uuid,name,memory.used,memory.total,utilization.gpu,temperature.gpu,power.draw,power.limit,clocks.sm", "--format=csv,noheader,nounits"], "h200-idle-query.csv"),
        ("load", ["--query-gpu=index,memory.used,utilization.gpu", "--format=csv"], "h200-load-seed-query-header.csv"),
        ("load", ["--query-compute-apps=pid,process_name,used_memory,gpu_uuid", "--format=csv,noheader,nounits"], "h200-load-apps.csv"),
    ],
)
def test_fake_nvidia_smi_on_target_prints_the_real_captures(ssh_env, mode, args, capture):
    with open(os.path.join(CAPTURES, capture), "rb") as f:
        expected = f.read()
    t = connect("target", ssh_env.inventory)
    assert t.run(["nvidia-smi", *args], env={"DFLASHCTL_FAKE_SMI": mode}).stdout_bytes == expected


def test_fake_nvidia_smi_refuses_unknown_fields(ssh_env):
    r = connect("target", ssh_env.inventory).run(["nvidia-smi", "--query-gpu=index,bogus", "--format=csv"], check=False)
    assert r.exit_code == 2 and 'Field "bogus" is not a valid field to query.' in r.stderr
