"""The controller's compile-cache store for real: entries written and checked on a real
disk, artifacts uploaded into and copied back from run directories through the local
host transport (the same ``sh -c`` path an ssh host with a container wrapper takes),
a restart and a launch that put a held artifact into the run directory before the
trainer starts, the supervisor copying a fake trainer's artifact back once, and
``dflashctl cache ls / rm``.

Every tmux server here is on a socket private to this test process, ended by its pid.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from dflashctl.config import load_inventory, load_playbook
from dflashctl.core.errors import TransportError
from dflashctl.hosts.tmux import SOCKET_ENV, Tmux
from dflashctl.hosts.transport import connect
from dflashctl.runs import compile_cache as cc
from dflashctl.runs.runhost import restart_run
from dflashctl.store import Store
from tests.harness import environ
from tests.harness.artifacts import TRAINER, artifact, run_config, written
from tests.harness.fake_trainer import start_fake_run
from tests.harness.local import kill_tmux_servers, wait_for, write_playbook
from trainer import compile_cache as trainer_cache
from trainer import config as trainer_config

SOCKET = f"dflash-cc-{os.getpid()}"
def local(cache: cc.LocalCache) -> dict:
    """The origin of an entry copied back from the local host: its domain, as issued."""
    return {"domain": cache.domain_for(load_inventory(None).get("local"), load_inventory(None)).id, "host": "local"}



@pytest.fixture(scope="module", autouse=True)
def private_tmux_socket():
    with environ(**{SOCKET_ENV: SOCKET}):
        yield
    inventory = load_inventory(None)
    kill_tmux_servers([(inventory.get("local"), inventory, SOCKET)])


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A controller data directory of this test's own: the default cache store lives there."""
    monkeypatch.setenv("DFLASHCTL_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


# --------------------------------------------------------------------------- into and out of a run directory


def test_provide_uploads_the_artifact_that_fits_manifest_last_and_only_once(tmp_path):
    transport = connect("local", load_inventory(None))
    cache = cc.LocalCache(str(tmp_path / "cache"))
    config = written(run_config())
    digest = cc.config_digest(config)
    run_dir = tmp_path / "run"
    assert cc.provide(transport, str(run_dir), config, "b" * 64, cache=cache).status == "none"  # nothing held
    other, data = artifact(digest, bundle="e" * 64)
    cache.put(other, data, local(cache))
    outcome = cc.provide(transport, str(run_dir), config, "b" * 64, cache=cache)
    assert outcome.status == "none" and f"{other['key']} (bundle differs)" in outcome.message
    assert not (run_dir / "compile_cache").exists()  # a mismatched key is never uploaded

    manifest, data = artifact(digest)
    cache.put(manifest, data, local(cache))
    outcome = cc.provide(transport, str(run_dir), config, "b" * 64, cache=cache)
    assert (outcome.status, outcome.key, outcome.bytes) == ("uploaded", manifest["key"], len(data))
    directory = run_dir / "compile_cache"
    assert sorted(os.listdir(directory)) == sorted([manifest["file"], trainer_cache.MANIFEST_FILE])
    assert (directory / manifest["file"]).read_bytes() == data
    assert trainer_cache.read_manifest(str(run_dir)) == manifest  # what the trainer reads
    bin_ns = (directory / manifest["file"]).stat().st_mtime_ns
    assert bin_ns <= (directory / trainer_cache.MANIFEST_FILE).stat().st_mtime_ns  # the manifest last
    assert cache.get(manifest["key"], local(cache)["domain"]).last_used is not None
    again = cc.provide(transport, str(run_dir), config, "b" * 64, cache=cache)
    assert again.status == "present" and (directory / manifest["file"]).stat().st_mtime_ns == bin_ns


def test_a_corrupted_held_artifact_is_never_uploaded(tmp_path):
    transport = connect("local", load_inventory(None))
    cache = cc.LocalCache(str(tmp_path / "cache"))
    config = written(run_config())
    manifest, data = artifact(cc.config_digest(config))
    entry = cache.put(manifest, data, local(cache))
    Path(entry.path, manifest["file"]).write_bytes(b"\0" * len(data))  # bit rot: same size, other bytes
    outcome = cc.provide(transport, str(tmp_path / "run"), config, "b" * 64, cache=cache)
    assert outcome.status == "none" and "damaged" in outcome.message and "sha256" in outcome.message
    assert not (tmp_path / "run" / "compile_cache").exists()


def test_the_host_side_refuses_bytes_that_do_not_check_out_and_leaves_the_old_artifact(tmp_path):
    transport = connect("local", load_inventory(None))
    run_dir = tmp_path / "run"
    manifest, data = artifact("c" * 16)
    transport.run(cc.receive_argv(str(run_dir), manifest), input=data)
    before = sorted(os.listdir(run_dir / "compile_cache"))
    newer, newer_data = artifact("d" * 16)
    with pytest.raises(TransportError, match="incomplete or corrupted"):
        transport.run(cc.receive_argv(str(run_dir), newer), input=newer_data[: len(newer_data) // 2])
    assert sorted(os.listdir(run_dir / "compile_cache")) == before  # no temporary directory, old one intact
    assert trainer_cache.read_manifest(str(run_dir))["key"] == manifest["key"]


def test_fetch_copies_a_run_directorys_artifact_back_once_per_key(tmp_path):
    transport = connect("local", load_inventory(None))
    cache = cc.LocalCache(str(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    cfg = trainer_config.from_dict(TRAINER)
    trainer, bundle = cfg.to_dict(), "b" * 64  # the run's own config and bundle: what the controller expects
    assert cc.fetch(transport, str(run_dir), trainer, bundle, cache=cache).status == "absent"
    fields = artifact(trainer_cache.config_digest(cfg))[0]["fields"]
    data = os.urandom(3 << 20)
    written = trainer_cache.write(str(run_dir), fields, cfg, data, {"inductor": 1})  # as the trainer saves it
    outcome = cc.fetch(transport, str(run_dir), trainer, bundle, cache=cache)
    assert (outcome.status, outcome.key, outcome.bytes) == ("fetched", written["key"], len(data))
    assert cache.read(written["key"], local(cache)["domain"]) == (written, data)
    assert cc.fetch(transport, str(run_dir), trainer, bundle, cache=cache).status == "held"
    # A manifest whose bytes were swapped underneath it is not taken.
    cache.remove(written["key"], every_domain=True)
    Path(run_dir, "compile_cache", written["file"]).write_bytes(os.urandom(len(data)))
    outcome = cc.fetch(transport, str(run_dir), trainer, bundle, cache=cache)
    assert outcome.status == "failed" and "sha256" in outcome.message and cache.entries() == []


# --------------------------------------------------------------------------- restart, launch, supervisor


def _trainer_pid(run_dir: str, other_than: int | None = None) -> int:
    def pid():
        try:
            status = json.loads(Path(run_dir, "status.json").read_text())
        except (OSError, ValueError):
            return None
        return status.get("pid") if status.get("pid") not in (None, other_than) else None

    return wait_for(pid, 20, "the trainer's pid")


def test_a_restart_puts_the_held_artifact_into_a_wiped_run_directory_before_the_trainer_starts(tmp_path, home):
    inventory = load_inventory(None)
    store = Store(str(tmp_path / "runs.db"))
    run_id = start_fake_run(store, inventory, "local", trainer_config.from_dict(TRAINER).to_dict(), socket=SOCKET)
    run = store.get_run(run_id)
    tmux = Tmux(inventory.get("local"), inventory, SOCKET)
    try:
        first = _trainer_pid(run.run_dir)
        manifest, data = artifact(cc.config_digest(written(run.config)), bundle=run.bundle_hash)
        cc.LocalCache().put(manifest, data, local(cc.LocalCache()))
        said: list[str] = []
        restart_run(run_id, False, store, inventory, progress=lambda step, message: said.append(message))
        directory = Path(run.run_dir, "compile_cache")
        assert (directory / manifest["file"]).read_bytes() == data
        assert json.loads((directory / trainer_cache.MANIFEST_FILE).read_text()) == manifest
        [event] = store.events(run_id, kind="compile_cache")
        assert event.detail["status"] == "uploaded" and event.detail["key"] == manifest["key"]
        assert any(f"compile artifact {manifest['key']} uploaded" in m for m in said)
        # It was there before the new trainer wrote its status (run.sh removes the old one first).
        new_status = Path(run.run_dir, "status.json")
        _trainer_pid(run.run_dir, other_than=first)
        assert (directory / trainer_cache.MANIFEST_FILE).stat().st_mtime <= new_status.stat().st_mtime
    finally:
        tmux.kill(run_id)


def test_launch_uploads_the_held_artifact_and_says_so(tmp_path, home):
    inventory = load_inventory(None)
    store = Store(str(tmp_path / "runs.db"))
    from dflashctl import launch

    pb = load_playbook(str(write_playbook(tmp_path / "playbooks", "cached", "local",
                                          {"train": {"steps": 100000, "log_every": 50}})), inventory=inventory)
    bundle = launch.build_bundle()
    config = {"trainer": pb.trainer.to_dict(), "gpus": [], "env": {}, "python": "python3", "compile_cache": None}
    manifest, data = artifact(cc.config_digest(written(config)), bundle=bundle.hash)
    cache = cc.LocalCache()
    cache.put(manifest, data, local(cache))
    said: list[tuple[str, str]] = []
    result = launch.launch_run(pb, inventory, store, progress=lambda step, message: said.append((step, message)),
                               start_timeout=0.1, bundle=bundle)
    try:
        directory = Path(result.run_dir, "compile_cache")
        assert (directory / manifest["file"]).read_bytes() == data
        assert trainer_cache.read_manifest(result.run_dir) == manifest
        assert ("configure", f"compile artifact {manifest['key']} uploaded") in [
            (s, m.split(" (")[0]) for s, m in said]
        [event] = store.events(result.run_id, kind="compile_cache")
        assert event.detail["status"] == "uploaded"
    finally:
        Tmux(inventory.get("local"), inventory, launch.socket_name()).kill(result.run_id)


def test_the_supervisor_copies_a_cold_starts_artifact_back_once(tmp_path, home):
    inventory = load_inventory(None)
    store = Store(str(tmp_path / "runs.db"))
    playbooks = tmp_path / "playbooks"
    pb = load_playbook(str(write_playbook(playbooks, "cold", "local", {"train": {"steps": 100000, "log_every": 2}},
                                          poll_interval=0.2, expect={"compile_cache_after": "1s"})),
                       inventory=inventory)
    run_id = start_fake_run(store, inventory, "local", pb.trainer.to_dict(), playbook=pb.name,
                            playbook_source=pb.source, socket=SOCKET, env={"FAKE_TRAINER_COMPILE_CACHE": "miss"})
    from dflashctl.supervise.supervisor import Supervisor

    sup = Supervisor(store, inventory, interval=0.2, playbooks_dir=str(playbooks))
    sup.attach(run_id)
    try:
        def copied():
            return [e for e in store.events(run_id, kind="compile_cache") if e.detail and e.detail.get("status")]

        [event] = wait_for(copied, 30, "the artifact copied back", tick=sup.tick)
        assert event.detail["status"] == "fetched", event.message
        held = cc.LocalCache().read(event.detail["key"], local(cc.LocalCache())["domain"])
        run = store.get_run(run_id)
        assert held[0] == trainer_cache.read_manifest(run.run_dir)
        # Keyed as the controller matches a later start: that start would get it.
        assert (held[0]["fields"]["config"], held[0]["fields"]["bundle"]) == (cc.config_digest(written(run.config)),
                                                                              run.bundle_hash)
        for _ in range(8):  # later ticks: asked once
            sup.tick()
            time.sleep(0.1)
        assert len(copied()) == 1
        messages = [e.message for e in store.events(run_id, kind="compile_cache")]
        assert messages[0].startswith("compile cache miss")
    finally:
        Tmux(inventory.get("local"), inventory, SOCKET).kill(run_id)
        sup.close()
