"""The trainer bundle (reproducible, self-sufficient) and its deployment: locally
and through jump -> container over real sshd, idempotent, and safe when the
connection is cut halfway."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
import yaml

from dflashctl.config import load_inventory
from dflashctl.core.errors import TransportError
from dflashctl.hosts import deploy
from dflashctl.hosts.bundle import Bundle, build_bundle
from dflashctl.hosts.transport import connect
from tests import harness
from tests.harness.bundle import source_copy

REPO = harness.REPO





def _changed_bundle(tmp_path: Path, text: str = "CHANGED = True\n") -> Bundle:
    root = source_copy(tmp_path)
    (root / "trainer" / "_variant.py").write_text(text)
    return build_bundle(str(root))


@pytest.fixture
def local_inventory(tmp_path):
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump({"hosts": {"local": {"transport": "local", "workdir": str(tmp_path / "work")}}}))
    return load_inventory(str(path))


# --------------------------------------------------------------------------- bundle


def test_unpacked_bundle_imports_every_trainer_module_on_its_own(tmp_path):
    tarfile.open(fileobj=io.BytesIO(build_bundle().data)).extractall(tmp_path)
    probe = textwrap.dedent(
        """
        import importlib, pkgutil, sys, trainer
        for m in pkgutil.iter_modules(trainer.__path__):
            if m.name != "__main__":
                importlib.import_module("trainer." + m.name)
        import trainer.__main__  # noqa
        print(sorted(k for k in sys.modules if k.split(".")[0] == "dflashctl"))
        print(trainer.__file__)
        """
    )
    # The bundle comes first on the path, as on a run host: a trainer module that
    # needed any other part of dflashctl would fail to import here.
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)}, timeout=120)
    assert out.returncode == 0, out.stderr
    modules, location = out.stdout.splitlines()
    assert modules == "['dflashctl', 'dflashctl.core', 'dflashctl.core.contract']"
    assert location.startswith(str(tmp_path))


# --------------------------------------------------------------------------- deploy, local


def test_local_deploy_is_idempotent_and_writes_run_files(local_inventory, tmp_path):
    t = connect("local", local_inventory)
    bundle = build_bundle()
    first = deploy.deploy_bundle(t, bundle)
    assert (first.status, first.bytes_sent) == ("uploaded", bundle.size)
    target = tmp_path / "work" / "bundles" / bundle.hash
    assert first.bundle_dir == str(target) and (target / ".complete").read_text().strip() == bundle.hash
    assert sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file() and p.name != ".complete") == bundle.files
    second = deploy.deploy_bundle(t, bundle)
    assert (second.status, second.bytes_sent) == ("unchanged", 0)
    run_dir = deploy.run_dir(first.workdir, "demo-x")
    deploy.write_run_files(t, run_dir, {"config.json": '{"a": 1}\n', "run.sh": "#!/bin/sh\necho hi\n"})
    assert (tmp_path / "work" / "runs" / "demo-x" / "config.json").read_text() == '{"a": 1}\n'
    assert os.access(tmp_path / "work" / "runs" / "demo-x" / "run.sh", os.X_OK)


def test_corrupted_upload_is_refused_and_leaves_nothing(local_inventory, tmp_path):
    t = connect("local", local_inventory)
    good = build_bundle()
    half = Bundle(hash=good.hash, data=good.data[: good.size // 2], files=good.files)
    with pytest.raises(TransportError) as e:
        deploy.deploy_bundle(t, half)
    text = str(e.value)
    assert "upload of bundle" in text and "bundles already on the host are untouched" in text
    assert f"upload incomplete or corrupted: received {good.size // 2} of" in text
    bundles = tmp_path / "work" / "bundles"
    assert os.listdir(bundles) == []  # no half bundle, no temporary directory
    assert deploy.deploy_bundle(t, good).status == "uploaded"


def test_stale_upload_dirs_are_cleaned_by_the_next_deploy(local_inventory, tmp_path):
    t = connect("local", local_inventory)
    bundles = tmp_path / "work" / "bundles"
    stale = bundles / ".tmp-deadbeef-abc123"
    fresh = bundles / ".tmp-deadbeef-def456"  # may be another deploy in progress
    for d in (stale, fresh):
        (d / "trainer").mkdir(parents=True)
    old = time.time() - (deploy.STALE_TEMP_MINUTES + 2) * 60
    os.utime(stale, (old, old))
    result = deploy.deploy_bundle(t, build_bundle())
    assert result.cleaned_temp_dirs == 1
    assert not stale.exists() and fresh.exists()


# --------------------------------------------------------------------------- deploy through jump -> container


def test_deploy_through_jump_into_the_container(ssh_env):
    t = connect("target", ssh_env.inventory)
    bundle = build_bundle()
    first = deploy.deploy_bundle(t, bundle)
    second = deploy.deploy_bundle(t, bundle)
    assert first.status in ("uploaded", "unchanged")  # another test may have deployed it already
    assert (second.status, second.bytes_sent) == ("unchanged", 0)
    on_disk = ssh_env.workdir("target") / "bundles" / bundle.hash
    assert first.bundle_dir == str(on_disk) and (on_disk / ".complete").exists()
    # The commands really ran inside the container layer (its hostname is ct200).
    assert t.run(["hostname"]).stdout.strip() == "ct200"


# A container wrapper stand-in that passes the first N bytes of stdin on, says so in
# a flag file, then holds the rest back until its connection is cut (its parent,
# the session's sshd, dies); then it closes the command's stdin. Commands with less
# stdin than N (every other round trip) pass straight through.
_CUT_WRAPPER = """#!{python}
import os, subprocess, sys, time
limit, flag, cmd = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
proc = subprocess.Popen(cmd, stdin=subprocess.PIPE)
sent = 0
while sent < limit:
    chunk = os.read(0, min(65536, limit - sent))
    if not chunk:
        break
    proc.stdin.write(chunk)
    proc.stdin.flush()
    sent += len(chunk)
if sent >= limit:
    with open(flag, "w") as f:
        f.write(str(sent))
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.05)
proc.stdin.close()
sys.exit(proc.wait())
"""


def test_upload_cut_halfway_keeps_the_previous_bundle_and_says_so(ssh_env, tmp_path):
    good = build_bundle()
    deploy.deploy_bundle(connect("target", ssh_env.inventory), good)  # the previous bundle
    new = _changed_bundle(tmp_path)
    assert new.hash != good.hash

    wrapper = tmp_path / "cutwrap"
    wrapper.write_text(_CUT_WRAPPER.format(python=sys.executable))
    wrapper.chmod(0o755)
    flag = tmp_path / "halfway"
    raw = yaml.safe_load(Path(ssh_env.inventory_path).read_text())
    cut = dict(raw["hosts"]["target"])
    cut["wrapper"] = [str(wrapper), str(new.size // 2), str(flag), *ssh_env.inventory.get("target").wrapper]
    raw["hosts"]["target-cut"] = cut
    inv_path = tmp_path / "inventory.yaml"
    inv_path.write_text(yaml.safe_dump(raw))
    inventory = load_inventory(str(inv_path))

    outcome: dict = {}

    def upload():
        try:
            outcome["result"] = deploy.deploy_bundle(connect("target-cut", inventory), new)
        except Exception as e:  # noqa: BLE001  (asserted below)
            outcome["error"] = e

    thread = threading.Thread(target=upload, name="cut-upload")
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not flag.exists() and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert flag.exists(), outcome
        assert int(flag.read_text()) == new.size // 2
        killed = ssh_env.kill_connections("target")  # the link drops mid-transfer
        assert killed
    finally:
        thread.join(60)
    assert not thread.is_alive()
    error = outcome.get("error")
    assert isinstance(error, TransportError), outcome
    assert "the connection was lost mid-transfer" in str(error)
    assert "bundles already on the host are untouched" in str(error)
    assert error.hint and "partial upload is never used" in error.hint

    bundles = ssh_env.workdir("target") / "bundles"
    assert not (bundles / new.hash).exists()
    assert (bundles / good.hash / ".complete").exists()
    # The receiver saw its stdin end short, refused the hash and removed its temporary dir.
    deadline = time.monotonic() + 20
    while [p for p in os.listdir(bundles) if p.startswith(".tmp-")] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in os.listdir(bundles) if p.startswith(".tmp-")] == []
    # The previous bundle is whole and usable.
    t = connect("target", ssh_env.inventory)
    check = t.run([ssh_env.inventory.get("target").python, "-c", "import trainer.config, dflashctl.core.contract; print('ok')"],
                  env={"PYTHONPATH": str(bundles / good.hash)}, cwd="/")
    assert check.stdout.strip() == "ok"
    # And the next deploy of the new bundle completes.
    assert deploy.deploy_bundle(t, new).status == "uploaded"
    assert (bundles / new.hash / "trainer" / "_variant.py").read_text() == "CHANGED = True\n"
