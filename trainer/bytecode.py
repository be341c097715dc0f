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

What travels is checked-hash bytecode (PEP 552), one archive member per module,
named by its source's path: each carries the hash of the source it was compiled
from. ``unpack`` compares that hash with the source at the same path on this host
and writes the bytecode only where they are equal, as ordinary bytecode of that
file (its size and modification time in the header, as Python writes it), so the
imports that follow run exactly as on a warm host. A module whose source differs
here (another torch, a patched file) or is absent is left to Python, which compiles
it from its own source: travelled bytecode never runs in place of a source it was
not made from.

What the source hash does not prove is what the code object does: a crafted member
with the true hash runs at ``import torch``. So bytecode travels only inside the
operator's trust domain (the controller puts an artifact only on hosts of the domain
it came from), is unpacked only when the artifact's key fields known before the
imports match (``trainer.compile_cache.load_bytecode``), never decompressed past
MAX_EXPANSION times its size, and is dropped from this host's cache when the
operator removes artifacts (``drop_if_outdated``).

Standard library only: this runs before torch is imported.
"""

from __future__ import annotations

import importlib.util
import io
import os
import shutil
import subprocess
import sys
import tarfile
import zlib
from typing import Iterable, Optional

from dflashctl.core import contract
from trainer import procgroup

PREFIX_DIR = "pycache"
FLAGS_CHECKED_HASH = 0b11  # hash-based, check the source (PEP 552)
MAX_FILE_BYTES = 64 << 20
MAX_TOTAL_BYTES = 1 << 30
# Decompressed bytes per compressed byte past which an archive is refused unread
# (bytecode compresses about 3:1 at level 1; a gzip bomb, a thousand to one).
MAX_EXPANSION = 16
_UNPACKED = ".dflash-unpacked"  # in the prefix: one empty file per archive unpacked there


def host_cache(cache_dir: Optional[str]) -> str:
    """This host's cache directory for a start's own files: ``cache_dir``, else the
    inductor cache, else ``~/.cache/dflashctl`` (absolute)."""
    base = cache_dir or os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join("~", ".cache", "dflashctl")
    return os.path.abspath(os.path.expanduser(base))


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
    path = os.path.join(host_cache(cache_dir), PREFIX_DIR)
    try:  # another user's directory is refused (UnsafeDirectory): its bytecode would run here
        contract.private_dir(path, "bytecode cache")
    except OSError:
        return None
    sys.pycache_prefix = path
    sys.dont_write_bytecode = False
    # The same for the Python processes this one starts: inductor's compile workers
    # import torch too, and would compile it from source at every start.
    os.environ["PYTHONPYCACHEPREFIX"] = path
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    return path


# What a start imports most of, compiled ahead (``compile_ahead``); transformers only in
# its shared modules and the model families the trainer builds (the rest of models/ is
# hundreds of architectures it never imports).
AHEAD_PACKAGES = ("torch", "transformers", "triton", "sympy", "jinja2", "networkx")
AHEAD_SKIP = r"[/\\](tests?|benchmarks)[/\\]|[/\\]testing[/\\]_internal[/\\]|[/\\]transformers[/\\]models[/\\](?!(auto|qwen\w*|llama)[/\\]|__init__)"
AHEAD_MIN_CPUS = 4
AHEAD_MAX_WORKERS = 8  # half the CPUs, up to this: a large host's imports need no more


def compile_ahead(prefix: Optional[str], cpus: Optional[int] = None,
                  packages: Iterable[str] = AHEAD_PACKAGES) -> Optional[subprocess.Popen]:
    """Start compiling the bytecode of the ``packages`` a start imports
    into the cache ``prefix``, in worker processes, while this process imports them
    one module at a time: a module they reached first is read, not compiled. For a
    cold cache only (torch's ``__init__`` without bytecode there), on a host with at
    least ``AHEAD_MIN_CPUS`` CPUs (half of them work, ``AHEAD_MAX_WORKERS`` at most);
    None where nothing was started.
    Python writes each file under a temporary name and renames it, so the two never
    meet in a half-written file. The caller ends it with ``stop_ahead`` once its own
    imports are done (inductor's compile workers need the CPUs next)."""
    cpus = cpus or os.cpu_count() or 1
    if not prefix or cpus < AHEAD_MIN_CPUS:
        return None
    roots = []
    for package in packages:
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.origin and spec.origin.endswith("__init__.py"):
            roots.append(os.path.dirname(spec.origin))
    if not roots or os.path.exists(os.path.join(prefix, member_name(os.path.join(roots[0], "__init__.py")))):
        return None
    cmd = [sys.executable, "-m", "compileall", "-q", "-j", str(min(cpus // 2, AHEAD_MAX_WORKERS)), "-x", AHEAD_SKIP, *roots]
    # The prefix in the environment, not only as -X: compileall's workers are started by a
    # forkserver, which passes on the environment but not that option.
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}, "PYTHONPYCACHEPREFIX": prefix}
    try:
        return procgroup.start(cmd, env)  # its own group: stop_ahead ends its workers with it
    except OSError:
        return None


def stop_ahead(proc: Optional[subprocess.Popen]) -> Optional[str]:
    """End ``compile_ahead``'s process (and its workers, which exit with it) and say
    how far it got: ``finished`` or ``stopped``; None where none was started."""
    return procgroup.end(proc)


GENERATION_FILE = ".dflash-generation"  # in the prefix: the controller generation it was kept under


def drop_if_outdated(prefix: Optional[str], generation: Optional[str]) -> bool:
    """Empty the bytecode cache ``prefix`` when the controller's artifact generation
    (``contract.ARTIFACT_GENERATION_ENV``) grew since it was kept: the operator removed
    artifacts (``dflashctl cache rm``), so nothing unpacked from them may stay. Python
    writes its own bytecode there again. True when it was emptied."""
    if not prefix or generation is None or not generation.strip().isdigit():
        return False
    path = os.path.join(prefix, GENERATION_FILE)
    try:
        with open(path) as f:
            kept = int(f.read(32).strip() or 0)
    except (OSError, ValueError):
        kept = 0
    wanted = int(generation)
    dropped = wanted > kept
    if dropped:
        for name in os.listdir(prefix):
            target = os.path.join(prefix, name)
            if os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target, ignore_errors=True)
            elif name != GENERATION_FILE:
                try:
                    os.unlink(target)
                except OSError:
                    pass
    if dropped or not os.path.exists(path):
        with open(path, "w") as f:
            f.write(f"{max(wanted, kept)}\n")
    return dropped


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


def timestamp_pyc(pyc: bytes, source: bytes, source_stat: os.stat_result) -> Optional[bytes]:
    """Checked-hash ``pyc`` as ordinary (timestamp) bytecode of the local ``source``,
    or None unless it carries this Python's magic number and ``source``'s hash."""
    if (len(pyc) < 16 or pyc[:4] != importlib.util.MAGIC_NUMBER
            or int.from_bytes(pyc[4:8], "little") != FLAGS_CHECKED_HASH
            or pyc[8:16] != importlib.util.source_hash(source)):
        return None
    return (pyc[:4] + bytes(4) + (int(source_stat.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little")
            + (source_stat.st_size & 0xFFFFFFFF).to_bytes(4, "little") + pyc[16:])


def imported_sources(modules: Optional[Iterable] = None) -> list[tuple[str, str]]:
    """(source, bytecode file) of each imported module that was loaded from a .py
    source with bytecode on disk, in import order."""
    out: dict[tuple[str, str], None] = {}
    for module in list(sys.modules.values()) if modules is None else modules:
        spec = getattr(module, "__spec__", None)
        origin, cached = getattr(spec, "origin", None), getattr(spec, "cached", None)
        if isinstance(origin, str) and origin.endswith(".py") and isinstance(cached, str):
            out[(origin, cached)] = None
    return list(out)


def pack(sources: list[tuple[str, str]], exclude: Iterable[str] = ()) -> tuple[bytes, dict]:
    """A gzip tar of checked-hash bytecode for ``sources`` (``imported_sources``), one
    member per module named by its source's absolute path (without the leading
    separator); sources under an ``exclude`` directory (generated code in a compile
    cache) are left out. Returns (bytes, counts)."""
    excluded = tuple(os.path.join(os.path.abspath(d), "") for d in exclude if d)
    buf = io.BytesIO()
    counts = {"files": 0, "stale": 0, "unreadable": 0, "bytes": 0}
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1) as tar:
        for source, cached in sources:
            source = os.path.abspath(source)
            if excluded and source.startswith(excluded):
                continue
            try:
                text, st = _read_source(source)
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
            info = tarfile.TarInfo(source.lstrip(os.sep))
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
    """Write the archive's bytecode under ``prefix`` for each module whose source on
    this host is the one it was made from (``timestamp_pyc``), where none is yet.
    Members that are not relative ``.py`` paths of plain files are refused; nothing
    is written outside ``prefix``. Each file is written whole and renamed into place
    (Python must never read half a file). Returns counts:
    written, present (bytecode there already), stale (the source here differs),
    absent (no such source here), refused."""
    counts = {"written": 0, "present": 0, "stale": 0, "absent": 0, "refused": 0}
    root = os.path.join(os.path.abspath(prefix), "")
    total = 0
    with tarfile.open(fileobj=io.BytesIO(decompress(data)), mode="r:") as tar:
        for member in tar:
            name = os.path.normpath(member.name)
            if (not member.isfile() or os.path.isabs(name) or name.startswith("..") or not name.endswith(".py")
                    or member.size > MAX_FILE_BYTES or total + member.size > MAX_TOTAL_BYTES):
                counts["refused"] += 1
                continue
            target = os.path.join(root, member_name(os.sep + name))
            if not target.startswith(root):
                counts["refused"] += 1
                continue
            if os.path.lexists(target):
                counts["present"] += 1
                continue
            total += member.size
            counts[_place(os.sep + name, tar.extractfile(member).read(), target)] += 1
    mark_unpacked(prefix, sha256)
    return counts


def decompress(data: bytes) -> bytes:
    """The gzip archive ``data`` decompressed, never past MAX_EXPANSION times its size
    (nor MAX_TOTAL_BYTES): ValueError for a bomb, before it costs more than that."""
    limit = min(MAX_TOTAL_BYTES, MAX_EXPANSION * len(data) + (1 << 20))
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = inflate.decompress(data, limit + 1)
    except zlib.error as e:
        raise ValueError(f"bytecode archive is not gzip: {e}") from None
    if len(out) > limit:
        raise ValueError(f"bytecode archive of {len(data)} bytes expands past {limit} bytes: refused")
    return out


def _place(source: str, pyc: bytes, target: str) -> str:
    """Write ``pyc`` at ``target`` as bytecode of the local ``source`` if it was made
    from it; the count it adds to."""
    try:
        text, st = _read_source(source)
    except OSError:
        return "absent"
    body = timestamp_pyc(pyc, text, st)
    if body is None:
        return "stale"
    # Written like Python writes its own bytecode (a cache, not synced to disk:
    # contract.atomic_write_bytes's fsync per file would cost seconds here).
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = f"{target}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(body)
    os.replace(tmp, target)
    return "written"


def _read_source(path: str) -> tuple[bytes, os.stat_result]:
    """A source file's bytes and the status of the file they were read from."""
    with open(path, "rb") as f:
        return f.read(), os.fstat(f.fileno())
