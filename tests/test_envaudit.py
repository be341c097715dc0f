"""env-audit: parsers and rules on the real GPU-host captures (tests/fixtures/env),
the audit script on this machine and through jump + container, the CLI, and the
launcher's preflight hook."""

from __future__ import annotations

import ast
import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dflashctl import envaudit as ea
from dflashctl.config import load_inventory, load_playbook
from dflashctl.detectors import env_drift
from dflashctl.errors import ConfigError, TransportError
from dflashctl.store import Store

FIXTURES = Path(__file__).parent / "fixtures" / "env"

# torch 2.11.0's requirements on Linux and those of the cuda-toolkit 13.0.2 extras it
# asks for, as pip resolved them for that wheel ("Requirement already satisfied:
# ... (from torch)"); the capture has names and versions only.
TORCH_2_11_REQUIRES = [
    "filelock",
    "typing-extensions>=4.10.0",
    "setuptools<82",
    "sympy>=1.13.3",
    "networkx>=2.5.1",
    "jinja2",
    "fsspec>=0.8.5",
    'cuda-toolkit[cublas,cudart,cufft,cufile,cupti,curand,cusolver,cusparse,nvjitlink,nvrtc,nvtx]==13.0.2; '
    'platform_system == "Linux"',
    'cuda-bindings<14,>=13.0.3; platform_system == "Linux"',
    'nvidia-cudnn-cu13==9.19.0.56; platform_system == "Linux"',
    'nvidia-cusparselt-cu13==0.8.0; platform_system == "Linux"',
    'nvidia-nccl-cu13==2.28.9; platform_system == "Linux"',
    'nvidia-nvshmem-cu13==3.4.5; platform_system == "Linux"',
    'triton==3.6.0; platform_system == "Linux"',
    'optree>=0.13.0; extra == "optree"',
    'pyyaml; extra == "pyyaml"',
]
CUDA_TOOLKIT_13_0_2_REQUIRES = [
    f'{name}=={version}.*; extra == "{extra}"'
    for name, version, extra in [
        ("nvidia-cublas", "13.1.0.3", "cublas"),
        ("nvidia-cuda-runtime", "13.0.96", "cudart"),
        ("nvidia-cufft", "12.0.0.61", "cufft"),
        ("nvidia-cufile", "1.15.1.6", "cufile"),
        ("nvidia-cuda-cupti", "13.0.85", "cupti"),
        ("nvidia-curand", "10.4.0.35", "curand"),
        ("nvidia-cusolver", "12.0.4.66", "cusolver"),
        ("nvidia-cusparse", "12.6.3.3", "cusparse"),
        ("nvidia-nvjitlink", "13.0.88", "nvjitlink"),
        ("nvidia-cuda-nvrtc", "13.0.88", "nvrtc"),
        ("nvidia-nvtx", "13.0.85", "nvtx"),
        ("nvidia-npp", "13.0.1.2", "npp"),  # an extra torch does not ask for
    ]
]
LINUX = {"platform_system": "Linux", "sys_platform": "linux", "python_version": "3.12",
         "python_full_version": "3.12.3", "platform_machine": "x86_64", "os_name": "posix",
         "implementation_name": "cpython", "platform_python_implementation": "CPython"}
VERSION_PY_CU130 = "__version__ = '2.11.0+cu130'\ndebug = False\ncuda: Optional[str] = '13.0'\nhip = None\n"


def _capture(name: str) -> str:
    return (FIXTURES / name).read_text()


def gpu_host(**requires) -> ea.Snapshot:
    """The captured H200 host as a snapshot, with torch's requirements supplied."""
    return ea.snapshot_from_captures(
        ea.parse_pip_freeze(_capture("gpu-pip-freeze.txt")),
        _capture("gpu-python-paths.txt"),
        _capture("gpu-libs.txt"),
        host="gpu1",
        requires={"torch": TORCH_2_11_REQUIRES, "cuda-toolkit": CUDA_TOOLKIT_13_0_2_REQUIRES, **requires},
        markers=LINUX,
    )


def _with(snapshot: ea.Snapshot, *dists: ea.Dist, drop: tuple[str, ...] = ()) -> ea.Snapshot:
    s = copy.deepcopy(snapshot)
    replaced = {d.key for d in dists} | {ea.canon(n) for n in drop}
    s.dists = [d for d in s.dists if d.key not in replaced] + list(dists)
    return s


def _codes(findings) -> list[tuple[str, str]]:
    return [(f.severity, f.code) for f in findings]


# --------------------------------------------------------------------------- captures


def test_pip_freeze_capture():
    found = dict(ea.parse_pip_freeze(_capture("gpu-pip-freeze.txt")))
    assert len(found) == 196
    assert found["torch"] == "2.11.0" and found["triton"] == "3.6.0"
    assert found["nvidia-cufft"] == "12.0.0.61" and found["nvidia-cudnn-cu13"] == "9.19.0.56"
    assert ea.parse_pip_freeze("-e git+https://x/y.git#egg=y\nfoo @ file:///tmp/foo\n# comment\n") == [("foo", "")]


def test_pip_list_capture_agrees_with_freeze():
    listed = {ea.canon(n): v for n, v in ea.parse_pip_list_json(_capture("gpu-pip-list.json"))}
    frozen = {ea.canon(n): v for n, v in ea.parse_pip_freeze(_capture("gpu-pip-freeze.txt"))}
    assert listed.pop("pip") == "24.0"  # `pip freeze` leaves pip itself out
    assert listed == frozen


def test_python_paths_capture():
    prefix, path, user_site = ea.parse_python_paths(_capture("gpu-python-paths.txt"))
    assert prefix == "/opt/torch/.venv"
    assert path[-1] == "/opt/torch/.venv/lib/python3.12/site-packages" and len(path) == 5
    assert user_site == "/root/.local/lib/python3.12/site-packages" and user_site not in path


def test_libs_capture():
    entries, ld_path = ea.parse_libs_capture(_capture("gpu-libs.txt"))
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


def test_torch_cuda_build_from_version_py_label_or_requirements():
    s = gpu_host()
    assert ea.torch_build(s) == ea.TorchBuild("2.11.0", "13", "the CUDA wheels it requires")  # PyPI: no label
    s.torch_version_py = VERSION_PY_CU130
    assert ea.torch_build(s).cuda == "13.0" and ea.torch_build(s).source == "torch/version.py"
    labelled = _with(gpu_host(), ea.Dist("torch", "2.7.1+cu128"))
    assert ea.torch_build(labelled).cuda == "12.8"
    assert ea.torch_build(_with(gpu_host(), ea.Dist("torch", "2.7.1+cpu"))).cuda is None
    assert ea.torch_build(_with(gpu_host(), drop=("torch",))) is None


# --------------------------------------------------------------------------- rules on the capture


def test_captured_gpu_host():
    findings = ea.audit(gpu_host())
    assert _codes(findings) == [
        ("warning", "duplicate-library"), ("warning", "duplicate-library"),
        ("info", "duplicate-library"), ("info", "other-framework"),
    ]
    cudnn, nccl, libcuda, frameworks = findings
    # cuDNN 9 twice: the wheel torch requires and the system's libraries.
    assert cudnn.packages == ["nvidia-cudnn-cu13"]
    assert "libcudnn.so.9" in cudnn.detail["sonames"] and len(cudnn.detail["sonames"]) == 8
    assert "/lib/x86_64-linux-gnu/libcudnn.so.9" in cudnn.detail["system"]
    assert "torch loads the wheel's copy" in cudnn.message
    assert cudnn.remove == [] and "keep nvidia-cudnn-cu13 (torch requires it)" in cudnn.fix
    assert nccl.packages == ["nvidia-nccl-cu13"] and nccl.detail["sonames"] == ["libnccl.so.2"]
    # Two driver libraries in the cache: the one on LD_LIBRARY_PATH is loaded.
    assert "/usr/local/nvidia/lib64/libcuda.so.1 is the one loaded (it is on LD_LIBRARY_PATH)" in libcuda.message
    assert frameworks.packages == ["cupy-cuda13x", "jax-cuda13-pjrt", "jax-cuda13-plugin"]
    assert ea.exit_code(findings) == 1
    # Every pin of torch 2.11.0 (through the cuda-toolkit extras too) is met.
    checks = ea.requirement_checks(gpu_host())
    assert all(c.satisfied for c in checks)
    assert "torch -> cuda-toolkit[cublas,cudart,cufft,cufile,cupti,curand,cusolver,cusparse,nvjitlink,nvrtc,nvtx]" \
        in {c.chain for c in checks}
    assert "nvidia-npp" not in {c.requirement.name for c in checks}  # an extra nobody asked for


def test_system_copy_on_ld_library_path_wins_over_torchs_runpath():
    s = gpu_host()
    s.ld_library_path = ["/lib/x86_64-linux-gnu", *s.ld_library_path]
    cudnn = next(f for f in ea.audit(s) if f.packages == ["nvidia-cudnn-cu13"])
    assert cudnn.severity == "error"
    assert "LD_LIBRARY_PATH holds /lib/x86_64-linux-gnu/libcudnn.so.9" in cudnn.message
    assert "torch loads that copy, not the wheel's" in cudnn.message
    assert "take its directory off LD_LIBRARY_PATH" in cudnn.fix and cudnn.remove == []
    # With RPATH (not RUNPATH) the loader reads torch's paths before LD_LIBRARY_PATH.
    s.torch_elf = {"file": "torch/lib/libtorch_cuda.so", "rpath": "$ORIGIN/../../nvidia/cudnn/lib"}
    assert "torch loads the wheel's copy" in next(f for f in ea.audit(s) if f.packages == ["nvidia-cudnn-cu13"]).message


def test_cleaning_up_a_wheel_torch_needs_is_an_error():
    s = _with(gpu_host(), drop=("nvidia-cudnn-cu13",))
    missing = [f for f in ea.audit(s) if f.code == "missing-requirement"]
    assert [f.message for f in missing] == ["torch requires nvidia-cudnn-cu13==9.19.0.56, which is not installed"]
    assert missing[0].severity == "error" and missing[0].fix == "pip install nvidia-cudnn-cu13==9.19.0.56"
    assert ea.exit_code(ea.audit(s)) == 2
    # Requirements whose markers exclude the host are not required there.
    s.markers = {**LINUX, "platform_system": "Darwin", "sys_platform": "darwin"}
    assert not [f for f in ea.audit(s) if f.code == "missing-requirement"]


def test_requirement_versions_and_extras():
    s = _with(gpu_host(), ea.Dist("nvidia-cublas", "13.0.0.19", "/opt/torch/.venv/lib/python3.12/site-packages"),
              ea.Dist("sympy", "1.12", "/opt/torch/.venv/lib/python3.12/site-packages"))
    found = {f.packages[0]: f for f in ea.audit(s) if f.code == "requirement-version"}
    assert found["nvidia-cublas"].severity == "error"  # a binary pinned by torch
    assert found["nvidia-cublas"].message.startswith("torch -> cuda-toolkit[cublas,")
    assert "requires nvidia-cublas==13.1.0.3.*; nvidia-cublas 13.0.0.19 is installed" in found["nvidia-cublas"].message
    assert found["sympy"].severity == "warning" and found["sympy"].fix == "pip install 'sympy>=1.13.3'"


def polluted_host() -> ea.Snapshot:
    """The captured host after an inference stack was installed beside the trainer."""
    site = "/opt/torch/.venv/lib/python3.12/site-packages"
    user = "/root/.local/lib/python3.12/site-packages"
    s = _with(
        gpu_host(vllm=["torch==2.8.0", "triton==3.4.0", "nvidia-cudnn-cu12==9.10.2.21", "xformers==0.0.32"],
                 sglang=["flashinfer-python==0.4.1", "sgl-kernel==0.3.9"]),
        ea.Dist("vllm", "0.11.0", site, ["torch==2.8.0", "triton==3.4.0", "nvidia-cudnn-cu12==9.10.2.21",
                                         "nvidia-cublas-cu12==12.8.4.1", "xformers==0.0.32"]),
        ea.Dist("sglang", "0.5.3", site, ["flashinfer-python==0.4.1", "sgl-kernel==0.3.9"]),
        ea.Dist("flashinfer-python", "0.4.1", site, []),
        ea.Dist("sgl-kernel", "0.3.9", site, []),
        ea.Dist("xformers", "0.0.32", site, ["torch==2.8.0"]),
        ea.Dist("triton", "3.4.0", site, []),
        ea.Dist("nvidia-cudnn-cu12", "9.10.2.21", site, []),
        ea.Dist("nvidia-nccl-cu12", "2.27.3", site, []),
        ea.Dist("nvidia-cublas-cu12", "12.8.4.1", site, []),
        ea.Dist("torchvision", "0.23.0+cu128", site, ["torch==2.8.0"]),
    )
    s.torch_version_py = VERSION_PY_CU130
    # `pip install --user sympy==1.12` once: the user site comes first on sys.path.
    s.user_site_enabled = True
    s.sys_path = s.sys_path[:4] + [user] + s.sys_path[4:]
    s.dists.insert(0, ea.Dist("sympy", "1.12", user, [], ["sympy", "isympy"]))
    s.pythonpath = [ea.PathEntry("/opt/sglang/python", True, ["sglang", "sympy"], ["sglang", "sympy"]),
                    ea.PathEntry("/nonexistent", False)]
    s.env_sources = {"PYTHONPATH": "inventory hosts.gpu1.env"}
    return s


def test_polluted_host():
    s = polluted_host()
    findings = ea.audit(s)
    by_code: dict[str, list] = {}
    for f in findings:
        by_code.setdefault(f.code, []).append(f)

    stray = by_code["stray-stack"][0]
    assert stray.severity == "warning"
    assert set(stray.packages) == {"vllm", "sglang", "flashinfer-python", "sgl-kernel", "xformers"}
    assert stray.fix.startswith("pip uninstall -y ")

    # cuDNN 9 and NCCL 2 for CUDA 12 ship the same sonames as torch's CUDA 13 wheels.
    conflicts = {f.packages[0]: f for f in by_code["cuda-major"] if f.severity == "error"}
    assert set(conflicts) == {"nvidia-cudnn-cu12", "nvidia-nccl-cu12"}
    assert "same library as nvidia-cudnn-cu13 9.19.0.56" in conflicts["nvidia-cudnn-cu12"].message
    assert "required by vllm" in conflicts["nvidia-cudnn-cu12"].message
    assert conflicts["nvidia-cudnn-cu12"].remove == ["nvidia-cudnn-cu12"]
    (others,) = [f for f in by_code["cuda-major"] if f.severity == "warning"]
    assert set(others.packages) == {"nvidia-cublas-cu12", "torchvision"}  # other sonames: dead weight
    assert "torchvision 0.23.0+cu128 (CUDA 12)" in others.message

    (triton,) = by_code["triton-version"]
    assert triton.severity == "error"
    assert triton.message.startswith("torch 2.11.0 requires triton==3.6.0; triton 3.4.0 is installed (also required by vllm)")
    assert triton.fix == "pip install triton==3.6.0" and triton.remove == []

    (user,) = by_code["user-site"]
    assert user.severity == "error" and user.packages == ["sympy"]  # torch requires it
    assert "shadows the environment's sympy 1.12" in user.message
    assert "PYTHONNOUSERSITE=1" in user.fix and user.remove == []
    assert "torch requires sympy>=1.13.3; sympy 1.12 is installed" in by_code["requirement-version"][0].message

    shadow, missing_dir = by_code["pythonpath"]
    assert shadow.severity == "error"  # sympy: torch requires it
    assert "/opt/sglang/python (set by inventory hosts.gpu1.env) shadows sglang, sympy" in shadow.message
    assert missing_dir.severity == "info"
    assert ea.exit_code(findings) == 2


def test_the_script_follows_the_libraries_the_rules_know():
    line = next(l for l in ea.AUDIT_SOURCE.splitlines() if l.startswith("LIB_PREFIXES = "))
    assert ast.literal_eval(line.split("=", 1)[1].split("#")[0].strip()) == ea.LIB_PREFIXES
    lib_name = re.search(r"LIB_NAME = re.compile\(r\"\^lib\(\?:([a-z|]+)\)", ea.AUDIT_SOURCE).group(1)
    assert tuple(f"lib{n}" for n in lib_name.split("|")) == ea.LIB_PREFIXES


def test_fixes_never_remove_what_torch_requires():
    local = ea.parse_snapshot(
        subprocess.run([sys.executable, "-c", ea.AUDIT_SOURCE], capture_output=True, text=True, check=True).stdout,
        "local")
    # torch itself pins cuda-bindings; a CUDA 12 build of it must be reinstalled, not removed.
    old_bindings = _with(gpu_host(), ea.Dist("cuda-bindings", "12.9.2", "/opt/torch/.venv/lib/python3.12/site-packages"))
    # A nightly torch requires pytorch-triton; a stray `triton` provides the same module.
    nightly = _with(gpu_host(), ea.Dist("pytorch-triton", "3.6.0+git1234", "/opt/torch/.venv/lib/python3.12/site-packages"),
                    ea.Dist("torch", "2.12.0.dev20260301", "/opt/torch/.venv/lib/python3.12/site-packages",
                            [r.replace("triton==3.6.0", "pytorch-triton==3.6.0+git1234") for r in TORCH_2_11_REQUIRES]))
    # Even a stack the audit calls stray stays when torch requires it.
    odd = _with(gpu_host(), ea.Dist("xformers", "0.0.32", "/x"), ea.Dist("vllm", "0.11.0", "/x", []),
                ea.Dist("torch", "2.11.0", "/x", [*TORCH_2_11_REQUIRES, "xformers"]))
    seen = 0
    for snapshot in (gpu_host(), polluted_host(), old_bindings, nightly, odd, local):
        keep = ea.protected(snapshot)
        for f in ea.audit(snapshot):
            assert not {ea.canon(n) for n in f.remove} & keep, f
            for command in re.findall(r"pip uninstall -y ([^;(]+)", f.fix or ""):
                assert not {ea.canon(n) for n in command.split() if not n.startswith("(")} & keep, f.fix
            seen += bool(f.remove)
    assert seen >= 4  # removals were suggested, just never of those

    bindings = [f for f in ea.audit(old_bindings) if "cuda-bindings" in f.packages]
    assert [(f.code, f.fix) for f in bindings] == [("requirement-version", "pip install 'cuda-bindings<14,>=13.0.3'")]
    (both,) = [f for f in ea.audit(nightly) if f.code == "triton-version"]
    assert both.remove == ["triton"] and "torch requires pytorch-triton" in both.fix
    (stray,) = [f for f in ea.audit(odd) if f.code == "stray-stack"]
    assert stray.remove == ["vllm"] and "keep xformers (torch or the trainer requires them)" in stray.fix


def test_policy_from_the_playbook():
    s = polluted_host()
    policy = ea.Policy.from_dict({"allow": ["xformers", "vllm"], "ignore": ["user-site"]})
    findings = ea.audit(s, policy=policy)
    assert "user-site" not in {f.code for f in findings}
    stray = next(f for f in findings if f.code == "stray-stack")
    assert "xformers" not in stray.packages and "vllm" not in stray.packages
    with pytest.raises(ConfigError) as e:
        ea.Policy.from_dict({"ignroe": ["user-site"], "allow": "vllm"}, source="playbooks/prod.yaml")
    assert e.value.problems == ["env_audit.ignroe: unknown key (did you mean 'ignore'?)",
                                "env_audit.allow: expected a list of names"]
    with pytest.raises(ConfigError, match=r"env_audit.ignore\[0\]: unknown finding 'stray' \(did you mean 'stray-stack'\?\)"):
        ea.Policy.from_dict({"ignore": ["stray"]})


def test_cpu_torch_against_the_playbooks_device():
    s = _with(gpu_host(), ea.Dist("torch", "2.11.0+cpu", "/x", []))
    (cuda,) = [f for f in ea.audit(s, device="cuda") if f.code == "torch-cpu-build"]
    assert cuda.severity == "warning" and "the trainer will refuse to start" in cuda.message
    assert _codes(f for f in ea.audit(s, device="auto", host_gpus=8) if f.code == "torch-cpu-build") == \
        [("warning", "torch-cpu-build")]
    assert _codes(f for f in ea.audit(s, device="cpu", host_gpus=8) if f.code == "torch-cpu-build") == \
        [("info", "torch-cpu-build")]
    (missing,) = ea.audit(_with(gpu_host(), drop=("torch",)))[:1]
    assert (missing.severity, missing.code) == ("error", "torch-missing")


# --------------------------------------------------------------------------- on real hosts


def test_local_host_audit_finds_the_venv_torch(tmp_path):
    inventory = load_inventory(None)
    report = ea.audit_target("local", inventory)
    s = report.snapshot
    assert s.python == sys.executable and s.prefix == sys.prefix
    import torch  # noqa: F401  (the test side only: to compare with what the script read without it)

    assert report.torch.version == torch.__version__
    assert report.torch.source == "torch/version.py" and report.torch.cuda == torch.version.cuda
    assert s.torch_elf and s.torch_elf["file"].startswith("torch/lib/") and "$ORIGIN" in s.torch_elf.get("runpath", "")
    chains = {(c.chain, ea.canon(c.requirement.name)) for c in ea.requirement_checks(s)}
    assert ("torch", "sympy") in chains and ("torch -> sympy", "mpmath") in chains
    torch_dist = s.installed()["torch"]
    assert "torch" in torch_dist.modules and torch_dist.location.endswith("site-packages")
    assert report.exit_code == ea.exit_code(report.findings) < 2

    # A PYTHONPATH that shadows torch's own requirement, read by the script for real.
    polluted = tmp_path / "polluted"
    (polluted / "sympy").mkdir(parents=True)
    (polluted / "sympy" / "__init__.py").write_text("")
    (polluted / "notes").write_text("not a module")
    from dflashctl.transport import connect

    snapshot = ea.collect(connect("local", inventory), env={"PYTHONPATH": str(polluted)})
    assert snapshot.pythonpath == [ea.PathEntry(str(polluted), True, ["sympy"], ["sympy"])]
    (shadow,) = [f for f in ea.audit(snapshot) if f.code == "pythonpath"]
    assert shadow.severity == "error" and "shadows sympy" in shadow.message


def test_target_through_jump_and_container(ssh_env):
    report = ea.audit_host("target", ssh_env.inventory)
    s = report.snapshot
    assert s.hostname == "ct200"  # answered from inside `pct exec 200 --`
    assert report.torch is not None and s.installed()["torch"].requires
    assert ("torch", "sympy") in {(c.chain, ea.canon(c.requirement.name)) for c in ea.requirement_checks(s)}
    assert "direct-tcpip" in ssh_env.log("jump")


def test_cli_json_text_and_recorded_snapshot(tmp_path):
    env = {**os.environ, "DFLASHCTL_STORE": str(tmp_path / "runs.db")}
    env.pop("DFLASHCTL_INVENTORY", None)
    env.pop("DFLASHCTL_PLAYBOOKS", None)

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "dflashctl", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)

    done = cli("env-audit", "local", "--json")
    payload = json.loads(done.stdout)
    assert done.returncode == payload["exit_code"] in (0, 1)
    assert payload["host"] == "local" and payload["torch"]["version"] == payload["packages"]["torch"]
    text = cli("env-audit", "demo")  # the embedded playbook: its host, with its env
    assert text.returncode == payload["exit_code"]
    assert text.stdout.startswith("demo: local") and f"torch {payload['torch']['version']}" in text.stdout
    snapshots = Store(env["DFLASHCTL_STORE"]).env_snapshots("local")
    assert len(snapshots) == 2 and snapshots[0]["data"]["torch"] == payload["torch"]["version"]
    bad = cli("env-audit", "lcal")
    assert bad.returncode == 2 and "'lcal' is neither a playbook nor a host (did you mean 'local'?)" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_launch_preflight_hook_audits_and_records(tmp_path):
    from dflashctl import launch

    inventory = load_inventory(None)
    store = Store(str(tmp_path / "runs.db"))
    findings = launch.preflight(load_playbook("demo", None, inventory), inventory, store)
    assert all(f.severity != "error" for f in findings)  # the demo runs here
    (recorded,) = store.env_snapshots("local")
    assert recorded["kind"] == "packages" and "torch" in recorded["data"]
    changed = {**recorded["data"], "sglang": "0.5.3"}
    drift = env_drift(recorded["data"], changed)
    assert drift is not None and "added sglang 0.5.3" in drift.message
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


def test_one_finding_per_missing_package():
    site = "/opt/torch/.venv/lib/python3.12/site-packages"
    s = _with(gpu_host(), ea.Dist("sympy", "1.14.0", site, ["mpmath<1.4,>=1.1.0"]),
              ea.Dist("transformers", "5.17.0", site, ["mpmath<1.4,>=1.1.0", "numpy>=1.17"]), drop=("mpmath",))
    missing = [f for f in ea.audit(s) if f.code == "missing-requirement"]
    assert [f.message for f in missing] == [
        "transformers requires mpmath<1.4,>=1.1.0, which is not installed (also required by torch -> sympy)"]


def test_cli_help():
    done = subprocess.run([sys.executable, "-m", "dflashctl", "env-audit", "--help"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "COLUMNS": "120"})
    assert done.returncode == 0 and "PLAYBOOK|HOST" in done.stdout and "Exit code 0 clean" in done.stdout
