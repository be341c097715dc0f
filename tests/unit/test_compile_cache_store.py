"""The controller's compile-cache store on a real disk: entries checked on the way
in and out and kept whole, pruning, matching, the config digest the trainer
computes, and ``dflashctl cache ls / rm`` in process. (Artifacts moved through a
host, launches and the supervisor: tests/integration/test_compile_cache_store.py.)"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflashctl.runs import compile_cache as cc
from tests.harness.artifacts import TRAINER, artifact, run_config, written
from trainer import compile_cache as trainer_cache
from trainer import config as trainer_config

SOCKET = f"dflash-cc-{os.getpid()}"


def local(cache: cc.LocalCache) -> dict:
    """The origin of an entry copied back from the local host (its domain, as issued)."""
    return {"domain": cache.domain("host:local", "<test>").id, "host": "local"}


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A controller data directory of this test's own: the default cache store lives there."""
    monkeypatch.setenv("DFLASHCTL_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_an_entry_is_checked_on_the_way_in_and_out_and_kept_whole(tmp_path):
    cache = cc.LocalCache(str(tmp_path / "cache"))
    manifest, data = artifact("c" * 16)
    with pytest.raises(cc.CacheError, match="sha256"):
        cache.put(manifest, data[:-1] + b"X")
    with pytest.raises(cc.CacheError, match="bytes"):
        cache.put(manifest, data[:-1])
    forged = {**manifest, "fields": {**manifest["fields"], "torch": "2.12.0"}}  # its key no longer says what it is
    with pytest.raises(cc.CacheError, match="not the key of its fields"):
        cache.put(forged, data)
    assert cache.entries() == [] and cc._listdir(cache.root) == []  # nothing half-written left behind
    entry = cache.put(manifest, data)
    assert sorted(os.listdir(entry.path)) == sorted([manifest["file"], trainer_cache.MANIFEST_FILE, cc.ORIGIN_FILE])
    assert cache.read(manifest["key"]) == (manifest, data)
    entry = cache.put(manifest, data, local(cache))  # in the local host's domain now
    assert entry.domain_name == "host:local" and cache.read(manifest["key"], entry.domain) == (manifest, data)
    # A damaged entry reads as damaged, never as its manifest's bytes.
    Path(entry.path, manifest["file"]).write_bytes(data[:-1] + b"X")
    with pytest.raises(cc.CacheError, match="sha256"):
        cache.read(manifest["key"], entry.domain)
    assert cache.read(manifest["key"]) == (manifest, data)  # each domain's entry is its own
    with pytest.raises(cc.CacheError, match="16 hex digits"):
        cache.get("../../etc")


def test_prune_removes_what_was_neither_used_nor_created_lately(tmp_path):
    cache = cc.LocalCache(str(tmp_path / "cache"))
    old, data = artifact("1" * 16)
    used, _ = artifact("2" * 16)
    new, _ = artifact("3" * 16)
    long_ago = time.time() - 40 * 86400  # the controller's date of receipt, never the manifest's 'created'
    for m, when in ((old, long_ago), (used, long_ago), (new, None)):
        cache.put(m, data, now=when)
    cache.touch(used["key"], now=time.time() - 86400)
    assert cache.prune(30 * 86400) == [old["key"]]
    assert [e.key for e in cache.entries()] == [new["key"], used["key"]]  # most recently used or created first
    assert cache.remove(used["key"]) and not cache.remove(used["key"])
    assert cache.clear() == [new["key"]] and cache.entries() == []


def test_matching_compares_config_bundle_and_a_known_gpu_and_says_what_differs(tmp_path):
    cache = cc.LocalCache(str(tmp_path / "cache"))
    _, data = artifact("x" * 16)
    for config, bundle, gpu in [("c" * 16, "b" * 64, "NVIDIA H200"), ("c" * 16, "b" * 64, "NVIDIA A100-SXM4-80GB"),
                                ("d" * 16, "b" * 64, "NVIDIA H200"), ("c" * 16, "e" * 64, "NVIDIA H200")]:
        cache.put(artifact(config, bundle, gpu)[0], data)
    fit, other = cc.choose(cache.entries(), cc.Wanted("c" * 16, "b" * 64, "NVIDIA H200"))
    assert [e.fields["gpu"] for e in fit] == ["NVIDIA H200"]
    assert sorted(f for _, f in other) == ["bundle", "config", "gpu"]
    fit, _ = cc.choose(cache.entries(), cc.Wanted("c" * 16, "b" * 64, None))  # GPU not known: not compared
    assert len(fit) == 2
    readings = [{"index": 5, "name": "NVIDIA H200"}, {"index": 6, "name": "NVIDIA H200"}, {"index": 0, "name": "X"}]
    assert cc.gpu_name(readings, [5, 6]) == "NVIDIA H200"
    assert cc.gpu_name(readings, [5, 7]) is None and cc.gpu_name(readings, []) is None


def test_the_config_digest_is_the_one_the_trainer_computes_from_its_config_json(tmp_path):
    """Physical GPU indices renumbered under CUDA_VISIBLE_DEVICES, and a model given by
    path identified by its config.json on the run host."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 64}')
    trainer = {**TRAINER, "model": {"path": str(model)}, "placement": {"device": "cuda", "target": [5], "drafter": [6]}}
    trainer = written(run_config(trainer, gpus=[5, 6]))
    assert trainer["placement"]["target"] == [0]
    theirs = trainer_cache.config_digest(trainer_config.from_dict(trainer))  # the trainer, on this host
    sha = hashlib.sha256((model / "config.json").read_bytes()).hexdigest()
    assert cc.config_digest(trainer, sha) == theirs
    assert cc.config_digest(trainer, None) != theirs  # unreadable there: another model for all we know
    assert cc.config_digest(written(run_config())) == trainer_cache.config_digest(trainer_config.from_dict(TRAINER))


def test_cache_ls_and_rm(tmp_path, home):
    from dflashctl.cli import _load_commands
    from dflashctl.commands._app import app

    _load_commands()
    cache = cc.LocalCache()
    old, data = artifact("1" * 16, gpu="NVIDIA H200\x1b[31m")
    new, _ = artifact("2" * 16)
    cache.put(old, data, now=time.time() - 40 * 86400)
    cache.put(new, data)
    runner = CliRunner()
    listed = runner.invoke(app, ["cache", "ls", "--json"])
    assert listed.exit_code == 0, listed.output
    rows = json.loads(listed.output)
    assert [r["key"] for r in rows] == [new["key"], old["key"]] and rows[0]["bytes"] == len(data)
    table = runner.invoke(app, ["cache", "ls"])
    assert table.exit_code == 0 and old["key"] in table.output and "\x1b[31m" not in table.output
    assert len(table.output.splitlines()) == 4  # the title, the header, a line per artifact: cells cut, never folded
    assert runner.invoke(app, ["cache", "rm", "--older-than", "30d"]).exit_code == 0
    assert [e.key for e in cache.entries()] == [new["key"]]
    missing = runner.invoke(app, ["cache", "rm", "0123456789abcdef"])
    assert missing.exit_code != 0
    assert runner.invoke(app, ["cache", "rm", new["key"]]).exit_code == 0 and cache.entries() == []
    cache.put(old, data)
    assert runner.invoke(app, ["cache", "rm", "--all"]).exit_code == 0 and cache.entries() == []
    assert runner.invoke(app, ["cache", "rm"]).exit_code != 0  # says what to remove
