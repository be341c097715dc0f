"""Bytecode that travels with the compile artifacts (trainer/bytecode.py and the
artifact's bytecode part in trainer/compile_cache.py), in real processes: an image
without bytecode (PYTHONDONTWRITEBYTECODE, none beside the sources) packs what it
imported; a fresh cache on the next start unpacks it before the imports, and
Python then compiles nothing it was given, but compiles again any module whose
source differs from the one the bytecode was made from."""

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

import pytest

from tests import harness
from trainer import bytecode
from trainer import compile_cache as cc

REPO = str(harness.REPO)
FIELDS = {"torch": "2.11.0+cu130", "triton": "3.6.0", "cuda": "13.0", "gpu": "NVIDIA H200", "python": "3.12.3",
          "bundle": "b" * 64, "config": "0123456789abcdef"}

_CHILD = textwrap.dedent("""
    import importlib._bootstrap_external as be, json, os, sys
    mode, cache, site, run_dir = sys.argv[1:5]
    sys.path.insert(0, site)
    from trainer import bytecode, compile_cache as cc
    from trainer.config import TrainerConfig
    report = {"prefix": bytecode.keep(cache, package="fakepkg")}
    if mode == "load":
        report["travelled"] = cc.load_bytecode(run_dir, report["prefix"], json.loads(sys.argv[5]))
    compiled = []
    original = be.SourceLoader.source_to_code
    def spy(self, data, path, *args, **kwargs):  # every module Python compiles from source
        compiled.append(os.path.relpath(path, site))
        return original(self, data, path, *args, **kwargs)
    be.SourceLoader.source_to_code = spy
    import fakepkg, fakepkg.b, fakepkg.sub.c
    report["compiled"] = sorted(compiled)
    report["values"] = [fakepkg.VALUE, fakepkg.b.VALUE, fakepkg.sub.c.VALUE]
    if mode == "plain":  # a Python this start runs (as inductor runs its compile workers) finds that bytecode
        import subprocess
        code = ("import importlib._bootstrap_external as be, json, sys; seen = []; o = be.SourceLoader.source_to_code; "
                "be.SourceLoader.source_to_code = lambda self, d, p, *a, **k: (seen.append(p), o(self, d, p, *a, **k))[1]; "
                "sys.path.insert(0, sys.argv[1]); import fakepkg, fakepkg.b, fakepkg.sub.c; print(json.dumps(seen))")
        out = subprocess.run([sys.executable, "-c", code, site], capture_output=True, text=True, check=True)
        report["child_compiled"] = json.loads(out.stdout)
    if mode == "save":
        packed = bytecode.pack(bytecode.imported_sources())
        report["counts"] = packed[1]
        report["manifest"] = cc.write(run_dir, json.loads(sys.argv[5]), TrainerConfig(), b"artifact bytes", {},
                                      packed)
    print(json.dumps(report))
""")


def _site(tmp_path):
    site = tmp_path / "site"
    (site / "fakepkg" / "sub").mkdir(parents=True)
    (site / "fakepkg" / "__init__.py").write_text("VALUE = 'init'\n")
    (site / "fakepkg" / "b.py").write_text("VALUE = 'b1'\n")
    (site / "fakepkg" / "sub" / "__init__.py").write_text("")
    (site / "fakepkg" / "sub" / "c.py").write_text("VALUE = 'c'\n")
    return site


def _child(mode, cache, site, run_dir) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"}
    env.update(PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", _CHILD, mode, str(cache), str(site), str(run_dir), json.dumps(FIELDS)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


MODULES = ["fakepkg/__init__.py", "fakepkg/b.py", "fakepkg/sub/__init__.py", "fakepkg/sub/c.py"]


def test_a_fresh_cache_compiles_nothing_the_artifact_brought(tmp_path):
    site, run_dir = _site(tmp_path), tmp_path / "run"
    saved = _child("save", tmp_path / "cache1", site, run_dir)
    assert saved["compiled"] == MODULES  # the first start compiles everything
    part = saved["manifest"]["parts"]["bytecode"]
    assert part["magic"] == importlib.util.MAGIC_NUMBER.hex() and part["offset"] == len(b"artifact bytes")
    blob = (run_dir / cc.CACHE_DIR / saved["manifest"]["file"]).read_bytes()
    assert cc.part(saved["manifest"], blob, "artifacts") == b"artifact bytes"
    with tarfile.open(fileobj=io.BytesIO(cc.part(saved["manifest"], blob, "bytecode")), mode="r:gz") as tar:
        names = tar.getnames()
    ours = sorted(n for n in names if "/fakepkg/" in n)
    assert ours == sorted(str(site / m).lstrip("/") for m in MODULES)  # named by their sources
    assert part["files"] == len(names) == saved["counts"]["files"]

    fresh = _child("load", tmp_path / "cache2", site, run_dir)
    assert fresh["travelled"]["status"] == "unpacked" and fresh["travelled"]["written"] >= 4
    assert fresh["travelled"]["refused"] == fresh["travelled"]["stale"] == 0
    assert fresh["compiled"] == []  # every module's bytecode came with the artifact
    assert fresh["values"] == ["init", "b1", "c"]

    again = _child("load", tmp_path / "cache2", site, run_dir)
    assert again["travelled"] == {"status": "present"} and again["compiled"] == []

    without = _child("plain", tmp_path / "cache3", site, run_dir)  # the proof: no artifact, all compiled
    assert without["compiled"] == MODULES
    assert without["child_compiled"] == []  # its own child processes read what it wrote


def test_a_module_whose_source_differs_is_compiled_from_its_source(tmp_path):
    site, run_dir = _site(tmp_path), tmp_path / "run"
    _child("save", tmp_path / "cache1", site, run_dir)
    (site / "fakepkg" / "b.py").write_text("VALUE = 'b2, patched here'\n")
    fresh = _child("load", tmp_path / "cache2", site, run_dir)
    assert fresh["travelled"]["status"] == "unpacked" and fresh["travelled"]["stale"] == 1
    assert fresh["compiled"] == ["fakepkg/b.py"]
    assert fresh["values"] == ["init", "b2, patched here", "c"]


def test_bytecode_of_another_python_or_bytes_that_do_not_check_out_are_not_unpacked(tmp_path):
    site, run_dir = _site(tmp_path), tmp_path / "run"
    saved = _child("save", tmp_path / "cache1", site, run_dir)
    manifest_path = run_dir / cc.CACHE_DIR / cc.MANIFEST_FILE
    manifest = saved["manifest"]
    other = json.loads(json.dumps(manifest))
    other["parts"]["bytecode"]["magic"] = "00000000"
    manifest_path.write_text(json.dumps(other))
    prefix = tmp_path / "cache2" / "pycache"
    out = cc.load_bytecode(str(run_dir), str(prefix), FIELDS)
    assert out["status"] == "mismatch:python" and not prefix.exists()

    manifest_path.write_text(json.dumps(manifest))
    blob = run_dir / cc.CACHE_DIR / manifest["file"]
    blob.write_bytes(blob.read_bytes()[:-1] + b"x")
    assert cc.load_bytecode(str(run_dir), str(prefix), FIELDS)["status"] == "mismatch:sha256" and not prefix.exists()

    outside = json.loads(json.dumps(manifest))
    outside["parts"]["bytecode"]["bytes"] = manifest["bytes"] * 2
    with pytest.raises(ValueError, match="outside the file"):
        cc.part(outside, blob.read_bytes(), "bytecode")
    assert cc.load_bytecode(str(run_dir), None, FIELDS) is None  # a host with bytecode of its own: nothing to do


def _member(tar, name, data=b"", kind=tarfile.REGTYPE, target=""):
    info = tarfile.TarInfo(name)
    info.type, info.size, info.linkname = kind, len(data) if kind == tarfile.REGTYPE else 0, target
    tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def test_unpack_writes_only_bytecode_of_the_sources_here_inside_the_prefix(tmp_path):
    site = tmp_path / "srv"
    site.mkdir()
    sources = {name: f"NAME = {name!r}\n".encode() for name in ("ok", "other", "old", "unchecked")}
    for name, text in sources.items():
        (site / f"{name}.py").write_bytes(text)
    body = b"code"
    magic = importlib.util.MAGIC_NUMBER

    def checked(text, flags=3):
        return magic + flags.to_bytes(4, "little") + importlib.util.source_hash(text) + body

    rel = str(site).lstrip("/")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        _member(tar, f"{rel}/ok.py", checked(sources["ok"]))
        _member(tar, f"{rel}/other.py", checked(b"made from another source\n"))        # stale here
        _member(tar, f"{rel}/missing.py", checked(b"X = 1\n"))                           # no such source here
        _member(tar, f"{rel}/unchecked.py", checked(sources["unchecked"], flags=1))     # hash, never checked
        _member(tar, f"{rel}/old.py", magic + bytes(12) + body)                         # timestamp bytecode
        _member(tar, "../escape.py", checked(sources["ok"]))
        _member(tar, "/abs/x.py", checked(sources["ok"]))
        _member(tar, f"{rel}/readme.txt", checked(sources["ok"]))
        _member(tar, f"{rel}/link.py", kind=tarfile.SYMTYPE, target="/etc/passwd")
    prefix = tmp_path / "prefix"
    counts = bytecode.unpack(buf.getvalue(), str(prefix), "a" * 64)
    assert counts == {"written": 1, "present": 0, "stale": 3, "absent": 1, "refused": 4}
    written = sorted(str(p.relative_to(prefix)) for p in prefix.rglob("*") if p.is_file())
    assert written == [".dflash-unpacked/" + "a" * 64, bytecode.member_name(str(site / "ok.py"))]
    pyc = (prefix / bytecode.member_name(str(site / "ok.py"))).read_bytes()
    st = os.stat(site / "ok.py")  # ordinary bytecode of the source here: Python checks it like its own
    assert pyc[4:8] == bytes(4) and int.from_bytes(pyc[8:12], "little") == int(st.st_mtime)
    assert int.from_bytes(pyc[12:16], "little") == st.st_size and pyc[16:] == body
    again = bytecode.unpack(buf.getvalue(), str(prefix), "a" * 64)
    assert again["written"] == 0 and again["present"] == 1


def test_checked_hash_pyc_rejects_bytecode_of_another_source(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("X = 1\n")
    code = compile(source.read_bytes(), str(source), "exec")
    import marshal

    st = os.stat(source)
    stamp = (importlib.util.MAGIC_NUMBER + (0).to_bytes(4, "little") + (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little")
             + (st.st_size & 0xFFFFFFFF).to_bytes(4, "little") + marshal.dumps(code))
    out = bytecode.checked_hash_pyc(stamp, source.read_bytes(), st)
    assert out[4:8] == (3).to_bytes(4, "little") and out[8:16] == importlib.util.source_hash(source.read_bytes())
    assert out[16:] == stamp[16:]
    assert bytecode.checked_hash_pyc(out, source.read_bytes(), st) == out  # already checked-hash: kept
    assert bytecode.checked_hash_pyc(out, b"X = 2\n", st) is None  # another source
    later = os.stat_result((*st[:8], st.st_mtime + 10, st.st_ctime))
    assert bytecode.checked_hash_pyc(stamp, source.read_bytes(), later) is None  # a stale timestamp
    assert bytecode.checked_hash_pyc(b"\0\0\0\0" + stamp[4:], source.read_bytes(), st) is None  # another Python


def test_the_artifact_read_twice_at_a_start_is_hashed_again_once_it_changed(tmp_path):
    """The bytecode is read before torch is imported and the compiled artifacts after;
    the second read reuses the first's sha256 only for the very same file."""
    site, run_dir = _site(tmp_path), tmp_path / "run"
    saved = _child("save", tmp_path / "cache1", site, run_dir)
    assert cc.load_bytecode(str(run_dir), str(tmp_path / "cache2" / "pycache"), FIELDS)["status"] == "unpacked"
    blob = run_dir / cc.CACHE_DIR / saved["manifest"]["file"]
    tampered = tmp_path / "tampered.bin"
    tampered.write_bytes(b"ARTIFACT BYTES" + blob.read_bytes()[len(b"artifact bytes"):])  # same size
    os.replace(tampered, blob)
    out = cc.load(str(run_dir), FIELDS)
    assert out.status == "mismatch:sha256" and not out.loaded


def test_the_controller_reads_the_bytecode_size_of_a_manifest_it_was_sent(tmp_path):
    from dflashctl.runs.compile_cache import Entry

    good = {"parts": {"artifacts": {"offset": 0, "bytes": 5}, "bytecode": {"offset": 5, "bytes": 7}}}
    assert Entry("k", good, str(tmp_path)).bytecode_bytes == 7
    for parts in ({"bytecode": "7"}, {"bytecode": {"bytes": True}}, ["bytecode"], None):
        assert Entry("k", {"parts": parts}, str(tmp_path)).bytecode_bytes is None


def test_bytecode_compiled_ahead_leaves_a_cold_start_nothing_to_compile_and_skips_tests(tmp_path, monkeypatch):
    site = _site(tmp_path)
    (site / "fakepkg" / "tests").mkdir()
    (site / "fakepkg" / "tests" / "test_x.py").write_text("VALUE = 'never imported'\n")
    monkeypatch.syspath_prepend(str(site))
    prefix = tmp_path / "cache" / bytecode.PREFIX_DIR
    prefix.mkdir(parents=True)
    assert bytecode.compile_ahead(str(prefix), cpus=2, packages=("fakepkg",)) is None  # too few CPUs to share
    proc = bytecode.compile_ahead(str(prefix), cpus=4, packages=("fakepkg",))
    assert proc is not None
    proc.wait(timeout=60)
    assert bytecode.stop_ahead(proc) == "finished"
    made = {os.path.relpath(os.path.join(d, f), prefix) for d, _, files in os.walk(prefix) for f in files}
    ours = {name for name in made if name.startswith(str(site).lstrip(os.sep))}  # (compileall's own imports beside)
    assert ours == {bytecode.member_name(str(site / m)) for m in MODULES}  # tests/ skipped
    report = _child("plain", tmp_path / "cache", site, tmp_path / "run")
    assert report["compiled"] == [] and report["values"] == ["init", "b1", "c"]
    assert bytecode.compile_ahead(str(prefix), cpus=4, packages=("fakepkg",)) is None  # warm: nothing to do


def _alive_in_group(pgid: int) -> int:
    """Processes of group ``pgid`` that are not zombies, from /proc."""
    alive = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        alive += fields[0] != "Z" and int(fields[2]) == pgid
    return alive


def test_stopping_the_compile_ahead_ends_its_whole_process_group():
    proc = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                             "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"],
                            start_new_session=True)  # what compile_ahead starts: a parent and its workers
    time.sleep(0.5)  # the worker started
    assert _alive_in_group(proc.pid) == 2
    assert bytecode.stop_ahead(proc) == "stopped"
    assert proc.returncode is not None
    deadline = time.monotonic() + 5
    while _alive_in_group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _alive_in_group(proc.pid) == 0  # the worker ended with it (a zombie left to init is not alive)
    assert bytecode.stop_ahead(None) is None
