"""Python bytecode for the trainer's imports: where a start keeps it, and the part of
it that travels with the compile artifacts.

A start imports a few thousand modules (torch, its compiler, transformers). An image
that ships them without bytecode and cannot write any beside them (read-only, or
PYTHONDONTWRITEBYTECODE) compiles all of them from source at every start: 10-20 s.
``keep`` gives such a process a bytecode cache of its own (``sys.pycache_prefix``).
A new host, a new container or a wiped cache starts without it, so the bytecode of
every imported module also travels inside the compile artifact
(``trainer.compile_cache``): ``pack`` after the warm-up, ``unpack`` before the first
import of torch on the next host.

What travels is checked-hash bytecode only (PEP 552): each file carries the hash of
the source it was compiled from, and Python compares it with the source on this
host at import time. A file whose source differs here (another torch, a patched
module) is compiled again from that source, never run in its place; a file whose
source lies elsewhere here is simply never found.

Standard library only: this runs before torch is imported.
"""

from __future__ import annotations

import importlib.util
import io
import os
import sys
import tarfile
from typing import Iterable, Optional

PREFIX_DIR = "pycache"
FLAGS_CHECKED_HASH = 0b11  # hash-based, check the source (PEP 552)
MAX_FILE_BYTES = 64 << 20
MAX_TOTAL_BYTES = 1 << 30
_UNPACKED = ".dflash-unpacked"  # in the prefix: one empty file per archive unpacked there


def keep(cache_dir: Optional[str], package: str = "torch") -> Optional[str]:
    """Give Python a bytecode cache it can write when ``package`` (torch) ships none.

    Bytecode then goes to ``<cache>/pycache`` (``cache_dir``, else the inductor
    cache, else ``~/.cache/dflashctl``), never beside the sources. Returns that
    directory, or None when nothing had to change (bytecode present beside the
    sources, or Python writes it there itself)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    if os.path.exists(importlib.util.cache_from_source(spec.origin)):
        return None
    pycache = os.path.join(os.path.dirname(spec.origin), "__pycache__")
    if not sys.dont_write_bytecode and os.access(pycache if os.path.isdir(pycache) else os.path.dirname(pycache), os.W_OK):
        return None
    base = cache_dir or os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join("~", ".cache", "dflashctl")
    path = os.path.join(os.path.abspath(os.path.expanduser(base)), PREFIX_DIR)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None
    sys.pycache_prefix = path
    sys.dont_write_bytecode = False
    return path


def member_name(source: str) -> str:
    """Where a source's bytecode lies under a pycache prefix, relative to it (the
    layout ``sys.pycache_prefix`` uses: the source's absolute directory, then
    ``<name>.<tag>.pyc``)."""
    source = os.path.abspath(source)
    head, tail = os.path.split(source)
    return os.path.join(head.lstrip(os.sep), os.path.basename(importlib.util.cache_from_source(tail)))


def checked_hash_pyc(pyc: bytes, source: bytes, source_stat: os.stat_result) -> Optional[bytes]:
    """``pyc`` rewritten as checked-hash bytecode of ``source``, or None when it was
    not compiled from that source (another Python, a stale timestamp or hash)."""
    magic = importlib.util.MAGIC_NUMBER
    if len(pyc) < 16 or pyc[:4] != magic:
        return None
    flags = int.from_bytes(pyc[4:8], "little")
    digest = importlib.util.source_hash(source)
    if flags == 0:
        if (int.from_bytes(pyc[8:12], "little") != int(source_stat.st_mtime) & 0xFFFFFFFF
                or int.from_bytes(pyc[12:16], "little") != source_stat.st_size & 0xFFFFFFFF):
            return None
    elif not flags & 1 or pyc[8:16] != digest:
        return None
    return magic + FLAGS_CHECKED_HASH.to_bytes(4, "little") + digest + pyc[16:]


def imported_sources(modules: Optional[Iterable] = None) -> list[tuple[str, str]]:
    """(source, bytecode file) of each imported module that was loaded from a .py
    source with bytecode on disk."""
    out = []
    for module in list(sys.modules.values()) if modules is None else modules:
        spec = getattr(module, "__spec__", None)
        origin, cached = getattr(spec, "origin", None), getattr(spec, "cached", None)
        if isinstance(origin, str) and origin.endswith(".py") and isinstance(cached, str):
            out.append((origin, cached))
    return sorted(set(out))


def pack(sources: list[tuple[str, str]], exclude: Iterable[str] = ()) -> tuple[bytes, dict]:
    """A gzip tar of checked-hash bytecode for ``sources`` (``imported_sources``),
    members named by ``member_name``; sources under an ``exclude`` directory
    (generated code in a compile cache) are left out. Returns (bytes, counts)."""
    excluded = tuple(os.path.join(os.path.abspath(d), "") for d in exclude if d)
    buf = io.BytesIO()
    counts = {"files": 0, "stale": 0, "unreadable": 0, "bytes": 0}
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1) as tar:
        for source, cached in sources:
            if excluded and os.path.abspath(source).startswith(excluded):
                continue
            try:
                with open(source, "rb") as f:
                    st = os.fstat(f.fileno())
                    text = f.read()
                with open(cached, "rb") as f:
                    pyc = f.read(MAX_FILE_BYTES + 1)
            except OSError:
                counts["unreadable"] += 1
                continue
            data = checked_hash_pyc(pyc, text, st) if len(pyc) <= MAX_FILE_BYTES else None
            if data is None:
                counts["stale"] += 1
                continue
            if counts["bytes"] + len(data) > MAX_TOTAL_BYTES:
                break
            info = tarfile.TarInfo(member_name(source))
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
            counts["files"] += 1
            counts["bytes"] += len(data)
    return buf.getvalue(), counts


def unpacked_marker(prefix: str, sha256: str) -> str:
    return os.path.join(prefix, _UNPACKED, sha256)


def mark_unpacked(prefix: str, sha256: str) -> None:
    """Note that the bytecode of artifact ``sha256`` is under ``prefix`` (it was
    unpacked there, or packed from there), so later starts do not read it again."""
    marker = unpacked_marker(prefix, sha256)
    os.makedirs(os.path.dirname(marker), exist_ok=True)
    with open(marker, "w"):
        pass


def unpack(data: bytes, prefix: str, sha256: str) -> dict:
    """Put the archive's bytecode under ``prefix`` where none is yet. Members that are
    not plain, relative ``.pyc`` files of checked-hash bytecode for this Python are
    refused; nothing is written outside ``prefix``. Returns counts."""
    counts = {"written": 0, "present": 0, "refused": 0}
    root = os.path.join(os.path.abspath(prefix), "")
    header = importlib.util.MAGIC_NUMBER + FLAGS_CHECKED_HASH.to_bytes(4, "little")
    made: set[str] = set()
    total = 0
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar:
            name = os.path.normpath(member.name)
            target = os.path.join(root, name)
            if (not member.isfile() or os.path.isabs(name) or name.startswith("..") or not name.endswith(".pyc")
                    or not target.startswith(root) or member.size > MAX_FILE_BYTES
                    or total + member.size > MAX_TOTAL_BYTES):
                counts["refused"] += 1
                continue
            if os.path.lexists(target):
                counts["present"] += 1
                continue
            body = tar.extractfile(member).read()
            if body[:8] != header:
                counts["refused"] += 1
                continue
            total += len(body)
            directory = os.path.dirname(target)
            if directory not in made:
                os.makedirs(directory, exist_ok=True)
                made.add(directory)
            tmp = f"{target}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(body)
            os.replace(tmp, target)
            counts["written"] += 1
    mark_unpacked(prefix, sha256)
    return counts
