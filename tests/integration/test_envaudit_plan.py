"""The printed plan applied for real, step by step, with real pip in real venvs
built from wheels made here (their libraries are real files: a libcudnn.so.9 or
libnccl.so.2 deleted or overwritten really breaks the fake torch's loader).

After every step of the plan, `import torch` and `import transformers` must
still work; the plan stops at the first command that fails, as the printed plan
says; at the end the re-audit has no error. The environments: a CUDA 13 stack
installed before torch's CUDA 12 wheels (which overwrite its files), a host with
no index reachable, a METADATA that makes pip itself crash, a stale second
dist-info of transformers, an older transformers on PYTHONPATH.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dflashctl import envaudit as ea
from dflashctl.hosts.transport import connect
from tests.harness import cli
from tests.harness.envs import (
    OFFLINE,
    TORCH_VERSION,
    TRAINER_STACK,
    Venv,
    dist_info_name,
    elf_library,
    pip,
    trainer_stack_wheels,
    write_dist,
    write_wheel,
)

CUDNN12, CUDNN13 = ("nvidia-cudnn-cu12", "9.1.0.70"), ("nvidia-cudnn-cu13", "9.13.0.50")
NCCL12, NCCL13 = ("nvidia-nccl-cu12", "2.21.5"), ("nvidia-nccl-cu13", "2.27.7")

# torch that loads its cuDNN and NCCL the way torch's libraries do (next to it, in
# nvidia/*/lib) and refuses a build for another CUDA.
TORCH_INIT = '''import os
from torch import version
__version__ = version.__version__
_nvidia = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nvidia")
for _sub, _so in (("cudnn", "libcudnn.so.9"), ("nccl", "libnccl.so.2")):
    _lib = os.path.join(_nvidia, _sub, "lib", _so)
    if not os.path.exists(_lib):
        raise OSError("%s: cannot open shared object file: No such file or directory" % _so)
    with open(_lib, "rb") as _f:
        if not _f.read(64).startswith(b"cu12"):
            raise RuntimeError("%s was built for another CUDA than torch" % _so)
'''


def torch_wheel_files() -> dict:
    return {"torch/__init__.py": TORCH_INIT,
            "torch/version.py": f"__version__ = {TORCH_VERSION!r}\ncuda = '12.6'\n",
            "torch/lib/libtorch_cuda.so": elf_library("$ORIGIN/../../nvidia/cudnn/lib:$ORIGIN/../../nvidia/nccl/lib",
                                                      ["libcudnn.so.9", "libnccl.so.2"])}


def library(sub: str, soname: str, cuda: str) -> dict:
    """An NVIDIA library wheel's files: the CUDA 12 and 13 builds own the same paths, with other bytes."""
    return {"nvidia/__init__.py": "", f"nvidia/{sub}/__init__.py": "",
            f"nvidia/{sub}/lib/{soname}": f"{cuda} {soname} ".encode() + bytes(40 if cuda == "cu13" else 8)}


def transformers_files(version: str) -> dict:
    files = dict(TRAINER_STACK[0][2])
    files["transformers/__init__.py"] = f"__version__ = {version!r}\nimport safetensors\n"
    return files


@pytest.fixture
def wheels(tmp_path) -> Path:
    d = tmp_path / "wheels"
    d.mkdir()
    write_wheel(d, "torch", TORCH_VERSION, torch_wheel_files(), [f"{CUDNN12[0]}=={CUDNN12[1]}",
                                                                 f"{NCCL12[0]}=={NCCL12[1]}"])
    write_wheel(d, *CUDNN12, library("cudnn", "libcudnn.so.9", "cu12"))
    write_wheel(d, *CUDNN13, library("cudnn", "libcudnn.so.9", "cu13"))
    write_wheel(d, *NCCL12, library("nccl", "libnccl.so.2", "cu12"))
    write_wheel(d, *NCCL13, library("nccl", "libnccl.so.2", "cu13"))
    trainer_stack_wheels(d)  # transformers 4.56.2 (Qwen3 classes), safetensors, triton
    write_wheel(d, "huggingface-hub", "0.34.4", {"huggingface_hub/__init__.py": ""})
    write_wheel(d, "transformers", "4.46.3", transformers_files("4.46.3"), ["safetensors>=0.4.1"])
    write_wheel(d, "sglang", "0.5.3", {"sglang/__init__.py": ""}, [f"{CUDNN13[0]}>=9.10", f"{NCCL13[0]}>=2.27"])
    return d


def venv(tmp_path: Path, fresh: Path, wheels: Path) -> tuple[Venv, dict]:
    shutil.copytree(fresh, tmp_path / "venv", symlinks=True)
    return Venv.existing(tmp_path / "venv"), {**OFFLINE, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels)}


def assert_trainer_imports(env: Venv, after: str) -> None:
    for module in ("torch", "transformers"):
        done = env.imports(module)
        assert done.returncode == 0, (after, module, done.stderr[-600:])


def apply_plan_by_hand(report: ea.AuditReport, inventory, environment: dict, env: Venv) -> tuple[list[str], str | None]:
    """The printed plan run as it says: in order, through the host's transport,
    stopping at the first command that fails; the trainer's imports checked after
    every step. (lines run, the line that failed or None)."""
    transport = connect(report.host, inventory)
    ran = []
    for argv, line in report.plan():
        result = transport.run(argv, env=environment, check=False, timeout=120)
        if result.exit_code != 0:
            assert_trainer_imports(env, f"failed: {line}")
            return ran, line
        ran.append(line)
        assert_trainer_imports(env, line)
    return ran, None


def cu13_stack_then_cu12_torch(tmp_path, fresh, wheels) -> tuple[Venv, dict]:
    """The inference stack's CUDA 13 libraries first, then torch (reinstalled after
    it: common), whose CUDA 12 wheels overwrite the files the CUDA 13 ones list."""
    env, offline = venv(tmp_path, fresh, wheels)
    pip(env, offline, "install", "sglang")
    pip(env, offline, "install", "torch", "transformers", "triton")
    assert_trainer_imports(env, "the setup")
    return env, offline


def test_a_cu13_stack_then_cu12_torch_the_plan_never_puts_the_strays_back(tmp_path, fresh_venv, wheels):
    env, offline = cu13_stack_then_cu12_torch(tmp_path, fresh_venv, wheels)
    inventory = env.inventory(tmp_path)
    report = ea.audit_host("box", inventory)
    # The CUDA 13 wheels' RECORDs disagree with the disk (torch's wheels wrote over them): their
    # reinstall would put the CUDA 13 builds back under torch.
    stale = [f for f in report.findings if f.code == "missing-files" and f.packages[0] in (CUDNN13[0], NCCL13[0])]
    assert len(stale) == 2 and all(f.argv == [] and "no command is given" in f.fix for f in stale)
    lines = [line for _, line in report.plan()]
    assert not [line for line in lines if (CUDNN13[0] in line or NCCL13[0] in line) and "uninstall" not in line], lines
    assert len(lines) == len(set(lines))
    ran, failed = apply_plan_by_hand(report, inventory, offline, env)
    assert failed is None and ran
    cudnn = env.site / "nvidia/cudnn/lib/libcudnn.so.9"
    assert cudnn.read_bytes().startswith(b"cu12") and (env.site / "nvidia/nccl/lib/libnccl.so.2").read_bytes()[:4] == b"cu12"
    after = ea.audit_host("box", inventory)
    assert after.counts()["error"] == 0, [f.message for f in after.findings if f.severity == "error"]
    assert not {CUDNN13[0], NCCL13[0]} & set(after.snapshot.packages())


def test_a_host_with_no_index_stops_before_anything_is_removed(tmp_path, fresh_venv, wheels):
    env, offline = cu13_stack_then_cu12_torch(tmp_path, fresh_venv, wheels)
    pip(env, offline, "install", "transformers==4.46.3")  # too old for the trainer: the plan installs a newer one
    inventory = env.inventory(tmp_path)
    report = ea.audit_host("box", inventory)
    before = report.snapshot.packages()
    air_gapped = {**OFFLINE, "PIP_NO_INDEX": "1"}  # no index, no local wheels: nothing can be fetched
    ran, failed = apply_plan_by_hand(report, inventory, air_gapped, env)
    assert failed is not None and " download " in failed and [r.split()[0] for r in ran] == ["mkdir"]
    assert ea.audit_host("box", inventory).snapshot.packages() == before  # nothing changed


def test_a_metadata_pip_cannot_read_is_removed_before_pip_is_needed(tmp_path, fresh_venv, wheels):
    env, offline = cu13_stack_then_cu12_torch(tmp_path, fresh_venv, wheels)
    info = write_dist(env.site, "latin-tool", "1.0", {"latin_tool.py": ""})
    (info / "METADATA").write_bytes(b"Metadata-Version: 2.1\nName: latin-tool\nVersion: 1.0\nSummary: caf\xe9\n")
    inventory = env.inventory(tmp_path)
    report = ea.audit_host("box", inventory)
    (blocking,) = [f for f in report.findings if f.code == "broken-metadata"]
    assert blocking.severity == "error" and "every pip command (any fix) fails" in blocking.message
    steps = [argv for argv, _ in report.plan()]
    assert steps[0] == ["rm", "-r", "--", str(info)]
    ran, failed = apply_plan_by_hand(report, inventory, offline, env)
    assert failed is None
    assert ea.audit_host("box", inventory).counts()["error"] == 0


def test_a_stale_second_dist_info_is_removed_as_that_directory(tmp_path, fresh_venv, wheels):
    env, offline = venv(tmp_path, fresh_venv, wheels)
    pip(env, offline, "install", "torch", "transformers", "triton")
    # What a half-finished upgrade leaves: the old version's dist-info, its RECORD
    # listing the files the new one now owns (other bytes) and one it no longer has.
    old = transformers_files("4.55.0")
    old["transformers/old_only.py"] = ""
    stale = write_dist(tmp_path / "scratch", "transformers", "4.55.0", old, ["safetensors"])
    shutil.copytree(stale, env.site / stale.name)
    live = env.site / dist_info_name("transformers", "4.56.2")
    assert live.is_dir()
    inventory = env.inventory(tmp_path)
    report = ea.audit_host("box", inventory)
    (found,) = [f for f in report.findings if f.code == "stale-dist-info"]
    assert found.argv == [["rm", "-r", "--", str(env.site / stale.name)]]
    assert not [a for _, a in report.plan() if "transformers==4.55.0" in a]
    ran, failed = apply_plan_by_hand(report, inventory, offline, env)
    assert failed is None and not (env.site / stale.name).exists() and live.is_dir()
    assert (env.site / "transformers/__init__.py").read_text().startswith("__version__ = '4.56.2'")
    after = ea.audit_host("box", inventory)
    assert after.counts()["error"] == after.counts()["warning"] == 0, [f.message for f in after.findings]


@pytest.mark.parametrize("how", ["pythonpath", "pth"])
def test_an_older_transformers_that_shadows_the_environments_steers_no_install(tmp_path, fresh_venv, wheels, how):
    """An older transformers imported ahead of the environment's own (from
    PYTHONPATH, a directory a .pth puts in front): what it asks for is never
    installed into the environment, and the environment's copy is never named for
    removal. (A venv puts the user site behind its own site-packages: a user-site
    copy shadows only a python that is not a venv, which this machine's tests
    cannot fill.)"""
    env, offline = venv(tmp_path, fresh_venv, wheels)
    pip(env, offline, "install", "torch", "transformers", "triton", "huggingface-hub")
    shadow = tmp_path / "shadow"
    write_dist(shadow, "transformers", "4.46.3", transformers_files("4.46.3"),
               ["safetensors>=0.4.1", "huggingface-hub>=0.23.2,<0.30", "tokenizers>=0.20,<0.21"])
    environment = {"PYTHONPATH": str(shadow)} if how == "pythonpath" else {}
    if how == "pth":
        (env.site / "front.pth").write_text(f"import sys; sys.path.insert(0, {str(shadow)!r})\n")
    inventory = env.inventory(tmp_path, environment)
    report = ea.audit_host("box", inventory)
    assert report.snapshot.installed()["transformers"].version == "4.46.3"  # the shadow is what is imported
    lines = [line for _, line in report.plan()]
    assert not [line for line in lines if "huggingface-hub" in line or "tokenizers" in line or
                "transformers" in line], lines
    steered = [f for f in report.findings if f.code in ("requirement-version", "missing-requirement")]
    assert steered and all(f.argv == [] and f"take {shadow} off the trainer's sys.path first" in f.fix
                           for f in steered)
    (old,) = [f for f in report.findings if f.code == "trainer-requirement" and f.packages == ["transformers"]]
    assert old.argv == [] and old.fix.startswith(f"take {shadow} off the trainer's sys.path")
    if how == "pythonpath":
        assert [f for f in report.findings if f.code == "pythonpath" and f.paths == [str(shadow)]]
    for f in report.findings:
        assert str(env.site / dist_info_name("transformers", "4.56.2")) not in " ".join(f.commands), f
    ran, failed = apply_plan_by_hand(report, inventory, {**offline, **environment}, env)
    assert failed is None
    # Nothing the shadowing copy asks for was installed into the environment: its own copies stay.
    assert (env.site / dist_info_name("huggingface_hub", "0.34.4")).is_dir()
    assert (env.site / dist_info_name("transformers", "4.56.2")).is_dir()


# --------------------------------------------------------------------------- env-audit --apply


def old_transformers_after_a_cu13_stack(tmp_path, fresh, wheels, host_env: dict | None = None):
    env, offline = cu13_stack_then_cu12_torch(tmp_path, fresh, wheels)
    pip(env, offline, "install", "transformers==4.46.3")
    return env, offline, env.inventory(tmp_path, host_env if host_env is not None else offline)


def test_apply_runs_the_plan_and_the_audit_after_it_is_clean(tmp_path, fresh_venv, wheels):
    import json

    env, offline, inventory = old_transformers_after_a_cu13_stack(tmp_path, fresh_venv, wheels)
    before = ea.audit_host("box", inventory)
    assert [f for f in before.findings if f.code == "trainer-requirement" and f.packages == ["transformers"]]
    done = cli.invoke("--inventory", inventory.source, "env-audit", "box", "--apply", "--json",
                      env={"DFLASHCTL_STORE": str(tmp_path / "runs.db")})
    payload = json.loads(done.stdout)
    assert payload["stopped"] is None, payload["why"]
    # The printed plan, its wheels fetched into the apply's own directory (mkdtemp on the host).
    wheels = payload["applied"][0].split(" -- ")[-1]
    assert wheels.startswith("/tmp/dflashctl-env-apply-") and wheels.endswith("/wheels")
    assert payload["applied"] == [line for _, line in before.plan(wheels)]
    assert payload["after"]["counts"]["error"] == 0 and done.returncode == payload["after"]["exit_code"] < 2
    assert payload["after"]["packages"]["transformers"] == "4.56.2"
    assert_trainer_imports(env, "--apply")
    again = cli.invoke("--inventory", inventory.source, "env-audit", "box", "--apply",
                       env={"DFLASHCTL_STORE": str(tmp_path / "runs.db")}, columns=200)
    assert again.returncode < 2 and "0 error(s)" in again.stdout, again.stdout + again.stderr


def test_apply_on_a_host_with_no_index_stops_at_the_fetch_with_nothing_changed(tmp_path, fresh_venv, wheels):
    from dflashctl.envaudit.apply import apply_plan

    env, offline, inventory = old_transformers_after_a_cu13_stack(tmp_path, fresh_venv, wheels,
                                                                   {**OFFLINE, "PIP_NO_INDEX": "1"})
    before = ea.audit_host("box", inventory).snapshot.packages()
    done = apply_plan("box", inventory)
    assert not done.ok and " download " in done.stopped and [r.split()[0] for r in done.ran] == ["mkdir"]
    assert "the wheel could not be fetched: nothing has been changed" in done.why
    assert done.after.snapshot.packages() == before
    assert_trainer_imports(env, "a failed fetch")


def test_apply_stops_and_undoes_the_step_pip_crashes_in(tmp_path, fresh_venv, wheels):
    """pip crashing halfway: a METADATA it cannot read appears after the first
    removal (another installer at work); the next pip step fails, is undone, and
    nothing after it runs."""
    from dflashctl.envaudit.apply import apply_plan

    env, offline, inventory = old_transformers_after_a_cu13_stack(tmp_path, fresh_venv, wheels)

    def after_step(i: int, line: str) -> None:
        assert_trainer_imports(env, line)
        if " uninstall " in line:
            info = write_dist(env.site, "latin-tool", "1.0", {"latin_tool.py": ""})
            (info / "METADATA").write_bytes(b"Metadata-Version: 2.1\nName: latin-tool\nVersion: 1.0\nSummary: caf\xe9\n")

    done = apply_plan("box", inventory, after_step=after_step)
    assert not done.ok and "install" in done.stopped and "transformers" in done.stopped, done
    assert "UnicodeDecodeError" in done.why and done.restored
    assert any(" uninstall " in line for line in done.ran)
    assert_trainer_imports(env, "the undone step")
    assert (env.site / dist_info_name("transformers", "4.46.3")).is_dir()
    assert (env.site / "transformers/__init__.py").read_text().startswith("__version__ = '4.46.3'")


# --------------------------------------------------------------------------- a second user of the host


def _evil_transformers(marker: Path) -> bytes:
    """transformers 4.56.2 as the stranger builds it: the real files, and a .pth that
    runs their code in every Python that starts on the host (as root, after the apply)."""
    import tempfile

    files = {**TRAINER_STACK[0][2], "zz_planted.pth": f"import os; open({str(marker)!r}, 'w').write(str(os.getuid()))\n"}
    with tempfile.TemporaryDirectory() as d:
        return write_wheel(Path(d), "transformers", "4.56.2", files, ["safetensors>=0.4.3"]).read_bytes()


def test_a_wheel_another_user_planted_where_the_plan_fetches_is_never_installed(tmp_path, fresh_venv, wheels):
    """The stranger computes the plan the operator will apply (the same audit) and
    makes its wheel directory first, with their own transformers wheel in it. The
    apply fetches into a directory of its own (mkdtemp on the host), so the
    stranger's wheel is never installed; the printed plan makes its directory
    itself (mkdir -m 700), so run by hand it stops there, before any wheel is fetched."""
    from dflashctl.envaudit.apply import apply_plan
    from tests.harness.users import plant

    env, offline, inventory = old_transformers_after_a_cu13_stack(tmp_path, fresh_venv, wheels)
    marker = Path("/tmp") / f"dflashctl-planted-{tmp_path.name}"
    guessed = ea.audit_host("box", inventory)
    fetch = next(argv for argv, _ in guessed.plan() if "download" in argv)
    dest = fetch[fetch.index("--dest") + 1]
    shutil.rmtree(dest, ignore_errors=True)  # left by an earlier run: the stranger is first here
    plant(dest, {"transformers-4.56.2-py3-none-any.whl": _evil_transformers(marker)}, mode=0o777)
    try:
        done = apply_plan("box", inventory)
        assert done.ok, done.why
        assert not (env.site / "zz_planted.pth").exists(), "the stranger's wheel was installed"
        assert_trainer_imports(env, "--apply")
        assert not marker.exists(), "the stranger's code ran"

        # The printed plan run by hand, the stranger having made the directory it names.
        env2, offline2, inventory2 = old_transformers_after_a_cu13_stack(tmp_path / "by-hand", fresh_venv, wheels)
        report = ea.audit_host("box", inventory2)
        fetch = next(argv for argv, _ in report.plan() if "download" in argv)
        plant(fetch[fetch.index("--dest") + 1], {"transformers-4.56.2-py3-none-any.whl": _evil_transformers(marker)},
              mode=0o777)
        ran, failed = apply_plan_by_hand(report, inventory2, offline2, env2)
        assert ran == [] and failed is not None and failed.startswith("mkdir -m 700 -- "), (ran, failed)
        assert not (env2.site / "zz_planted.pth").exists() and not marker.exists()
    finally:
        shutil.rmtree(dest, ignore_errors=True)
        shutil.rmtree(fetch[fetch.index("--dest") + 1], ignore_errors=True)
        marker.unlink(missing_ok=True)
