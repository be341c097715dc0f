"""The incident, replayed end to end with real pip in a real venv.

Wheels of tiny projects, built here: a protected torch pinning the CUDA 12 cuDNN
wheel, that wheel, a CUDA 13 cuDNN wheel owning the same files, and an inference
stack (sglang) that wants it. Installed with pip from a local directory only
(``--no-index --find-links``: no network), the CUDA 13 wheel overwrites torch's
cuDNN. Then: the audit; every command it suggests, in the order it prints them,
run through the host's transport with the same pip; `import torch` must work and
the audit must be clean. A plain `pip uninstall` of the stray (what a fix that
was not simulated suggests) is replayed too: it breaks torch, and the next audit
says so and repairs it.
"""

from __future__ import annotations

import shutil

import pytest

from dflashctl import envaudit as ea
from dflashctl.hosts.transport import connect
from tests.harness.envs import (
    CUDNN12,
    CUDNN13,
    OFFLINE,
    TORCH_VERSION,
    Venv,
    cudnn_files,
    pip,
    torch_files,
    trainer_stack_wheels,
    write_wheel,
)


@pytest.fixture
def polluted(tmp_path, fresh_venv):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    write_wheel(wheels, "torch", TORCH_VERSION, torch_files(), [f"{CUDNN12[0]}=={CUDNN12[1]}"])
    write_wheel(wheels, *CUDNN12, cudnn_files("cudnn-cu12"))
    write_wheel(wheels, *CUDNN13, cudnn_files("cudnn-cu13"))
    write_wheel(wheels, "sglang", "0.5.3", {"sglang/__init__.py": ""}, ["torch==2.8.0", f"{CUDNN13[0]}>=9.10"])
    trainer_stack_wheels(wheels)
    shutil.copytree(fresh_venv, tmp_path / "venv", symlinks=True)
    env = Venv.existing(tmp_path / "venv")
    offline = {**OFFLINE, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels)}
    pip(env, offline, "install", "torch", "transformers", "triton")
    assert env.imports().returncode == 0
    # The inference stack, as `pip install --no-deps` (or uv) leaves it: its cuDNN over torch's.
    pip(env, offline, "install", "--no-deps", "sglang", CUDNN13[0])
    return env, offline


def apply(report: ea.AuditReport, inventory, environment: dict) -> list[str]:
    """Every command of every finding, in the order they are printed, run on the host."""
    transport = connect(report.host, inventory)
    ran = []
    for finding in report.findings:
        for argv, line in zip(finding.argv, finding.commands):
            result = transport.run(argv, env=environment, check=False, timeout=120)
            assert result.exit_code == 0, (line, result.stderr)
            ran.append(line)
    return ran


def test_the_incident_replayed_with_real_pip(polluted, tmp_path):
    env, offline = polluted
    broken = env.imports()
    assert "cuDNN version incompatibility" in broken.stderr  # what the trainer would crash with

    inventory = env.inventory(tmp_path)
    report = ea.audit_host("box", inventory)
    assert report.exit_code == 2
    codes = {f.code for f in report.findings}
    assert {"cuda-major", "missing-files", "shared-files", "stray-stack", "unmet-requirement"} <= codes
    ran = apply(report, inventory, offline)
    # The stray is detached, not uninstalled (`pip uninstall` would delete torch's cuDNN files):
    # torch's cuDNN put back first, then only the stray's dist-info removed.
    detach = f"rm -r -- {env.site}/{CUDNN13[0].replace('-', '_')}-{CUDNN13[1]}.dist-info"
    reinstall = f"{env.python} -m pip install --force-reinstall --no-deps {CUDNN12[0]}=={CUDNN12[1]}"
    assert ran.index(reinstall) < ran.index(detach)
    assert not [line for line in ran if f"uninstall -y {CUDNN13[0]}" in line]

    assert env.imports().returncode == 0, env.imports().stderr
    after = ea.audit_host("box", inventory)
    assert after.findings == [] and after.exit_code == 0
    assert {"torch", CUDNN12[0]} <= set(after.snapshot.packages())
    assert not {"sglang", CUDNN13[0]} & set(after.snapshot.packages())

    # The fix that was not simulated: uninstalling the stray alone deletes torch's cuDNN.
    pip(env, offline, "install", "--no-deps", CUDNN13[0])
    pip(env, offline, "uninstall", "-y", CUDNN13[0])
    assert "libcudnn.so.9: cannot open shared object file" in env.imports().stderr
    report = ea.audit_host("box", inventory)
    assert report.exit_code == 2  # not "0 errors": the files torch's wheel lists are gone
    (damaged,) = [f for f in report.findings if f.code == "missing-files"]
    assert "`import torch` fails with 'OSError: libcudnn.so.9: cannot open shared object file" in damaged.message
    apply(report, inventory, offline)
    assert env.imports().returncode == 0
    assert ea.audit_host("box", inventory).exit_code == 0


def test_the_plan_applies_every_fix_once_in_a_safe_order(polluted, tmp_path):
    env, offline = polluted
    inventory = env.inventory(tmp_path)
    report = ea.audit_host("box", inventory)
    steps = report.plan()
    lines = [line for _, line in steps]
    assert len(lines) == len(set(lines))
    stages = ["fetch" if "download" in argv or argv[0] == "mkdir" else "uninstall" if "uninstall" in argv else "detach" if argv[0] == "rm"
              else "reinstall" if "--force-reinstall" in argv else "install" for argv, _ in steps]
    assert stages == sorted(stages, key=["fetch", "uninstall", "install", "reinstall", "detach"].index)
    assert stages[0] == "fetch" and all("--no-index" in argv for argv, _ in steps if "install" in argv)
    transport = connect("box", inventory)
    for argv, line in steps:
        assert transport.run(argv, env=offline, check=False, timeout=120).exit_code == 0, line
    assert env.imports().returncode == 0
    assert ea.audit_host("box", inventory).exit_code == 0
