"""Red team, the trainer's side: what a compromised or shared run host can write
into a run directory (compile artifacts, their bytecode, a second trainer, a
standby's go file), tried as an attacker would, against the trainer's own loaders
and processes: the loaders run in child Python processes that import what they
unpacked, the trainers are real (tiny, CPU).

One test per attack; each failed before the trust boundaries were drawn
(docs/trust.md). The controller's side: tests/integration/test_trust_artifacts.py."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest

from dflashctl.core import contract
from dflashctl.runs import compile_cache as cc
from tests import harness
from tests.harness.tiny import Trainer, read_status, tiny_config
from trainer import bytecode
from trainer import compile_cache as trainer_cache
from trainer import config as trainer_config

REPO = str(harness.REPO)


TRAINER = {"model": {"preset": "tiny"}, "data": {"buckets": [256], "batch_size": 1, "max_anchors": 16},
           "placement": {"device": "cpu", "target": [0], "drafter": [0]}}


BUNDLE = "b" * 64


def _trainer() -> dict:
    return trainer_config.from_dict(TRAINER).to_dict()


def _fields(**changes) -> dict:
    fields = {"torch": "2.13.0", "triton": "3.5", "cuda": "12.8", "gpu": "cpu", "python": "3.11.0", "bundle": BUNDLE,
              "config": cc.config_digest(_trainer())}
    return {**fields, **changes}


_IMPORTER = textwrap.dedent("""
    import json, sys
    prefix, site, run_dir, expected = sys.argv[1:5]
    sys.pycache_prefix, sys.dont_write_bytecode = prefix, False
    sys.path.insert(0, site)
    from trainer import compile_cache as cc
    report = {"travelled": cc.load_bytecode(run_dir, prefix, json.loads(expected))}
    import victim
    report["value"] = victim.VALUE
    print(json.dumps(report))
""")


def _crafted_bytecode(site: Path) -> bytes:
    """A bytecode archive whose member for ``victim.py`` carries that source's true hash
    (the 16-byte header checks out) and a code object that is something else."""
    source = (site / "victim.py").read_bytes()
    payload = compile(f"open({str(site / 'PWNED')!r}, 'w').write('ran')\nVALUE = 'payload'\n", str(site / "victim.py"),
                      "exec")
    import marshal

    pyc = (importlib.util.MAGIC_NUMBER + bytecode.FLAGS_CHECKED_HASH.to_bytes(4, "little")
           + importlib.util.source_hash(source) + marshal.dumps(payload))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo(str(site / "victim.py").lstrip(os.sep))
        info.size = len(pyc)
        tar.addfile(info, io.BytesIO(pyc))
    return buf.getvalue()


_LOADER = textwrap.dedent("""
    import json, os, sys
    run_dir, evil = sys.argv[1:3]
    from torch.compiler._cache import CacheArtifactFactory, CacheArtifactManager, _serialize_single_cache
    from torch.utils._appending_byte_serializer import AppendingByteSerializer
    from trainer import compile_cache as cc
    from trainer.config import from_dict
    import torch
    cfg = from_dict(json.loads(sys.argv[3]))
    fields = cc.key_fields(cfg, [torch.device("cpu")])
    CacheArtifactManager._ensure_cache_artifacts_registered()
    entries = [CacheArtifactFactory.create("autotune", "ab/fine.best_config", b"{}"),
               CacheArtifactFactory.create("autotune", evil, b"import os; os.system('touch owned')\\n")]
    serializer = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
    serializer.extend([("autotune", entries)])
    cc.write(run_dir, fields, cfg, serializer.to_bytes(), {"autotune": 2})
    out = cc.load(run_dir, fields)
    print(json.dumps({"status": out.status, "note": out.note, "loaded": out.loaded}))
""")


def test_crafted_bytecode_with_the_true_header_in_an_artifact_of_another_key_never_runs(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "victim.py").write_text("VALUE = 'honest'\n")
    archive = _crafted_bytecode(site)
    run_dir = tmp_path / "run"
    artifacts = b"kernels"
    stats = {"files": 1}
    # The host's artifact claims another playbook's config: its bytecode is not this run's.
    trainer_cache.write(str(run_dir), _fields(config="f" * 16), trainer_config.from_dict(TRAINER), artifacts, {},
                        (archive, stats))
    expected = {"python": "3.11.0", "bundle": BUNDLE, "config": cc.config_digest(_trainer())}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"}
    env.update(PYTHONPATH=REPO, PYTHONDONTWRITEBYTECODE="1")
    out = subprocess.run([sys.executable, "-c", _IMPORTER, str(tmp_path / "pycache"), str(site), str(run_dir),
                          json.dumps(expected)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["travelled"]["status"] == "mismatch:config", report
    assert report["value"] == "honest" and not (site / "PWNED").exists()


def test_a_gzip_bomb_in_the_bytecode_part_is_refused_before_it_expands(tmp_path):
    bomb = io.BytesIO()
    with tarfile.open(fileobj=bomb, mode="w:gz") as tar:
        info = tarfile.TarInfo("x/y.py")
        info.size = 256 << 20
        tar.addfile(info, io.BytesIO(bytes(info.size)))
    data = bomb.getvalue()
    assert len(data) < 1 << 20
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="expands past"):
        bytecode.unpack(data, str(tmp_path / "prefix"), "0" * 64)
    assert time.monotonic() - t0 < 5 and not (tmp_path / "prefix" / "x").exists()


def test_an_artifact_entry_whose_key_is_an_absolute_path_is_refused_whole(tmp_path):
    evil = tmp_path / "site-packages" / "evil.pth"
    evil.parent.mkdir()
    inductor = tmp_path / "inductor"
    env = {**os.environ, "PYTHONPATH": REPO, "TORCHINDUCTOR_CACHE_DIR": str(inductor)}
    out = subprocess.run([sys.executable, "-c", _LOADER, str(tmp_path / "run"), str(evil), json.dumps(TRAINER)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["status"] == "mismatch:entry" and not report["loaded"], report
    assert "absolute path" in report["note"]
    assert not evil.exists()
    assert not list(inductor.rglob("fine.best_config"))  # refused whole: not even the good entry


def test_a_second_trainer_in_a_live_run_directory_never_starts(tmp_path):
    run_dir = tmp_path / "run"
    first = Trainer(tiny_config(train={"steps": 100000, "log_every": 1}), run_dir)
    try:
        first.wait_for_step(1)
        owner = read_status(str(run_dir))["pid"]
        second = Trainer(tiny_config(train={"steps": 5}), run_dir)
        code = second.wait(120)
        assert code == contract.EXIT_RUN_DIR_BUSY, second.output[-2000:]
        assert "owned by another trainer" in second.output and f"pid {first.proc.pid}" in second.output
        assert read_status(str(run_dir))["pid"] == owner == first.proc.pid and first.proc.poll() is None
        from dflashctl.core.signatures import classify

        assert classify(second.output, exit_code=code).name == "run_dir_busy"
    finally:
        first.kill()


def test_a_go_file_from_another_process_does_not_wake_a_standby_beside_the_live_trainer(tmp_path):
    run_dir = tmp_path / "run"
    first = Trainer(tiny_config(train={"steps": 100000, "log_every": 1}), run_dir)
    try:
        first.wait_for_step(1)
        token = "t1"
        standby = Trainer(tiny_config(train={"steps": 5}), run_dir, "--standby", token)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # the standby has imported everything and waits
            try:
                if json.loads((run_dir / contract.STANDBY_FILE).read_text()).get("token") == token:
                    break
            except (OSError, ValueError):
                pass
            assert standby.proc.poll() is None, standby.output[-2000:]
            time.sleep(0.1)
        (run_dir / contract.standby_go(token)).write_text("")  # written by anyone who can write the run dir
        code = standby.wait(120)
        assert code == contract.EXIT_RUN_DIR_BUSY, standby.output[-2000:]
        # Its went file is taken back: run.sh writes no exit code for the live run.
        assert not (run_dir / contract.standby_went(token)).exists()
        assert read_status(str(run_dir))["pid"] == first.proc.pid and first.proc.poll() is None
    finally:
        first.kill()
