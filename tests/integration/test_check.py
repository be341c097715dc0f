"""`dflashctl hosts` and `dflashctl check` against the loopback sshd hosts, the
command run in this process (tests/harness/cli.py: its output and exit code as a
process prints them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from dflashctl.hosts.transport import connect
from tests import harness
from tests.harness import cli
from tests.harness.waiting import wait_for

CAPTURES = str(harness.FIXTURES / "nvidia-smi")


def dflashctl(ssh_env, *args: str, inventory: str | None = None, columns: int = 250) -> subprocess.CompletedProcess:
    return cli.invoke("--inventory", inventory or ssh_env.inventory_path, *args, columns=columns)


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


# --------------------------------------------------------------------------- what launch needs


def check_json(ssh_env, *names: str, inventory: str | None = None) -> tuple[int, dict]:
    proc = dflashctl(ssh_env, "check", *names, "--json", inventory=inventory)
    return proc.returncode, {h["name"]: h for h in json.loads(proc.stdout)["hosts"]}


def changed_inventory(ssh_env, tmp_path, name: str, **changes) -> str:
    raw = yaml.safe_load(open(ssh_env.inventory_path))
    raw["hosts"][name].update(changes)
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def lingering_check_processes(ssh_env) -> list[int]:
    """Processes the facts script started on this test's hosts to look at again (it
    must stop them): the ones whose environment names this harness's directory
    (another suite on this machine may be running a check of its own)."""
    found = []
    mine = str(ssh_env.root).encode()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            if b"import time; time.sleep(300)" not in cmdline and b"dflashctl-check-" not in cmdline:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                if mine not in f.read():
                    continue
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        if stat[stat.rindex(b")") + 2:].split()[0] not in (b"Z", b"X"):  # a zombie has stopped; init reaps it
            found.append(int(entry))
    return found


def test_a_wrapper_that_starts_a_new_pid_namespace_per_call_fails_check_with_the_fix(ssh_env):
    proc = dflashctl(ssh_env, "check", "fresh")
    assert proc.returncode == 1
    assert "this wrapper (`docker run --rm ct-fresh`) runs each command in a new pid namespace: processes die " \
           "when the call returns" in proc.stderr
    assert "fix: use a wrapper that enters the running container" in proc.stderr
    assert "`docker exec NAME`" in proc.stderr
    code, hosts = check_json(ssh_env, "fresh")
    assert code == 1 and hosts["fresh"]["ok"] is False and hosts["fresh"]["facts"]["hostname"] == "ct-fresh"
    assert [p["code"] for p in hosts["fresh"]["problems"]] == ["pid-namespace"]


def test_a_container_whose_processes_persist_passes_check(ssh_env):
    code, hosts = check_json(ssh_env, "lxc", "target", "local")
    assert code == 0, hosts
    for name, hostname in (("lxc", "ct300"), ("target", "ct200")):
        assert hosts[name]["ok"] and hosts[name]["problems"] == [] and hosts[name]["facts"]["hostname"] == hostname
    lxc = hosts["lxc"]["facts"]["launch"]
    assert lxc["pidns"] == os.readlink(f"/proc/{ssh_env.container_pid('lxc')}/ns/pid")  # inside the container
    assert lxc["versions"]["torch"] and lxc["versions"]["transformers"]
    # What it started to look at again, it stopped (sent its signal before it returned;
    # the end itself may take a moment on a loaded machine).
    wait_for(lambda: lingering_check_processes(ssh_env) == [], 10, "the check's processes to end", every=0.05)


def test_a_jump_host_is_only_reached_and_described(ssh_env):
    code, hosts = check_json(ssh_env, "jump")
    assert code == 0 and hosts["jump"]["role"] == "jump" and hosts["jump"]["facts"]["launch"] is None
    assert dflashctl(ssh_env, "check", "jump").stdout.count("(jump host)") == 1


def test_an_unwritable_workdir_fails_check(ssh_env, tmp_path):
    blocker = ssh_env.home("direct") / f"file-{tmp_path.name}"
    blocker.write_text("not a directory\n")
    code, hosts = check_json(ssh_env, "direct", inventory=changed_inventory(ssh_env, tmp_path, "direct",
                                                                          workdir=str(blocker)))
    assert code == 1
    (problem,) = hosts["direct"]["problems"]
    assert problem["code"] == "workdir" and str(blocker) in problem["message"]
    assert "`workdir:` for host 'direct'" in problem["fix"]


@pytest.mark.skipif(not os.path.exists("/usr/bin/python3") or subprocess.run(
    ["/usr/bin/python3", "-c", "import torch"], capture_output=True).returncode == 0,
    reason="needs a python without torch at /usr/bin/python3")
def test_a_python_without_torch_fails_check_naming_it(ssh_env, tmp_path):
    code, hosts = check_json(ssh_env, "direct", inventory=changed_inventory(ssh_env, tmp_path, "direct",
                                                                          python="/usr/bin/python3"))
    assert code == 1
    codes = {p["code"]: p for p in hosts["direct"]["problems"]}
    assert "torch-missing" in codes
    assert "torch is not installed for /usr/bin/python3" in codes["torch-missing"]["message"]
    assert "/usr/bin/python3 -m pip install 'torch>=2.6'" in codes["torch-missing"]["fix"]
    assert "`python:` for host 'direct'" in codes["torch-missing"]["fix"]


def test_gpus_in_the_inventory_that_nvidia_smi_does_not_show_are_a_warning(ssh_env, tmp_path):
    inventory = changed_inventory(ssh_env, tmp_path, "target", gpus=8)
    code, hosts = check_json(ssh_env, "target", inventory=inventory)
    assert code == 0 and hosts["target"]["ok"]
    (problem,) = hosts["target"]["problems"]
    assert problem["severity"] == "warning" and problem["code"] == "gpu-count"
    assert "`gpus: 8`" in problem["message"] and "nvidia-smi shows 1 GPU" in problem["message"]
    assert "warning: target: the inventory says `gpus: 8`" in dflashctl(ssh_env, "check", "target",
                                                                        inventory=inventory).stderr


# --------------------------------------------------------------------------- launch_problems as a table


def test_launch_preflight_warns_on_the_gpu_count_and_names_absent_gpus(ssh_env, tmp_path):
    from dflashctl.config import load_inventory
    from dflashctl.launch import LaunchError, launch_run
    from dflashctl.store import Store
    from tests.harness.launch import tiny_playbook

    inventory = load_inventory(changed_inventory(ssh_env, tmp_path, "target", gpus=8))
    pb = tiny_playbook(tmp_path, inventory, "target", placement={"device": "cuda", "target": [3], "drafter": [3]})
    said = []
    with pytest.raises(LaunchError) as caught:
        launch_run(pb, inventory, Store(str(tmp_path / "runs.db")), progress=lambda step, text: said.append(text))
    assert "GPUs not present: GPU 3: not present (nvidia-smi shows 1 GPU(s))" in str(caught.value)
    assert "wait for them" not in caught.value.hint and "trainer.placement" in caught.value.hint
    assert any("warning: the inventory says `gpus: 8` for host 'target', but nvidia-smi shows 1 GPU" in s
               for s in said), said


def test_check_and_hosts_fit_80_columns_and_check_names_the_versions_it_proved(ssh_env):
    """Defect: `check` folded its cells over several lines each (the system over three)
    and never said which torch and transformers it had proved; `hosts` folded routes."""
    proc = dflashctl(ssh_env, "check", "target", "direct", "jump2", columns=80)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert lines[0].split()[:2] == ["host", "result"]
    rows = [line for line in lines[1:] if not line.startswith("  ")]
    assert [row.split()[:2] for row in rows] == [["target", "ok"], ["direct", "ok"], ["jump2", "ok"]]
    report = json.loads(dflashctl(ssh_env, "check", "target", "--json").stdout)
    versions = report["hosts"][0]["facts"]["launch"]["versions"]
    proved = lines[lines.index(rows[0]) + 1]  # the run host's versions, on the line below it
    assert proved.startswith(f"  proved: torch {versions['torch']}") and f"transformers {versions['transformers']}" \
        in proved
    assert not any(line.startswith("  proved") for line in lines[lines.index(rows[2]):])  # a jump host proves nothing
    # Which attention kernels a run gets there, from the host's own packages and its GPU (the stand-in
    # nvidia-smi's one); flash-attn-4 is read, never required. The line is cut to the terminal, --json is whole.
    attention = lines[lines.index(rows[0]) + 2]
    assert attention.startswith("  attention: flex_attention compiled, its own Triton kernels")
    said = report["hosts"][0]["attention"]
    assert said.startswith(attention.split(": ", 1)[1].rstrip("…")) and said.endswith("flash-attn-4 is not installed")
    assert versions["flash-attn-4"] is None

    hosts = dflashctl(ssh_env, "hosts", columns=80).stdout.splitlines()
    assert max(len(line) for line in hosts) <= 80
    listed = {h["name"] for h in json.loads(dflashctl(ssh_env, "hosts", "--json").stdout)["hosts"]}
    assert len(hosts) == 2 + len(listed)  # the title, the header, one line per host
