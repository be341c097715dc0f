"""False negatives and plans that could not work, with real pip, wheels built
here and real shared objects (gcc): each environment is broken in a way an
earlier audit missed or could not fix, and each must now be an error (or a
finding of its own) whose fix works when --apply runs it.

- an editable checkout of a dependency that makes `import torch` fail, and one
  that makes `import transformers` fail: errors with --deep and in the launch
  preflight, which imports as --deep does;
- torch with no RECORD: pip can neither uninstall nor upgrade it;
- pip broken (its package deleted, or its code raising at import);
- transformers missing: installed with its requirements resolved;
- Python 3.8: no plan at all.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from dflashctl import envaudit as ea
from dflashctl.config import load_playbook
from dflashctl.envaudit.apply import apply_plan
from tests.harness.envs import (
    CUDNN12,
    OFFLINE,
    REAL_TORCH_INIT,
    TORCH_VERSION,
    TRAINER_STACK,
    Venv,
    dist_info_name,
    editable_checkout,
    pip,
    pyenv_python,
    pyenv_venv,
    real_cudnn_files,
    real_torch_files,
    torch_files,
    trainer_stack_wheels,
    write_dist,
    write_wheel,
)

SYMPY = ("sympy", "1.14.0")
HUB = ("huggingface-hub", "0.34.4")


@pytest.fixture
def wheels(tmp_path) -> Path:
    d = tmp_path / "wheels"
    d.mkdir()
    torch = dict(real_torch_files(), **{"torch/__init__.py": "import sympy\n" + REAL_TORCH_INIT})
    write_wheel(d, "torch", TORCH_VERSION, torch, [f"{CUDNN12[0]}=={CUDNN12[1]}", "sympy>=1.13.3"])
    write_wheel(d, *CUDNN12, real_cudnn_files(12))
    write_wheel(d, *SYMPY, {"sympy/__init__.py": "__version__ = '1.14.0'\n"})
    trainer_stack_wheels(d)  # transformers 4.56.2 (requires safetensors), safetensors, triton
    files = dict(TRAINER_STACK[0][2], **{"transformers/__init__.py": "import huggingface_hub, safetensors\n"})
    write_wheel(d, "transformers", "4.57.1", files, ["safetensors>=0.4.3", "huggingface-hub>=0.34,<1.0"])
    write_wheel(d, *HUB, {"huggingface_hub/__init__.py": ""})
    return d


def trainer_env(tmp_path: Path, fresh: Path, wheels: Path, *install: str) -> tuple[Venv, dict]:
    shutil.copytree(fresh, tmp_path / "venv", symlinks=True)
    env = Venv.existing(tmp_path / "venv")
    offline = {**OFFLINE, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels)}
    pip(env, offline, "install", *(install or ("torch", "transformers==4.56.2", "triton")))
    return env, offline


def playbook_for(tmp_path: Path, inventory):
    (tmp_path / "pb.yaml").write_text("host: box\ntrainer:\n  placement: {device: cpu}\n")
    return load_playbook(str(tmp_path / "pb.yaml"), inventory=inventory)


def errors(report: ea.AuditReport) -> list[ea.Finding]:
    return [f for f in report.findings if f.severity == "error"]


# --------------------------------------------------------------------------- false negatives


@pytest.mark.parametrize("module, dependency", [("torch", "sympy"), ("transformers", "safetensors")])
def test_an_editable_dependency_that_breaks_an_import_is_an_error_and_blocks_a_launch(
        tmp_path, fresh_venv, wheels, module, dependency):
    env, offline = trainer_env(tmp_path, fresh_venv, wheels)
    checkout = editable_checkout(tmp_path / "checkout", dependency, "9.9.dev0", {
        f"{dependency}/__init__.py": "raise ImportError('a half-finished refactor in the checkout')\n"})
    pip(env, offline, "install", "--no-build-isolation", "--no-deps", "-e", str(checkout))
    assert env.imports(module).returncode != 0
    inventory = env.inventory(tmp_path, offline)
    deep = ea.audit_host("box", inventory, deep=True)
    code = "torch-import" if module == "torch" else "import-error"
    found = [f for f in errors(deep) if f.code == code and "half-finished refactor" in f.message]
    assert found and deep.exit_code == 2, [(f.severity, f.code, f.message) for f in deep.findings]
    # The launch preflight imports as --deep does: the same error, which blocks a launch.
    from dflashctl import launch

    findings = launch.preflight(playbook_for(tmp_path, inventory), inventory)
    assert [f for f in findings if f.code == code and f.severity == "error"]
    assert launch.blocking_findings(findings)


def test_torch_without_a_record_is_said_and_the_fix_gives_it_one(tmp_path, fresh_venv, wheels):
    env, offline = trainer_env(tmp_path, fresh_venv, wheels)
    info = env.site / dist_info_name("torch", TORCH_VERSION)
    (info / "RECORD").unlink()  # what a tool that writes no RECORD, or a copy by hand, leaves
    failed = subprocess.run([env.python, "-m", "pip", "uninstall", "-y", "torch"], capture_output=True, text=True,
                            env={**os.environ, **offline}, timeout=120)
    assert failed.returncode != 0 and "RECORD" in failed.stderr  # pip cannot act on it
    inventory = env.inventory(tmp_path, offline)
    report = ea.audit_host("box", inventory)
    (found,) = [f for f in report.findings if f.code == "pip-unusable"]
    assert found.severity == "warning" and "has no RECORD" in found.message and report.exit_code >= 1
    assert found.argv == [[env.python, "-m", "pip", "install", "--ignore-installed", "--no-deps", "--index-url",
                           "https://download.pytorch.org/whl/cu126", f"torch=={TORCH_VERSION}"]]
    done = apply_plan("box", inventory)
    assert done.ok, done.why
    assert (info / "RECORD").is_file() and env.imports().returncode == 0
    assert not [f for f in done.after.findings if f.code == "pip-unusable"]


@pytest.mark.parametrize("how", ["package deleted", "raises at import"])
def test_a_broken_pip_is_a_finding_whose_fix_works(tmp_path, fresh_venv, wheels, how):
    env, offline = trainer_env(tmp_path, fresh_venv, wheels, "torch", "transformers==4.56.2")  # no triton: a fix
    if how == "package deleted":
        shutil.rmtree(env.site / "pip")
    else:
        (env.site / "pip/_internal/cli/main.py").write_text("raise RuntimeError('pip, half upgraded')\n")
    inventory = env.inventory(tmp_path, offline)
    report = ea.audit_host("box", inventory, deep=how == "raises at import")
    (found,) = [f for f in report.findings if f.code == "pip-unusable"]
    assert found.severity == "warning" and "pip is broken" in found.message, found.message
    pip_info = next(env.site.glob("pip-*.dist-info"))
    steps = [argv for argv, _ in report.plan()]
    assert steps[:2] == [["rm", "-r", "--", str(pip_info)], [env.python, "-m", "ensurepip"]], steps
    done = apply_plan("box", inventory)
    assert done.ok, done.why
    works = subprocess.run([env.python, "-m", "pip", "--version"], capture_output=True, text=True, timeout=120)
    assert works.returncode == 0, works.stderr
    assert "triton" in done.after.snapshot.packages()


def test_a_missing_trainer_requirement_is_installed_with_its_requirements(tmp_path, fresh_venv, wheels):
    env, offline = trainer_env(tmp_path, fresh_venv, wheels, "torch", "triton", "safetensors")
    inventory = env.inventory(tmp_path, offline)
    report = ea.audit_host("box", inventory)
    install = [line for _, line in report.plan() if " install " in line and "transformers" in line]
    assert install and "--no-deps" not in install[0], install
    assert f"torch=={TORCH_VERSION}" in install[0]  # pinned: pip refuses rather than change torch
    done = apply_plan("box", inventory)
    assert done.ok, done.why
    got = done.after.snapshot.packages()
    assert got["transformers"] == "4.57.1" and got["huggingface-hub"] == HUB[1] and got["torch"] == TORCH_VERSION
    assert env.imports("transformers").returncode == 0
    check = subprocess.run([env.python, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout


@pytest.mark.skipif(pyenv_python("3.8") is None, reason="no Python 3.8 here")
def test_no_plan_for_an_interpreter_the_trainer_cannot_run_on(tmp_path):
    env = pyenv_venv(tmp_path / "venv38", "3.8")
    for name, version, files, requires in TRAINER_STACK[1:]:  # no transformers; a stray stack
        write_dist(env.site, name, version, files, requires)
    write_dist(env.site, "torch", TORCH_VERSION, torch_files(), [])
    write_dist(env.site, "sglang", "0.5.3", {"sglang/__init__.py": ""})
    report = env.audit(tmp_path)
    assert report.plan() == []
    commanded = [f for f in report.findings if f.argv]
    assert not commanded, commanded
    said = [f for f in report.findings if f.code in ("trainer-requirement", "stray-stack") and f.fix]
    assert said and all("the trainer cannot run on Python 3.8" in f.fix for f in said if f.packages)
