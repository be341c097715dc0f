"""Integrity rules: RECORD files missing or changed, and files two distributions list.

``missing-files``: an error for torch and what it requires when code they import
is affected. ``shared-files``: uninstalling one owner deletes them for the others.
"""

from __future__ import annotations

import os

from dflashctl.envaudit.context import _Context, crash_signature
from dflashctl.envaudit.findings import Finding
from dflashctl.envaudit.fixes import listing, only_inits, short_path
from dflashctl.envaudit.snapshot import LIB_PREFIXES

_CODE_SUFFIXES = (".py", ".pyc", ".pth", ".pyd")


def _imported(rel: str) -> bool:
    """Whether a RECORD path is something Python imports or loads: inside the
    distribution's own directory (not ``../../bin/`` scripts), code or a library,
    not data (a CA bundle an image patched, say)."""
    name = rel.rsplit("/", 1)[-1]
    return not rel.startswith("../") and (name.endswith(_CODE_SUFFIXES) or ".so" in name or name.startswith(LIB_PREFIXES))


def _rule_integrity(c: _Context) -> list[Finding]:
    """RECORD files missing or of another size (or, for a file another RECORD lists
    too, another sha256): an error for torch and what it
    requires when a file it imports or loads is affected (their code must all be
    there), a warning when only its scripts or data are, information for others."""
    owners_of: dict[str, list[int]] = {}
    for group in c.s.shared:
        for path in group.paths:
            owners_of[path] = group.owners
    findings = []
    for d in c.s.dists:
        if d.denied_count and d.name:
            vital = c.is_protected(d) and c.installed.get(d.key) is d
            findings.append(c.finding(
                ("error" if any(_imported(r) for r in d.denied) else "warning") if vital else "info",
                "missing-files", f"{d.label()}: permission denied: {d.denied_count} file(s) its RECORD lists cannot "
                f"be read by this user ({listing(d.denied, 3)})",
                fix="make them readable by the user the trainer runs as (chmod -R a+rX on the package's "
                    "directories), not a reinstall", packages=[d.name],
                detail={"denied": d.denied, "denied_count": d.denied_count}))
        if not (d.missing_count or d.changed_count) or not d.name:
            continue
        live = c.installed.get(d.key)
        if live is not None and live is not d and live.location == d.location:
            continue  # a stale second dist-info: the stale-dist-info finding says it, and removes only that
        if only_scripts(d):
            continue  # the relocated-scripts finding says it, for every package at once
        vital = c.is_protected(d) and c.installed.get(d.key) is d
        parts = []
        if d.missing_count:
            parts.append(f"{d.missing_count} file(s) its RECORD lists are missing ({listing(d.missing, 3)})")
        if d.dangling_count:
            targets = sorted({os.path.dirname(x.get("target") or "") for x in d.dangling})
            parts.append(f"{d.dangling_count} of them {'is a symlink' if d.dangling_count == 1 else 'are symlinks'} "
                         f"into {listing(targets, 2)}, which no longer exists (a uv install in symlink link mode "
                         "whose cache was removed): a reinstall writes real files")
        if d.changed_count:
            parts.append(f"{d.changed_count}{'' if parts else ' file(s) its RECORD lists'} have another size "
                         f"or sha256 than recorded ({listing(d.changed, 3)})")
        sharers = set()
        for rel in [*d.missing, *d.changed]:
            full = os.path.normpath(os.path.join(d.location or "", rel))
            sharers |= {i for i in owners_of.get(full, []) if i != d.index}
        shared_with = [o.label() for i in sorted(sharers) if (o := c.s.dist(i)) is not None]
        consequence = ""
        gone = [rel.rsplit("/", 1)[-1] for rel in d.missing if rel.rsplit("/", 1)[-1].startswith(LIB_PREFIXES)]
        other = [rel.rsplit("/", 1)[-1] for rel in d.changed if rel.rsplit("/", 1)[-1].startswith(LIB_PREFIXES)]
        lost_libs = gone + other
        if vital and gone:
            text, signature = crash_signature(gone[0])
            consequence = f": `import torch` fails with '{text}' (crash signature {signature})"
        elif vital and other:
            consequence = (f": torch loads a {other[0]} that is not the one this wheel installed (another build's: "
                           "a version mismatch when it loads, or at the first call into it)")
        message = (f"{d.label()}{' (torch or the trainer requires it)' if vital else ''}: {'; '.join(parts)}"
                   + (f"; {listing(shared_with, 3)} also list{'s' if len(shared_with) == 1 else ''} them "
                      "(installed over it, or its uninstall deleted them)" if shared_with else "")
                   + consequence)
        breaks_import = any(_imported(rel) for rel in [*d.missing, *d.changed])
        if vital and not breaks_import:
            message += ": it still imports (only its command-line scripts or data files differ)"
        fix, argv = f"reinstall {d.spec()} over itself", [c.fixer.reinstall(d)]
        if d.dangling_count:
            # pip writes a file through a symlink that is there: one whose target is gone fails the write.
            tops = sorted({os.path.normpath(os.path.join(d.location or "", x["path"].split("/", 1)[0]))
                           for x in d.dangling if not x["path"].startswith("../")})
            fix = f"remove the dangling symlinks (pip cannot write through them), then reinstall {d.spec()} over itself"
            argv = [["find", top, "-xtype", "l", "-delete"] for top in tops] + argv
        if not c.inside(d):
            fix, argv = (f"it lies outside this environment ({d.location}: the base interpreter's, or a directory "
                         "added to sys.path): this environment's pip does not change it; repair it with the pip of "
                         "the interpreter it belongs to, or leave it"), []
        elif c.fixer.target(d.name) is not d:
            fix, argv = (f"another copy of {d.name} comes first on sys.path, and pip acts on that one: "
                         "see the duplicate-package finding"), []
        findings.append(c.finding(
            ("error" if breaks_import else "warning") if vital else "info", "missing-files", message,
            fix=fix, argv=argv, packages=[d.name],
            libraries=sorted(set(lost_libs)),
            detail={"missing": d.missing, "missing_count": d.missing_count, "changed": d.changed,
                    "changed_count": d.changed_count, "shared_with": shared_with}))
    return findings


def only_scripts(d) -> bool:
    """Every difference between ``d``'s RECORD and the disk is a console script's
    ``#!`` line (outside its package directory): nothing it imports differs."""
    return (not d.missing_count and d.changed_count == len(d.changed) > 0
            and all(rel.startswith("../") and rel in d.shebangs for rel in d.changed))


def _interpreter(line: str) -> str:
    """The program a ``#!`` line runs ('' for ``#!/bin/sh``: pip's wrapper for long paths names it on line 2)."""
    words = line[2:].split()
    return words[0] if words and "python" in words[0].rsplit("/", 1)[-1] else ""


def _rule_relocated_scripts(c: _Context) -> list[Finding]:
    """Console scripts whose only difference from their RECORD is the ``#!`` line
    (a venv moved or copied, its scripts rewritten, or not): one finding for
    every package, never a reinstall (of torch, say) to put a line back."""
    dists = [d for d in c.s.dists if d.name and only_scripts(d)]
    if not dists:
        return []
    scripts = {os.path.normpath(os.path.join(d.location or "", rel)): d.shebangs[rel] for d in dists for rel in d.changed}
    prefix = (c.s.prefix or "").rstrip("/")
    foreign = {path: _interpreter(line) for path, line in scripts.items()
               if _interpreter(line) and not _interpreter(line).startswith(prefix + "/")}
    names = listing([d.label() for d in dists], 4)
    if not foreign:
        return [c.finding(
            "info", "relocated-scripts",
            f"{len(scripts)} console script(s) of {names} differ from their RECORDs only in their #! line, which names "
            f"this environment's python (a venv moved or copied, its scripts rewritten): they run; nothing they "
            "import differs", fix="nothing to do; a reinstall would only make the RECORDs agree",
            packages=[d.name for d in dists], paths=sorted(scripts), detail={"scripts": len(scripts)})]
    olds = sorted({os.path.dirname(i) for i in foreign.values()})
    new = f"{prefix}/bin" if prefix else ""
    argv = [["sed", "-i", f"1s|^#!{old}/|#!{new}/|", *sorted(p for p, i in foreign.items() if i.startswith(old + "/"))]
            for old in olds] if new else []
    return [c.finding(
        "warning", "relocated-scripts",
        f"{len(foreign)} console script(s) of {names} run {listing(sorted(set(foreign.values())), 2)}, not this "
        f"environment's python (a venv moved or copied from {listing(olds, 2)}): they fail, or run another "
        "environment's python; nothing they import differs",
        fix=f"point their #! lines at {new}/ (one command per old directory), not a reinstall",
        argv=argv, packages=[d.name for d in dists], paths=sorted(foreign),
        detail={"scripts": len(scripts), "interpreters": sorted(set(foreign.values()))})]


def _rule_shared_files(c: _Context) -> list[Finding]:
    """Files listed by more than one distribution: an uninstall of one deletes them
    from under the others."""
    findings = []
    for group in c.s.shared:
        dists = [d for i in group.owners if (d := c.s.dist(i)) is not None]
        if len(dists) < 2:
            continue
        keep = [d for d in dists if c.is_protected(d) or not d.name]
        others = [d for d in dists if d not in keep]
        shown = [short_path(p, dists[0]) for p in group.paths]
        mixed = bool(keep and others)
        inits = only_inits(group)
        severity = "warning" if mixed and not inits else "info"
        message = (f"{group.count} file(s) are listed by {' and '.join(d.label() for d in dists)} "
                   f"({listing(shown, 3)}): uninstalling one deletes them for the other"
                   + ("s" if len(dists) > 2 else ""))
        fix = None
        if mixed:
            removal = c.fixer.removal([d.name for d in others])
            message += f"; {listing([d.name for d in keep], 3)} {'is' if len(keep) == 1 else 'are'} the trainer's"
            fix = (f"never uninstall {', '.join(d.name for d in others)} alone: follow it with "
                   + "; ".join(c.fixer.shell(a) for a in removal.argv[1:])) if len(removal.argv) > 1 else None
        findings.append(c.finding(severity, "shared-files", message, fix=fix,
                                  packages=[d.name or "?" for d in dists], paths=group.paths,
                                  detail={"owners": [d.label() for d in dists], "count": group.count}))
    return findings
