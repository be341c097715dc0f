"""Shadowing rules: a module imported from another copy than the one pip lists.

``shadowed`` and ``user-site``: a module imported from a .pth-added directory, the
user site or a directory no distribution owns. ``duplicate-package`` and
``stale-dist-info``: one name installed twice.
"""

from __future__ import annotations

import os

from dflashctl.envaudit.context import _Context
from dflashctl.envaudit.findings import Finding
from dflashctl.envaudit.fixes import listing
from dflashctl.envaudit.snapshot import Dist, ModuleSpec


def _rule_shadowed(c: _Context) -> list[Finding]:
    """A module imported from another copy than the one pip lists first for it: the
    import system's answer (find_spec) against the distributions' RECORDs."""
    s = c.s
    if not s.asked:
        return []
    pythonpath = {os.path.normpath(e.path) for e in s.pythonpath}
    groups: dict[tuple[int, str], list[ModuleSpec]] = {}
    for name, spec in s.modules.items():
        if spec is None or spec.origin is None or spec.error:
            continue
        listed = c.declared.get(name)
        if listed is None:
            continue
        owner = s.owner(name)
        if owner is listed or (owner is not None and not owner.name):
            continue  # the normal case; a nameless owner is broken-metadata's
        if owner is None and (listed.editable or _under(spec.origin, listed, name)):
            continue  # an editable install, or files it made after it was installed
        if spec.finder:
            groups.setdefault((listed.index, f"finder|{spec.finder}"), []).append(spec)
            continue
        if spec.entry in pythonpath:
            continue  # the pythonpath rule reports PYTHONPATH entries
        groups.setdefault((listed.index, f"{owner.index if owner else -1}|{spec.entry}"), []).append(spec)
    findings = []
    for specs in groups.values():
        listed = c.declared[specs[0].name]
        if specs[0].finder:
            findings.append(_finder_finding(c, specs, listed))
            continue
        owner = s.owner(specs[0].name)
        entry = specs[0].entry
        names = [sp.name for sp in specs]
        vital = any(c.module_is_vital(n) for n in names) or c.is_protected(owner)
        same = owner is not None and owner.key == listed.key and owner.version == listed.version
        severity = ("warning" if same else "error") if vital else "info"
        what = owner.label() + f" at {owner.location}" if owner else "files no installed distribution lists"
        origin = specs[0].origin
        code = "user-site" if entry == s.user_site else "shadowed"
        argv = []
        if code == "user-site":
            fix = (f"set PYTHONNOUSERSITE=1 for the trainer (the inventory's env: for host {s.host}), or move "
                   f"{s.user_site} aside; do not pip uninstall (pip removes whichever copy it finds first)")
        elif owner is None and entry in s.site_packages:
            fix = f"these files are no distribution's (a copy made by hand, or what an uninstall left): reinstall {listed.name}"
            argv = [c.fixer.reinstall(listed)]
        else:
            fix = f"take {entry} off the trainer's sys.path{c.where_from(entry)}"
        findings.append(c.finding(
            severity, code,
            f"{listing(names, 4)} {'is' if len(names) == 1 else 'are'} imported from {origin} ({what}, under "
            f"{entry}{c.where_from(entry)}), not from {listed.label()} in {listed.location} that pip lists",
            fix=fix, argv=argv, packages=[listed.name] + ([owner.name] if owner and owner.key != listed.key else []),
            paths=[entry] if entry else [],
            detail={"modules": names, "origin": origin, "entry": entry, "listed": listed.label(),
                    "imported": owner.label() if owner else None}))
    return findings


def _finder_finding(c: _Context, specs: list[ModuleSpec], listed: Dist) -> Finding:
    """Modules a meta-path finder serves (one that .pth code installs at every
    start), not the copy pip lists: no pip command changes what a finder serves."""
    finder = specs[0].finder or ""
    top = finder.split(".", 1)[0]
    code = [p for p in c.s.pth if p.code]
    named = [p for p in code if top and top in p.text] or code
    where = f", installed by {listing([p.file for p in named], 2)} (code run at every start)" if named else ""
    names = [sp.name for sp in specs]
    vital = any(c.module_is_vital(n) for n in names)
    return c.finding(
        "error" if vital else "info", "shadowed",
        f"{listing(names, 4)} {'is' if len(names) == 1 else 'are'} imported from {specs[0].origin}, served by the "
        f"meta-path finder {finder}{where}, not from {listed.label()} in {listed.location} that pip lists",
        fix=(f"remove or correct {named[0].file} (the finder it installs decides what is imported; pip does not "
             "change that)" if named else f"find what installs {finder} on sys.meta_path (sitecustomize, a .pth) "
             "and remove it"),
        packages=[listed.name], paths=[p.file for p in named],
        detail={"modules": names, "origin": specs[0].origin, "finder": finder, "listed": listed.label()})


def _under(origin: str, dist: Dist, module: str) -> bool:
    base = (dist.location or "").rstrip("/")
    return bool(base) and (origin.startswith(f"{base}/{module}/") or origin.startswith(f"{base}/{module}."))


def _rule_duplicate_packages(c: _Context) -> list[Finding]:
    """One name installed more than once (another site directory, a .pth-added one,
    the user site). When the user site's copy is the one imported ahead of another,
    that is the user-site finding (the fix is PYTHONNOUSERSITE, not pip)."""
    copies: dict[str, list[Dist]] = {}
    for d in c.s.dists:
        if d.key:
            copies.setdefault(d.key, []).append(d)
    findings = []
    user = c.s.user_site
    for key, dists in copies.items():
        if len(dists) < 2:
            continue
        imported = c.installed.get(key)
        stale = [d for d in dists if d is not imported and imported is not None and d.location == imported.location]
        for d in stale:
            findings.append(c.finding(
                "warning", "stale-dist-info",
                f"{d.metadata} is a second dist-info of {d.name} ({d.version}) beside the one of {imported.label()} "
                f"that owns the files Python imports, in the same directory {d.location}: what a half-finished "
                "upgrade leaves; pip acts on whichever it finds first",
                fix=f"remove that one dist-info directory (not `pip uninstall`: it would delete {imported.name}'s "
                    "files its RECORD lists too)",
                argv=[["rm", "-r", "--", d.metadata]] if d.metadata else [], packages=[d.name],
                paths=[d.metadata] if d.metadata else [], detail={"stale": d.version, "live": imported.version}))
        dists = [d for d in dists if d not in stale]
        if len(dists) < 2:
            continue
        others = [d for d in dists if d is not imported]
        parts = [f"{d.label()} at {d.location}" + (" (imported)" if d is imported and c.s.asked else "")
                 + c.where_from(os.path.normpath(d.location or "")) for d in dists]
        differ = len({d.version for d in dists}) > 1
        vital = key in c.protected
        detail = {"copies": [{"version": d.version, "location": d.location} for d in dists]}
        if c.s.asked and imported is not None and imported.location == user and user and \
                any(d.location != user for d in others):
            findings.append(c.finding(
                ("error" if differ else "warning") if vital else "info", "user-site",
                f"user site-packages {user} shadows {', '.join(d.label() for d in others)}: Python imports "
                f"the user copy ({imported.label()}) first",
                fix=(f"set PYTHONNOUSERSITE=1 for the trainer (the inventory's env: for host {c.s.host}), or move "
                     f"{user} aside; do not pip uninstall (pip removes whichever copy it finds first)"),
                packages=[imported.name], paths=[user], detail={**detail, "modules": imported.modules}))
            continue
        only_user = all(d.location == user for d in others)
        severity = "warning" if vital and differ and not only_user else "info"
        findings.append(c.finding(
            severity, "duplicate-package",
            f"{dists[0].name} is installed {len(dists)} times: {'; '.join(parts)}"
            + (": the copy imported depends on sys.path order, and pip acts on the first" if differ else ""),
            fix=(f"take {imported.location} off the trainer's sys.path{c.where_from(imported.location)}: it shadows "
                 f"the environment's own {', '.join(d.label() for d in others)}"
                 if c.shadows(imported) else
                 f"remove the copy that is not imported ({listing([d.location or '?' for d in others], 3)}): "
                 "delete its dist-info and the files its RECORD lists, or take its directory off sys.path")
            if severity == "warning" else None,
            packages=[dists[0].name], paths=[d.location for d in others if d.location], detail=detail))
    return findings
