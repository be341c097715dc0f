"""What torch's loader really loads, protected by the plan and by --apply, with
real pip, wheels built here and real shared objects (gcc): the fake torch
dlopens its libtorch_cuda.so, whose DT_NEEDED libcudnn.so.9 the dynamic loader
finds through its RUNPATH in site-packages/nvidia/cudnn/lib.

The incident: torch's CUDA 12 cuDNN wheel whose RECORD does not list the
libcudnn.so.9 torch loads (a library put back by hand after an incident), while a
stray CUDA 13 cuDNN wheel's RECORD does. `pip uninstall` of the stray deletes the
library torch loads; no reinstall of torch's wheel puts it back.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dflashctl import envaudit as ea
from dflashctl.envaudit.apply import apply_plan
from tests.harness.envs import (
    CUDNN12,
    CUDNN13,
    OFFLINE,
    TORCH_VERSION,
    TRAINER_STACK,
    Venv,
    pip,
    real_cudnn,
    real_cudnn_files,
    real_torch_files,
    trainer_stack_wheels,
    write_wheel,
)


@pytest.fixture
def wheels(tmp_path) -> Path:
    d = tmp_path / "wheels"
    d.mkdir()
    write_wheel(d, "torch", TORCH_VERSION, real_torch_files(), [f"{CUDNN12[0]}=={CUDNN12[1]}"])
    write_wheel(d, *CUDNN12, real_cudnn_files(12, with_library=False))  # its RECORD lists no libcudnn.so.9
    write_wheel(d, *CUDNN13, real_cudnn_files(13))
    write_wheel(d, "sglang", "0.5.3", {"sglang/__init__.py": ""}, [f"{CUDNN13[0]}>=9.10"])
    trainer_stack_wheels(d)
    return d


def library_put_back_by_hand(tmp_path: Path, fresh: Path, wheels: Path) -> tuple[Venv, dict, Path]:
    shutil.copytree(fresh, tmp_path / "venv", symlinks=True)
    env = Venv.existing(tmp_path / "venv")
    offline = {**OFFLINE, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels)}
    pip(env, offline, "install", "sglang")
    pip(env, offline, "install", "torch", "transformers", "triton")
    lib = env.site / "nvidia/cudnn/lib/libcudnn.so.9"
    assert "built for CUDA 13" in env.imports().stderr  # the loader links the CUDA 13 build: torch refuses it
    lib.write_bytes(real_cudnn(12))  # put back by hand: listed by the stray's RECORD only
    assert env.imports().returncode == 0, env.imports().stderr
    return env, offline, lib


def test_the_collector_lists_what_the_loader_resolves_owned_or_not(tmp_path, fresh_venv, wheels):
    env, _, lib = library_put_back_by_hand(tmp_path, fresh_venv, wheels)
    report = ea.audit_host("box", env.inventory(tmp_path))
    s = report.snapshot
    (found,) = [f for f in s.loader if f.path == str(lib)]
    assert found.via == "RUNPATH" and found.needed_by.endswith("torch/lib/libtorch_cuda.so")
    assert [s.dist(i).name for i in found.owners] == [CUDNN13[0]]  # the stray's RECORD, no protected one


def test_a_library_no_protected_record_lists_is_never_removed(tmp_path, fresh_venv, wheels):
    env, offline, lib = library_put_back_by_hand(tmp_path, fresh_venv, wheels)
    inventory = env.inventory(tmp_path)
    report = ea.audit_host("box", inventory)
    lines = [line for _, line in report.plan()]
    assert not [line for line in lines if " uninstall " in line and CUDNN13[0] in line], lines
    (stray,) = [f for f in report.findings if f.code == "cuda-major" and CUDNN13[0] in f.packages]
    assert "detached, not uninstalled" in stray.fix and "libcudnn.so.9" in stray.fix, stray.fix
    # --apply, with the trainer's imports checked after every step it keeps.
    seen: list[str] = []

    def after_step(i: int, line: str) -> None:
        done = env.imports()
        assert done.returncode == 0, (line, done.stderr[-400:])
        seen.append(line)

    done = apply_plan("box", env.inventory(tmp_path, offline), after_step=after_step)
    assert done.ok, done.why
    assert seen == done.ran and seen
    assert lib.read_bytes() == real_cudnn(12) and env.imports().returncode == 0
    assert CUDNN13[0] not in done.after.snapshot.packages()


def test_the_proof_refuses_a_step_that_deletes_a_loader_file(tmp_path, fresh_venv, wheels):
    """The same stray, uninstalled as a finding asks outright: the proof refuses the command, and says which file."""
    env, _, _ = library_put_back_by_hand(tmp_path, fresh_venv, wheels)
    s = ea.audit_host("box", env.inventory(tmp_path)).snapshot
    finding = ea.Finding("warning", "stray-stack", "test: a stray", argv=[[s.python, "-m", "pip", "uninstall", "-y",
                                                                            CUDNN13[0]]], remove=[CUDNN13[0]])
    from dflashctl.envaudit.program import prove

    proof = prove([finding], s, ea.protected(s))
    assert finding.argv == [] and "libcudnn.so.9" in proof.refused[id(finding)], proof.refused
    assert "the loader resolves" in finding.fix


# --------------------------------------------------------------------------- --apply compares imports, not counts


def transformers_that_overwrites_cudnn(tmp_path: Path, fresh: Path) -> tuple[Venv, dict, Path]:
    """torch with its cuDNN put back by hand (no RECORD lists it), transformers too
    old for the trainer, and an index whose newer transformers ships a CUDA 13
    libcudnn.so.9 at the path torch loads: nothing in the environment's RECORDs
    says the upgrade touches that file."""
    d = tmp_path / "wheels"
    d.mkdir()
    write_wheel(d, "torch", TORCH_VERSION, real_torch_files(), [f"{CUDNN12[0]}=={CUDNN12[1]}"])
    write_wheel(d, *CUDNN12, real_cudnn_files(12, with_library=False))
    for name, version, files, requires in TRAINER_STACK[1:]:
        write_wheel(d, name, version, files, requires)
    old = dict(TRAINER_STACK[0][2], **{"transformers/__init__.py": "__version__ = '4.46.3'\nimport safetensors\n"})
    write_wheel(d, "transformers", "4.46.3", old, ["safetensors>=0.4.1"])
    new = dict(TRAINER_STACK[0][2], **{"nvidia/cudnn/lib/libcudnn.so.9": real_cudnn(13)})
    write_wheel(d, "transformers", "4.57.0", new, ["safetensors>=0.4.3"])
    shutil.copytree(fresh, tmp_path / "venv", symlinks=True)
    env = Venv.existing(tmp_path / "venv")
    offline = {**OFFLINE, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(d)}
    pip(env, offline, "install", "torch", "transformers==4.46.3")  # no triton: the plan installs it too
    lib = env.site / "nvidia/cudnn/lib/libcudnn.so.9"
    lib.parent.mkdir(parents=True, exist_ok=True)
    lib.write_bytes(real_cudnn(12))
    assert env.imports().returncode == 0, env.imports().stderr
    return env, offline, lib


def test_a_step_that_breaks_an_import_with_the_error_count_level_is_undone(tmp_path, fresh_venv):
    env, offline, lib = transformers_that_overwrites_cudnn(tmp_path, fresh_venv)
    inventory = env.inventory(tmp_path, offline)
    before = ea.audit_host("box", inventory, deep=True)
    assert before.counts()["error"] == 2, [f.message for f in before.findings if f.severity == "error"]
    # By hand, the upgrade the plan asks for: one error gone (transformers too old), one new (import torch).
    pip(env, offline, "install", "--no-deps", "transformers==4.57.0")
    by_hand = ea.audit_host("box", inventory, deep=True)
    assert by_hand.counts()["error"] == before.counts()["error"], [f.message for f in by_hand.findings]
    assert [f for f in by_hand.findings if f.code == "torch-import" and "built for CUDA 13" in f.message]
    pip(env, offline, "install", "--no-deps", "--force-reinstall", "transformers==4.46.3")
    lib.parent.mkdir(parents=True, exist_ok=True)  # the uninstall of 4.57.0 took the library and its directory
    lib.write_bytes(real_cudnn(12))
    assert env.imports().returncode == 0

    done = apply_plan("box", inventory)
    assert not done.ok and "transformers" in done.stopped, done.ran
    assert any("triton" in line for line in done.ran)  # the step before it was kept
    assert "`import torch` fails after it" in done.why and "CUDA 13" in done.why, done.why
    assert done.restored and env.imports().returncode == 0, env.imports().stderr
    assert lib.read_bytes() == real_cudnn(12)
    assert done.after.snapshot.packages()["transformers"] == "4.46.3"
    assert done.backups and not Path(done.backups).exists() and done.backups_left is None  # removed once undone
    assert str(env.root) in done.backups  # kept beside the environment (hard links), and said where


# --------------------------------------------------------------------------- the backups


def envsave(argument: dict) -> dict:
    import json
    import subprocess
    import sys

    from dflashctl.hosts import remote

    done = subprocess.run([sys.executable, "-I", "-S", "-c", remote.source("envsave"), json.dumps(argument)],
                          capture_output=True, text=True, timeout=60)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_backups_are_hard_links_a_restore_writes_only_what_changed_and_removes_pips_stashes(tmp_path):
    from tests.harness.envs import write_dist

    site = tmp_path / "venv" / "lib" / "site-packages"
    info = write_dist(site, "transformers", "4.46.3", {"transformers/__init__.py": "x = 1\n"})
    lib = site / "nvidia/cudnn/lib/libcudnn.so.9"  # a loader file no RECORD lists
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"cudnn 12")
    root = envsave({"action": "start", "near": str(tmp_path / "venv")})["dir"]
    assert Path(root).parent == tmp_path / "venv" and oct(Path(root).stat().st_mode)[-3:] == "700"
    step = f"{root}/step-0"
    assert envsave({"action": "save", "dir": step, "dist_infos": [str(info)], "files": [str(lib)]}) == \
        {"saved": 6, "errors": []}
    kept = Path(step) / "files" / str(lib).lstrip("/")
    assert kept.stat().st_ino == lib.stat().st_ino  # a hard link: no copy of a 1 GB library
    # A step that changed nothing (pip refused on a read-only environment): nothing is written back.
    assert envsave({"action": "restore", "dir": step}) == {"restored": 0, "errors": []}
    # A step killed halfway: the library replaced, a file gone, pip's stash left behind.
    lib.unlink()
    lib.write_bytes(b"cudnn 13")
    (site / "transformers/__init__.py").unlink()
    (site / "~ransformers").mkdir()
    assert envsave({"action": "restore", "dir": step}) == {"restored": 2, "errors": []}
    assert lib.read_bytes() == b"cudnn 12" and (site / "transformers/__init__.py").read_text() == "x = 1\n"
    assert not (site / "~ransformers").exists()
    # Dropped once not needed; only a directory envsave made.
    assert envsave({"action": "drop", "dir": str(site)})["errors"]
    assert envsave({"action": "drop", "dir": root}) == {"dropped": True, "errors": []} and not Path(root).exists()
