"""What `check` concludes from a host's facts, as tables: the GPU answers, the
trainer's requirements (pyproject's trainer extra), the launch problems.
(`check` against real sshd hosts: tests/integration/test_check.py.)"""

from __future__ import annotations

import json

import pytest

from dflashctl.hosts.facts import parse_facts
from tests import harness

CAPTURES = str(harness.FIXTURES / "nvidia-smi")


LINUX = {"platform_system": "Linux", "sys_platform": "linux", "platform_machine": "x86_64", "python_version": "3.11",
         "python_full_version": "3.11.7", "os_name": "posix", "implementation_name": "cpython",
         "platform_python_implementation": "CPython", "platform_release": "6", "platform_version": "1",
         "implementation_version": "3.11.7"}


GOOD = {"torch": "2.8.0", "triton": "3.4.0", "transformers": "4.56.0", "safetensors": "0.6.2"}


TRITON_PIN = ["triton==3.4.0; platform_system == \"Linux\" and platform_machine == \"x86_64\""]


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


def test_the_trainer_requirements_are_pyprojects_trainer_extra():
    tomllib = pytest.importorskip("tomllib")
    from dflashctl.hosts.facts import TRAINER_REQUIREMENTS

    with open(harness.REPO / "pyproject.toml", "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["trainer"]
    assert [r.replace('"', "'") for r in extra] == list(TRAINER_REQUIREMENTS)


@pytest.mark.parametrize(
    "launch, look, codes",
    [
        ({}, {}, []),
        ({"pidns": "pid:[1]"}, {"pidns": "pid:[2]", "detached_alive": False, "tmux_alive": False}, ["pid-namespace"]),
        ({"pid1_start": 10}, {"pid1_start": 99, "detached_alive": False, "tmux_alive": False},  # inode reused
         ["pid-namespace"]),
        ({}, {"detached_alive": False}, ["detached-killed"]),
        ({}, {"tmux_alive": False}, ["tmux-lost"]),
        ({"tmux_exit_code": 1, "tmux_error": "no server"}, {"tmux_alive": False}, ["tmux-failed"]),
        ({"workdir_error": "Read-only file system"}, {}, ["workdir"]),
        ({"versions": {**GOOD, "torch": None}}, {}, ["torch-missing"]),
        ({"versions": {**GOOD, "transformers": "4.40.0"}}, {}, ["transformers-version"]),
        ({"versions": {**GOOD, "triton": "3.3.1"}}, {}, ["triton-version"]),
        ({"versions": {**GOOD, "triton": None}}, {}, ["triton-version"]),
        ({"versions": {**GOOD, "triton": None}, "torch_requires_triton": []}, {}, []),  # a CPU build
        ({"versions": {**GOOD, "triton": None}, "markers": {**LINUX, "platform_machine": "aarch64"}}, {}, []),
    ],
)
def test_launch_problems(launch, look, codes):
    from dflashctl.config import Host
    from dflashctl.hosts.facts import HostFacts, LaunchFacts, LookAgain, launch_problems

    host = Host(name="h", address="h", wrapper="pct exec 1 --")
    facts = HostFacts("h", "Debian", "6", "3.11.7", "/usr/bin/python3", "/w", tmux="tmux 3.3a")
    facts.launch = LaunchFacts(**{"versions": GOOD, "torch_requires_triton": TRITON_PIN, "markers": LINUX,
                                  "pidns": "pid:[1]", "detached_pid": 5, "detached_start": 9, "tmux_exit_code": 0,
                                  **launch})
    seen = LookAgain(**{"pidns": "pid:[1]", "detached_alive": True, "tmux_alive": True, **look})
    problems = launch_problems(host, facts, seen, user="ops")
    assert [p.code for p in problems] == codes
    for p in problems:
        assert p.severity == "error" and p.message and p.fix
    if "detached-killed" in codes:
        assert "`loginctl enable-linger ops`" in problems[0].fix


def test_launch_problems_without_tmux():
    from dflashctl.config import Host
    from dflashctl.hosts.facts import HostFacts, LaunchFacts, LookAgain, launch_problems

    facts = HostFacts("h", "Debian", "6", "3.11.7", "/usr/bin/python3", "/w", tmux=None)
    facts.launch = LaunchFacts(versions=GOOD, pidns="pid:[1]", detached_pid=5, detached_start=9)
    (problem,) = launch_problems(Host(name="h", address="h"), facts, LookAgain(pidns="pid:[1]", detached_alive=True))
    assert problem.code == "tmux-missing" and "apt-get install -y tmux" in problem.fix


TRITON = "flex_attention compiled, its own Triton kernels (compile.flex_kernel auto); not flash-attention 4's: "


@pytest.mark.parametrize(
    "gpus, gpu, flash, says, problem",
    [
        (0, "NVIDIA H200", None, "dense SDPA over the DFlash mask (no GPU)", None),
        (8, "NVIDIA H200", None, TRITON + "flash-attn-4 is not installed", None),
        (8, "NVIDIA H200", "4.0.0b36", "flex_attention compiled on flash-attention 4's kernels "
                                       "(compile.flex_kernel auto; flash-attn-4 4.0.0b36)", None),
        (2, "NVIDIA B200", "4.0.0b36", "flex_attention compiled on flash-attention 4's kernels", None),
        (8, "NVIDIA H200", "4.0.0b25", TRITON + "flash-attn-4 4.0.0b25 is older than 4.0.0b26", "flash-attn-version"),
        (8, "NVIDIA A100-SXM4-80GB", "4.0.0b36", TRITON + "NVIDIA A100-SXM4-80GB: not a Hopper or Blackwell GPU",
         None),
        (1, "NVIDIA L40S", "4.0.0b25", TRITON + "NVIDIA L40S: not a Hopper or Blackwell GPU", None),  # unused there
    ],
)
def test_check_says_which_attention_kernels_a_run_gets_from_the_hosts_own_packages(gpus, gpu, flash, says, problem):
    from dflashctl.hosts.facts import Gpu, HostFacts, LaunchFacts, attention_text

    facts = HostFacts("h", "Debian", "6", "3.11.7", "/opt/torch/.venv/bin/python3", "/w", tmux="tmux 3.3a",
                      nvidia_smi="/usr/bin/nvidia-smi" if gpus else None,
                      gpus=[Gpu(i, gpu, 143771, 0) for i in range(gpus)])
    facts.launch = LaunchFacts(versions={**GOOD, "flash-attn-4": flash})
    text, found = attention_text(facts)
    assert says in text and "\n" not in text  # one line under the host's row
    assert (found and found.code) == problem
    if found:  # the trainer refuses it: the fix installs the fixed release into the host's own python
        assert found.severity == "warning" and "'flash-attn-4>=4.0.0b26'" in found.fix and "/opt/torch/.venv" in found.fix
    facts.launch = None  # a jump host: nothing said
    assert attention_text(facts) == (None, None)


@pytest.mark.parametrize("name, capable", [
    ("NVIDIA H200", True), ("NVIDIA H100 80GB HBM3", True), ("NVIDIA H100 PCIe", True), ("NVIDIA H20", True),
    ("NVIDIA GH200 480GB", True), ("NVIDIA B200", True), ("NVIDIA GB200", True), ("NVIDIA B300 SXM6 AC", True),
    ("NVIDIA A100-SXM4-80GB", False), ("NVIDIA L40S", False), ("NVIDIA GeForce RTX 4090", False),
    ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", False), ("NVIDIA GB10", False),
    ("Tesla V100-SXM2-32GB", False), ("", False),
])
def test_flash_attention_4_runs_on_hopper_and_datacenter_blackwell_gpus(name, capable):
    from dflashctl.core.contract import flash_capable_gpu

    assert flash_capable_gpu(name) is capable


def test_the_flash_path_is_refused_before_the_release_that_fixed_its_backward():
    from dflashctl.core.contract import flash_attn_problem

    assert flash_attn_problem("4.0.0b26") is None and flash_attn_problem("4.0.1") is None
    assert "older than 4.0.0b26" in flash_attn_problem("4.0.0b25")
    assert "not installed" in flash_attn_problem(None)
    assert "not a version" in flash_attn_problem("garbage!")
