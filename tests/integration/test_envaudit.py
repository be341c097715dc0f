"""env-audit: the rules on the real GPU-host captures (tests/fixtures/env, with every
distribution's metadata from `pip inspect`), rule tables (duplicate libraries,
ignore rules, fixes), the collector run by a real python (this one and a 3.8), on
this machine and through jump + container, the CLI (exit codes, --json always a
document), drift against the playbook's last good run in a real store, and the
launcher's preflight (fixes shown, drift in a dry run).

Real environments built from wheels' metadata are tests/integration/test_envaudit_envs.py; the
incident replayed with real pip is tests/integration/test_envaudit_replay.py.
"""

from __future__ import annotations

import ast
import copy
import glob
import gzip
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from dflashctl import envaudit as ea
from dflashctl.config import load_inventory, load_playbook
from dflashctl.core.errors import ConfigError, TransportError
from dflashctl.envaudit.snapshot import FRAME, framed
from dflashctl.hosts import remote
from dflashctl.store import Store
from tests import harness
from tests.harness import cli, environ

FIXTURES = harness.FIXTURES / "env"
COLLECTOR = Path(remote.__file__).parent / "audit.py"
SITE = "/opt/torch/.venv/lib/python3.12/site-packages"

LINUX = {"platform_system": "Linux", "sys_platform": "linux", "python_version": "3.12",
         "python_full_version": "3.12.3", "platform_machine": "x86_64", "os_name": "posix",
         "implementation_name": "cpython", "platform_python_implementation": "CPython"}
VERSION_PY_CU130 = "__version__ = '2.11.0+cu130'\ndebug = False\ncuda: Optional[str] = '13.0'\nhip = None\n"


def _capture(name: str) -> str:
    return (FIXTURES / name).read_text()


# --------------------------------------------------------------------------- captures -> snapshot
#
# The fixtures were captured with pip and a few python lines, not with the collector:
# these read them into a Snapshot so that the rules run on a real GPU host's packages.

_FREEZE_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(?:==\s*(\S+)|@\s*(\S+))")


def parse_pip_freeze(text: str) -> list[tuple[str, str]]:
    """``pip freeze`` -> [(name, version)]; ``name @ url`` lines get version '' (unknown)."""
    found = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "-")):
            continue
        m = _FREEZE_LINE.match(line)
        if m:
            found.append((m.group(1), m.group(2) or ""))
    return found


def parse_python_paths(text: str) -> tuple[str, list[str], str | None]:
    """Three lines: ``sys.prefix``, ``repr(sys.path)``, ``site.getusersitepackages()``."""
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) < 2:
        raise ValueError("expected sys.prefix, sys.path and the user site on three lines")
    path = ast.literal_eval(lines[1].strip())
    return lines[0].strip(), [str(p) for p in path], (lines[2].strip() if len(lines) > 2 else None)


def parse_libs_capture(text: str) -> tuple[list[ea.LibEntry], list[str]]:
    """The libs capture: filtered ``ldconfig -p`` lines, then ``LD_LIBRARY_PATH=...``."""
    ld_path: list[str] = []
    for line in text.splitlines():
        if line.startswith("LD_LIBRARY_PATH="):
            ld_path = [p for p in line.split("=", 1)[1].strip().split(":") if p]
    return ea.parse_ldconfig(text), ld_path


def pip_inspect() -> dict:
    with gzip.open(FIXTURES / "gpu-pip-inspect.json.gz", "rt") as f:
        return json.load(f)


def gpu_host() -> ea.Snapshot:
    """The captured H200 host as a snapshot: every distribution with the metadata
    `pip inspect` read on the host (name, version, location, requirements), the
    environment markers it reported, its paths and its ldconfig cache. A capture
    does not ask the import system: the rules that need it stay silent."""
    inspect = pip_inspect()
    prefix, sys_path, user_site = parse_python_paths(_capture("gpu-python-paths.txt"))
    entries, ld_path = parse_libs_capture(_capture("gpu-libs.txt"))
    dists = [ea.Dist(d["metadata"]["name"], d["metadata"]["version"], d["metadata_location"].rsplit("/", 1)[0],
                     list(d["metadata"].get("requires_dist") or []), index=i)
             for i, d in enumerate(inspect["installed"])]
    return ea.Snapshot(host="gpu1", python=f"{prefix}/bin/python3", prefix=prefix, base_prefix="/usr",
                       sys_path=sys_path, user_site=user_site, user_site_enabled=bool(user_site in sys_path),
                       markers=dict(inspect["environment"]), dists=dists, ldconfig=entries, ld_library_path=ld_path)


def _with(snapshot: ea.Snapshot, *dists: ea.Dist, drop: tuple[str, ...] = ()) -> ea.Snapshot:
    s = copy.deepcopy(snapshot)
    replaced = {d.key for d in dists} | {canonicalize_name(n) for n in drop}
    s.dists = [d for d in s.dists if d.key not in replaced] + list(dists)
    for i, d in enumerate(s.dists):
        d.index = i
    return s


def _codes(findings) -> list[tuple[str, str]]:
    return [(f.severity, f.code) for f in findings]


def _one(findings, code: str) -> ea.Finding:
    (found,) = [f for f in findings if f.code == code]
    return found


# --------------------------------------------------------------------------- captures


def test_pip_freeze_capture():
    found = dict(parse_pip_freeze(_capture("gpu-pip-freeze.txt")))
    assert len(found) == 196
    assert found["torch"] == "2.11.0" and found["triton"] == "3.6.0"
    assert found["nvidia-cufft"] == "12.0.0.61" and found["nvidia-cudnn-cu13"] == "9.19.0.56"
    assert parse_pip_freeze("-e git+https://x/y.git#egg=y\nfoo @ file:///tmp/foo\n# comment\n") == [("foo", "")]


def test_pip_list_and_inspect_captures_agree_with_freeze():
    listed = {canonicalize_name(d["name"]): d["version"] for d in json.loads(_capture("gpu-pip-list.json"))}
    frozen = {canonicalize_name(n): v for n, v in parse_pip_freeze(_capture("gpu-pip-freeze.txt"))}
    inspected = {canonicalize_name(d["metadata"]["name"]): d["metadata"]["version"] for d in pip_inspect()["installed"]}
    assert listed.pop("pip") == "24.0" == inspected.pop("pip")  # `pip freeze` leaves pip itself out
    assert listed == frozen == inspected


def test_python_paths_capture():
    prefix, path, user_site = parse_python_paths(_capture("gpu-python-paths.txt"))
    assert prefix == "/opt/torch/.venv"
    assert path[-1] == SITE and len(path) == 5
    assert user_site == "/root/.local/lib/python3.12/site-packages" and user_site not in path


def test_libs_capture():
    entries, ld_path = parse_libs_capture(_capture("gpu-libs.txt"))
    assert len(entries) == 22
    assert ld_path == ["/usr/local/nvidia/lib64", "/usr/local/nvidia/lib"]
    cuda = [e.path for e in entries if e.soname == "libcuda.so.1"]
    assert cuda == ["/usr/local/nvidia/lib64/libcuda.so.1", "/lib/libcuda.so.1"]  # cache order kept
    assert ea.LibEntry("libcudnn.so.9", "/lib/x86_64-linux-gnu/libcudnn.so.9") in entries


# --------------------------------------------------------------------------- CUDA majors


def test_cuda_major_of_every_cuda_wheel_in_the_capture():
    majors = {d.name: ea.cuda_major(d) for d in gpu_host().dists}
    # Un-suffixed CUDA 13 wheels, including those with their own version schemes
    # (naively cuFFT 12.x, cuSOLVER 12.x and cuSPARSE 12.6 read as CUDA 12).
    for name in ("nvidia-cublas", "nvidia-cuda-runtime", "nvidia-cuda-nvrtc", "nvidia-cuda-cupti", "nvidia-cufft",
                 "nvidia-cufile", "nvidia-curand", "nvidia-cusolver", "nvidia-cusparse", "nvidia-nvjitlink",
                 "nvidia-nvtx", "nvidia-cudnn-cu13", "nvidia-nccl-cu13", "nvidia-cusparselt-cu13",
                 "nvidia-nvshmem-cu13", "cuda-toolkit", "cuda-bindings", "cupy-cuda13x", "jax-cuda13-plugin",
                 "jax-cuda13-pjrt"):
        assert majors[name] == 13, name
    # Not CUDA-specific, whatever their version says: nvidia-ml-py follows the driver.
    for name in ("nvidia-ml-py", "cuda-core", "cuda-pathfinder", "numba-cuda", "torch-geometric"):
        assert majors[name] is None, name
    assert {n for n, m in majors.items() if m is not None and m != 13} == set()


@pytest.mark.parametrize("name, version, major", [
    ("nvidia-cufft-cu12", "11.3.3.83", 12),
    ("nvidia-cufft", "11.3.3.83", 12),
    ("nvidia-cusparse", "12.5.8.93", 12),
    ("nvidia-cusparse", "12.6.3.3", 13),
    ("nvidia-curand", "10.3.9.90", 12),
    ("nvidia-cublas", "13.1.0.3", 13),
    ("nvidia-cudnn-cu12", "9.10.2.21", 12),
    ("torchvision", "0.23.0+cu128", 12),
    ("cupy-cuda12x", "13.6.0", 12),
    ("nvidia-dali-cuda120", "1.50.0", 12),
    ("cuda-bindings", "12.9.2", 12),
    ("nvidia-cufft", "99.0", None),  # outside every known range: nothing is claimed
])
def test_cuda_major_table(name, version, major):
    assert ea.cuda_major(ea.Dist(name, version)) == major


def test_torch_cuda_build_from_a_capture():
    s = gpu_host()
    assert ea.torch_build(s) == ea.TorchBuild("2.11.0", "13", "the CUDA wheels it requires")  # PyPI: no label
    s.torch_version_py = VERSION_PY_CU130
    assert ea.torch_build(s) == ea.TorchBuild("2.11.0+cu130", "13.0", "torch/version.py")
    assert ea.torch_build(_with(gpu_host(), ea.Dist("torch", "2.7.1+cu128"))).cuda == "12.8"
    assert ea.torch_build(_with(gpu_host(), ea.Dist("torch", "2.7.1+cpu"))).cuda is None
    assert ea.torch_build(_with(gpu_host(), drop=("torch",))) is None


# --------------------------------------------------------------------------- the real GPU host


def test_the_real_gpu_host_is_clean():
    """Nothing there needs fixing (the capture's `pip check`: no broken requirements):
    the system cuDNN / NCCL beside the wheels' are the image's CUDA toolkit, torch loads
    the wheels' copies through its RUNPATH, and the versions cannot be told apart."""
    s = gpu_host()
    findings = ea.audit(s)
    assert _codes(findings) == [("info", "duplicate-library")] * 3 + [("info", "other-framework")]
    cudnn, nccl, libcuda, frameworks = findings
    assert cudnn.packages == ["nvidia-cudnn-cu13"] and len(cudnn.libraries) == 8 and "libcudnn.so.9" in cudnn.libraries
    assert "versions not comparable" in cudnn.message and "torch loads the wheel's copy" in cudnn.message
    assert cudnn.fix is None and cudnn.argv == [] and cudnn.remove == []
    assert nccl.packages == ["nvidia-nccl-cu13"] and nccl.libraries == ["libnccl.so.2"]
    assert "/usr/local/nvidia/lib64/libcuda.so.1 is the one loaded (it is on LD_LIBRARY_PATH)" in libcuda.message
    assert frameworks.packages == ["jax-cuda13-pjrt", "cupy-cuda13x", "jax-cuda13-plugin"]
    assert ea.exit_code(findings) == 0
    assert ea.unmet_requirements(s) == []  # what `pip check` said on that host
    # Every pin of torch 2.11.0 (through the cuda-toolkit extras too) is met.
    checks = ea.requirement_checks(s)
    assert checks and all(c.satisfied for c in checks)
    assert "torch -> cuda-toolkit[cublas,cudart,cufft,cufile,cupti,curand,cusolver,cusparse,nvjitlink,nvrtc,nvtx]" \
        in {c.chain for c in checks}
    assert "nvidia-npp" not in {c.requirement.name for c in checks}  # an extra nobody asked for
    assert {"nvidia-cudnn-cu13", "triton", "huggingface-hub", "tokenizers"} <= ea.protected(s)


# --------------------------------------------------------------------------- duplicate libraries: precision


def _cudnn_twice(*, system_file: str | None, loads: str | None = None, ld_library_path=(), deep=None,
                 rpath: bool = False) -> ea.Snapshot:
    """The capture, with what the collector reads on a host: the file the system's
    libcudnn.so.9 resolves to, the library torch's loader picks, an LD_LIBRARY_PATH."""
    s = gpu_host()
    if system_file:  # every cuDNN library of the system resolves to a file of that version
        version = system_file.split(".so.9", 1)[1]
        s.ldconfig_real = {e.path: e.path + version for e in s.ldconfig if e.soname.startswith("libcudnn")
                           and e.soname.endswith(".so.9")}
    if loads:
        s.torch_libs = {"libcudnn.so.9": ea.LoadedLib("libcudnn.so.9", loads, "LD_LIBRARY_PATH" if loads.startswith("/lib") else "RUNPATH")}
    s.ld_library_path = [*ld_library_path, *s.ld_library_path]
    s.deep = deep
    if rpath:
        s.torch_elf = {"file": "torch/lib/libtorch_cuda.so", "rpath": "$ORIGIN/../../nvidia/cudnn/lib"}
    return s


WHEEL_CUDNN = f"{SITE}/nvidia/cudnn/lib/libcudnn.so.9"


@pytest.mark.parametrize("snapshot, severity, says", [
    # The capture as it is: versions unknown, torch loads the wheel's copy.
    (lambda: _cudnn_twice(system_file=None), "info", "versions not comparable"),
    (lambda: _cudnn_twice(system_file="/lib/x86_64-linux-gnu/libcudnn.so.9.19.0"), "info", "the same version"),
    (lambda: _cudnn_twice(system_file="/lib/x86_64-linux-gnu/libcudnn.so.9.10.2"), "warning",
     "different versions: the wheel's 9.19.0.56, the system's 9.10.2"),
    # The loader gives torch the other copy: LD_LIBRARY_PATH is searched before RUNPATH.
    (lambda: _cudnn_twice(system_file="/lib/x86_64-linux-gnu/libcudnn.so.9.19.0",
                          ld_library_path=["/lib/x86_64-linux-gnu"]), "warning",
     "torch loads /lib/x86_64-linux-gnu/libcudnn.so.9 (LD_LIBRARY_PATH is searched before torch's RUNPATH)"),
    (lambda: _cudnn_twice(system_file="/lib/x86_64-linux-gnu/libcudnn.so.9.10.2",
                          ld_library_path=["/lib/x86_64-linux-gnu"]), "error", "not the wheel's copy"),
    (lambda: _cudnn_twice(system_file=None, ld_library_path=["/lib/x86_64-linux-gnu"]), "error", "not the wheel's copy"),
    # ... unless torch's libraries use RPATH, which comes before LD_LIBRARY_PATH.
    (lambda: _cudnn_twice(system_file=None, ld_library_path=["/lib/x86_64-linux-gnu"], rpath=True), "info",
     "torch loads the wheel's copy"),
    # What the collector found for torch's NEEDED, and what `import torch` mapped (--deep), win.
    (lambda: _cudnn_twice(system_file="/lib/x86_64-linux-gnu/libcudnn.so.9.10.2", loads=WHEEL_CUDNN), "warning",
     "torch loads the wheel's copy (the loader's order: RUNPATH)"),
    (lambda: _cudnn_twice(system_file="/lib/x86_64-linux-gnu/libcudnn.so.9.10.2",
                          deep={"version": "2.11.0+cu130", "cuda": "13.0", "loaded": ["/lib/x86_64-linux-gnu/libcudnn.so.9.10.2"]}),
     "error", "torch loads /lib/x86_64-linux-gnu/libcudnn.so.9.10.2 (mapped by `import torch` (--deep))"),
])
def test_duplicate_library_precision(snapshot, severity, says):
    cudnn = next(f for f in ea.audit(snapshot()) if f.code == "duplicate-library" and "nvidia-cudnn-cu13" in f.packages)
    assert cudnn.severity == severity and says in cudnn.message, cudnn.message
    assert cudnn.remove == [] and cudnn.argv == []  # torch requires the wheel: never removed
    if "LD_LIBRARY_PATH" in cudnn.message and severity != "info":
        assert cudnn.fix.startswith("take /lib/x86_64-linux-gnu off LD_LIBRARY_PATH for the trainer")


def test_a_driver_library_twice_in_the_cache_at_other_versions():
    s = gpu_host()
    s.ldconfig_real = {"/usr/local/nvidia/lib64/libcuda.so.1": "/usr/local/nvidia/lib64/libcuda.so.580.65.06",
                       "/lib/libcuda.so.1": "/lib/libcuda.so.550.54.15"}
    libcuda = next(f for f in ea.audit(s) if f.libraries == ["libcuda.so.1"])
    assert libcuda.severity == "warning" and "their versions differ" in libcuda.message


# --------------------------------------------------------------------------- requirements


def test_a_wheel_torch_needs_missing_says_what_import_torch_does():
    s = _with(gpu_host(), drop=("nvidia-cudnn-cu13",))
    missing = _one(ea.audit(s), "missing-requirement")
    text = "OSError: libcudnn.so.9: cannot open shared object file: No such file or directory"
    assert missing.message == ("torch requires nvidia-cudnn-cu13==9.19.0.56, which is not installed: torch loads "
                               f"libcudnn.so.9 from this wheel, so `import torch` fails with '{text}' (crash "
                               "signature missing_shared_library)")
    assert missing.severity == "error"
    assert missing.argv == [["/opt/torch/.venv/bin/python3", "-m", "pip", "install", "nvidia-cudnn-cu13==9.19.0.56"]]
    assert missing.commands == ["/opt/torch/.venv/bin/python3 -m pip install nvidia-cudnn-cu13==9.19.0.56"]
    assert ea.exit_code(ea.audit(s)) == 2
    # Requirements whose markers exclude the host are not required there.
    s.markers = {**LINUX, "platform_system": "Darwin", "sys_platform": "darwin"}
    assert not [f for f in ea.audit(s) if f.code == "missing-requirement"]


def test_requirement_versions_and_extras():
    s = _with(gpu_host(), ea.Dist("nvidia-cublas", "13.0.0.19", SITE), ea.Dist("sympy", "1.12", SITE))
    found = {f.packages[0]: f for f in ea.audit(s) if f.code == "requirement-version"}
    assert found["nvidia-cublas"].severity == "error"  # a binary pinned by torch
    assert found["nvidia-cublas"].message.startswith("torch -> cuda-toolkit[cublas,")
    assert "requires nvidia-cublas==13.1.0.3.*; nvidia-cublas 13.0.0.19 is installed" in found["nvidia-cublas"].message
    assert found["sympy"].severity == "warning"
    assert found["sympy"].commands == ["/opt/torch/.venv/bin/python3 -m pip install 'sympy>=1.13.3'"]


def test_one_finding_per_missing_package():
    s = _with(gpu_host(), ea.Dist("sympy", "1.14.0", SITE, ["mpmath<1.4,>=1.1.0"]),
              ea.Dist("transformers", "5.17.0", SITE, ["mpmath<1.4,>=1.1.0", "numpy>=1.17"]), drop=("mpmath",))
    missing = [f for f in ea.audit(s) if f.code == "missing-requirement"]
    assert [f.message for f in missing] == [
        "transformers requires mpmath<1.4,>=1.1.0, which is not installed (also required by torch -> sympy)"]


def test_unmet_requirements_of_every_package_as_pip_check_says():
    s = _with(gpu_host(), ea.Dist("sglang", "0.5.3", SITE, ["torch==2.8.0", "orjson", 'uvloop; sys_platform == "win32"']),
              ea.Dist("jaxtyping", "0.3.11", SITE, ["typeguard>=9"]))
    unmet = {(u.requirer.name, str(u.requirement)) for u in ea.unmet_requirements(s)}
    assert unmet == {("sglang", "torch==2.8.0"), ("sglang", "orjson"), ("jaxtyping", "typeguard>=9")}
    found = {f.packages[0]: f for f in ea.audit(s) if f.code == "unmet-requirement"}
    # A pin on the trainer's torch: installing what it asks for would replace torch.
    assert found["sglang"].severity == "warning"
    assert found["sglang"].message == (
        "sglang 0.5.3 requires torch==2.8.0 (torch 2.11.0 is installed), orjson (it is not installed): sglang "
        "will not work as installed; the trainer does not import it. Installing what it asks for would replace "
        "the trainer's torch")
    assert found["sglang"].argv == [["/opt/torch/.venv/bin/python3", "-m", "pip", "uninstall", "-y", "sglang"]]
    assert found["jaxtyping"].severity == "info" and found["jaxtyping"].argv == []


def test_triton_pinned_by_torch():
    s = _with(gpu_host(), ea.Dist("triton", "3.4.0", SITE, []),
              ea.Dist("vllm", "0.11.0", SITE, ["torch==2.8.0", "triton==3.4.0"]))
    triton = _one(ea.audit(s), "triton-version")
    assert triton.severity == "error"
    assert triton.message.startswith("torch 2.11.0 requires triton==3.6.0; triton 3.4.0 is installed (also required by vllm)")
    assert triton.commands == ["/opt/torch/.venv/bin/python3 -m pip install triton==3.6.0"] and triton.remove == []


# --------------------------------------------------------------------------- fixes


def _shared(s: ea.Snapshot, a: str, b: str, *paths: str) -> ea.Snapshot:
    """``a`` and ``b`` list the same files (what the collector reads from their RECORDs)."""
    s = copy.deepcopy(s)
    owners = [next(d.index for d in s.dists if d.key == canonicalize_name(n)) for n in (a, b)]
    s.shared.append(ea.SharedFiles(sorted(owners), len(paths), [f"{SITE}/{p}" for p in paths]))
    return s


def polluted_host() -> ea.Snapshot:
    """The captured host after SGLang and its CUDA 12 wheels were installed beside the trainer."""
    s = _with(
        gpu_host(),
        ea.Dist("sglang", "0.5.3", SITE, ["flashinfer-python==0.4.1", "sgl-kernel==0.3.9", "torch==2.8.0"]),
        ea.Dist("flashinfer-python", "0.4.1", SITE, []),
        ea.Dist("sgl-kernel", "0.3.9", SITE, []),
        ea.Dist("xformers", "0.0.32", SITE, ["torch==2.8.0"]),
        ea.Dist("nvidia-cudnn-cu12", "9.10.2.21", SITE, []),
        ea.Dist("nvidia-nccl-cu12", "2.27.3", SITE, []),
        ea.Dist("nvidia-cublas-cu12", "12.8.4.1", SITE, []),
        ea.Dist("torchvision", "0.23.0+cu128", SITE, ["torch==2.8.0"]),
    )
    s.torch_version_py = VERSION_PY_CU130
    s.wrapper = ["pct", "exec", "200", "--"]
    # The CUDA 12 cuDNN wheel ships the same files as torch's CUDA 13 one.
    return _shared(s, "nvidia-cudnn-cu13", "nvidia-cudnn-cu12", "nvidia/cudnn/lib/libcudnn.so.9",
                   "nvidia/cudnn/lib/libcudnn_ops.so.9")


def test_polluted_host_fixes_are_simulated_commands():
    s = polluted_host()
    findings = ea.audit(s)
    python = "/opt/torch/.venv/bin/python3"
    keep = ea.protected(s)
    for f in findings:
        assert not {canonicalize_name(n) for n in f.remove} & keep, f
        assert [shlex.join(["pct", "exec", "200", "--", *argv]) for argv in f.argv] == f.commands
        for argv in f.argv:
            assert argv[:3] in ([python, "-m", "pip"], ["rm", "-r", "--"]), argv

    # cuDNN and NCCL for CUDA 12 ship the sonames of torch's CUDA 13 wheels.
    conflicts = {f.packages[0]: f for f in findings if f.code == "cuda-major" and f.severity == "error"}
    assert set(conflicts) == {"nvidia-cudnn-cu12", "nvidia-nccl-cu12"}
    cudnn = conflicts["nvidia-cudnn-cu12"]
    assert "same library as nvidia-cudnn-cu13 9.19.0.56" in cudnn.message
    # Its uninstall deletes torch's cuDNN files: the reinstall follows, in that order, and the fix says why.
    assert cudnn.argv == [[python, "-m", "pip", "uninstall", "-y", "nvidia-cudnn-cu12"],
                          [python, "-m", "pip", "install", "--force-reinstall", "--no-deps",
                           "nvidia-cudnn-cu13==9.19.0.56"]]
    assert ("uninstalling nvidia-cudnn-cu12 deletes 2 file(s) that nvidia-cudnn-cu13 9.19.0.56 also lists "
            "(nvidia/cudnn/lib/libcudnn.so.9, nvidia/cudnn/lib/libcudnn_ops.so.9): nvidia-cudnn-cu13 is reinstalled "
            "right after") in cudnn.fix
    assert conflicts["nvidia-nccl-cu12"].argv == [[python, "-m", "pip", "uninstall", "-y", "nvidia-nccl-cu12"]]
    (others,) = [f for f in findings if f.code == "cuda-major" and f.severity == "warning"]
    assert set(others.packages) == {"nvidia-cublas-cu12", "torchvision"}  # other sonames: dead weight

    shared = _one(findings, "shared-files")
    assert shared.severity == "warning" and "uninstalling one deletes them for the other" in shared.message
    assert shared.fix == ("never uninstall nvidia-cudnn-cu12 alone: follow it with pct exec 200 -- "
                          f"{python} -m pip install --force-reinstall --no-deps nvidia-cudnn-cu13==9.19.0.56")

    stray = _one(findings, "stray-stack")
    assert set(stray.packages) == {"sglang", "flashinfer-python", "sgl-kernel", "xformers"}
    assert stray.argv == [[python, "-m", "pip", "uninstall", "-y", "sglang", "flashinfer-python", "sgl-kernel",
                           "xformers"]]
    assert ea.exit_code(findings) == 2

    # The plan: every command once; the wheel fetched, then the uninstalls, then the reinstall from what was fetched.
    steps = [argv for argv, _ in ea.plan(findings, s)]
    make, fetch, *removals, reinstall = steps
    assert fetch[:6] == [python, "-m", "pip", "download", "--no-deps", "--dest"]
    wheels = fetch[6]
    assert make == ["mkdir", "-m", "700", "--", wheels]  # its own directory: the plan stops if it exists
    assert fetch[7:] == ["nvidia-cudnn-cu13==9.19.0.56"]
    assert reinstall == [python, "-m", "pip", "install", "--no-index", "--find-links", wheels, "--no-deps",
                         "--force-reinstall", "nvidia-cudnn-cu13==9.19.0.56"]
    assert removals and all("uninstall" in a for a in removals)


def test_the_plan_holds_no_information_findings_command_and_nothing_twice():
    """A name the stray-stack and unmet-requirement findings both remove is
    uninstalled once; an information finding's command (a reinstall of a local
    package no index has) never joins the plan."""
    s = _with(polluted_host(), ea.Dist("my-tool", "0.1.dev0+local", SITE, []))
    s.dists[-1].missing, s.dists[-1].missing_count = ["my_tool/__init__.py"], 1
    findings = ea.audit(s)
    (local,) = [f for f in findings if f.code == "missing-files" and f.packages == ["my-tool"]]
    assert local.severity == "info" and local.argv  # its command is shown with it ...
    steps = [argv for argv, _ in ea.plan(findings, s)]
    assert not [a for a in steps if any("my-tool" in x for x in a)]  # ... and is not in the plan
    removed = [n for a in steps if "uninstall" in a for n in a[a.index("-y") + 1:]]
    assert "sglang" in removed and len(removed) == len(set(removed))
    assert len(steps) == len({tuple(a) for a in steps})


def test_a_finding_whose_commands_would_make_the_plan_worse_gets_words_only():
    """The CUDA 13 wheels' own damage (torch's CUDA 12 wheels written over them)
    would be repaired by putting the CUDA 13 builds back over torch's: refused, with why."""
    s = polluted_host()
    cu12 = next(d for d in s.dists if d.name == "nvidia-cudnn-cu12")
    cu13 = next(d for d in s.dists if d.name == "nvidia-cudnn-cu13")
    s.shared[-1].holder = cu13.index  # torch's CUDA 13 cuDNN holds the shared files
    cu12.changed, cu12.changed_count, cu12.metadata = ["nvidia/cudnn/lib/libcudnn.so.9"], 1, f"{SITE}/cu12.dist-info"
    cu12.missing, cu12.missing_count = [], 0
    findings = ea.audit(s)
    (conflict,) = [f for f in findings if f.code == "cuda-major" and f.packages == ["nvidia-cudnn-cu12"]]
    assert conflict.argv == [["rm", "-r", "--", f"{SITE}/cu12.dist-info"]]  # detached: nothing to put back
    s.shared[-1].holder = cu12.index  # now the stray's bytes are there: a reinstall of it is refused
    findings = ea.audit(s)
    (own,) = [f for f in findings if f.code == "missing-files" and f.packages == ["nvidia-cudnn-cu12"]]
    assert own.argv == [] and "no command is given" in own.fix


def test_a_stray_sharing_only_package_init_files_is_uninstalled_not_detached():
    s = _shared(polluted_host(), "nvidia-nccl-cu12", "nvidia-nccl-cu13", "nvidia/__init__.py")
    stray = next(d for d in s.dists if d.name == "nvidia-nccl-cu12")
    stray.metadata = f"{SITE}/nvidia_nccl_cu12-2.27.3.dist-info"
    (conflict,) = [f for f in ea.audit(s) if f.code == "cuda-major" and f.packages == ["nvidia-nccl-cu12"]]
    assert conflict.argv[0] == ["/opt/torch/.venv/bin/python3", "-m", "pip", "uninstall", "-y", "nvidia-nccl-cu12"]
    assert "detach" not in conflict.fix


def test_a_removal_whose_damage_cannot_be_repaired_is_not_suggested():
    s = _with(gpu_host(), ea.Dist("vllm", "0.11.0", SITE, []), ea.Dist("", "", SITE, [], ["torch"]))
    s = _shared(s, "vllm", "torch", "torch/lib/libc10.so")
    s.shared[-1].owners = [s.dists[-2].index, s.dists[-1].index]  # vllm and the nameless distribution
    stray = _one(ea.audit(s), "stray-stack")
    assert stray.argv == [] and stray.remove == []
    assert "do not uninstall vllm: it shares files with a distribution whose metadata is broken" in stray.fix


@pytest.mark.parametrize("version, index", [
    ("2.7.1+cu128", ["--index-url", "https://download.pytorch.org/whl/cu128"]),
    ("2.7.1+cpu", ["--index-url", "https://download.pytorch.org/whl/cpu"]),
    ("2.11.0", []),
    ("3.6.0+git1234", []),
])
def test_a_reinstall_names_the_index_only_pytorch_serves(version, index):
    fixer = ea.Fixer(gpu_host(), set())
    assert fixer.reinstall(ea.Dist("torch", version)) == [
        "/opt/torch/.venv/bin/python3", "-m", "pip", "install", "--force-reinstall", "--no-deps", *index,
        f"torch=={version}"]


def test_pip_acts_on_the_environments_copy_when_the_user_site_has_another():
    s = _with(gpu_host(), ea.Dist("six", "1.16.0", "/root/.local/lib/python3.12/site-packages", []))
    s.dists.insert(0, s.dists.pop())  # the user site first
    s.dists.append(ea.Dist("six", "1.17.0", SITE, [], index=len(s.dists)))
    s.user_site_enabled = True
    fixer = ea.Fixer(s, set())
    assert fixer.uninstall(["six"])[:2] == ["env", "PYTHONNOUSERSITE=1"]
    assert fixer.uninstall(["sympy"])[0] == "/opt/torch/.venv/bin/python3"


# --------------------------------------------------------------------------- policy


def test_ignore_by_code_and_subject():
    s = gpu_host()
    s.ld_library_path = ["/lib/x86_64-linux-gnu", *s.ld_library_path]  # an error on cuDNN, info on NCCL
    everything = ea.audit(s)
    assert ("error", "duplicate-library") in _codes(everything)
    policy = ea.Policy.from_dict({"ignore": [{"code": "duplicate-library", "library": "libnccl*"},
                                             {"code": "other-framework", "package": "jax*"}]})
    kept = ea.audit(s, policy=policy)
    assert [f.libraries for f in kept if f.code == "duplicate-library"] == \
        [f.libraries for f in everything if f.code == "duplicate-library" and f.libraries != ["libnccl.so.2"]]
    # Ignoring the jax wheels leaves the finding, which also names cupy: every subject must match.
    assert "other-framework" in {f.code for f in kept}
    assert ea.Policy.from_dict({"ignore": [{"code": "other-framework", "package": "*cuda13*"}]}).ignores(
        _one(everything, "other-framework"))
    # By code alone, as before.
    assert "duplicate-library" not in {f.code for f in ea.audit(s, policy=ea.Policy.from_dict(
        {"ignore": ["duplicate-library"]}))}


def test_policy_errors_name_their_yaml_path():
    with pytest.raises(ConfigError) as e:
        ea.Policy.from_dict({"ignroe": ["user-site"], "allow": "vllm",
                             "ignore": [{"code": "duplicate-library", "libary": "libcudnn*"}, {"package": "x"}, 3]},
                            source="playbooks/prod.yaml")
    assert e.value.problems == [
        "env_audit.ignroe: unknown key (did you mean 'ignore'?)",
        "env_audit.allow: expected a list of names",
        "env_audit.ignore[0].libary: unknown key (did you mean 'library'?)",
        "env_audit.ignore[1].code: required: the finding code to ignore",
        "env_audit.ignore[2]: expected a finding code or {code: ..., package|library|path: GLOB}",
    ]
    with pytest.raises(ConfigError, match=r"hosts.gpu1.env_audit.ignore\[0\]: unknown finding 'stray' "
                                          r"\(did you mean 'stray-stack'\?\)"):
        ea.Policy.from_dict({"ignore": ["stray"]}, where="hosts.gpu1.env_audit")


def test_policy_per_host_in_the_inventory_and_per_playbook(tmp_path):
    (tmp_path / "inventory.yaml").write_text(
        "hosts:\n  local:\n    transport: local\n    env_audit:\n      ignore:\n"
        "        - {code: duplicate-library, library: 'libcudnn*'}\n")
    (tmp_path / "pb.yaml").write_text("host: local\nenv_audit:\n  allow: [sglang]\n  ignore: [other-framework]\n")
    inventory = load_inventory(str(tmp_path / "inventory.yaml"))
    playbook = load_playbook(str(tmp_path / "pb.yaml"), inventory=inventory)
    host_only = ea.policy_for(inventory.get("local"), inventory, None)
    assert host_only == ea.Policy([], [ea.IgnoreRule("duplicate-library", library="libcudnn*")])
    both = ea.policy_for(inventory.get("local"), inventory, playbook)
    assert both.allow == ["sglang"] and [r.code for r in both.ignore] == ["duplicate-library", "other-framework"]
    (tmp_path / "bad.yaml").write_text("hosts:\n  local:\n    transport: local\n    env_audit: {ignore: [nope]}\n")
    bad = load_inventory(str(tmp_path / "bad.yaml"))
    with pytest.raises(ConfigError, match=r"hosts.local.env_audit.ignore\[0\]: unknown finding 'nope'"):
        ea.audit_host("local", bad)


def test_allow_keeps_a_stack_out_of_the_strays():
    s = polluted_host()
    stray = _one(ea.audit(s, policy=ea.Policy.from_dict({"allow": ["xformers", "sglang"]})), "stray-stack")
    assert "xformers" not in stray.packages and "sglang" not in stray.packages


def test_cpu_torch_against_the_playbooks_device():
    s = _with(gpu_host(), ea.Dist("torch", "2.11.0+cpu", "/x", []))
    cuda = _one(ea.audit(s, device="cuda"), "torch-cpu-build")
    assert cuda.severity == "warning" and "the trainer will refuse to start" in cuda.message
    assert _codes(f for f in ea.audit(s, device="auto", host_gpus=8) if f.code == "torch-cpu-build") == \
        [("warning", "torch-cpu-build")]
    assert _codes(f for f in ea.audit(s, device="cpu", host_gpus=8) if f.code == "torch-cpu-build") == \
        [("info", "torch-cpu-build")]
    missing = ea.audit(_with(gpu_host(), drop=("torch",)))[0]
    assert (missing.severity, missing.code) == ("error", "torch-missing")


def test_flash_attn_says_which_kernels_the_drafter_gets_and_warns_of_a_refused_release():
    host = gpu_host()
    assert not [f for f in ea.audit(host) if f.code == "flash-attn"]  # the captured host has none
    site = host.copies("torch")[0].location  # beside torch, in the trainer's environment
    fixed = _one(ea.audit(_with(host, ea.Dist("flash-attn-4", "4.0.0b36", site, []))), "flash-attn")
    assert fixed.severity == "info" and "flash-attention 4's kernels" in fixed.message and not fixed.commands
    old = _one(ea.audit(_with(host, ea.Dist("flash-attn-4", "4.0.0b20", site, []))), "flash-attn")
    assert old.severity == "warning" and "older than 4.0.0b26" in old.message and "does not use it" in old.message
    assert old.packages == ["flash-attn-4"] and any("flash-attn-4>=4.0.0b26" in c for c in old.commands)


# --------------------------------------------------------------------------- the collector, run by a real python


def _python38() -> str | None:
    candidates = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.8*/bin/python3.8")))
    return candidates[0] if candidates else None


PYTHON_3_8 = _python38()


def run_collector(argument, env: dict[str, str] | None = None, check: bool = True,
                  python: str = sys.executable, cwd: str | None = None) -> subprocess.CompletedProcess:
    """dflashctl/hosts/remote/audit.py run as a file by a real python, as a person (or the
    controller, through ``python -c``) runs it on a host."""
    argv = [python, str(COLLECTOR)] + ([] if argument is None else
                                       [argument if isinstance(argument, str) else json.dumps(argument)])
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=check, cwd=cwd)


@pytest.mark.parametrize("python", [
    pytest.param(sys.executable, id="this-python"),
    pytest.param(PYTHON_3_8, id="python3.8", marks=pytest.mark.skipif(PYTHON_3_8 is None, reason="no Python 3.8 here")),
])
def test_collector_on_a_built_site_packages(tmp_path, python):
    from tests.harness.envs import CUDNN12, cudnn_files, torch_files, write_dist

    site = tmp_path / "site"
    write_dist(site, "torch", "9.9.0", torch_files("9.9.0", "12.8"), ["sympy", "not-installed-anywhere==1.0"])
    write_dist(site, *CUDNN12, cudnn_files("cudnn-cu12"))
    write_dist(site, "Demo.Wheel", "1.2.0", {"demo_wheel/__init__.py": "", "demo_helper.py": "",
                                             "_demo_ext.cpython-311-x86_64-linux-gnu.so": b"\0",
                                             "demo_wheel/lib/libnccl.so.2": b"n"}, ['numpy; extra == "fast"'])
    (site / "demo_helper.py").unlink()  # a file its RECORD lists, gone
    libs = tmp_path / "lib"
    libs.mkdir()
    for name in ("libcudnn.so.9", "libfoo.so.1", "README"):
        (libs / name).write_text("")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "PYTHONPATH", "LD_LIBRARY_PATH")}
    env.update(PYTHONPATH=str(site), LD_LIBRARY_PATH=f"{libs}:{tmp_path / 'missing'}", PYTHONNOUSERSITE="1")
    done = run_collector({"lib_prefixes": ["libcudnn", "libnccl"], "modules": ["demo_helper", "absent_module"]},
                         env, python=python)
    assert done.stderr == ""
    raw = json.loads(framed(done.stdout))
    assert raw["v"] == 2 and raw["errors"] == [] and raw["python"]["executable"] == python
    assert raw["python"]["dropped_path"] == str(COLLECTOR.parent)  # run as a file: its own directory
    ours = {d["name"]: d for d in raw["distributions"] if d["location"] == str(site)}
    demo = ours["Demo.Wheel"]
    assert demo["version"] == "1.2.0" and demo["requires"] == ['numpy; extra == "fast"']
    assert demo["modules"] == ["_demo_ext", "demo_helper", "demo_wheel"] and demo["libs"] == ["demo_wheel/lib/libnccl.so.2"]
    assert (demo["missing"], demo["missing_count"], demo["changed_count"]) == (["demo_helper.py"], 1, 0)
    index = {d["name"]: i for i, d in enumerate(raw["distributions"]) if d["location"] == str(site)}
    assert raw["modules"]["torch"] == {"origin": str(site / "torch" / "__init__.py"), "namespace": False,
                                       "owners": [index["torch"]], "entry": str(site)}
    assert raw["modules"]["absent_module"] is None and raw["modules"]["demo_helper"] is None  # deleted
    # torch's CUDA library, as the loader would resolve it: LD_LIBRARY_PATH first.
    assert raw["torch"]["elf"]["needed"] == ["libcudnn.so.9"]
    assert raw["torch"]["libs"] == {"libcudnn.so.9": {"path": str(libs / "libcudnn.so.9"), "via": "LD_LIBRARY_PATH"}}
    assert raw["ld_library_path"] == [{"path": str(libs), "libs": ["libcudnn.so.9"]},
                                      {"path": str(tmp_path / "missing"), "libs": None}]
    assert all(line.strip().startswith(("libcudnn", "libnccl")) for line in raw["ldconfig"].get("text", "").splitlines())

    snapshot = ea.parse_snapshot(done.stdout, "built")
    assert ea.torch_build(snapshot) == ea.TorchBuild("9.9.0", "12.8", "torch/version.py", str(site / "torch"))
    findings = ea.audit(snapshot)
    # (Said as the requirement of a shadowing copy where this python has a torch of its own.)
    assert [f for f in findings if f.code == "missing-requirement" and f.message.startswith(
        ("torch requires not-installed-anywhere==1.0, which is not installed",
         "torch requires not-installed-anywhere==1.0; it is not installed: that is what torch 9.9.0 at"))]
    assert ["Demo.Wheel"] in [f.packages for f in findings if f.code == "missing-files" and f.severity == "info"]


@pytest.mark.parametrize("argument", [None, "not json", "[]", {"lib_prefixes": []}, {"lib_prefixes": "libcuda"},
                                      {"lib_prefixes": ["libcuda", 3]}, {"libs": ["libcuda"]},
                                      {"lib_prefixes": ["libcuda"], "modules": "torch"},
                                      {"lib_prefixes": ["libcuda"], "deep": "yes"},
                                      {"lib_prefixes": ["libcuda"], "deep": True, "deep_timeout": 0}])
def test_collector_refuses_an_argument_it_does_not_understand(argument):
    done = run_collector(argument, check=False)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith("usage: audit.py '{\"lib_prefixes\": [") and "Traceback" not in done.stderr


def test_collector_is_python_3_8_stdlib_only():
    tree = ast.parse(COLLECTOR.read_text(), feature_version=(3, 8))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "a relative import does not exist on the host"
            imported.add(node.module.split(".")[0])
    assert imported and imported <= sys.stdlib_module_names, imported - sys.stdlib_module_names


def test_the_controller_ships_the_collectors_text():
    host = load_inventory(None).get("local")
    argv = ea.audit_command(host)
    assert argv[:-2] == [*shlex.split(host.python), "-c"]
    assert argv[-2] == COLLECTOR.read_text() and argv[-2] is ea.audit_command(host)[-2]  # read once
    assert json.loads(argv[-1]) == {"lib_prefixes": list(ea.LIB_PREFIXES), "modules": [*ea.TRAINER_MODULES, "pip", "ensurepip"]}
    assert json.loads(ea.audit_command(host, deep=True)[-1])["deep"] is True
    assert f"FRAME = {FRAME!r}".replace("'", "\"") in argv[-2]  # the collector frames its answer as the controller reads it
    # Shipped as text it answers as it does run as a file, without its own sys.path[0] (the cwd).
    shipped = json.loads(framed(subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True).stdout))
    assert {d["name"] for d in shipped["distributions"]} >= {"torch", "sympy"}
    assert shipped["python"]["dropped_path"] == "" and "" not in shipped["python"]["path"]


# --------------------------------------------------------------------------- on real hosts


def test_local_host_audit_asks_the_import_system():
    inventory = load_inventory(None)
    report = ea.audit_target("local", inventory)
    s = report.snapshot
    assert s.python == sys.executable and s.prefix == sys.prefix
    import torch  # noqa: F401  (the test side only: to compare with what the script read without it)

    assert report.torch.version == torch.__version__ and report.torch.cuda == torch.version.cuda
    assert report.torch.location == os.path.dirname(torch.__file__)
    assert s.owner("torch").location == os.path.dirname(os.path.dirname(torch.__file__))
    chains = {(c.chain, canonicalize_name(c.requirement.name)) for c in ea.requirement_checks(s)}
    assert ("torch", "sympy") in chains and ("torch -> sympy", "mpmath") in chains
    assert report.exit_code == ea.exit_code(report.findings) < 2


def test_target_through_jump_and_container(ssh_env):
    report = ea.audit_host("target", ssh_env.inventory)
    s = report.snapshot
    assert s.hostname == "ct200" and s.wrapper == ["pct", "exec", "200", "--"]  # answered from inside `pct exec 200 --`
    assert report.torch is not None and s.owner("torch").requires
    assert "direct-tcpip" in ssh_env.log("jump")
    # A fix runs as it is written: the host's python, through the wrapper.
    from dflashctl.hosts.transport import connect

    fixer = ea.Fixer(s, ea.protected(s))
    argv = fixer.pip("--version")
    assert fixer.shell(argv) == shlex.join(["pct", "exec", "200", "--", s.python, "-m", "pip", "--version"])
    assert connect("target", ssh_env.inventory).run(argv).stdout.startswith("pip ")


# --------------------------------------------------------------------------- the CLI


def _cli(tmp_path, *args, **env):
    """The command in this process, in tmp_path (tests/harness/cli.py)."""
    return cli.invoke(*args, cwd=tmp_path, env={"DFLASHCTL_STORE": str(tmp_path / "runs.db"), "DFLASHCTL_INVENTORY": None,
                                                "DFLASHCTL_PLAYBOOKS": None, **env})


def test_cli_json_text_and_recorded_snapshot(tmp_path):
    done = _cli(tmp_path, "env-audit", "local", "--json")
    payload = json.loads(done.stdout)
    assert done.returncode == payload["exit_code"] in (0, 1)
    assert payload["schema"] == ea.SCHEMA and payload["error"] is None
    assert payload["host"] == "local" and payload["torch"]["version"] == payload["packages"]["torch"]
    text = _cli(tmp_path, "env-audit", "demo")  # the embedded playbook: its host, with its env
    assert text.returncode == payload["exit_code"]
    assert text.stdout.startswith("demo: local") and f"torch {payload['torch']['version']}" in text.stdout
    snapshots = Store(str(tmp_path / "runs.db")).env_snapshots("local")
    assert len(snapshots) == 2 and snapshots[0]["data"]["torch"] == payload["torch"]["version"]


def test_cli_exit_codes_and_json_when_the_audit_cannot_run(tmp_path):
    bad = _cli(tmp_path, "env-audit", "lcal")
    assert bad.returncode == 3 and "'lcal' is neither a playbook nor a host (did you mean 'local'?)" in bad.stderr
    assert "Traceback" not in bad.stderr
    bad = _cli(tmp_path, "env-audit", "lcal", "--json")
    payload = json.loads(bad.stdout)
    assert bad.returncode == payload["exit_code"] == 3 and payload["findings"] == []
    assert payload["error"] == "'lcal' is neither a playbook nor a host (did you mean 'local'?)"
    (tmp_path / "inventory.yaml").write_text(f"hosts:\n  local:\n    transport: local\n    python: {tmp_path}/no-python\n")
    dead = _cli(tmp_path, "--inventory", str(tmp_path / "inventory.yaml"), "env-audit", "local", "--json")
    payload = json.loads(dead.stdout)
    assert dead.returncode == 3 and payload["error"].startswith("local: the env-audit script gave no answer")


def test_cli_exit_code_2_and_the_fixes_it_prints(tmp_path):
    from tests.harness.envs import CUDNN13, cudnn_files, healthy, write_dist

    env = healthy(tmp_path / "venv")
    write_dist(env.site, *CUDNN13, cudnn_files("cudnn-cu13"))
    inventory = env.inventory(tmp_path, extra="    wrapper: env --\n")
    done = _cli(tmp_path, "--inventory", inventory.source, "env-audit", "box")
    assert done.returncode == 2, done.stderr
    detach = f"env -- rm -r -- {env.site}/nvidia_cudnn_cu13-9.13.0.50.dist-info"
    assert detach + "\n" in done.stdout
    plan = done.stdout[done.stdout.index("to apply every fix, in this order"):]
    assert "stop at the first command that fails" in plan
    fetch = plan.index("download --no-deps --dest")
    assert fetch < plan.index("--force-reinstall nvidia-cudnn-cu12") < plan.index(detach)


def test_cli_help():
    done = cli.invoke("env-audit", "--help", columns=160)
    assert done.returncode == 0 and "PLAYBOOK|HOST" in done.stdout and "--deep" in done.stdout
    assert "Exit code 0 clean, 1 warnings, 2 errors, 3 the audit could not run" in " ".join(done.stdout.split())


# --------------------------------------------------------------------------- drift and the launcher


def _good_run(store: Store, playbook: str, created: float, trained_for: float, packages: dict,
              host: str = "local") -> str:
    """A run of ``playbook`` on ``host`` whose launch recorded ``packages`` and whose
    trainer then trained for ``trained_for`` seconds."""
    store.add_env_snapshot(host, created - 1, packages)
    run = store.create_run(playbook, host, {}, created, claim_gpus=False)
    store.add_samples(run.id, [{"time": created + 60 + t, "step": i + 1, "phase": "training"}
                               for i, t in enumerate([0.0, trained_for / 2, trained_for])])
    return run.id


def test_drift_against_the_last_run_that_reached_healthy_after(tmp_path):
    store = Store(str(tmp_path / "runs.db"))
    then = {"torch": "2.11.0", "sympy": "1.14.0", "flashinfer-python": "0.2.5"}
    good = _good_run(store, "prod", 1000.0, 1200.0, then)
    short = _good_run(store, "prod", 5000.0, 1.0, {**then, "torch": "2.10.0"})  # stopped a second in: not good
    assert ea.last_good_run(store, "prod", "local", 900.0).id == good
    assert ea.last_good_run(store, "prod", "local", 0.5).id == short
    for i in range(60):  # audits after it do not push its snapshot out
        store.add_env_snapshot("local", 6000.0 + i, {"torch": "2.12.0"})
    now = {"torch": "2.12.0", "sympy": "1.14.0"}
    drift = ea.drift_since_good_run(store, "prod", "local", now, 900.0)
    assert drift.kind == "drift" and drift.severity == "warning"
    assert drift.message == ("environment changed since the last good run: removed flashinfer-python 0.2.5; changed "
                             f"torch 2.11.0 -> 2.12.0 (last good run: {good})")
    assert drift.detail["since_run"] == good
    assert ea.drift_since_good_run(store, "prod", "local", then, 900.0) is None
    assert ea.drift_since_good_run(store, "other", "local", now, 900.0) is None
    # What launch records on the new run: the newest snapshot (its preflight's) against that one.
    from dflashctl.launch import environment_drift

    newest = store.create_run("prod", "local", {}, 7000.0, claim_gpus=False)
    assert environment_drift(store, newest, 900.0).detail["since_run"] == good

    # A restart splits the stretch: two 10-minute processes are not 15 minutes of health.
    split = _good_run(store, "split", 9000.0, 1200.0, then)
    store.add_restart(split, 9000.0 + 60 + 600 - 1, "crash")
    assert ea.last_good_run(store, "split", "local", 900.0) is None
    assert ea.last_good_run(store, "split", "local", 500.0).id == split


def test_launch_dry_run_shows_the_audit_its_fixes_and_the_drift(tmp_path):
    from dflashctl.launch import launch_run
    from tests.harness.envs import CUDNN13, cudnn_files, healthy, write_dist

    env = healthy(tmp_path / "venv")
    write_dist(env.site, *CUDNN13, cudnn_files("cudnn-cu13"))
    inventory = env.inventory(tmp_path)
    (tmp_path / "pb.yaml").write_text("host: box\ntrainer:\n  placement: {device: cpu}\nrestart: {healthy_after: 10m}\n")
    playbook = load_playbook(str(tmp_path / "pb.yaml"), inventory=inventory)
    store = Store(str(tmp_path / "runs.db"))
    then = {**ea.audit_host("box", inventory).snapshot.packages(), "flashinfer-python": "0.2.5"}
    good = _good_run(store, "pb", 1000.0, 601.0, then, host="box")
    said: list[str] = []
    # As `dflashctl launch --dry-run` calls it: no store passed; the default one is read when it exists.
    with environ(DFLASHCTL_STORE=str(tmp_path / "runs.db")):
        result = launch_run(playbook, inventory, None, dry_run=True,
                            progress=lambda step, m: said.append(f"{step}: {m}"))
    assert result.state == "dry-run"  # errors do not stop a dry run: it says a launch would stop
    # The CUDA 13 cuDNN was written over torch's: the preflight imports torch as --deep does, and says it fails.
    assert "preflight: a launch would stop here: 3 error(s) (--force goes past them)" in said
    assert [f for f in result.findings if f.code == "torch-import" and "cuDNN version incompatibility" in f.message]
    drift = [f for f in result.findings if f.code == "drift"]
    assert drift and f"removed flashinfer-python 0.2.5 (last good run: {good})" in drift[0].message
    assert any(line.startswith("preflight: warning: environment changed since the last good run") for line in said)
    # Each finding with its fix and its exact commands.
    at = said.index(next(line for line in said if line.startswith("preflight: error: nvidia-cudnn-cu13")))
    assert said[at + 1].startswith("preflight:   fix: detach nvidia-cudnn-cu13")
    assert said[at + 2:at + 4] == [
        f"preflight:     {env.python} -m pip install --force-reinstall --no-deps nvidia-cudnn-cu12==9.1.0.70",
        f"preflight:     rm -r -- {env.site}/nvidia_cudnn_cu13-9.13.0.50.dist-info"]
    assert len(store.env_snapshots("box")) == 1  # a dry run records nothing


def test_launch_preflight_hook_audits_and_records(tmp_path):
    from dflashctl import launch

    inventory = load_inventory(None)
    store = Store(str(tmp_path / "runs.db"))
    findings = launch.preflight(load_playbook("demo", None, inventory), inventory, store)
    assert all(f.severity != "error" for f in findings)  # the demo runs here
    (recorded,) = store.env_snapshots("local")
    assert recorded["kind"] == "packages" and "torch" in recorded["data"]
    assert launch.blocking_findings([*findings, ea.Finding("error", "torch-missing", "x")])


def test_a_host_python_that_does_not_run(tmp_path):
    from dflashctl import launch

    (tmp_path / "inventory.yaml").write_text(f"hosts:\n  local:\n    transport: local\n    python: {tmp_path}/no-python\n")
    inventory = load_inventory(str(tmp_path / "inventory.yaml"))
    with pytest.raises(TransportError, match="the env-audit script gave no answer") as e:
        ea.audit_host("local", inventory)
    assert e.value.remote_exit_code == 127 and "no-python" in e.value.stderr_tail
    (failed,) = launch.preflight(load_playbook("demo", None, inventory), inventory)
    assert (failed.severity, failed.code) == ("error", "audit-failed")
    assert failed.message.startswith("cannot audit local: local: the env-audit script gave no answer")
