"""The trainer bundle: what is deployed to a run host, as one reproducible archive.

Contents: the ``trainer`` package, plus ``dflashctl/__init__.py``,
``dflashctl/core/__init__.py`` and ``dflashctl/core/contract.py`` (the torch-free
contract the trainer imports). Nothing
else of the controller travels.

The archive is byte-for-byte reproducible (sorted entries, fixed mtime, uid/gid,
owner names and modes, a gzip header without a timestamp or file name, no
``__pycache__``), so its sha256 names the content: an unchanged trainer has the
same hash on every launch and is never sent twice (see ``deploy.py``).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import tarfile
from dataclasses import dataclass, field

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (directory or file relative to the source root, whole tree?)
_CONTENTS = (
    ("trainer", True),
    ("dflashctl/__init__.py", False),
    ("dflashctl/core/__init__.py", False),
    ("dflashctl/core/contract.py", False),
)
_SKIP_DIRS = {"__pycache__", ".pytest_cache", ".mypy_cache"}
_SKIP_SUFFIXES = (".pyc", ".pyo", ".swp", "~")

# 2000-01-01: a fixed mtime (0 makes some tar versions warn about "implausibly old").
_MTIME = 946684800


@dataclass(frozen=True)
class Bundle:
    hash: str  # sha256 hex of ``data``
    data: bytes  # the .tar.gz archive
    files: list[str] = field(default_factory=list)  # archive member names, sorted

    @property
    def short(self) -> str:
        return self.hash[:12]

    @property
    def size(self) -> int:
        return len(self.data)


def bundle_files(source_root: str = _PACKAGE_ROOT) -> list[str]:
    """Relative paths (POSIX separators) that go into the bundle, sorted."""
    found: list[str] = []
    for rel, tree in _CONTENTS:
        path = os.path.join(source_root, rel)
        if not tree:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"bundle: {path} is missing")
            found.append(rel)
            continue
        if not os.path.isdir(path):
            raise FileNotFoundError(f"bundle: {path} is missing")
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
            for name in filenames:
                if name.startswith(".") or name.endswith(_SKIP_SUFFIXES):
                    continue
                full = os.path.join(dirpath, name)
                found.append(os.path.relpath(full, source_root).replace(os.sep, "/"))
    return sorted(found)


def _tar_info(name: str, size: int, is_dir: bool = False) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.mtime = _MTIME
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if is_dir:
        info.type = tarfile.DIRTYPE
        info.mode = 0o755
    else:
        info.size = size
        info.mode = 0o644
    return info


def build_bundle(source_root: str = _PACKAGE_ROOT) -> Bundle:
    """Pack the trainer bundle from ``source_root`` (the repository by default)."""
    files = bundle_files(source_root)
    dirs = sorted({"/".join(f.split("/")[:i]) for f in files for i in range(1, f.count("/") + 1)})
    raw = io.BytesIO()
    # mtime=0 and an empty file name keep the gzip header identical on every build.
    with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=6) as gz:
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for d in dirs:
                tar.addfile(_tar_info(d, 0, is_dir=True))
            for rel in files:
                with open(os.path.join(source_root, rel), "rb") as f:
                    content = f.read()
                tar.addfile(_tar_info(rel, len(content)), io.BytesIO(content))
    data = raw.getvalue()
    return Bundle(hash=hashlib.sha256(data).hexdigest(), data=data, files=files)
