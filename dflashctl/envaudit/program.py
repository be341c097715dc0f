"""The fix plan as a program over a model of the environment, proven before it is
printed.

The model is what the snapshot knows: every dist-info on disk (by its index, in
sys.path order), every file listed by more than one RECORD with whose bytes it
holds (``SharedFiles.holder``: the owner whose RECORD size and sha256 it matches),
the version of each name, which distributions lie outside the environment pip
can change (a system-site-packages venv's base). Each command a finding gives
(``Fixer``'s argv: ``pip uninstall``, ``pip install``, ``pip install
--force-reinstall``, ``rm -r -- DIST-INFO``, ``ensurepip``) is an operation on
it, with pip's effect: an uninstall deletes every file the RECORD lists (shared
ones too), an install or reinstall writes its wheel's files over whatever is
there, a dist-info removed deletes no file.

``prove`` walks the findings worst first and keeps a finding's commands only
when the whole sequence kept so far, with them added, in the order the plan runs
it, ends no worse on any count (``Counts``: protected files missing or holding
another wheel's bytes, protected packages gone, protected packages downgraded,
strays present, the trainer's missing requirements) and breaks no rule of the
program (nothing reinstalled that it uninstalled, no uninstall outside the
environment, no protected package uninstalled). A finding whose commands fail
that keeps its words and loses its commands, with the reason. Information
findings' commands are proven against the plan too but never join it.

``plan`` renders the kept commands in the order they must run, each once: pip
where it is missing, what makes pip itself fail, then every wheel the plan will
install fetched (``pip download --no-deps``; nothing has changed yet when one
cannot be fetched) into a directory the plan makes itself (``mkdir -m 700``: a
name no one can guess; one another user made first stops the plan before a wheel
lands in it), then the uninstalls, the installs
and the reinstalls, those from that directory only (``--no-index``), then the
dist-infos removed (a stray detached once the files it shares hold the
protected wheel's bytes again, a stale second dist-info). The plan stops at the
first command that fails.

Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Iterable

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from dflashctl.envaudit.fixes import Fixer, only_inits
from dflashctl.envaudit.snapshot import Dist, Snapshot

if TYPE_CHECKING:
    from dflashctl.envaudit.findings import Finding

# The order operations run in; ``fetch`` is rendered from the installs, never given.
STAGES = ("unpip", "ensurepip", "unblock", "fetch", "uninstall", "unlink", "install", "reinstall", "adopt",
          "rm-dist-info", "rm-stash", "scripts")
FETCHED = ("install", "reinstall", "adopt")  # the operations whose wheels the plan fetches first
# Where a printed plan fetches its wheels: a name no one can guess before it is printed
# (``new_wheels_dir``), made by the plan's own ``mkdir -m 700``. ``--apply`` fetches into a
# directory it made on the host with mkdtemp instead.
WHEELS_DIR = "/tmp/dflashctl-env-fix-{token}"


def new_wheels_dir() -> str:
    import secrets

    return WHEELS_DIR.format(token=secrets.token_hex(8))


@dataclass(frozen=True)
class Op:
    """One command as an operation on the model."""

    kind: str  # a STAGES entry
    prefix: tuple[str, ...]  # what comes before "-m": [env PYTHONNOUSERSITE=1] python
    names: tuple[str, ...] = ()  # uninstall: the names; install / reinstall: the specs' names
    specs: tuple[str, ...] = ()  # install / reinstall
    index: tuple[str, ...] = ()  # --index-url URL, for the fetch
    path: str | None = None  # rm-dist-info: the directory

    def argv(self) -> list[str]:
        """The command as a finding gives it (fetched from an index, not from the plan's directory)."""
        if self.kind in ("rm-dist-info", "unblock", "unpip", "rm-stash"):
            return ["rm", "-r", "--", self.path or ""]
        if self.kind == "scripts":
            return ["sed", "-i", *self.specs]
        if self.kind == "unlink":
            return ["find", self.path or "", "-xtype", "l", "-delete"]
        if self.kind == "ensurepip":
            return [*self.prefix, "-m", "ensurepip"]
        if self.kind == "uninstall":
            return [*self.prefix, "-m", "pip", "uninstall", "-y", *self.names]
        force = {"reinstall": ["--force-reinstall", "--no-deps"], "adopt": ["--ignore-installed", "--no-deps"]}.get(
            self.kind, [])
        return [*self.prefix, "-m", "pip", "install", *force, *self.index, *self.specs]


def parse_op(argv: list[str], snapshot: Snapshot) -> Op | None:
    """A Fixer command as an operation; None for anything the model does not know."""
    if argv[:1] == ["find"] and argv[2:] == ["-xtype", "l", "-delete"] and len(argv) == 5:
        return Op("unlink", (), path=argv[1])  # dangling symlinks only: their targets are gone already
    if argv[:2] == ["sed", "-i"] and len(argv) > 3 and argv[2].startswith("1s|^#!"):
        return Op("scripts", (), specs=tuple(argv[2:]))  # #! lines of console scripts: no package changes
    if argv[:3] == ["rm", "-r", "--"] and len(argv) == 4 and argv[3] in snapshot.stashes:
        return Op("rm-stash", (), path=argv[3])  # a pip stash directory: no package lists it
    if argv[:3] == ["rm", "-r", "--"] and len(argv) == 4:
        d = next((d for d in snapshot.dists if d.metadata == argv[3]), None)
        if d is None:
            return None
        return Op("unpip" if d.key == "pip" else "unblock" if d.unreadable else "rm-dist-info", (), path=argv[3])
    if "-m" not in argv:
        return None
    at = argv.index("-m")
    prefix, module, rest = tuple(argv[:at]), argv[at + 1:at + 2], argv[at + 2:]
    if module == ["ensurepip"] and not rest:
        return Op("ensurepip", prefix)
    if module != ["pip"]:
        return None
    if rest[:2] == ["uninstall", "-y"] and len(rest) > 2:
        return Op("uninstall", prefix, names=tuple(rest[2:]))
    if rest[:1] != ["install"]:
        return None
    rest = rest[1:]
    kind = "install"
    if rest[:2] == ["--force-reinstall", "--no-deps"]:
        kind, rest = "reinstall", rest[2:]
    elif rest[:2] == ["--ignore-installed", "--no-deps"]:
        kind, rest = "adopt", rest[2:]
    index: tuple[str, ...] = ()
    if rest[:1] == ["--index-url"] and len(rest) > 1:
        index, rest = tuple(rest[:2]), rest[2:]
    if not rest or any(a.startswith("-") for a in rest):
        return None
    try:
        names = tuple(Requirement(s).name for s in rest)
    except InvalidRequirement:
        return None
    return Op(kind, prefix, names=names, specs=tuple(rest), index=index)


# --------------------------------------------------------------------------- the model


@dataclass
class Counts:
    """What a plan must never make worse (lower is better)."""

    damaged_files: int = 0  # protected files missing or holding another wheel's bytes
    protected_gone: int = 0  # protected packages with no dist-info left
    downgraded: int = 0  # protected packages moved to a lower version
    strays: int = 0  # packages a finding asks to remove that are there
    missing_required: int = 0  # the trainer's requirements not installed
    loader_files: int = 0  # files the loader resolves for the trainer, missing or foreign at the worst step

    WORDS = {
        "loader_files": "delete or overwrite {n} file(s) the loader resolves for torch or the trainer "
                        "(listed by a RECORD of theirs or not)",
        "damaged_files": "delete or overwrite {n} file(s) of the wheels torch and the trainer need",
        "protected_gone": "remove {n} package(s) torch or the trainer needs",
        "downgraded": "downgrade {n} package(s) torch or the trainer needs",
        "strays": "put back {n} package(s) another fix removes",
        "missing_required": "leave {n} requirement(s) of the trainer missing",
    }

    def worse_than(self, other: "Counts") -> list[str]:
        """In words, every count that is higher here than in ``other``."""
        return [self.WORDS[k].format(n=getattr(self, k) - getattr(other, k)) for k in self.WORDS
                if getattr(self, k) > getattr(other, k)]


class Violation(Exception):
    """An operation the program never runs (its message says why)."""


@dataclass
class _Group:
    owners: set[int]
    count: int
    holder: int | None
    inits: bool = False  # only package __init__.py files: whose bytes they hold changes no import


@dataclass
class _Loaded:
    """A file the loader resolves for the trainer, as the plan changes it: the
    RECORDs that list it, and what it holds: "as-is" (the bytes torch loads now),
    "own" (a protected wheel's, or its listing wheel's own bytes again), "deleted",
    "foreign" (another wheel's)."""

    owners: set[int]
    state: str = "as-is"

    @property
    def hurt(self) -> bool:
        return self.state in ("deleted", "foreign")


@dataclass
class Model:
    """The environment as the plan changes it."""

    snapshot: Snapshot
    protected: set[str]
    strays: set[str]
    present: dict[int, Dist] = field(default_factory=dict)
    groups: list[_Group] = field(default_factory=list)
    uninstalled: set[str] = field(default_factory=set)
    downgraded: set[str] = field(default_factory=set)
    installed: set[str] = field(default_factory=set)  # names the plan installed where none was
    next_index: int = 0
    start_missing: set[str] = field(default_factory=set)  # the trainer's requirements missing at the start
    loaded: dict[str, _Loaded] = field(default_factory=dict)  # the loader's files, by path
    loader_worst: int = 0  # the most loader files hurt after any step so far
    loader_hurt: set[str] = field(default_factory=set)  # every loader file hurt at some step

    @classmethod
    def of(cls, snapshot: Snapshot, protected: set[str], strays: set[str]) -> "Model":
        m = cls(snapshot, protected, strays)
        m.present = {d.index: d for d in snapshot.dists}
        m.groups = [_Group(set(g.owners), g.count, g.holder, only_inits(g)) for g in snapshot.shared]
        m.next_index = max([d.index for d in snapshot.dists] + [len(snapshot.dists)]) + 1
        m.start_missing = {canonicalize_name(n) for n in _missing_requirements(snapshot)}
        m.loaded = {f.path: _Loaded(set(f.owners)) for f in snapshot.loader}
        return m

    def copy(self) -> "Model":
        m = replace(self, present=dict(self.present), groups=[replace(g, owners=set(g.owners)) for g in self.groups],
                    uninstalled=set(self.uninstalled), downgraded=set(self.downgraded),
                    installed=set(self.installed), loaded={p: replace(f, owners=set(f.owners))
                                                           for p, f in self.loaded.items()},
                    loader_hurt=set(self.loader_hurt))
        return m

    def target(self, name: str) -> Dist | None:
        """The copy pip acts on: the first present of that name on sys.path."""
        key = canonicalize_name(name)
        return next((d for i, d in sorted(self.present.items()) if d.key == key), None)

    def changeable(self, d: Dist) -> bool:
        """Whether pip of this environment changes ``d`` (not a base copy of a
        system-site-packages venv, not a directory PYTHONPATH or a .pth adds)."""
        prefix = (self.snapshot.prefix or "").rstrip("/")
        if d.index >= len(self.snapshot.dists) or not prefix or not d.location:
            return True
        return d.location == prefix or d.location.startswith(prefix + "/")

    # ----------------------------------------------------------------- operations

    def run(self, op: Op) -> None:
        """One operation, then the loader's files checked: the plan must keep
        them after every step, not only at its end (a step that breaks `import
        torch` is undone by --apply, and the plan never finishes)."""
        getattr(self, "_" + op.kind.replace("-", "_"))(op)
        hurt = {p for p, f in self.loaded.items() if f.hurt}
        self.loader_hurt |= hurt
        self.loader_worst = max(self.loader_worst, len(hurt))

    def _ensurepip(self, op: Op) -> None:
        pass

    def _rm_dist_info(self, op: Op) -> None:
        d = next((d for d in self.present.values() if d.metadata == op.path), None)
        if d is None:
            raise Violation(f"{op.path} is not a dist-info of this environment")
        del self.present[d.index]
        for g in self.groups:
            g.owners.discard(d.index)  # its files stay, with whatever bytes they hold
        for f in self.loaded.values():
            f.owners.discard(d.index)

    _unblock = _unpip = _rm_dist_info

    _rm_stash = _scripts = _unlink = _ensurepip  # no package changes

    def _adopt(self, op: Op) -> None:
        """The same wheel written over a copy pip cannot uninstall (no RECORD): its
        files and its dist-info, with a RECORD now; nothing removed first."""
        for spec, name in zip(op.specs, op.names):
            old = self.target(name)
            if old is None or old.version != _pinned(Requirement(spec)):
                raise Violation(f"{spec} is not the version of {name} that is installed")
            self._rewrite_loaded(old, old)

    def _delete(self, d: Dist, replaced: bool = False) -> None:
        """pip's uninstall of ``d`` (``replaced``: before its new version is written over the same paths)."""
        del self.present[d.index]
        for g in self.groups:
            if d.index in g.owners:
                g.owners.discard(d.index)
                g.holder = -1  # pip deletes every file the RECORD lists, shared or not
        for f in self.loaded.values():
            if d.index in f.owners:
                if not replaced:
                    f.owners.discard(d.index)
                f.state = "deleted"

    def _write(self, new: Dist, old: Dist | None) -> None:
        """A wheel's files written: over the old copy's shared files (the same paths)."""
        self.present[new.index] = new
        for g in self.groups:
            if old is not None and old.index in g.owners:
                g.owners.discard(old.index)
                g.owners.add(new.index)
            if new.index in g.owners:
                g.holder = new.index
        if old is not None:
            self._rewrite_loaded(old, new)

    def _rewrite_loaded(self, old: Dist, new: Dist) -> None:
        """The loader's files ``old``'s RECORD lists, written by ``new`` (the same
        name): a protected wheel's bytes are the ones torch wants; another wheel's
        are its own again only for the same version whose RECORD matched the disk."""
        base = (old.location or "").rstrip("/") + "/"
        for path, f in self.loaded.items():
            if old.index not in f.owners:
                continue
            f.owners.discard(old.index)
            f.owners.add(new.index)
            unchanged = old.version == new.version and not old.changed_count and not old.missing_count \
                and path.startswith(base)
            f.state = "own" if new.key in self.protected or unchanged else "foreign"

    def _uninstall(self, op: Op) -> None:
        for name in op.names:
            d = self.target(name)
            if d is None:
                raise Violation(f"{name} is uninstalled twice")
            if d.key in self.protected:
                raise Violation(f"{name} is required by torch or the trainer")
            if not self.changeable(d):
                raise Violation(f"{d.label()} lies outside the environment ({d.location}): pip of this python "
                                "does not uninstall it")
            self._delete(d)
            self.uninstalled.add(d.key)

    def _install(self, op: Op) -> None:
        for spec, name in zip(op.specs, op.names):
            key = canonicalize_name(name)
            old = self.target(name)
            requirement = Requirement(spec)
            if old is not None and _contains(requirement, old.version):
                continue  # already satisfied: pip leaves it
            if key in self.uninstalled:
                raise Violation(f"{name} is installed again after it is uninstalled")
            if old is not None and not self.changeable(old):
                raise Violation(f"{old.label()} lies outside the environment ({old.location})")
            if old is not None and key in self.protected and _lowers(requirement, old.version):
                self.downgraded.add(key)
            if old is not None:
                self._delete(old, replaced=True)
            elif key not in {d.key for d in self.present.values()}:
                self.installed.add(key)
            self._write(self._new(name, _pinned(requirement) or (old.version if old else ""), old), old)

    def _reinstall(self, op: Op) -> None:
        for spec, name in zip(op.specs, op.names):
            key = canonicalize_name(name)
            if key in self.uninstalled:
                raise Violation(f"{name} is reinstalled after it is uninstalled")
            old = self.target(name)
            if old is not None and not self.changeable(old):
                raise Violation(f"{old.label()} lies outside the environment ({old.location})")
            version = _pinned(Requirement(spec)) or ""
            if old is not None and old.version == version:
                self.present[old.index] = old
                for g in self.groups:
                    if old.index in g.owners:
                        g.holder = old.index
                self._rewrite_loaded(old, old)
                continue
            if old is not None:
                if key in self.protected and _lower(version, old.version):
                    self.downgraded.add(key)
                self._delete(old, replaced=True)
            else:
                self.installed.add(key)
            self._write(self._new(name, version, old), old)

    def _new(self, name: str, version: str, old: Dist | None) -> Dist:
        d = Dist(name, version, old.location if old else None, index=self.next_index)
        self.next_index += 1
        return d

    # ----------------------------------------------------------------- counts

    def counts(self) -> Counts:
        c = Counts()
        keys = {d.key for d in self.present.values()}
        for g in self.groups:
            keepers = {i for i in g.owners if i in self.present and self.present[i].key in self.protected}
            if keepers and g.holder not in keepers and not g.inits:
                c.damaged_files += g.count
        c.protected_gone = len({k for k in self.protected if k in self.start_keys} - keys)
        c.downgraded = len(self.downgraded)
        c.strays = len(self.strays & keys)
        c.missing_required = len(self.start_missing - keys)
        c.loader_files = self.loader_worst
        return c

    @property
    def start_keys(self) -> set[str]:
        return {d.key for d in self.snapshot.dists if d.key}


def _missing_requirements(snapshot: Snapshot) -> list[str]:
    from dflashctl.envaudit.stack import requirement_checks

    return [c.requirement.name for c in requirement_checks(snapshot) if c.installed is None]


def _contains(requirement: Requirement, version: str) -> bool:
    try:
        return requirement.specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def _pinned(requirement: Requirement) -> str | None:
    return next((s.version for s in requirement.specifier if s.operator in ("==", "===")
                 and not s.version.endswith(".*")), None)


def _lower(a: str, b: str) -> bool:
    try:
        return Version(a) < Version(b)
    except InvalidVersion:
        return False


def _lowers(requirement: Requirement, current: str) -> bool:
    """Whether every version ``requirement`` accepts is lower than ``current`` (an
    upper bound or a pin below it)."""
    for s in requirement.specifier:
        base = s.version.removesuffix(".*")
        if s.operator in ("<", "<=", "==", "~=", "===") and not s.contains(current, prereleases=True) \
                and _lower(base, current):
            return True
    return False


# --------------------------------------------------------------------------- the program


def _ordered(ops: Iterable[Op]) -> list[Op]:
    """The operations in the order they run, each once (an uninstall's names once
    over the whole plan)."""
    seen: set[tuple] = set()
    named: set[str] = set()
    buckets: dict[str, list[Op]] = {s: [] for s in STAGES}
    for op in ops:
        if op.kind == "uninstall":
            names = tuple(n for n in op.names if canonicalize_name(n) not in named)
            named |= {canonicalize_name(n) for n in names}
            if not names:
                continue
            op = replace(op, names=names)
        key = (op.kind, op.prefix, op.specs, op.names, op.path)
        if key in seen:
            continue
        seen.add(key)
        buckets[op.kind].append(op)
    return [op for s in STAGES for op in buckets[s]]


def simulate(model: Model, ops: list[Op]) -> Model:
    """The model after ``ops`` in order (raises Violation)."""
    after = model.copy()
    for op in ops:
        after.run(op)
    return after


@dataclass
class Proof:
    """What ``prove`` decided: the operations kept, in order, and why each refused finding was refused."""

    ops: list[Op]
    start: Counts
    end: Counts
    refused: dict[int, str] = field(default_factory=dict)  # id(finding) -> why


def prove(findings: list["Finding"], snapshot: Snapshot, protected: set[str], *, refuse: str = "") -> Proof:
    """Keep each finding's commands only where the plan with them stays safe (see
    the module docstring); the findings refused lose their commands, in place.
    ``refuse``: why no command at all is given (the trainer cannot run on this
    interpreter, whatever its packages)."""
    strays = {canonicalize_name(n) for f in findings for n in f.remove}
    model = Model.of(snapshot, protected, strays)
    kept: list[Op] = []
    best = model.counts()
    start = best
    refused: dict[int, str] = {}
    for f in sorted(findings, key=lambda f: f.severity == "info"):  # stable: worst first, information last
        if not f.argv:
            continue
        ops = [parse_op(a, snapshot) for a in f.argv]
        why = ""
        if refuse:
            why = refuse
        elif any(op is None for op in ops):
            why = "a command the plan cannot simulate"
        else:
            try:
                after = simulate(model, _ordered([*kept, *ops]))
                counts = after.counts()
                worse = counts.worse_than(best)
                if counts.loader_files > best.loader_files:
                    names = sorted(short for short in (p.rsplit("/", 1)[-1] for p in after.loader_hurt))
                    worse = [w + f" ({', '.join(names[:4])})" if w.startswith("delete or overwrite") and
                             "loader" in w else w for w in worse]
                if worse:
                    why = "run with the rest of the plan it would " + " and ".join(worse)
                elif f.severity != "info":
                    kept, best = _ordered([*kept, *ops]), counts
            except Violation as e:
                why = str(e)
        if why:
            refused[id(f)] = why
            f.fix = (f.fix + "; " if f.fix else "") + f"no command is given: {why}"
            f.argv, f.commands, f.remove = [], [], []
    return Proof(kept, start, best, refused)


def plan(findings: list["Finding"], snapshot: Snapshot, protected: set[str],
         wheels: str | None = None, wheels_from: str | None = None) -> list[tuple[list[str], str]]:
    """The commands of every finding that is not information, in the order they
    must run, fetch first (see the module docstring), the wheels fetched into
    ``wheels`` (a new ``new_wheels_dir`` when None), which the plan makes: (argv,
    shell line). ``wheels_from``: a directory on the host the wheels are fetched
    from instead of an index (what was carried to an air-gapped host)."""
    fixer = Fixer(snapshot, protected)
    ops = _ordered(op for f in findings if f.severity != "info" for a in f.argv
                   if (op := parse_op(a, snapshot)) is not None)
    if ops and not any(op.kind == "ensurepip" for op in ops):
        ops[:0] = [op for a in fixer.pip_repair() if (op := parse_op(a, snapshot)) is not None]
    fetched = [op for op in ops if op.kind in FETCHED]
    wheels = wheels or new_wheels_dir()
    pins = _pins(snapshot, protected, {canonicalize_name(n) for op in fetched for n in op.names})
    argv: list[list[str]] = []
    for op in ops:
        if fetched and STAGES.index(op.kind) > STAGES.index("fetch"):
            argv.append(["mkdir", "-m", "700", "--", wheels])  # fails, stopping the plan, if it exists
            argv += [[*f.prefix, "-m", "pip", "download", *(["--no-deps"] if f.kind != "install" else []),
                      "--dest", wheels, *(["--no-index", "--find-links", wheels_from] if wheels_from else f.index),
                      *f.specs] for f in fetched]
            fetched = []
        if op.kind in ("reinstall", "adopt"):
            argv.append([*op.prefix, "-m", "pip", "install", "--no-index", "--find-links", wheels, "--no-deps",
                         "--force-reinstall" if op.kind == "reinstall" else "--ignore-installed", *op.specs])
        elif op.kind == "install":
            # Its requirements resolved by pip, from the fetched wheels, every package torch and the
            # trainer have pinned where it is: pip refuses, changing nothing, rather than replace one.
            argv.append([*op.prefix, "-m", "pip", "install", "--no-index", "--find-links", wheels, *op.specs, *pins])
        else:
            argv.append(op.argv())
    return [(a, fixer.shell(a)) for a in argv]


def _pins(snapshot: Snapshot, protected: set[str], changing: set[str]) -> list[str]:
    """NAME==VERSION of every protected distribution installed that the plan does not install."""
    pins = []
    for key, d in sorted(snapshot.installed().items()):
        if key not in protected or key in changing or not (d.name and d.version):
            continue
        try:
            Version(d.version)
        except InvalidVersion:
            continue
        pins.append(d.spec())
    return pins
