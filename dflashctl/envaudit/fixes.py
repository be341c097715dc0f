"""Fixes as exact commands, simulated before they are suggested.

A fix is a list of argv lists run inside the host (``/path/python -m pip ...``,
the host's own python, never a bare ``pip``), shown as shell lines that go through
the inventory's container wrapper (``pct exec 200 -- /opt/venv/bin/python -m pip
...``), so each can be pasted as it is.

Every uninstall is simulated first against the files the host's distributions
list in their RECORDs: ``pip uninstall`` deletes every file its RECORD lists, so
removing a stray that shares files with a protected distribution (torch, what it
requires, the trainer's requirements) deletes that distribution's files too. Such
a removal is the uninstall followed by the force-reinstall of every protected
wheel that loses files, in that order, and the fix says why; a protected
distribution is never uninstalled, and a removal whose damage cannot be repaired
(the protected wheel has no name or version to reinstall) is not suggested.

Pure: no I/O; the commands are data, run by whoever reads them.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Iterable

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from dflashctl.envaudit.snapshot import Dist, Snapshot

# A local version label that only PyTorch's own index serves (torch 2.7.1+cu128).
_PYTORCH_LABEL = re.compile(r"^(cu\d+|cpu|rocm[\d.]+|xpu)$")
PYTORCH_INDEX = "https://download.pytorch.org/whl/{label}"
# A package's __init__.py, or its compiled copy (pip compiles on install and lists it in the RECORD).
_INIT = re.compile(r"/(?:__init__\.py|__pycache__/__init__\.[\w-]+\.pyc)$")


def index_args(version: str) -> list[str]:
    """``--index-url`` for a version only PyTorch's index has (a +cu128 label), else []."""
    try:
        local = Version(version).local
    except InvalidVersion:
        return []
    return ["--index-url", PYTORCH_INDEX.format(label=local)] if local and _PYTORCH_LABEL.match(local) else []


def short_path(path: str, dist: Dist | None) -> str:
    """A file as its RECORD names it (relative to the distribution's location) when it lies there."""
    base = (dist.location or "").rstrip("/") if dist else ""
    return path[len(base) + 1:] if base and path.startswith(base + "/") else path


def listing(items: list[str], shown: int = 6) -> str:
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


@dataclass
class Removal:
    """What uninstalling some distributions does, as a fix."""

    names: list[str]  # uninstalled
    kept: list[str]  # protected: never uninstalled
    blocked: list[str]  # not uninstalled: the files they share cannot be put back
    reinstalled: list[Dist]  # protected wheels that lose files, reinstalled after the uninstall
    argv: list[list[str]] = field(default_factory=list)
    why: str = ""  # the files that make the reinstall necessary, in words; "" when none
    detached: list[str] = field(default_factory=list)  # of ``names``: their dist-info removed, not uninstalled


def only_inits(group) -> bool:
    """A group of shared files that are all package ``__init__.py`` files (what every
    wheel of a namespace like ``nvidia`` lists, and their compiled copies): deleting them changes no import,
    so sharing them is no reason to detach instead of uninstalling."""
    return group.count == len(group.paths) and all(_INIT.search(p) for p in group.paths)


def pip_problem(snapshot: Snapshot) -> str | None:
    """Why this python's pip cannot run a fix: "missing" (not installed: a venv
    made by uv or --without-pip), the reason it is broken (its dist-info is there
    but its package is gone, or its code fails to import, --deep), or None."""
    if not snapshot.asked or "pip" not in snapshot.modules:
        return None
    listed = [d for d in snapshot.copies("pip") if d.metadata]
    if snapshot.modules["pip"] is None:
        return (f"{listed[0].label()} is listed ({listed[0].metadata}) but its package is gone"
                if listed else "missing")
    error = (snapshot.deep or {}).get("pip")
    if error:
        return f"pip's code fails to import: {error}"
    return None


class Fixer:
    """Commands for one snapshot's host: its python, its wrapper, its protected set."""

    def __init__(self, snapshot: Snapshot, protected: set[str]):
        self.s = snapshot
        self.protected = protected
        self.python = snapshot.python or "python3"
        self.pip_problem = pip_problem(snapshot)
        self.without_pip = self.pip_problem is not None
        self.can_ensurepip = not (snapshot.asked and "ensurepip" in snapshot.modules
                                  and snapshot.modules["ensurepip"] is None)

    def pip_repair(self) -> list[list[str]]:
        """What puts a working pip in place, in order: a broken pip's dist-info
        removed first (``ensurepip`` does nothing while one is there), then
        ``python -m ensurepip``; [] when pip works, or when this python has no
        ensurepip (the pip-unusable finding says what to carry instead)."""
        if not self.without_pip or not self.can_ensurepip:
            return []
        infos = [d.metadata for d in self.s.copies("pip") if d.metadata] if self.pip_problem != "missing" else []
        return [*(["rm", "-r", "--", i] for i in infos), [self.python, "-m", "ensurepip"]]

    def commands(self, argv: list[list[str]]) -> list[list[str]]:
        """A fix's commands as they must run: pip repaired first where it is missing or broken."""
        if self.without_pip and any(a[a.index("-m") + 1:a.index("-m") + 2] == ["pip"] for a in argv if "-m" in a):
            return [*self.pip_repair(), *argv]
        return argv

    # ----------------------------------------------------------------- commands

    def pip(self, *args: str, names: Iterable[str] = ()) -> list[str]:
        """``python -m pip ARGS``. When the user site holds another copy of a name the
        command acts on, pip would act on whichever comes first on sys.path: the user
        site is switched off for it (PYTHONNOUSERSITE)."""
        argv = [self.python, "-m", "pip", *args]
        user = self.s.user_site
        if user and self.s.user_site_enabled:
            for name in names:
                copies = self.s.copies(name)
                if any(d.location == user for d in copies) and any(d.location != user for d in copies):
                    return ["env", "PYTHONNOUSERSITE=1", *argv]
        return argv

    def uninstall(self, names: list[str]) -> list[str]:
        return self.pip("uninstall", "-y", *names, names=names)

    def install(self, specs: list[str]) -> list[str]:
        extra = next((index_args(v) for s in specs for v in re.findall(r"===?\s*([^,;\s]+)", s) if index_args(v)), [])
        return self.pip("install", *extra, *specs, names=[re.split(r"[\[<>=!~;\s]", s, 1)[0] for s in specs])

    def reinstall(self, dist: Dist) -> list[str]:
        """The exact wheel again, over whatever is there, without touching its requirements."""
        return self.pip("install", "--force-reinstall", "--no-deps", *index_args(dist.version), dist.spec(),
                        names=[dist.name])

    def shell(self, argv: list[str]) -> str:
        """The command line as typed on the host that runs the wrapper (copy-paste safe)."""
        return shlex.join([*self.s.wrapper, *argv])

    # ----------------------------------------------------------------- removals

    def target(self, name: str) -> Dist | None:
        """The copy ``pip uninstall NAME`` acts on: the first of that name on sys.path."""
        copies = self.s.copies(name)
        return copies[0] if copies else None

    def removal(self, names: Iterable[str]) -> Removal:
        """Uninstall ``names``, simulated: protected names are kept; a name whose
        RECORD shares files with a protected wheel is detached instead (its
        dist-info removed, which deletes no file), after the protected wheel is
        reinstalled where the shared files hold the stray's bytes; protected wheels
        that lose files to an uninstall are reinstalled after it."""
        names = list(dict.fromkeys(names))
        ok = [n for n in names if canonicalize_name(n) not in self.protected]
        kept = [n for n in names if canonicalize_name(n) in self.protected]
        detached = [n for n in ok if (d := self.target(n)) is not None and d.metadata
                    and (self._sharers(d) or self.loads(d))]
        ok = [n for n in ok if n not in detached]
        blocked: list[str] = []
        while True:
            losses, unrepairable = self._losses(ok)
            if not unrepairable:
                break
            blocked += unrepairable
            ok = [n for n in ok if n not in unrepairable]
        repaired = [d for d, _, _, _ in losses]
        for n in detached:
            repaired += [p for p in self._sharers(self.target(n), overwritten=True)
                         if p.name and p.version and p not in repaired]
        argv = ([self.uninstall(ok)] if ok else []) + [self.reinstall(d) for d in repaired] + \
            [["rm", "-r", "--", self.target(n).metadata] for n in detached]
        why = "; ".join(
            f"uninstalling {listing(sorted(by), 3)} deletes {count} file(s) that {d.label()} also lists "
            f"({listing([short_path(p, d) for p in paths], 3)}): {d.name} is reinstalled right after"
            for d, count, paths, by in losses)
        for n in detached:
            d = self.target(n)
            sharers = self._sharers(d)
            loaded = self.loads(d)
            if sharers:
                what = (f"files that {listing([s.label() for s in sharers], 2)} also lists"
                        f"{', which are put back first' if self._sharers(d, overwritten=True) else ''}")
            else:
                what = (f"{listing([f.name for f in loaded], 3)}, which the loader resolves for "
                        f"{listing(sorted({f.needed_by.rsplit('/', 1)[-1] for f in loaded}), 2)} (no RECORD of "
                        "torch's wheels lists it)")
            why += ("; " if why else "") + (
                f"{n} is detached, not uninstalled: its RECORD lists {what}, and "
                f"`pip uninstall {n}` would delete {'them' if sharers or len(loaded) > 1 else 'it'}; only its dist-info ({d.metadata}) is removed, its other "
                "files stay on disk, listed by no distribution")
        return Removal(ok + detached, kept, blocked, repaired, argv, why, detached)

    def loads(self, d: Dist) -> list:
        """The files the loader resolves for the trainer that ``d``'s RECORD lists
        and no protected RECORD does: `pip uninstall` of ``d`` deletes them, and no
        reinstall puts them back."""
        return [f for f in self.s.loader if d.index in f.owners
                and not any((o := self.s.dist(i)) is not None and self._is_protected(o) for i in f.owners)]

    def _sharers(self, d: Dist, overwritten: bool = False) -> list[Dist]:
        """Protected distributions that list files ``d`` lists (``overwritten``: only
        those whose shared files do not hold their own bytes)."""
        found: list[Dist] = []
        for group in self.s.shared:
            if d.index not in group.owners or only_inits(group):
                continue
            for i in group.owners:
                p = self.s.dist(i)
                if p is None or i == d.index or not self._is_protected(p) or p in found:
                    continue
                if not overwritten or group.holder != i:
                    found.append(p)
        return found

    def _losses(self, names: list[str]) -> tuple[list[tuple[Dist, int, list[str], set[str]]], list[str]]:
        """Protected distributions losing files when ``names`` are uninstalled, in
        sys.path order: (dist, file count, first paths, names that take them); and
        the names whose losses cannot be repaired."""
        removed = {d.index: n for n in names if (d := self.target(n)) is not None and d.index >= 0}
        losses: dict[int, tuple[Dist, int, list[str], set[str]]] = {}
        unrepairable: list[str] = []
        for group in self.s.shared:
            takers = [removed[i] for i in group.owners if i in removed]
            if not takers:
                continue
            for i in group.owners:
                d = self.s.dist(i)
                if i in removed or d is None or not self._is_protected(d):
                    continue
                if not (d.name and d.version):
                    unrepairable += [t for t in takers if t not in unrepairable]
                    continue
                _, count, paths, by = losses.get(i, (d, 0, [], set()))
                losses[i] = (d, count + group.count, paths + group.paths, by | set(takers))
        return [losses[i] for i in sorted(losses)], unrepairable

    def _is_protected(self, d: Dist) -> bool:
        if d.key:
            return d.key in self.protected
        return True  # a distribution without a name may be anything: treated as the trainer's
