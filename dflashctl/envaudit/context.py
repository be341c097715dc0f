"""What every rule reads, computed once per audit: ``_Context``.

The snapshot with torch's build, its requirement checks, the protected
distributions and the ``Fixer``; helpers for a finding's words. And
``crash_signature``: what `import torch` prints without a library.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterable

from packaging.utils import canonicalize_name

from dflashctl.envaudit.findings import Finding, Policy
from dflashctl.envaudit.fixes import Fixer, Removal
from dflashctl.envaudit.snapshot import TRAINER_MODULES, Dist, Snapshot
from dflashctl.envaudit.stack import ReqCheck, protected, requirement_checks, torch_build


class _Context:
    """What every rule needs, computed once per audit."""

    def __init__(self, snapshot: Snapshot, device: str | None, host_gpus: int | None, policy: Policy):
        self.s = snapshot
        self.device = device
        self.host_gpus = host_gpus
        self.policy = policy
        self.installed = snapshot.installed()
        self.torch = torch_build(snapshot)
        self.checks = requirement_checks(snapshot)
        self.protected = protected(snapshot, self.checks)
        self.allowed = {canonicalize_name(a) for a in policy.allow}
        self.fixer = Fixer(snapshot, self.protected)
        declared: dict[str, Dist] = {}
        for d in snapshot.dists:
            for m in d.modules:
                if d.key:
                    declared.setdefault(m, d)
        self.declared = declared  # module -> the first named distribution listing it

    def finding(self, severity: str, code: str, message: str, *, fix: str | None = None,
                argv: Iterable[list[str]] = (), packages: Iterable[str] = (), libraries: Iterable[str] = (),
                paths: Iterable[str] = (), remove: Iterable[str] = (), detail: dict[str, Any] | None = None) -> Finding:
        argv = self.fixer.commands([list(a) for a in argv])
        return Finding(severity, code, message, fix, [self.fixer.shell(a) for a in argv], argv, list(packages),
                       list(libraries), list(paths), list(remove), detail or {})

    def is_protected(self, d: Dist | None) -> bool:
        return d is not None and d.key in self.protected

    def module_is_vital(self, module: str) -> bool:
        """The trainer imports it: torch, triton, transformers, or a module of what they require."""
        return module in TRAINER_MODULES or self.is_protected(self.declared.get(module))

    def inside(self, d: Dist) -> bool:
        """``d`` lies in the environment itself (under its prefix), not in a directory
        PYTHONPATH, the user site or a .pth adds."""
        prefix = (self.s.prefix or "").rstrip("/")
        return not prefix or not d.location or d.location == prefix or d.location.startswith(prefix + "/")

    def shadows(self, d: Dist | None) -> bool:
        """``d`` is imported from outside the environment ahead of a copy of its own inside it."""
        return d is not None and not self.inside(d) and any(self.inside(o) for o in self.s.copies(d.name) if o is not d)

    def only_outside(self, names: list[str]) -> bool:
        """Every copy of every one of ``names`` lies outside the environment (in a
        system-site-packages venv's base), and none is torch's or the trainer's."""
        if not names or (self.s.prefix or "") == (self.s.base_prefix or ""):
            return False
        copies = [d for n in names for d in self.s.copies(n)]
        return bool(copies) and all(not self.inside(d) and d.key not in self.protected for d in copies)

    def torch_requirement(self, name: str) -> ReqCheck | None:
        return next((c for c in self.checks if canonicalize_name(c.requirement.name) == canonicalize_name(name)), None)

    def removal_fix(self, removal: Removal, why_remove: str = "") -> str:
        parts = []
        uninstalled = [n for n in removal.names if n not in removal.detached]
        if removal.names:
            verbs = ([f"uninstall {', '.join(uninstalled)}"] if uninstalled else []) + \
                ([f"detach {', '.join(removal.detached)}"] if removal.detached else [])
            parts.append(" and ".join(verbs) + (f" ({why_remove})" if why_remove else ""))
        if removal.why:
            parts.append(removal.why)
        if removal.kept:
            parts.append(f"keep {', '.join(removal.kept)} (torch or the trainer requires them)")
        if removal.blocked:
            parts.append(f"do not uninstall {', '.join(removal.blocked)}: it shares files with a distribution whose "
                         "metadata is broken, which could not be put back")
        return "; ".join(parts)

    def source(self, variable: str) -> str:
        where = self.s.env_sources.get(variable)
        return f" (set by {where})" if where else ""

    def where_from(self, entry: str | None) -> str:
        """How a sys.path entry got there, in words ('' when it is an ordinary one)."""
        if not entry or entry in self.s.site_packages:
            return ""
        named = re.compile(r"(?:^|[\s'\"])" + re.escape(entry) + r"/?(?:$|[\s'\"])", re.M)
        for p in self.s.pth:
            if entry in p.adds or named.search(p.text):
                return f", put on sys.path by {p.file}"
        if any(os.path.normpath(e.path) == entry for e in self.s.pythonpath):
            return f", a PYTHONPATH entry{self.source('PYTHONPATH')}"
        if entry == self.s.user_site:
            return ", the user site-packages"
        return ""


CRASH_TEXT = "OSError: {soname}: cannot open shared object file: No such file or directory"


def crash_signature(soname: str) -> tuple[str, str]:
    """The error `import torch` prints without ``soname``, and the crash signature
    the supervisor will file it under (the same table classifies real crashes)."""
    from dflashctl.core.signatures import classify

    text = CRASH_TEXT.format(soname=soname)
    return text, classify(text).name
