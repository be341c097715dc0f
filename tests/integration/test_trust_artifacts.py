"""Red team, the controller's side: what a compromised or shared run host can write
(compile artifacts, manifests, metrics) tried as an attacker would, with real
processes: hosts are ``transport: local`` inventory entries with their own work
directories and trust groups, the controller's store is a real directory, a fake
trainer under a real supervisor.

One test per attack; each failed before the trust boundaries were drawn
(docs/trust.md). The trainer's side: tests/trainer/test_trust_artifacts.py."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflashctl.config import load_inventory
from dflashctl.core import contract
from dflashctl.hosts.transport import connect
from dflashctl.runs import compile_cache as cc
from tests import harness
from trainer import bytecode
from trainer import compile_cache as trainer_cache
from trainer import config as trainer_config

REPO = str(harness.REPO)
TRAINER = {"model": {"preset": "tiny"}, "data": {"buckets": [256], "batch_size": 1, "max_anchors": 16},
           "placement": {"device": "cpu", "target": [0], "drafter": [0]}}
BUNDLE = "b" * 64


@pytest.fixture
def hosts(tmp_path):
    """Three hosts on this machine: red1 and red2 one trust group, blue1 another."""
    lines = ["hosts:"]
    for name, group in (("red1", "red"), ("red2", "red"), ("blue1", "blue")):
        (tmp_path / name).mkdir()
        lines += [f"  {name}:", "    transport: local", f"    workdir: {tmp_path / name}", f"    trust_group: {group}"]
    path = tmp_path / "inventory.yaml"
    path.write_text("\n".join(lines) + "\n")
    return load_inventory(str(path))


def red(cache: cc.LocalCache, hosts) -> dict:
    """The origin of an entry copied back from the red group of ``hosts``: its domain, as issued."""
    return {"domain": cache.domain_for(hosts.get("red1"), hosts).id}


def _trainer() -> dict:
    return trainer_config.from_dict(TRAINER).to_dict()


def _fields(**changes) -> dict:
    fields = {"torch": "2.13.0", "triton": "3.5", "cuda": "12.8", "gpu": "cpu", "python": "3.11.0", "bundle": BUNDLE,
              "config": cc.config_digest(_trainer())}
    return {**fields, **changes}


def _host_writes(run_dir: Path, fields: dict, data: bytes, **manifest_changes) -> dict:
    """What a host puts into its own run directory: a manifest and bytes of its choosing."""
    manifest = trainer_cache.write(str(run_dir), fields, trainer_config.from_dict(TRAINER), data, {"inductor": 1})
    if manifest_changes:
        manifest.update(manifest_changes)
        Path(run_dir, "compile_cache", trainer_cache.MANIFEST_FILE).write_text(json.dumps(manifest))
    return manifest


# --------------------------------------------------------------------------- bytecode with the true header


def test_an_artifact_from_another_trust_group_is_never_put_on_a_host(hosts, tmp_path):
    red1, red2, blue1 = (connect(n, hosts) for n in ("red1", "red2", "blue1"))
    cache = cc.LocalCache(str(tmp_path / "store"))
    red_run = tmp_path / "red1" / "run-a"
    data = os.urandom(4096)
    manifest = _host_writes(red_run, _fields(), data)
    outcome = cc.fetch(red1, str(red_run), _trainer(), BUNDLE, claim="miss", run_id="run-a", cache=cache)
    assert outcome.status == "fetched", outcome.message
    [entry] = cache.held(manifest["key"])
    assert (entry.domain, entry.domain_name) == (red(cache, hosts)["domain"], "group:red")
    blue_run = tmp_path / "blue1" / "run-b"
    refused = cc.provide(blue1, str(blue_run), _trainer(), BUNDLE, cache=cache)
    assert refused.status == "none" and "group:blue" in refused.message
    assert not (blue_run / "compile_cache").exists()  # nothing of red's ever reaches blue
    red_run2 = tmp_path / "red2" / "run-c"
    given = cc.provide(red2, str(red_run2), _trainer(), BUNDLE, cache=cache)  # inside the group: it travels
    assert given.status == "uploaded" and (red_run2 / "compile_cache" / manifest["file"]).read_bytes() == data


def test_without_a_trust_group_an_artifact_goes_back_only_to_its_own_host(tmp_path):
    path = tmp_path / "inventory.yaml"
    path.write_text(f"hosts:\n  a:\n    transport: local\n    workdir: {tmp_path}\n"
                    f"  b:\n    transport: local\n    workdir: {tmp_path}\n")
    inventory = load_inventory(str(path))
    cache = cc.LocalCache(str(tmp_path / "store"))
    _host_writes(tmp_path / "run-a", _fields(), b"x" * 100)
    assert cc.fetch(connect("a", inventory), str(tmp_path / "run-a"), _trainer(), BUNDLE, cache=cache).status == "fetched"
    assert cc.provide(connect("b", inventory), str(tmp_path / "run-b"), _trainer(), BUNDLE, cache=cache).status == "none"
    assert cc.provide(connect("a", inventory), str(tmp_path / "run-a2"), _trainer(), BUNDLE,
                      cache=cache).status == "uploaded"


def test_a_second_domains_copy_back_never_replaces_or_reaches_the_first_ones(hosts, tmp_path):
    """Another inventory's host in a group of the same name is another trust domain:
    its copy-back of the same key is held beside the first domain's entry, never in
    its place, and never provided to the first domain's hosts."""
    (tmp_path / "red9").mkdir()
    other_path = tmp_path / "other-inventory.yaml"
    other_path.write_text(f"hosts:\n  red9:\n    transport: local\n    workdir: {tmp_path / 'red9'}\n"
                          "    trust_group: red\n")
    other = load_inventory(str(other_path))
    cache = cc.LocalCache(str(tmp_path / "store"))
    b_run, b_data = tmp_path / "red9" / "run-b", os.urandom(4096)
    key = _host_writes(b_run, _fields(), b_data)["key"]
    assert cc.fetch(connect("red9", other), str(b_run), _trainer(), BUNDLE, cache=cache).status == "fetched"
    first = cc.provide(connect("red2", hosts), str(tmp_path / "red2" / "run-1"), _trainer(), BUNDLE, cache=cache)
    assert first.status == "none" and not (tmp_path / "red2" / "run-1" / "compile_cache").exists(), first.message
    a_run, a_data = tmp_path / "red1" / "run-a", os.urandom(4096)
    assert _host_writes(a_run, _fields(), a_data)["key"] == key  # the same key, other bytes
    assert cc.fetch(connect("red1", hosts), str(a_run), _trainer(), BUNDLE, cache=cache).status == "fetched"
    # B copies back again after A: A's entry stays A's.
    _host_writes(b_run, _fields(), b_data)
    assert cc.fetch(connect("red9", other), str(b_run), _trainer(), BUNDLE, cache=cache).status in ("held", "fetched")
    given = cc.provide(connect("red2", hosts), str(tmp_path / "red2" / "run-2"), _trainer(), BUNDLE, cache=cache)
    assert given.status == "uploaded", given.message
    assert (tmp_path / "red2" / "run-2" / "compile_cache" / f"{key}.bin").read_bytes() == a_data
    theirs = cc.provide(connect("red9", other), str(tmp_path / "red9" / "run-3"), _trainer(), BUNDLE, cache=cache)
    assert theirs.status == "uploaded" and (tmp_path / "red9" / "run-3" / "compile_cache" / f"{key}.bin") \
        .read_bytes() == b_data
    held = cache.held(key)
    assert sorted(e.domain_name for e in held) == ["group:red", "group:red"] and len({e.domain for e in held}) == 2


def test_a_trust_domain_is_an_id_the_controller_issued_not_a_name(hosts, tmp_path):
    cache = cc.LocalCache(str(tmp_path / "store"))
    red = cache.domain_for(hosts.get("red1"), hosts)
    assert re.fullmatch(r"d-[0-9a-f]{24}", red.id) and red.name == "group:red"
    assert red == cache.domain_for(hosts.get("red2"), hosts) == cc.LocalCache(cache.root).domain_of(connect("red2",
                                                                                                         hosts))
    assert cache.domain_for(hosts.get("blue1"), hosts).id != red.id
    assert cc.LocalCache(str(tmp_path / "another-store")).domain_for(hosts.get("red1"), hosts).id != red.id
    with pytest.raises(cc.CacheError, match="not a trust domain this controller issued"):
        cache.put(*_as_manifest(_fields(), b"x" * 10), {"domain": "group:red"})  # a name is not a domain
    with pytest.raises(cc.CacheError, match="not a trust domain this controller issued"):
        cache.get(_as_manifest(_fields(), b"x")[0]["key"], "../../elsewhere")


# --------------------------------------------------------------------------- compile artifacts that write files


# --------------------------------------------------------------------------- the copy-back believes the controller


def test_key_fields_the_host_claims_are_compared_with_the_runs_own(hosts, tmp_path):
    red1 = connect("red1", hosts)
    cache = cc.LocalCache(str(tmp_path / "store"))
    run_dir = tmp_path / "red1" / "run"
    # The host names another playbook's config (and bundle) so its bytes reach that playbook's runs.
    for claimed, field in ((_fields(config="f" * 16), "config"), (_fields(bundle="e" * 64), "bundle")):
        _host_writes(run_dir, claimed, os.urandom(1000))
        outcome = cc.fetch(red1, str(run_dir), _trainer(), BUNDLE, claim="miss", cache=cache)
        assert outcome.status == "refused" and f"its {field}" in outcome.message, outcome.message
    assert cache.entries() == []


def test_a_miss_the_controller_did_not_expect_copies_nothing_back(hosts, tmp_path):
    red1 = connect("red1", hosts)
    cache = cc.LocalCache(str(tmp_path / "store"))
    held, data = _fields(), b"held kernels" * 100
    cache.put(*_as_manifest(held, data), red(cache, hosts))
    run_dir = tmp_path / "red1" / "run"
    _host_writes(run_dir, _fields(torch="2.13.0+evil"), os.urandom(1000))  # a key of its own choosing
    outcome = cc.fetch(red1, str(run_dir), _trainer(), BUNDLE, claim="miss", cache=cache)
    assert outcome.status == "refused" and "did not expect" in outcome.message
    assert [e.key for e in cache.entries()] == [trainer_cache.key_of(held)]


def _as_manifest(fields: dict, data: bytes, **changes) -> tuple[dict, bytes]:
    key = trainer_cache.key_of(fields)
    manifest = {"v": 2, "key": key, "fields": fields, "file": f"{key}.bin", "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(), "created": time.time(), **changes}
    return manifest, data


def test_dates_are_the_controllers_and_a_newer_verified_copy_replaces_the_older(hosts, tmp_path):
    red1 = connect("red1", hosts)
    cache = cc.LocalCache(str(tmp_path / "store"))
    run_dir = tmp_path / "red1" / "run"
    first = _host_writes(run_dir, _fields(), os.urandom(2000), created=1e300)
    assert cc.fetch(red1, str(run_dir), _trainer(), BUNDLE, claim="mismatch:torch", cache=cache,
                    clock=lambda: time.time() - 40 * 86400).status == "fetched"
    entry = cache.get(first["key"], red(cache, hosts)["domain"])
    assert entry.created < time.time() - 39 * 86400  # the host's 1e300 is not a date the store believes
    newer = _host_writes(run_dir, _fields(), os.urandom(2000))
    outcome = cc.fetch(red1, str(run_dir), _trainer(), BUNDLE, claim="mismatch:torch", cache=cache)
    assert outcome.status == "fetched" and "replacing" in outcome.message
    assert cache.read(first["key"], red(cache, hosts)["domain"])[0]["sha256"] == newer["sha256"]
    assert cache.prune(30 * 86400) == []
    cache.put(*_as_manifest(_fields(gpu="old"), b"x" * 10, created=1e300), red(cache, hosts),
              now=time.time() - 40 * 86400)
    assert cache.prune(30 * 86400) == [trainer_cache.key_of(_fields(gpu="old"))]  # 1e300 does not keep it


_RSS = textwrap.dedent("""
    import json, resource, sys
    from dflashctl.runs import compile_cache as cc
    from dflashctl.config import load_inventory
    from dflashctl.hosts.transport import connect
    inventory, run_dir, store, trainer = sys.argv[1:5]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = cc.fetch(connect("red1", load_inventory(inventory)), run_dir, json.loads(trainer), "b" * 64, claim="miss",
                   cache=cc.LocalCache(store))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"status": out.status, "message": out.message, "before_kib": before, "after_kib": after}))
""")


def test_an_oversized_copy_back_is_cut_off_at_the_manifests_size_with_the_supervisors_memory_bounded(hosts,
                                                                                                    tmp_path):
    run_dir = tmp_path / "red1" / "run"
    manifest = _host_writes(run_dir, _fields(), b"k" * 1000)
    with open(run_dir / "compile_cache" / manifest["file"], "wb") as f:  # 256 MiB behind a 1,000-byte manifest
        f.truncate(256 << 20)
    env = {**os.environ, "PYTHONPATH": REPO}
    out = subprocess.run([sys.executable, "-c", _RSS, str(tmp_path / "inventory.yaml"), str(run_dir),
                          str(tmp_path / "store"), json.dumps(_trainer())],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["status"] == "failed" and "more than the 1000 bytes" in report["message"], report
    assert report["after_kib"] - report["before_kib"] < 32 << 10, report  # under 32 MiB more, for 256 MiB sent
    assert cc.LocalCache(str(tmp_path / "store")).entries() == []
    assert [n for n in os.listdir(tmp_path / "store") if n.startswith(".tmp-")] == []


def test_the_store_quota_is_kept(hosts, tmp_path, monkeypatch):
    monkeypatch.setenv(cc.QUOTA_ENV, str(5000))
    cache = cc.LocalCache(str(tmp_path / "store"))
    cache.put(*_as_manifest(_fields(gpu="a"), b"a" * 3000), red(cache, hosts), now=time.time() - 100)
    cache.put(*_as_manifest(_fields(gpu="b"), b"b" * 3000), red(cache, hosts))  # the older one makes room
    assert [e.fields["gpu"] for e in cache.entries()] == ["b"]
    with pytest.raises(cc.CacheError, match="quota"):
        cache.put(*_as_manifest(_fields(gpu="c"), b"c" * 6000))
    claimed, _ = _as_manifest(_fields(gpu="d"), b"d" * 4000)
    with pytest.raises(cc.CacheError, match="sha256"):  # a large claim with other bytes behind it evicts nothing
        cache.put(claimed, b"x" * 4000)
    assert [e.fields["gpu"] for e in cache.entries()] == ["b"]


# --------------------------------------------------------------------------- manifests of any shape


def test_a_deeply_nested_manifest_in_a_run_directory_is_refused_not_raised(hosts, tmp_path):
    red1 = connect("red1", hosts)
    run_dir = tmp_path / "red1" / "run"
    (run_dir / "compile_cache").mkdir(parents=True)
    (run_dir / "compile_cache" / trainer_cache.MANIFEST_FILE).write_text("[" * 20000 + "]" * 20000)
    cache = cc.LocalCache(str(tmp_path / "store"))
    cache.put(*_as_manifest(_fields(), b"x" * 10), red(cache, hosts))
    assert "nests deeper" in cc.look(red1, str(run_dir)).problem
    # The restart path: provide looks into the run directory first; it must answer, not raise.
    assert cc.provide(red1, str(run_dir), _trainer(), BUNDLE, cache=cache).status == "uploaded"
    with pytest.raises(ValueError, match="nests deeper"):  # the trainer: a refused manifest, never a traceback
        (run_dir / "compile_cache" / trainer_cache.MANIFEST_FILE).write_text("[" * 20000 + "]" * 20000)
        trainer_cache.read_manifest(str(run_dir))


def test_cache_ls_and_rm_all_survive_any_held_manifest(hosts, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASHCTL_HOME", str(tmp_path / "home"))
    from dflashctl.cli import _load_commands
    from dflashctl.commands._app import app

    _load_commands()
    cache = cc.LocalCache()
    good = cache.put(*_as_manifest(_fields(), b"x" * 10, created=float("nan")), red(cache, hosts))
    Path(good.path, cc.ORIGIN_FILE).write_text('{"received": 1e300, "domain": "d-0123456789abcdef01234567"}')
    broken = Path(cache.root, "0123456789abcdef")
    broken.mkdir()
    (broken / trainer_cache.MANIFEST_FILE).write_text("{not json")
    os.chmod(broken, 0o700)
    runner = CliRunner()
    listed = runner.invoke(app, ["cache", "ls"])
    assert listed.exit_code == 0 and good.key in listed.output, listed.output
    assert runner.invoke(app, ["cache", "ls", "--json"]).exit_code == 0
    removed = runner.invoke(app, ["cache", "rm", "--all"])
    assert removed.exit_code == 0, removed.output
    # The unreadable entry too; the trust domains issued stay (an identity, not an entry).
    assert sorted(os.listdir(cache.root)) == sorted([cc.GENERATION_FILE, cc.DOMAINS_FILE, cc.DOMAINS_FILE + ".lock"])


# --------------------------------------------------------------------------- one trainer per run directory


@pytest.fixture
def private_tmux(monkeypatch):
    from dflashctl.hosts.tmux import SOCKET_ENV
    from tests.harness.local import kill_tmux_servers

    socket = f"dflash-trust-{os.getpid()}"
    monkeypatch.setenv(SOCKET_ENV, socket)
    yield socket
    inventory = load_inventory(None)
    kill_tmux_servers([(inventory.get("local"), inventory, socket)])


def test_a_miss_a_host_writes_in_its_metrics_does_not_make_the_supervisor_copy_back(tmp_path, private_tmux,
                                                                                       monkeypatch):
    from dflashctl.config import load_playbook
    from dflashctl.hosts.tmux import Tmux
    from dflashctl.runs.runhost import run_files
    from dflashctl.store import Store
    from dflashctl.supervise.supervisor import Supervisor
    from tests.harness.fake_trainer import start_fake_run
    from tests.harness.local import wait_for, write_playbook

    monkeypatch.setenv("DFLASHCTL_HOME", str(tmp_path / "home"))
    inventory = load_inventory(None)
    store = Store(str(tmp_path / "runs.db"))
    playbooks = tmp_path / "playbooks"
    pb = load_playbook(str(write_playbook(playbooks, "warm", "local", {"train": {"steps": 100000, "log_every": 2}},
                                          poll_interval=0.2, expect={"compile_cache_after": "1s"})),
                       inventory=inventory)
    # The host's process says "miss" (and saves an artifact of its own) though the
    # controller holds one of the host's domain that fits the run.
    run_id = start_fake_run(store, inventory, "local", pb.trainer.to_dict(), playbook=pb.name,
                            playbook_source=pb.source, socket=private_tmux, env={"FAKE_TRAINER_COMPILE_CACHE": "miss",
                                                                                 "FAKE_TRAINER_GPU": "cpu"})
    run = store.get_run(run_id)
    trainer = json.loads(run_files(run.id, run.run_dir, run.config, private_tmux)["config.json"])
    held = _fields(config=cc.config_digest(trainer), bundle=run.bundle_hash, torch="held")
    cache = cc.LocalCache()
    cache.put(*_as_manifest(held, b"held" * 100), {"domain": cache.domain_for(inventory.get("local"), inventory).id})
    sup = Supervisor(store, inventory, interval=0.2, playbooks_dir=str(playbooks))
    sup.attach(run_id)
    try:
        def answered():
            return [e for e in store.events(run_id, kind="compile_cache") if e.detail and e.detail.get("status")]

        [event] = wait_for(answered, 30, "the copy-back answered", tick=sup.tick)
        assert event.detail["status"] == "refused" and "did not expect" in event.message, event.message
        assert [e.key for e in cache.entries()] == [trainer_cache.key_of(held)]
    finally:
        Tmux(inventory.get("local"), inventory, private_tmux).kill(run_id)
        sup.close()


_AFTER_RM = textwrap.dedent("""
    import json, os, sys
    prefix, site = sys.argv[1:3]
    sys.pycache_prefix, sys.dont_write_bytecode = prefix, False
    sys.path.insert(0, site)
    from dflashctl.core import contract
    from trainer import bytecode
    dropped = bytecode.drop_if_outdated(prefix, os.environ.get(contract.ARTIFACT_GENERATION_ENV))
    import victim
    print(json.dumps({"dropped": dropped, "value": victim.VALUE}))
""")


def test_bytecode_unpacked_on_a_host_does_not_survive_cache_rm_all(tmp_path, monkeypatch):
    """Bytecode an earlier start unpacked into the host's bytecode cache (the compile
    cache's ``pycache``), here a poisoned copy: after ``cache rm --all`` the next start
    the controller makes drops it before its imports."""
    monkeypatch.setenv("DFLASHCTL_HOME", str(tmp_path / "home"))
    from dflashctl.cli import _load_commands
    from dflashctl.commands._app import app
    from dflashctl.runs.runhost import RUN_SCRIPT, run_files

    site, prefix = tmp_path / "site", tmp_path / "cache" / "pycache"
    site.mkdir()
    (site / "victim.py").write_text("VALUE = 'honest'\n")
    st = os.stat(site / "victim.py")
    import marshal

    poisoned = (importlib.util.MAGIC_NUMBER + bytes(4) + (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little")
                + (st.st_size & 0xFFFFFFFF).to_bytes(4, "little") + marshal.dumps(compile("VALUE = 'payload'\n", "v", "exec")))
    target = prefix / bytecode.member_name(str(site / "victim.py"))
    target.parent.mkdir(parents=True)
    target.write_bytes(poisoned)
    bytecode.mark_unpacked(str(prefix), "a" * 64)

    _load_commands()
    assert CliRunner().invoke(app, ["cache", "rm", "--all"]).exit_code == 0
    config = {"trainer": _trainer(), "gpus": [], "env": {}, "python": "python3", "compile_cache": "/c"}
    script = run_files("r", "/r", config, "s")[RUN_SCRIPT]
    [line] = [x for x in script.splitlines() if contract.ARTIFACT_GENERATION_ENV in x]
    generation = line.split("=", 1)[1].strip("'")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"}
    env.update(PYTHONPATH=REPO, **{contract.ARTIFACT_GENERATION_ENV: generation})
    out = subprocess.run([sys.executable, "-c", _AFTER_RM, str(prefix), str(site)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"dropped": True, "value": "honest"}
    assert not os.path.exists(bytecode.unpacked_marker(str(prefix), "a" * 64))
