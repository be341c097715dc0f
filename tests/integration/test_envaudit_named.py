"""Things named for what they are, with fixes that fit them, in real venvs with
real pip: a relocated venv whose console scripts' #! lines are all that differ
(one finding, never a reinstall of torch), a meta-path finder a .pth installs,
a uv install in symlink mode whose cache was removed, pip's stash directories
left by a killed step, and the air-gapped path (what to carry, where to put it).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from dflashctl import envaudit as ea
from dflashctl.envaudit.apply import apply_plan
from tests.harness.envs import (
    OFFLINE,
    TORCH_VERSION,
    TRAINER_STACK,
    Venv,
    dist_info_name,
    healthy,
    pip,
    trainer_stack_wheels,
    write_wheel,
)

SCRIPTS = {"torch": "torchrun = torch:main", "transformers": "transformers-cli = transformers:main"}


@pytest.fixture
def wheels(tmp_path) -> Path:
    """torch and transformers with console scripts (pip writes them into bin/ with a #! line)."""
    d = tmp_path / "wheels"
    d.mkdir()
    trainer_stack_wheels(d)
    for name, version, files, requires in TRAINER_STACK[:1]:
        info = dist_info_name(name, "9.9.9")
        write_wheel(d, name, "9.9.9", {**files, "transformers/__init__.py": "def main():\n    return 0\n",
                                       f"{info}/entry_points.txt": f"[console_scripts]\n{SCRIPTS[name]}\n"},
                    requires)
    info = dist_info_name("torch", TORCH_VERSION)
    write_wheel(d, "torch", TORCH_VERSION, {
        "torch/__init__.py": "__version__ = '2.7.0+cu126'\ndef main():\n    return 0\n",
        "torch/version.py": "__version__ = '2.7.0+cu126'\ncuda = None\n",
        f"{info}/entry_points.txt": f"[console_scripts]\n{SCRIPTS['torch']}\n"})
    return d


def installed(tmp_path: Path, fresh: Path, wheels: Path) -> tuple[Venv, dict]:
    shutil.copytree(fresh, tmp_path / "venv", symlinks=True)
    env = Venv.existing(tmp_path / "venv")
    offline = {**OFFLINE, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels)}
    pip(env, offline, "install", "torch", "transformers==9.9.9", "triton")
    return env, offline


def relocate(env: Venv, to: Path, rewrite: str | None) -> Venv:
    """The venv moved (copied to ``to``, the old one gone), its scripts' #! lines
    pointed at ``rewrite`` (as a relocation tool does), or left as they were."""
    shutil.copytree(env.root, to, symlinks=True)
    shutil.rmtree(env.root)
    moved = Venv.existing(to)
    for script in (to / "bin").iterdir():
        text = script.read_bytes() if script.is_file() and not script.is_symlink() else b""
        if rewrite is not None and text.startswith(b"#!" + str(env.root).encode()):
            first, rest = text.split(b"\n", 1)
            script.write_bytes(b"#!" + rewrite.encode() + b"\n" + rest)
    return moved


def test_a_relocated_venv_whose_scripts_were_rewritten_is_one_finding_no_reinstall(tmp_path, fresh_venv, wheels):
    env, _ = installed(tmp_path, fresh_venv, wheels)
    moved = relocate(env, tmp_path / "moved", rewrite=str(tmp_path / "moved" / "bin" / "python"))
    report = moved.audit(tmp_path)
    (found,) = [f for f in report.findings if f.code == "relocated-scripts"]
    assert found.severity == "info" and "they run" in found.message and found.argv == []
    assert {"torch", "transformers"} <= set(found.packages)
    assert not [f for f in report.findings if f.code == "missing-files"], [f.message for f in report.findings]
    assert not [line for _, line in report.plan() if "torch" in line]
    assert subprocess.run([str(moved.root / "bin" / "torchrun")], timeout=60).returncode == 0


def test_scripts_that_run_another_python_get_one_cheap_fix(tmp_path, fresh_venv, wheels):
    env, offline = installed(tmp_path, fresh_venv, wheels)
    moved = relocate(env, tmp_path / "moved", rewrite="/opt/gone/bin/python3")
    inventory = moved.inventory(tmp_path, offline)
    report = ea.audit_host("box", inventory)
    (found,) = [f for f in report.findings if f.code == "relocated-scripts"]
    assert found.severity == "warning" and "/opt/gone/bin/python3" in found.message
    assert [a[:3] for a in found.argv] == [["sed", "-i", f"1s|^#!/opt/gone/bin/|#!{moved.root}/bin/|"]]
    steps = [argv for argv, _ in report.plan()]
    assert steps == found.argv  # one command: no reinstall of torch or anything else
    done = apply_plan("box", inventory)
    assert done.ok, done.why
    assert subprocess.run([str(moved.root / "bin" / "torchrun")], timeout=60).returncode == 0
    (after,) = [f for f in done.after.findings if f.code == "relocated-scripts"]
    assert after.severity == "info"


def test_a_meta_path_finder_a_pth_installs_is_named(tmp_path):
    env = healthy(tmp_path / "venv")
    elsewhere = tmp_path / "elsewhere" / "transformers"
    elsewhere.mkdir(parents=True)
    (elsewhere / "__init__.py").write_text("__version__ = '0.0-fork'\n")
    (env.site / "forkfinder.py").write_text(
        "import importlib.util, sys\n"
        "class ForkFinder:\n"
        "    @classmethod\n"
        "    def find_spec(cls, name, path=None, target=None):\n"
        "        if name == 'transformers':\n"
        f"            return importlib.util.spec_from_file_location(name, {str(elsewhere / '__init__.py')!r},\n"
        f"                submodule_search_locations=[{str(elsewhere)!r}])\n"
        "def install():\n"
        "    sys.meta_path.insert(0, ForkFinder)\n")
    (env.site / "fork.pth").write_text("import forkfinder; forkfinder.install()\n")
    assert "0.0-fork" in subprocess.run([env.python, "-c", "import transformers; print(transformers.__version__)"],
                                        capture_output=True, text=True, timeout=60).stdout
    report = env.audit(tmp_path)
    (found,) = [f for f in report.findings if f.code == "shadowed"]
    assert found.severity == "error" and "meta-path finder forkfinder.ForkFinder" in found.message
    assert str(env.site / "fork.pth") in found.message and found.argv == []
    assert found.fix.startswith(f"remove or correct {env.site / 'fork.pth'}")


def test_a_uv_symlink_install_whose_cache_was_removed_is_named_and_reinstalled(tmp_path, fresh_venv, wheels):
    env, offline = installed(tmp_path, fresh_venv, wheels)
    cache = tmp_path / "uv-cache" / "archive-v0" / "abc"
    for path in sorted((env.site / "transformers").rglob("*.py")):  # uv's link-mode=symlink: files point into its cache
        target = cache / path.relative_to(env.site)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(path), target)
        path.symlink_to(target)
    assert env.imports("transformers").returncode == 0
    shutil.rmtree(tmp_path / "uv-cache")  # `uv cache clean`
    inventory = env.inventory(tmp_path, offline)
    report = ea.audit_host("box", inventory)
    (found,) = [f for f in report.findings if f.code == "missing-files" and f.packages == ["transformers"]]
    assert found.severity == "error" and "symlinks into" in found.message and "uv install in symlink" in found.message
    assert str(cache) in found.message
    done = apply_plan("box", inventory)
    assert done.ok, done.why
    assert env.imports("transformers").returncode == 0
    assert not (env.site / "transformers" / "__init__.py").is_symlink()


def test_pip_stash_directories_are_named_and_removed(tmp_path):
    env = healthy(tmp_path / "venv")
    stash = env.site / "~ransformers"
    stash.mkdir()
    (stash / "__init__.py").write_text("")
    report = env.audit(tmp_path)
    (found,) = [f for f in report.findings if f.code == "pip-stash"]
    assert found.argv == [["rm", "-r", "--", str(stash)]] and found.severity == "warning"
    assert [argv for argv, _ in report.plan()] == found.argv


def test_the_air_gapped_path_says_what_to_carry_and_where(tmp_path, fresh_venv, wheels):
    env, offline = installed(tmp_path, fresh_venv, wheels)
    pip(env, offline, "uninstall", "-y", "safetensors")  # the trainer needs it: the plan installs it
    air_gapped = {**OFFLINE, "PIP_NO_INDEX": "1"}
    inventory = env.inventory(tmp_path, air_gapped)
    done = apply_plan("box", inventory)
    assert not done.ok and " download " in done.stopped
    assert "python -m pip download --dest DIR 'safetensors>=0.4.3' safetensors`" in done.why and "--wheels DIR" in done.why, done.why
    # Carried as it says: the wheels in a directory on the host, then --wheels.
    carried = tmp_path / "carried"
    carried.mkdir()
    shutil.copy(next(wheels.glob("safetensors-*.whl")), carried)
    done = apply_plan("box", inventory, wheels_from=str(carried))
    assert done.ok, done.why
    assert "safetensors" in done.after.snapshot.packages()
