"""Compile artifacts that travel (trainer/compile_cache.py): the key, the manifest, the
refusal of a mismatched or corrupted artifact, and a real save -> load round trip
between two processes with separate, fresh inductor caches (torch.compile on the CPU,
through the C++ compiler)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests import harness
from trainer import compile_cache as cc
from trainer.config import TrainerConfig

REPO = str(harness.REPO)

FIELDS = {"torch": "2.11.0+cu130", "triton": "3.6.0", "cuda": "13.0", "attention": "flash-attn-4 4.0.0b36",
          "gpu": "NVIDIA H200", "python": "3.12.3", "bundle": "b" * 64, "config": "0123456789abcdef"}


def test_importing_the_module_loads_no_torch():
    """The controller imports it for the config digest; it must stay torch-free."""
    code = ("import sys; from trainer import compile_cache as cc; from trainer.config import TrainerConfig; "
            "cc.config_digest(TrainerConfig()); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_config_digest_follows_shapes_only():
    base = cc.config_digest(TrainerConfig())
    other = TrainerConfig()
    other.optim.lr, other.train.steps, other.data.seed, other.run_dir = 1e-5, 7, 3, "/elsewhere"
    assert cc.config_digest(other) == base  # nothing that is compiled changed
    for change in (lambda c: c.data.buckets.append(512), lambda c: setattr(c.data, "batch_size", 4),
                   lambda c: setattr(c.model, "drafter_layers", 3), lambda c: setattr(c.compile, "target", False),
                   lambda c: setattr(c.placement, "drafter", [0, 1]), lambda c: setattr(c.train, "loss_chunk", 512),
                   lambda c: setattr(c.compile, "flex_kernel", "default")):
        cfg = TrainerConfig()
        change(cfg)
        assert cc.config_digest(cfg) != base


def test_a_local_model_is_keyed_by_its_config_not_its_path(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text('{"hidden_size": 64}')
    cfg_a, cfg_b = TrainerConfig(), TrainerConfig()
    cfg_a.model.path, cfg_b.model.path = str(tmp_path / "a"), str(tmp_path / "b")
    assert cc.config_digest(cfg_a) == cc.config_digest(cfg_b)
    (tmp_path / "b" / "config.json").write_text('{"hidden_size": 128}')
    assert cc.config_digest(cfg_a) != cc.config_digest(cfg_b)


def test_the_key_changes_with_every_field_and_the_first_difference_is_named():
    key = cc.key_of(FIELDS)
    assert len(key) == 16 and cc.key_of(dict(FIELDS)) == key
    for name in cc.FIELDS:
        changed = {**FIELDS, name: FIELDS[name] + "x"}
        assert cc.key_of(changed) != key
        assert cc.first_mismatch(changed, FIELDS) == name
    assert cc.first_mismatch({**FIELDS, "gpu": "A100", "bundle": "c"}, FIELDS) == "gpu"
    assert cc.first_mismatch(dict(FIELDS), FIELDS) is None


def test_an_artifact_from_before_the_attention_field_keeps_its_key_and_is_a_mismatch(tmp_path):
    """Its manifest still checks out (the key is over the fields it has); it is refused for the
    flash-attn-4 it cannot vouch for, which decides the kernels compile.flex_kernel: auto compiles."""
    older = {k: v for k, v in FIELDS.items() if k != "attention"}
    assert cc.key_of(older) != cc.key_of({**older, "attention": None})
    cc.write(str(tmp_path), older, TrainerConfig(), b"compiled before", {})
    assert cc.load(str(tmp_path), FIELDS).status == "mismatch:attention"
    assert cc.load(str(tmp_path), {**FIELDS, "attention": "none"}).status == "mismatch:attention"


def test_the_key_names_the_installed_flash_attention_4(monkeypatch):
    import torch

    import trainer.attention as attention

    monkeypatch.setattr(attention, "installed_version", lambda name: None)
    assert cc.key_fields(TrainerConfig(), [torch.device("cpu")])["attention"] == "none"
    monkeypatch.setattr(attention, "installed_version", lambda name: "4.0.0b36" if name == "flash-attn-4" else None)
    assert cc.key_fields(TrainerConfig(), [torch.device("cpu")])["attention"] == "flash-attn-4 4.0.0b36"


def test_bundle_hash_from_the_environment_the_bundle_directory_or_the_sources(tmp_path):
    assert cc.bundle_hash({cc.BUNDLE_ENV: "abc"}) == "abc"
    deployed = tmp_path / "bundles" / ("d" * 64) / "trainer"
    deployed.mkdir(parents=True)
    assert cc.bundle_hash({}, str(deployed)) == "d" * 64
    checkout = tmp_path / "repo" / "trainer"
    checkout.mkdir(parents=True)
    (checkout / "a.py").write_text("x = 1\n")
    first = cc.bundle_hash({}, str(checkout))
    assert first.startswith("src-") and cc.bundle_hash({}, str(checkout)) == first
    (checkout / "a.py").write_text("x = 2\n")
    assert cc.bundle_hash({}, str(checkout)) != first


def test_write_then_read_the_manifest(tmp_path):
    data = b"artifact bytes"
    manifest = cc.write(str(tmp_path), FIELDS, TrainerConfig(), data, {"inductor": 2})
    directory = tmp_path / cc.CACHE_DIR
    assert sorted(os.listdir(directory)) == sorted([cc.MANIFEST_FILE, f"{cc.key_of(FIELDS)}.bin"])
    on_disk = json.loads((directory / cc.MANIFEST_FILE).read_text())
    assert on_disk == manifest == cc.read_manifest(str(tmp_path))
    assert manifest["fields"] == FIELDS and manifest["key"] == cc.key_of(FIELDS)
    assert manifest["bytes"] == len(data) and manifest["sha256"] == hashlib.sha256(data).hexdigest()
    assert manifest["file"] == f"{manifest['key']}.bin" and manifest["artifacts"] == {"inductor": 2}
    assert manifest["shape"]["data"]["buckets"] == [256]
    # A new key replaces the old artifact file.
    other = {**FIELDS, "torch": "2.12.0"}
    cc.write(str(tmp_path), other, TrainerConfig(), b"new", {})
    assert sorted(os.listdir(directory)) == sorted([cc.MANIFEST_FILE, f"{cc.key_of(other)}.bin"])


def test_no_artifact_is_a_miss(tmp_path):
    out = cc.load(str(tmp_path), FIELDS)
    assert out.status == "miss" and not out.loaded and out.key == cc.key_of(FIELDS)


@pytest.mark.parametrize("field", ["torch", "attention", "gpu", "bundle", "config"])
def test_a_mismatched_key_is_never_loaded(tmp_path, field):
    cc.write(str(tmp_path), {**FIELDS, field: "something else"}, TrainerConfig(), b"not even a pickle", {})
    out = cc.load(str(tmp_path), FIELDS)
    assert out.status == f"mismatch:{field}" and not out.loaded and out.bytes == 0
    assert "something else" in out.note


def test_corrupt_bytes_a_broken_manifest_and_links_are_refused(tmp_path):
    cc.write(str(tmp_path), FIELDS, TrainerConfig(), b"the real bytes", {})
    blob = tmp_path / cc.CACHE_DIR / f"{cc.key_of(FIELDS)}.bin"
    blob.write_bytes(b"the fake bytes")
    assert cc.load(str(tmp_path), FIELDS).status == "mismatch:sha256"
    manifest = tmp_path / cc.CACHE_DIR / cc.MANIFEST_FILE
    good = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**good, "file": "../../etc/passwd"}))
    assert cc.load(str(tmp_path), FIELDS).status == "mismatch:manifest"
    manifest.write_text("{not json")
    assert cc.load(str(tmp_path), FIELDS).status == "mismatch:manifest"
    manifest.unlink()
    real = tmp_path / "elsewhere.json"
    real.write_text(json.dumps(good))
    manifest.symlink_to(real)
    out = cc.load(str(tmp_path), FIELDS)
    assert out.status == "mismatch:manifest" and "unreadable" in out.note


def test_should_save_unless_a_hit_covered_every_graph():
    assert not cc.should_save(cc.Outcome(status="off"), 3)
    assert cc.should_save(cc.Outcome(status="miss"), 0)  # a warm local cache: the artifact is new to the run dir
    assert cc.should_save(cc.Outcome(status="mismatch:torch"), 5)
    assert not cc.should_save(cc.Outcome(status="hit"), 0)
    assert cc.should_save(cc.Outcome(status="hit"), 1)  # the artifact lacked a graph: save the fuller one


_PROCESS = textwrap.dedent("""
    import json, os, sys
    import torch
    from torch._dynamo.utils import counters
    from trainer import compile_cache as cc
    from trainer.config import TrainerConfig

    mode, run_dir = sys.argv[1], sys.argv[2]
    cfg = TrainerConfig()
    fields = cc.key_fields(cfg, [torch.device("cpu")])
    report = {}
    if mode == "load":
        for name in sys.argv[3:]:  # other run directories first: mismatches, never loaded
            report[name] = cc.load(name, fields).summary()
        report["cache_files_before"] = sum(len(f) for _, _, f in os.walk(os.environ["TORCHINDUCTOR_CACHE_DIR"]))
        report["load"] = cc.load(run_dir, fields).summary()
    fn = torch.compile(lambda x: (x.sin() * 2 + x.cos()).relu().sum(-1), dynamic=False)
    fn(torch.randn(8, 16))
    report["inductor"] = {k: int(v) for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}
    if mode == "save":
        data, counts = cc.serialize()
        report["manifest"] = cc.write(run_dir, fields, cfg, data, counts)
    if mode == "again":
        report["load"] = cc.load(run_dir, fields).summary()
    print(json.dumps(report))
""")


def _process(mode: str, run_dir, cache, *others, script: str = _PROCESS) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), TRITON_CACHE_DIR=str(cache / "triton"),
               PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", script, mode, str(run_dir), *map(str, others)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # three processes, two CPU compiles: about 40 s alone, more on a busy 2-core machine
def test_save_then_load_in_a_fresh_process_with_a_wiped_cache(tmp_path):
    """Process 1 compiles (a cache miss) and saves; process 2, on an empty cache of
    its own, refuses a copy whose key says another torch, then loads the real one,
    and its compile is a cache hit. Process 3 on the same cache does not load again."""
    run_dir = tmp_path / "run"
    saved = _process("save", run_dir, tmp_path / "cache1")
    assert saved["inductor"] == {"fxgraph_cache_miss": 1}
    assert saved["manifest"]["bytes"] > 0 and saved["manifest"]["artifacts"].get("inductor") == 1

    other_torch = tmp_path / "other-torch"
    (other_torch / cc.CACHE_DIR).mkdir(parents=True)
    for name in os.listdir(run_dir / cc.CACHE_DIR):
        (other_torch / cc.CACHE_DIR / name).write_bytes((run_dir / cc.CACHE_DIR / name).read_bytes())
    manifest = json.loads((other_torch / cc.CACHE_DIR / cc.MANIFEST_FILE).read_text())
    manifest["fields"]["torch"] = "1.0.0"
    (other_torch / cc.CACHE_DIR / cc.MANIFEST_FILE).write_text(json.dumps(manifest))

    loaded = _process("load", run_dir, tmp_path / "cache2", other_torch)
    assert loaded[str(other_torch)]["status"] == "mismatch:torch" and not loaded[str(other_torch)]["loaded"]
    assert loaded["cache_files_before"] == 0  # the refused artifact wrote nothing
    assert loaded["load"]["status"] == "hit" and loaded["load"]["loaded"]
    assert loaded["load"]["bytes"] == saved["manifest"]["bytes"]
    assert loaded["inductor"].get("fxgraph_cache_hit") == 1 and not loaded["inductor"].get("fxgraph_cache_miss")

    again = _process("again", run_dir, tmp_path / "cache2")
    assert again["load"]["status"] == "hit" and not again["load"]["loaded"]
    assert "already" in again["load"]["note"]


_BYTECODE = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[2])
    from trainer.bytecode import keep
    path = keep(sys.argv[1], package="fakepkg")
    import fakepkg
    print(json.dumps(path))
""")


@pytest.mark.parametrize("dont_write", [True, False])
def test_bytecode_goes_to_the_cache_when_it_cannot_go_beside_the_sources(tmp_path, dont_write):
    """A restart imports thousands of modules: without bytecode each start compiles
    them all again. With PYTHONDONTWRITEBYTECODE (as in a read-only image) the trainer
    keeps bytecode under its cache directory; otherwise Python's own place is used."""
    site = tmp_path / "site"
    (site / "fakepkg").mkdir(parents=True)
    (site / "fakepkg" / "__init__.py").write_text("VALUE = 1\n")
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    env["PYTHONPATH"] = REPO
    if dont_write:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    run = lambda: subprocess.run([sys.executable, "-c", _BYTECODE, str(cache), str(site)], cwd=REPO, env=env,  # noqa: E731
                                 capture_output=True, text=True, check=True)
    path = json.loads(run().stdout.strip().splitlines()[-1])
    beside = list((site / "fakepkg").glob("__pycache__/*.pyc"))
    kept = list((cache / "pycache").rglob("fakepkg/__init__*.pyc")) if (cache / "pycache").exists() else []
    if dont_write:
        assert path == str(cache / "pycache") and len(kept) == 1 and not beside
        assert json.loads(run().stdout.strip().splitlines()[-1]) == str(cache / "pycache")  # still needed next time
    else:
        assert path is None and len(beside) == 1 and not kept
        assert json.loads(run().stdout.strip().splitlines()[-1]) is None


def test_saved_variants_travel_in_the_artifact_and_only_variant_files_are_unpacked(tmp_path, monkeypatch):
    from trainer import compile as compile_mod

    good = ["Layer_forward-" + "a" * 32 + ".0.bin", "f-" + "b" * 32 + ".1.bin"]
    made = tmp_path / "made"
    made.mkdir()
    for name in (*good, "not-a-variant.py"):
        (made / name).write_bytes(name.encode())
    packed = cc.pack_variants([str(made / n) for n in sorted(os.listdir(made))] + [str(made / "gone.0.bin")])
    assert packed is not None and packed[1] == 3  # the unreadable one is left out
    assert cc.pack_variants([]) is None
    manifest = cc.write(str(tmp_path / "run"), FIELDS, TrainerConfig(), b"artifact bytes", {}, None, packed)
    data = (tmp_path / "run" / cc.CACHE_DIR / manifest["file"]).read_bytes()
    assert cc.part(manifest, data, "artifacts") == b"artifact bytes"
    assert cc.part(manifest, data, "variants") == packed[0] and manifest["parts"]["variants"]["files"] == 3

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    assert cc.unpack_variants(packed[0]) == 2
    saved = tmp_path / "inductor" / compile_mod.SAVED_DIR
    assert sorted(os.listdir(saved)) == sorted(good) and (saved / good[0]).read_bytes() == good[0].encode()


_SHARED_PROCESS = textwrap.dedent("""
    import json, sys
    import torch
    from tests.harness.compile_race import Layer
    from trainer import compile as c, compile_cache as cc
    from trainer.config import TrainerConfig

    mode, run_dir = sys.argv[1], sys.argv[2]
    fields = cc.key_fields(TrainerConfig(), [torch.device("cpu")])
    report = {"load": cc.load(run_dir, fields).summary()} if mode == "load" else {}
    forward = c.Shared(Layer.forward, dynamic=False)
    forward(Layer(), torch.randn(2, 16)).sum().backward()
    if mode == "save":
        data, counts = cc.serialize()
        cc.write(run_dir, fields, TrainerConfig(), data, counts, None, cc.pack_variants(c.saved_variant_files()))
    print(json.dumps({**report, "compiles": forward.compiles, "loaded": forward.loaded}))
""")


@pytest.mark.slow
def test_an_artifact_start_on_a_wiped_cache_loads_the_saved_variants(tmp_path):
    """compile.share: shared saves each compiled variant whole; the artifact carries
    them, so a start on another, empty cache loads them instead of compiling."""
    run_dir = tmp_path / "run"
    assert _process("save", run_dir, tmp_path / "cache1", script=_SHARED_PROCESS) == {"compiles": 1, "loaded": 0}
    loaded = _process("load", run_dir, tmp_path / "cache2", script=_SHARED_PROCESS)
    assert loaded["load"]["status"] == "hit" and loaded["load"]["loaded"], loaded
    assert (loaded["compiles"], loaded["loaded"]) == (0, 1), loaded
