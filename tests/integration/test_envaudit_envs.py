"""env-audit against real environments built here, audited by the collector run
by the environment's own python through the local transport.

Each environment is a real venv whose site-packages hold distributions written as
an installer writes them: files, and a dist-info with METADATA, INSTALLER and a
RECORD (hashes and sizes). On top of a healthy torch + cuDNN wheel pair, each test
adds one of the pollutions seen on hosts: a second cuDNN wheel for another CUDA
owning the same files, a package whose pins torch does not meet, a wheel's files or
dist-info deleted, a .pth that puts a second torch in front of or behind the
environment's, an empty METADATA, a user site beside system site-packages, a
dist-info in the current directory, PYTHONPATH entries.

The helpers (``write_dist``, ``write_wheel``, ``torch_files``, ``cudnn_files``)
are also used by the incident replay (tests/integration/test_envaudit_replay.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from dflashctl import envaudit as ea
from dflashctl.core.errors import TransportError
from dflashctl.core.signatures import classify
from tests.harness import cli
from tests.harness.envs import (
    CUDNN12,
    CUDNN13,
    PY,
    TORCH_REQUIRES,
    TORCH_VERSION,
    TRAINER_STACK,
    Venv,
    assert_removals_are_safe,
    by_code,
    cudnn_files,
    dist_info_name,
    healthy,
    metadata_text,
    pyenv_python,
    pyenv_venv,
    torch_files,
    write_dist,
)

# --------------------------------------------------------------------------- the tests


def test_a_healthy_environment_is_clean(tmp_path):
    env = healthy(tmp_path / "venv")
    report = env.audit(tmp_path)
    assert env.imports().returncode == 0
    assert report.torch == ea.TorchBuild(TORCH_VERSION, "12.6", "torch/version.py", str(env.site / "torch"))
    s = report.snapshot
    assert s.owner("torch").label() == f"torch {TORCH_VERSION}" and s.dropped_path == ""  # `python -c`: the cwd
    cudnn = s.torch_libs["libcudnn.so.9"]
    assert (cudnn.path, cudnn.via) == (str(env.site / "nvidia/cudnn/lib/libcudnn.so.9"), "RUNPATH")
    assert report.findings == [] and report.exit_code == 0


def test_two_cuda_builds_of_cudnn_owning_the_same_files(tmp_path):
    """The incident's environment: SGLang's CUDA 13 cuDNN installed over torch's CUDA 12 one."""
    env = healthy(tmp_path / "venv")
    stray = write_dist(env.site, *CUDNN13, cudnn_files("cudnn-cu13"))
    write_dist(env.site, "sglang", "0.5.3", {"sglang/__init__.py": ""}, ["torch==2.8.0", f"{CUDNN13[0]}>=9.10"])
    assert "cuDNN version incompatibility" in env.imports().stderr
    report = env.audit(tmp_path)
    found = by_code(report)
    python = env.python
    reinstall = [python, "-m", "pip", "install", "--force-reinstall", "--no-deps", f"{CUDNN12[0]}=={CUDNN12[1]}"]

    # The files both wheels list: an uninstall of either deletes them for the other.
    (shared,) = [f for f in found["shared-files"] if f.severity == "warning"]
    assert shared.packages == [CUDNN12[0], CUDNN13[0]]
    assert "nvidia/cudnn/lib/libcudnn.so.9" in shared.message and "uninstalling one deletes them" in shared.message

    # The stray's removal is simulated: `pip uninstall` would delete torch's cuDNN files, so torch's
    # cuDNN is put back first and the stray detached (its dist-info removed: no file deleted).
    (conflict,) = found["cuda-major"]
    assert conflict.severity == "error" and conflict.remove == [CUDNN13[0]]
    assert conflict.argv == [reinstall, ["rm", "-r", "--", str(stray)]]
    assert conflict.commands == [" ".join(reinstall), f"rm -r -- {stray}"]
    assert f"{CUDNN13[0]} is detached, not uninstalled: its RECORD lists files that {CUDNN12[0]} {CUDNN12[1]} " \
        "also lists, which are put back first" in conflict.fix

    # torch's cuDNN was overwritten: its RECORD says so, and what that does to `import torch`.
    (damaged,) = found["missing-files"]
    assert damaged.severity == "error" and damaged.argv == [reinstall]
    assert "1 file(s) its RECORD lists have another size or sha256 than recorded (nvidia/cudnn/lib/libcudnn.so.9)" in damaged.message
    assert "torch loads a libcudnn.so.9 that is not the one this wheel installed" in damaged.message
    assert f"{CUDNN13[0]} {CUDNN13[1]} also lists them" in damaged.message

    # What `pip check` says, and what it means for the trainer.
    (unmet,) = found["unmet-requirement"]
    assert unmet.severity == "warning" and unmet.packages == ["sglang"]
    assert "sglang 0.5.3 requires torch==2.8.0 (torch 2.7.0+cu126 is installed)" in unmet.message
    assert "would replace the trainer's torch" in unmet.message
    assert unmet.argv == [[python, "-m", "pip", "uninstall", "-y", "sglang"]]

    assert found["stray-stack"][0].argv == [[python, "-m", "pip", "uninstall", "-y", "sglang"]]
    assert report.exit_code == 2
    assert assert_removals_are_safe(report) >= 2  # the stray cuDNN is detached: no uninstall of it


def test_a_wheel_torch_needs_removed_says_import_torch_fails(tmp_path):
    env = healthy(tmp_path / "venv")
    info = env.site / dist_info_name(*CUDNN12)
    for rel in cudnn_files("cudnn-cu12"):
        (env.site / rel).unlink()
    for file in info.iterdir():
        file.unlink()
    info.rmdir()
    assert "libcudnn.so.9: cannot open shared object file" in env.imports().stderr
    report = env.audit(tmp_path)
    (missing,) = by_code(report)["missing-requirement"]
    text = "OSError: libcudnn.so.9: cannot open shared object file: No such file or directory"
    assert missing.message == (f"torch requires {CUDNN12[0]}=={CUDNN12[1]}, which is not installed: `import torch` "
                               f"fails with '{text}' (crash signature missing_shared_library)")
    assert classify(text).name == "missing_shared_library"  # the supervisor files the crash the same way
    assert missing.argv == [[env.python, "-m", "pip", "install", f"{CUDNN12[0]}=={CUDNN12[1]}"]]
    assert "torch-import" not in by_code(report)  # one finding for one cause

    # Only the dist-info gone (the files still there): pip calls it missing, torch still loads it.
    env2 = healthy(tmp_path / "venv2")
    info = env2.site / dist_info_name(*CUDNN12)
    for file in info.iterdir():
        file.unlink()
    info.rmdir()
    (missing,) = by_code(env2.audit(tmp_path))["missing-requirement"]
    assert missing.message.endswith(f"; torch still finds libcudnn.so.9 at {env2.site}/nvidia/cudnn/lib/libcudnn.so.9 "
                                    "(RUNPATH)")

    # Only the library gone (its RECORD still lists it): the loader finds it nowhere.
    env3 = healthy(tmp_path / "venv3")
    (env3.site / "nvidia/cudnn/lib/libcudnn.so.9").unlink()
    found = by_code(env3.audit(tmp_path))
    (damaged,) = found["missing-files"]
    assert damaged.severity == "error" and "`import torch` fails with 'OSError: libcudnn.so.9" in damaged.message
    (broken,) = found["torch-import"]
    assert broken.libraries == ["libcudnn.so.9"] and "crash signature missing_shared_library" in broken.message
    assert broken.argv == damaged.argv == [[env3.python, "-m", "pip", "install", "--force-reinstall", "--no-deps",
                                            f"{CUDNN12[0]}=={CUDNN12[1]}"]]


def test_a_pth_that_puts_a_second_torch_in_front(tmp_path):
    env = healthy(tmp_path / "venv")
    other = tmp_path / "other"
    for rel, content in torch_files("2.5.1+cu118", "11.8", needed=()).items():
        (other / rel).parent.mkdir(parents=True, exist_ok=True)
        (other / rel).write_text(content)
    pth = env.site / "zz_front.pth"
    pth.write_text(f"import sys; sys.path.insert(0, {str(other)!r})\n")
    report = env.audit(tmp_path)
    # The torch Python imports, not the one dist-info order names first.
    assert report.torch == ea.TorchBuild("2.5.1+cu118", "11.8", "torch/version.py", str(other / "torch"))
    (shadowed,) = by_code(report)["shadowed"]
    assert shadowed.severity == "error" and shadowed.paths == [str(other)]
    assert shadowed.message.startswith(f"torch is imported from {other}/torch/__init__.py (files no installed "
                                       f"distribution lists, under {other}, put on sys.path by {pth}), not from "
                                       f"torch {TORCH_VERSION} in {env.site}")
    (cuda,) = by_code(report)["cuda-major"]  # the imported torch's CUDA, against the wheels
    assert "torch's CUDA 11.8" in cuda.message and CUDNN12[0] in cuda.message
    assert cuda.remove == [] and cuda.argv == []  # torch's own requirement is never removed
    assert report.exit_code == 2


def test_a_pth_that_adds_a_second_torch_behind(tmp_path):
    env = healthy(tmp_path / "venv")
    other = tmp_path / "other"
    write_dist(other, "torch", "2.5.1", torch_files("2.5.1", None, needed=()))
    pth = env.site / "other.pth"
    pth.write_text(f"{other}\n")
    report = env.audit(tmp_path)
    assert report.torch.version == TORCH_VERSION  # the environment's comes first
    (twice,) = by_code(report)["duplicate-package"]
    assert twice.severity == "warning" and twice.paths == [str(other)]
    assert twice.message.startswith(f"torch is installed 2 times: torch {TORCH_VERSION} at {env.site} (imported); "
                                    f"torch 2.5.1 at {other}, put on sys.path by {pth}")
    assert "shadowed" not in by_code(report)


def test_an_empty_metadata_of_the_imported_torch(tmp_path):
    env = healthy(tmp_path / "venv")
    info = env.site / dist_info_name("torch", TORCH_VERSION)
    (info / "METADATA").write_text("")
    # A stale torch dist-info from an older install, without files: first in dist-info order.
    stale = env.site / "torch-2.5.0.dist-info"
    stale.mkdir()
    (stale / "METADATA").write_text(metadata_text("torch", "2.5.0", []))
    report = env.audit(tmp_path)
    assert report.torch.version == TORCH_VERSION and report.torch.cuda == "12.6"  # from the imported files
    (broken,) = by_code(report)["broken-metadata"]
    assert broken.severity == "error" and broken.paths == [str(info)]
    assert "METADATA has no name; it owns torch, which the trainer imports from it" in broken.message
    assert broken.message.endswith(f"(pip lists torch 2.5.0 at {env.site} instead, which is not what is imported)")
    assert broken.argv == [["rm", "-r", "--", str(info)],
                           [env.python, "-m", "pip", "install", "--force-reinstall", "--no-deps", "--index-url",
                            "https://download.pytorch.org/whl/cu126", f"torch=={TORCH_VERSION}"]]
    assert report.exit_code == 2


def test_user_site_beside_system_site_packages(tmp_path):
    """A venv with system site-packages puts the user site after its own site-packages
    and before the system's: the venv's copy is the one imported, and nothing blocks
    a launch. (The system site-packages are this machine's: only what the user site
    shadows there, if anything, is asserted on.)"""
    env = healthy(tmp_path / "venv", system_site=True)
    base = tmp_path / "userbase"
    user_site = base / "lib" / PY / "site-packages"
    write_dist(user_site, "sympy", "1.12", {"sympy/__init__.py": "__version__ = '1.12'\n"})
    write_dist(user_site, "tqdm-lite", "0.1", {"tqdm_lite.py": ""})
    report = env.audit(tmp_path, env={"PYTHONUSERBASE": str(base)})
    s = report.snapshot
    assert s.user_site == str(user_site) and s.user_site_enabled
    assert s.sys_path.index(str(env.site)) < s.sys_path.index(str(user_site))
    assert s.owner("sympy").location == str(env.site) and s.installed()["sympy"].version == "1.14.0"
    found = by_code(report)
    assert ("info", ["tqdm-lite"]) in [(f.severity, f.packages) for f in found["user-site"]]
    assert not [f for f in found.get("user-site", []) + found.get("shadowed", [])
                if f.severity != "info" and "sympy" in f.packages]
    (twice,) = [f for f in found["duplicate-package"] if f.packages == ["sympy"]]
    assert f"sympy 1.14.0 at {env.site} (imported); sympy 1.12 at {user_site}" in twice.message
    assert report.exit_code < 2, [f for f in report.findings if f.severity == "error"]

    # What the user site does shadow (a copy in the system site-packages) is said, by the import system.
    system = [d for d in s.dists if d.location not in (str(env.site), str(user_site)) and d.modules]
    if system:
        victim = system[0]
        write_dist(user_site, victim.name, "0.0.1", {f"{victim.modules[0]}/__init__.py": ""})
        report = env.audit(tmp_path, env={"PYTHONUSERBASE": str(base)})
        assert report.snapshot.owner(victim.modules[0]).location == str(user_site)
        (shadows,) = [f for f in by_code(report)["user-site"] if f.packages == [victim.name]]
        assert shadows.message.startswith(f"user site-packages {user_site} shadows {victim.label()}: Python imports "
                                          f"the user copy ({victim.name} 0.0.1) first")


def test_a_dist_info_in_the_current_directory_is_not_installed(tmp_path):
    env = healthy(tmp_path / "venv")
    cwd = tmp_path / "somewhere"
    write_dist(cwd, "torch", "99.0.0", torch_files("99.0.0", None, needed=()))
    inventory = env.inventory(tmp_path)
    done = cli.invoke("--inventory", inventory.source, "env-audit", "box", "--json", cwd=cwd,
                      env={"DFLASHCTL_STORE": str(tmp_path / "runs.db")})
    payload = json.loads(done.stdout)
    assert payload["torch"]["version"] == TORCH_VERSION and payload["packages"]["torch"] == TORCH_VERSION
    assert done.returncode == payload["exit_code"] == 0, payload["findings"]


def test_pythonpath_only_when_an_entry_shadows_something(tmp_path):
    env = healthy(tmp_path / "venv")
    tools, shadow = tmp_path / "tools", tmp_path / "shadow"
    (tools / "my_tools").mkdir(parents=True)
    (tools / "my_tools" / "__init__.py").write_text("")
    (shadow / "sympy").mkdir(parents=True)
    (shadow / "sympy" / "__init__.py").write_text("")
    report = env.audit(tmp_path, env={"PYTHONPATH": f"{tools}:{tmp_path / 'missing'}"})
    assert "pythonpath" not in by_code(report) and report.exit_code == 0
    report = env.audit(tmp_path, env={"PYTHONPATH": f"{tools}:{shadow}"})
    (entry,) = by_code(report)["pythonpath"]
    assert entry.severity == "error" and entry.paths == [str(shadow)] and entry.packages == ["sympy"]


def test_deep_imports_torch_in_a_subprocess(tmp_path):
    env = healthy(tmp_path / "venv")
    report = env.audit(tmp_path, deep=True)
    assert report.torch.source == "import torch (--deep)" and report.torch.version == TORCH_VERSION
    assert report.snapshot.deep["exit_code"] == 0 and report.exit_code == 0
    write_dist(env.site, *CUDNN13, cudnn_files("cudnn-cu13"))
    report = env.audit(tmp_path, deep=True)
    (failed,) = by_code(report)["torch-import"]
    assert failed.severity == "error" and "`import torch` fails on the host: RuntimeError: cuDNN version " \
        "incompatibility" in failed.message
    assert failed.detail["crash_signature"] == "cudnn_version_mismatch"


def test_the_collector_answers_in_time_and_from_its_own_python(tmp_path):
    env = healthy(tmp_path / "venv")
    s = env.audit(tmp_path).snapshot
    assert s.python == env.python and s.prefix == str(env.root)
    assert s.seconds is not None and s.seconds < 10
    torch = s.dist(s.modules["torch"].owners[0])
    assert torch.installer == "pip" and torch.files == 7 and torch.missing_count == torch.changed_count == 0
    assert torch.libs == [] and torch.modules == ["torch"]  # libtorch_cuda.so is not a followed library
    cudnn = s.installed()["nvidia-cudnn-cu12"]
    assert cudnn.libs == ["nvidia/cudnn/lib/libcudnn.so.9"] and cudnn.modules == ["nvidia"]
    assert s.modules["nvidia"].namespace is False  # it has an __init__.py in these wheels
    assert s.torch_elf == {"file": "torch/lib/libtorch_cuda.so", "needed": ["libcudnn.so.9"],
                           "runpath": "$ORIGIN/../../nvidia/cudnn/lib"}


def test_fixes_install_pip_first_where_it_is_missing(tmp_path):
    env = healthy(tmp_path / "venv")
    for path in [env.site / "pip", env.site / dist_info_name("pip", "24.0")]:
        shutil.rmtree(path)
    write_dist(env.site, *CUDNN13, cudnn_files("cudnn-cu13"))
    report = env.audit(tmp_path)
    (conflict,) = by_code(report)["cuda-major"]
    assert conflict.argv[0] == [env.python, "-m", "ensurepip"] and conflict.argv[-1][-1].startswith(
        str(env.site / CUDNN13[0].replace("-", "_")))
    steps = [argv for argv, _ in report.plan()]
    assert steps[0] == [env.python, "-m", "ensurepip"] and steps.count(steps[0]) == 1


def test_a_protected_wheel_missing_only_its_script_or_a_data_file_still_imports(tmp_path):
    """Seen on a real GPU image: wheels installed with --target have no bin/ scripts,
    and the image patches certifi's CA bundle. torch still imports: a warning that
    says so, never the error that blocks a launch."""
    env = healthy(tmp_path / "venv")
    (info,) = env.site.glob("sympy-*.dist-info")
    (env.site / "sympy" / "data.pem").write_text("y" * 70)  # patched after install
    with open(info / "RECORD", "a") as f:
        f.write("../../../bin/isympy,sha256=abc,12\nsympy/data.pem,sha256=abc,50\n")
    (damaged,) = by_code(env.audit(tmp_path))["missing-files"]
    assert damaged.severity == "warning" and "it still imports" in damaged.message
    (env.site / "sympy" / "__init__.py").unlink()  # now a file it imports is gone
    (damaged,) = by_code(env.audit(tmp_path))["missing-files"]
    assert damaged.severity == "error"


def test_a_pth_that_prints_to_stdout_at_start_and_at_exit(tmp_path):
    """Code in a .pth runs in every python, the collector's too: what it prints
    around the answer is not the answer."""
    env = healthy(tmp_path / "venv")
    (env.site / "noisy.pth").write_text(
        "import sys, atexit; print('hello from a .pth', end=''); atexit.register(lambda: print('bye {\\\"v\\\": 2}'))\n")
    assert "bye" in env.imports("sympy").stdout
    report = env.audit(tmp_path, deep=True)
    assert report.torch.source == "import torch (--deep)" and report.exit_code == 0, report.findings


# --------------------------------------------------------------------------- the trainer's own needs


def test_the_trainers_own_requirements(tmp_path):
    env = healthy(tmp_path / "venv")
    for name in ("transformers", "safetensors", "triton"):
        version = next(v for n, v, _, _ in TRAINER_STACK if n == name)
        info = env.site / dist_info_name(name, version)
        for file in info.iterdir():
            file.unlink()
        info.rmdir()
    found = {f.packages[0]: f for f in by_code(env.audit(tmp_path))["trainer-requirement"]}
    assert set(found) == {"transformers", "safetensors", "triton"}
    assert all(f.severity == "error" for f in found.values())
    assert found["transformers"].argv == [[env.python, "-m", "pip", "install", "transformers>=4.51"]]
    assert found["safetensors"].argv == [[env.python, "-m", "pip", "install", "safetensors"]]
    assert "torch 2.7.0+cu126 (CUDA 12.6) is a CUDA build but no Triton is installed" in found["triton"].message
    assert found["triton"].argv == [[env.python, "-m", "pip", "install", "triton==3.3.1"]]

    # Too old, and new enough but without the Qwen3 classes the drafter is built from.
    write_dist(env.site, "safetensors", "0.5.3", {"safetensors/__init__.py": ""})
    write_dist(env.site, "triton", "3.3.1", {"triton/__init__.py": ""})
    write_dist(env.site, "transformers", "4.46.3", {"transformers/__init__.py": "",
                                                    "transformers/models/qwen3/__init__.py": ""})
    (old,) = by_code(env.audit(tmp_path))["trainer-requirement"]
    assert old.message == "transformers 4.46.3 is older than the transformers 4.51 the trainer needs: the trainer " \
                          "cannot start"
    shutil.rmtree(env.site / dist_info_name("transformers", "4.46.3"))
    shutil.rmtree(env.site / "transformers")
    write_dist(env.site, "transformers", "4.52.0", {"transformers/__init__.py": "",
                                                    "transformers/models/llama/__init__.py": ""})
    (classes,) = by_code(env.audit(tmp_path))["trainer-requirement"]
    assert "transformers 4.52.0 has no qwen3 model classes (transformers/models/qwen3/)" in classes.message
    assert classes.argv == [[env.python, "-m", "pip", "install", "transformers>=4.51"]]

    # torch too old for the trainer.
    write_dist(env.site, "torch", "2.5.1+cu124", torch_files("2.5.1+cu124", "12.4"), TORCH_REQUIRES)
    found = [f for f in by_code(env.audit(tmp_path))["trainer-requirement"] if f.packages == ["torch"]]
    assert found and "older than the torch 2.6 the trainer needs" in found[0].message
    assert found[0].argv[-1][-2:] == ["https://download.pytorch.org/whl/cu124", "torch>=2.6"]


@pytest.mark.skipif(pyenv_python("3.8") is None, reason="no Python 3.8 here")
def test_a_python_older_than_the_trainer_needs(tmp_path):
    env = pyenv_venv(tmp_path / "venv38", "3.8")
    for name, version, files, requires in TRAINER_STACK:
        write_dist(env.site, name, version, files, requires)
    write_dist(env.site, "torch", TORCH_VERSION, torch_files(), ["sympy"])
    write_dist(env.site, "sympy", "1.13.3", {"sympy/__init__.py": ""})
    found = [f for f in env.audit(tmp_path).findings if f.code == "trainer-requirement"]
    assert [f.message for f in found] == [f"{env.python} is Python 3.8.18: the trainer needs Python 3.10 or newer"]
    assert found[0].severity == "error" and found[0].argv == []


@pytest.mark.skipif(pyenv_python("3.7") is None, reason="no Python 3.7 here")
def test_a_python_too_old_to_be_audited_is_exit_3_with_the_reason(tmp_path):
    root = tmp_path / "venv37"
    subprocess.run([pyenv_python("3.7"), "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    inventory = Venv.existing(root).inventory(tmp_path)
    with pytest.raises(TransportError, match=r"is Python 3\.7\.\d+: too old to be audited"):
        ea.audit_host("box", inventory)
    done = cli.invoke("--inventory", inventory.source, "env-audit", "box", "--json",
                      env={"DFLASHCTL_STORE": str(tmp_path / "runs.db")})
    assert done.returncode == 3 and "too old to be audited" in json.loads(done.stdout)["error"]


def test_a_system_site_packages_venv_never_gets_a_command_for_the_base(tmp_path):
    """The base interpreter's packages (and those of a directory a .pth adds) are
    not this environment's pip's to change: what is wrong with them is
    information, with no command (an uninstall of a base package is a no-op that
    comes back every audit; a reinstall would install another copy into the venv)."""
    env = healthy(tmp_path / "venv", system_site=True)
    extra = tmp_path / "extra"
    write_dist(extra, "vllm", "0.11.0", {"vllm/__init__.py": ""}, ["torch==2.8.0"])
    write_dist(extra, "demo-lib", "1.0", {"demo_lib/__init__.py": "", "demo_lib/gone.py": ""})
    (extra / "demo_lib" / "gone.py").unlink()
    (env.site / "extra.pth").write_text(f"{extra}\n")
    report = env.audit(tmp_path)
    s = report.snapshot
    outside = {d.key for d in s.dists if d.key and not d.location.startswith(str(env.root) + "/")}
    inside = {d.key for d in s.dists if d.key and d.location.startswith(str(env.root) + "/")}
    only_outside = outside - inside
    assert {"vllm", "demo-lib"} <= only_outside
    for f in report.findings:
        if {canonicalize_name(p) for p in f.packages} <= only_outside and f.packages:
            assert f.severity == "info" and f.argv == [], f
    (stray,) = by_code(report)["stray-stack"]
    assert "no command is given: vllm 0.11.0 lies outside the environment" in stray.fix
    (damaged,) = [f for f in by_code(report)["missing-files"] if f.packages == ["demo-lib"]]
    assert "this environment's pip does not change it" in damaged.fix
    assert not [line for _, line in report.plan() if "vllm" in line or "demo-lib" in line]
    assert report.exit_code < 2


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None or not os.path.exists("/usr/bin/python3.11"),
                    reason="needs root, setpriv and /usr/bin/python3.11 (to audit as an unprivileged user)")
def test_permission_denied_is_named_as_such(tmp_path):
    """Files and metadata the trainer's user may not read: said as permission
    denied, never as 'missing', 'not installed' or 'no name'. The audit runs as
    nobody (root reads everything), through the inventory's python: line."""
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="envaudit-perm-", dir="/tmp"))
    try:
        base.chmod(0o755)
        root = base / "venv"
        subprocess.run(["/usr/bin/python3.11", "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
        env = Venv.existing(root)
        env.site = root / "lib" / "python3.11" / "site-packages"
        write_dist(env.site, "torch", TORCH_VERSION, torch_files(), TORCH_REQUIRES)
        write_dist(env.site, *CUDNN12, cudnn_files("cudnn-cu12"))
        write_dist(env.site, "sympy", "1.14.0", {"sympy/__init__.py": ""})
        for name, version, files, requires in TRAINER_STACK:
            write_dist(env.site, name, version, files, requires)
        locked = write_dist(env.site, "locked-tool", "1.0", {"locked_tool.py": ""})
        (locked / "METADATA").chmod(0)
        (env.site / "sympy" / "__init__.py").chmod(0)
        (env.site / "nvidia" / "cudnn" / "lib").chmod(0)
        env.python = f"setpriv --reuid=65534 --regid=65534 --clear-groups {root}/bin/python"
        report = env.audit(tmp_path)
        found = by_code(report)
        (sympy,) = [f for f in found["missing-files"] if f.packages == ["sympy"]]
        assert sympy.severity == "error" and "permission denied: 1 file(s) its RECORD lists cannot be read " \
            "by this user (sympy/__init__.py)" in sympy.message and sympy.argv == []
        (cudnn,) = [f for f in found["missing-files"] if f.packages == [CUDNN12[0]]]
        assert "permission denied" in cudnn.message and "nvidia/cudnn/lib/libcudnn.so.9" in cudnn.message
        assert "are missing" not in cudnn.message and cudnn.argv == []
        (meta,) = found["broken-metadata"]
        assert meta.message.startswith(f"{locked}: permission denied reading its METADATA") and meta.argv == []
        assert "no name" not in meta.message
    finally:
        for path in (base / "venv" / "lib" / "python3.11" / "site-packages" / "nvidia" / "cudnn" / "lib",):
            if path.exists():
                path.chmod(0o755)
        shutil.rmtree(base, ignore_errors=True)


def test_a_shared_file_of_the_same_size_is_told_apart_by_its_sha256(tmp_path):
    """Two builds of one library with the same size: the size says nothing, the
    RECORDs' sha256 say whose bytes are on disk."""
    env = healthy(tmp_path / "venv")
    same_size = {rel: (data.replace(b"cudnn-cu12", b"cudnn-cu13") if isinstance(data, bytes) else data)
                 for rel, data in cudnn_files("cudnn-cu12").items()}
    stray = write_dist(env.site, *CUDNN13, same_size)
    assert "cuDNN version incompatibility" in env.imports().stderr
    report = env.audit(tmp_path)
    s = report.snapshot
    (group,) = [g for g in s.shared if any(p.endswith("libcudnn.so.9") for p in g.paths)]
    assert s.dist(group.holder).name == CUDNN13[0]  # whose bytes the file holds, by hash
    (damaged,) = by_code(report)["missing-files"]
    assert damaged.packages == [CUDNN12[0]] and damaged.severity == "error"
    assert "have another size or sha256 than recorded (nvidia/cudnn/lib/libcudnn.so.9)" in damaged.message
    (conflict,) = by_code(report)["cuda-major"]
    assert conflict.argv[-1] == ["rm", "-r", "--", str(stray)]
    assert "--force-reinstall" in conflict.argv[0] and conflict.argv[0][-1] == f"{CUDNN12[0]}=={CUDNN12[1]}"
