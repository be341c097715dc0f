"""What a host's trainer python loads, as data: the ``Snapshot`` and its parts, and
``parse_snapshot``, which reads the collector's JSON (dflashctl/hosts/remote/audit.py).

The collector asks the host's import system; this module only holds the answers
and the few lookups every rule needs (which distribution owns a module, which copy
of a name is the one imported). Which torch is imported is never read from
dist-info order: it is the owner of the file ``find_spec("torch")`` names.

Pure: no I/O, no SSH, no judgement (that is ``rules``). A reading the collector
could not take is an empty field or a line in ``errors``, never an exception here;
only an answer that is not the collector's raises (ValueError).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from packaging.utils import canonicalize_name

# Shared libraries the audit follows, sent to the collector as its ``lib_prefixes``:
# ldconfig is filtered to these (libcuda also matches libcudart).
LIB_PREFIXES = ("libcudnn", "libnccl", "libcuda", "libcublas")
# Modules the trainer imports, looked up by the collector (with every distribution's
# top-level modules), and pip, which every fix runs.
TRAINER_MODULES = ("torch", "triton", "transformers")
ASKED_MODULES = (*TRAINER_MODULES, "pip", "ensurepip")  # ensurepip: whether pip can be put back without a wheel
SNAPSHOT_VERSION = 2  # the collector's "v"

_LDCONFIG_LINE = re.compile(r"^\s*(\S+)\s+\(([^)]*)\)\s+=>\s+(\S+)\s*$")


@dataclass
class Dist:
    """One installed distribution (one dist-info or egg-info directory). ``name`` is
    '' when its METADATA has none; ``requires`` / ``libs`` are None when unknown (a
    capture that has names and versions only); ``files`` is None without a RECORD."""

    name: str
    version: str
    location: str | None = None
    requires: list[str] | None = None
    modules: list[str] = field(default_factory=list)
    libs: list[str] | None = None  # paths (relative to location) of followed .so files it ships
    index: int = -1  # position in the collector's list (sys.path order); -1: built by hand
    metadata: str | None = None  # its .dist-info / .egg-info directory
    files: int | None = None
    missing: list[str] = field(default_factory=list)  # RECORD paths not on disk (the first few)
    missing_count: int = 0
    changed: list[str] = field(default_factory=list)  # RECORD paths whose size is not the recorded one
    changed_count: int = 0
    installer: str | None = None
    editable: bool = False
    error: str | None = None  # what the collector could not read of it ("metadata: UnicodeDecodeError: ...")
    denied: list[str] = field(default_factory=list)  # RECORD paths this user may not read (the first few)
    denied_count: int = 0
    dangling: list[dict[str, str]] = field(default_factory=list)  # missing RECORD paths that are symlinks: path, target
    dangling_count: int = 0
    shebangs: dict[str, str] = field(default_factory=dict)  # changed scripts outside the package -> their #! line

    @property
    def unreadable(self) -> bool:
        """Its METADATA cannot be read (not UTF-8, no permission): pip itself fails on it."""
        return bool(self.error) and self.error.startswith("metadata:")

    @property
    def key(self) -> str:
        return canonicalize_name(self.name) if self.name else ""

    def label(self) -> str:
        if not self.name:
            return f"a distribution with no name in its METADATA ({self.metadata or self.location or '?'})"
        return f"{self.name} {self.version}"

    def spec(self) -> str:
        """NAME==VERSION: this exact wheel, for a reinstall."""
        return f"{self.name}=={self.version}"


@dataclass
class LibEntry:
    """One ``ldconfig -p`` line: a soname and the file the dynamic loader's cache maps it to."""

    soname: str
    path: str

    @property
    def directory(self) -> str:
        return self.path.rsplit("/", 1)[0] if "/" in self.path else ""


@dataclass
class PathEntry:
    """One PYTHONPATH entry: what it holds and which of those names it shadows."""

    path: str
    exists: bool = True
    names: list[str] = field(default_factory=list)
    shadows: list[str] = field(default_factory=list)


@dataclass
class ModuleSpec:
    """Where the host's import system finds a top-level module (``find_spec``)."""

    name: str
    origin: str | None = None  # the file imported (None: a namespace package, or built in)
    owners: list[int] = field(default_factory=list)  # distributions (indexes) whose RECORD lists it
    entry: str | None = None  # the sys.path entry it was found under
    namespace: bool = False
    error: str | None = None
    finder: str | None = None  # the meta-path finder that found it, when not one of Python's own (module.Class)


# A shared file's holder that is none of its owners (the collector's values).
HOLDER_MISSING, HOLDER_FOREIGN, HOLDER_DENIED, HOLDER_UNKNOWN = -1, -2, -3, -4


@dataclass
class SharedFiles:
    """Files listed in the RECORD of every one of ``owners`` (indexes), and whose
    bytes they hold on disk: ``holder`` is the owner whose RECORD (size and sha256)
    they match, or one of the HOLDER_ values; None when the answer does not say
    (a capture, an older collector)."""

    owners: list[int]
    count: int
    paths: list[str] = field(default_factory=list)  # absolute, the first few
    holder: int | None = None


@dataclass
class PthFile:
    """A .pth file of a site directory: the directories it adds to sys.path."""

    file: str
    adds: list[str] = field(default_factory=list)
    code: bool = False  # it has an ``import`` line: code run at every start
    text: str = ""


@dataclass
class LoadedLib:
    """A followed library torch's CUDA library needs: the file the loader picks, and why."""

    soname: str
    path: str | None
    via: str | None  # RPATH | LD_LIBRARY_PATH | RUNPATH | ldconfig cache | ... ; None: not found


@dataclass
class LoaderFile:
    """A file the dynamic loader resolves for a shared object of the trainer's
    distributions (or one beside such a library, which it dlopens by name), inside
    the environment: pip can remove or overwrite it. ``owners``: the distributions
    whose RECORD lists it (indexes; empty: none does, e.g. a library put back by hand)."""

    path: str
    via: str
    needed_by: str = ""
    owners: list[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


@dataclass
class Snapshot:
    host: str
    hostname: str | None = None
    python: str | None = None  # the executable
    python_version: str | None = None
    prefix: str | None = None
    base_prefix: str | None = None
    sys_path: list[str] = field(default_factory=list)  # as the trainer has it (the collector's own entry left out)
    dropped_path: str | None = None  # the collector's own sys.path[0], left out
    site_packages: list[str] = field(default_factory=list)
    user_site: str | None = None
    user_site_enabled: bool = False
    markers: dict[str, str] = field(default_factory=dict)
    dists: list[Dist] = field(default_factory=list)  # in sys.path order
    modules: dict[str, ModuleSpec | None] = field(default_factory=dict)  # {} : the import system was not asked
    shared: list[SharedFiles] = field(default_factory=list)
    pth: list[PthFile] = field(default_factory=list)
    torch_dir: str | None = None  # the imported torch package's directory
    torch_version_py: str | None = None
    torch_elf: dict[str, Any] | None = None  # {"file", "needed", "runpath" and/or "rpath"}
    torch_libs: dict[str, LoadedLib] = field(default_factory=dict)
    deep: dict[str, Any] | None = None  # `import torch` in a subprocess: version, cuda, error, loaded
    transformers_models: list[str] | None = None  # the imported transformers' models/ subdirectories
    ldconfig: list[LibEntry] = field(default_factory=list)
    ldconfig_real: dict[str, str] = field(default_factory=dict)  # cache path -> the file it resolves to
    ldconfig_error: str | None = None
    ld_library_path: list[str] = field(default_factory=list)
    # LD_LIBRARY_PATH directory -> the followed files in it (None: unreadable, or a capture)
    ld_library_libs: dict[str, list[str] | None] = field(default_factory=dict)
    ld_preload: list[str] = field(default_factory=list)
    pythonpath: list[PathEntry] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    env_sources: dict[str, str] = field(default_factory=dict)  # variable -> where it was set
    wrapper: list[str] = field(default_factory=list)  # the inventory's container wrapper: fixes run through it
    seconds: float | None = None  # the collector's own time
    errors: list[str] = field(default_factory=list)
    loader: list[LoaderFile] = field(default_factory=list)  # what the loader resolves for the trainer's libraries
    stashes: list[str] = field(default_factory=list)  # pip's ~ stash directories left in a site directory

    def imports(self) -> dict[str, dict[str, Any]]:
        """--deep: each module imported in the child: {"error"?, "version", "loaded"}; {} without --deep."""
        found = (self.deep or {}).get("imports")
        return dict(found) if isinstance(found, dict) else {}

    @property
    def asked(self) -> bool:
        """The host's import system was asked (a capture of pip's output was not)."""
        return bool(self.modules)

    def dist(self, index: int) -> Dist | None:
        """The distribution the collector listed at ``index``."""
        if 0 <= index < len(self.dists) and self.dists[index].index == index:
            return self.dists[index]
        return next((d for d in self.dists if d.index == index), None)

    def owner(self, module: str) -> Dist | None:
        """The distribution whose RECORD lists the file ``module`` is imported from."""
        spec = self.modules.get(module)
        if spec is None or not spec.owners:
            return None
        owners = [self.dist(i) for i in spec.owners]
        declaring = [d for d in owners if d is not None and module in d.modules]
        return (declaring or [d for d in owners if d is not None] or [None])[0]

    def installed(self) -> dict[str, Dist]:
        """The distribution of each name that Python imports: the copy that owns one
        of its top-level modules as the import system finds them, else (no module
        asked about, or none found) the first of that name on sys.path."""
        found: dict[str, Dist] = {}
        for d in self.dists:
            if d.key:
                found.setdefault(d.key, d)
        if not self.asked:
            return found
        copies: dict[str, list[Dist]] = {}
        for d in self.dists:
            if d.key:
                copies.setdefault(d.key, []).append(d)
        for key, dists in copies.items():
            if len(dists) < 2:
                continue
            for d in dists:
                if any((o := self.owner(m)) is not None and o is d for m in d.modules):
                    found[key] = d
                    break
        return found

    def copies(self, name: str) -> list[Dist]:
        key = canonicalize_name(name)
        return [d for d in self.dists if d.key == key]

    def packages(self) -> dict[str, str]:
        """name -> version of what is imported: the package set stored for drift checks."""
        return {d.name: d.version for d in self.installed().values()}


# The collector's answer is framed by these (its FRAME): code a .pth file runs may print before and after it.
FRAME = ("<<dflashctl-env-audit>>", "<</dflashctl-env-audit>>")


def framed(stdout: str) -> str:
    """The collector's answer in its stdout: between the last frame start and the
    frame end after it (ValueError when there is none)."""
    start = stdout.rfind(FRAME[0])
    end = stdout.find(FRAME[1], start)
    if start < 0 or end < 0:
        raise ValueError("no framed env-audit answer")
    return stdout[start + len(FRAME[0]):end]


def parse_snapshot(stdout: str, host: str) -> Snapshot:
    """The collector's JSON -> Snapshot. Raises ValueError when it is not the collector's output."""
    raw = json.loads(framed(stdout))
    if not isinstance(raw, dict) or raw.get("v") != SNAPSHOT_VERSION:
        raise ValueError("not an env-audit answer")
    py = raw.get("python") or {}
    torch = raw.get("torch") or {}
    ldconfig = raw.get("ldconfig") or {}
    env = raw.get("env") or {}
    ld_dirs = raw.get("ld_library_path") or []
    return Snapshot(
        host=host,
        hostname=raw.get("hostname"),
        python=py.get("executable"),
        python_version=py.get("version"),
        prefix=py.get("prefix"),
        base_prefix=py.get("base_prefix"),
        sys_path=list(py.get("path") or []),
        dropped_path=py.get("dropped_path"),
        site_packages=list(py.get("site_packages") or []),
        user_site=py.get("user_site"),
        user_site_enabled=bool(py.get("user_site_enabled")),
        markers=dict(raw.get("markers") or {}),
        dists=[_dist(i, d) for i, d in enumerate(raw.get("distributions") or [])],
        modules={name: (ModuleSpec(name, m.get("origin"), list(m.get("owners") or []), m.get("entry"),
                                   bool(m.get("namespace")), m.get("error"), m.get("finder"))
                        if m is not None else None)
                 for name, m in (raw.get("modules") or {}).items()},
        shared=[SharedFiles(list(g["owners"]), int(g["count"]), list(g.get("paths") or []), g.get("holder"))
                for g in raw.get("shared_files") or []],
        pth=[PthFile(p["file"], list(p.get("adds") or []), bool(p.get("code")), p.get("text") or "")
             for p in raw.get("pth") or []],
        torch_dir=torch.get("dir"),
        torch_version_py=torch.get("version_py"),
        torch_elf=torch.get("elf"),
        torch_libs={n: LoadedLib(n, v.get("path"), v.get("via")) for n, v in (torch.get("libs") or {}).items()},
        deep=raw.get("deep"),
        transformers_models=((raw.get("transformers") or {}).get("models")),
        ldconfig=parse_ldconfig(ldconfig.get("text") or ""),
        ldconfig_real=dict(ldconfig.get("real") or {}),
        ldconfig_error=ldconfig.get("error"),
        ld_library_path=[e["path"] for e in ld_dirs],
        ld_library_libs={e["path"]: e.get("libs") for e in ld_dirs},
        ld_preload=[p for p in re.split(r"[:\s]+", env.get("LD_PRELOAD", "")) if p],
        pythonpath=[PathEntry(**e) for e in raw.get("pythonpath") or []],
        env=dict(env),
        seconds=raw.get("seconds"),
        errors=list(raw.get("errors") or []),
        loader=[LoaderFile(f["path"], f.get("via") or "", f.get("needed_by") or "", list(f.get("owners") or []))
                for f in raw.get("loader") or []],
        stashes=[str(p) for p in raw.get("stashes") or []],
    )


def _dist(index: int, d: dict[str, Any]) -> Dist:
    return Dist(
        d.get("name") or "", d.get("version") or "", d.get("location"), d.get("requires"), d.get("modules") or [],
        d.get("libs"), index, d.get("metadata"), d.get("files"), list(d.get("missing") or []),
        int(d.get("missing_count") or 0), list(d.get("changed") or []), int(d.get("changed_count") or 0),
        d.get("installer"), bool(d.get("editable")), d.get("error"), list(d.get("denied") or []),
        int(d.get("denied_count") or 0), list(d.get("dangling") or []), int(d.get("dangling_count") or 0),
        dict(d.get("shebangs") or {}),
    )


def parse_ldconfig(text: str) -> list[LibEntry]:
    """``ldconfig -p`` lines -> entries, in cache order (the first of a soname is the one found)."""
    entries = []
    for line in text.splitlines():
        m = _LDCONFIG_LINE.match(line)
        if m:
            entries.append(LibEntry(m.group(1), m.group(3)))
    return entries
