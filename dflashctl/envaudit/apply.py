"""``dflashctl env-audit --apply``: the plan run on the host as the printed plan
says, one step at a time, and checked after each.

Before a step that removes or replaces a distribution (an uninstall, a dist-info
removed, an install or reinstall over an installed copy), what it will remove is
saved on the host (dflashctl/hosts/remote/envsave.py: the dist-info and every file its
RECORD lists, and the files torch's loader resolves, whoever lists them: hard
links where it can, in a private directory of the environment's prefix, said
before the first step). The step runs through the host's transport (jump hosts,
container wrapper, the playbook's environment); then the host is audited again,
with every protected package's modules imported in a fresh interpreter (--deep).

A step is undone (the saved files put back, a dist-info it created and pip's
stash directories removed) and nothing after it runs when it fails, or when
``worse`` finds it made any protected package worse: a module that imported no
longer does, a version changed that the step did not install, a library loaded
from another file or not at all; or when the audit has more errors than before,
whatever the error count says about the rest. A step's backup is removed once
the audit after it shows it kept (or once it is undone): nothing is kept that
can no longer be needed.

The order of the plan does the rest: every wheel is fetched before anything is
removed, so a host without an index stops at its first step with nothing changed.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from dflashctl.core.errors import first_line
from dflashctl.envaudit.host import audit_host, resolve_target
from dflashctl.envaudit.report import AuditReport
from dflashctl.envaudit.stack import protected
from dflashctl.hosts import remote

if TYPE_CHECKING:
    from dflashctl.config import Inventory

STEP_TIMEOUT = 600.0
DEEP_IMPORTS = ("torch", "triton", "transformers", "safetensors")  # the trainer's own imports, first
MAX_IMPORTS = 80


@dataclass
class Applied:
    """What ``apply_plan`` did."""

    before: AuditReport
    after: AuditReport
    ran: list[str] = field(default_factory=list)  # the steps that ran and were kept
    stopped: str | None = None  # the step it stopped at, None when every step ran
    why: str | None = None  # why it stopped (the step's error, or what the audit found worse)
    restored: bool = False  # the stopped step's removals were put back
    backups: str | None = None  # the host directory the run's backups went to
    backups_left: str | None = None  # where backups are still kept (a restore that failed), None when removed
    workdir: str | None = None  # the host directory the run's wheels were fetched into

    @property
    def ok(self) -> bool:
        return self.stopped is None


def removed_by(argv: list[str], report: AuditReport) -> list[str]:
    """The dist-info directories a plan step removes or replaces, as the snapshot knows them."""
    s = report.snapshot
    if argv[:3] == ["rm", "-r", "--"]:
        return [argv[3]]
    if "-m" not in argv or argv[argv.index("-m") + 1:argv.index("-m") + 2] != ["pip"]:
        return []
    rest = argv[argv.index("-m") + 2:]
    if rest[:2] == ["uninstall", "-y"]:
        names = rest[2:]
    elif rest[:1] == ["install"]:
        names = [a for a in rest[1:] if not a.startswith("-") and a not in _option_values(rest)]
    else:
        return []
    infos = []
    for spec in names:
        try:
            copies = s.copies(Requirement(spec).name)
        except InvalidRequirement:
            continue
        if copies and copies[0].metadata:
            infos.append(copies[0].metadata)
    return infos


def _option_values(args: list[str]) -> set[str]:
    return {args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--find-links", "--index-url", "--dest")}


def step_targets(argv: list[str]) -> set[str]:
    """The names a plan step installs or reinstalls (canonical): their versions may change."""
    if "-m" not in argv or argv[argv.index("-m") + 1:argv.index("-m") + 2] != ["pip"]:
        return set()
    rest = argv[argv.index("-m") + 2:]
    if rest[:1] != ["install"]:
        return set()
    found = set()
    for a in rest[1:]:
        if a.startswith("-") or a in _option_values(rest):
            continue
        try:
            found.add(canonicalize_name(Requirement(a).name))
        except InvalidRequirement:
            continue
    return found


def import_modules(report: AuditReport) -> list[str]:
    """The modules --apply imports after each step: the trainer's, then every
    top-level module of every protected package's imported copy (public names)."""
    s = report.snapshot
    keep = protected(s)
    names = [*DEEP_IMPORTS]
    for key, d in sorted(s.installed().items()):
        if key in keep:
            names += [m for m in d.modules if m.isidentifier() and not m.startswith("_")]
    return list(dict.fromkeys(names))[:MAX_IMPORTS]


def worse(before: AuditReport, after: AuditReport, targets: set[str]) -> list[str]:
    """What a step made worse for the protected packages, in words (empty: nothing):
    an import that worked and fails, a library an import loaded that it loads
    from another file or not at all, a version changed that the step did not
    install, a package gone. Pure."""
    found = []
    was, now = before.snapshot.imports(), after.snapshot.imports()
    deep_error = (after.snapshot.deep or {}).get("error") if not now else None
    for module, answer in was.items():
        if answer.get("error"):
            continue
        got = now.get(module)
        if got is None:
            found.append(f"`import {module}` was not tried after it ({deep_error or 'no answer'})")
        elif got.get("error"):
            found.append(f"`import {module}` fails after it: {got['error']}")
        else:
            lost = _by_name(answer.get("loaded") or []).items() - _by_name(got.get("loaded") or []).items()
            if lost:
                moved = _by_name(got.get("loaded") or [])
                found += [f"`import {module}` loaded {path}, after it " +
                          (f"{moved[name]}" if name in moved else "no such library") for name, path in sorted(lost)]
    old, new = before.snapshot.installed(), after.snapshot.installed()
    for key in sorted(protected(before.snapshot)):
        if key not in old or key in targets:
            continue
        if key not in new:
            found.append(f"{old[key].label()} is gone after it")
        elif new[key].version != old[key].version:
            found.append(f"{old[key].label()} is {new[key].version} after it, which the step did not install")
    return found


def _by_name(paths: list[str]) -> dict[str, str]:
    return {p.rsplit("/", 1)[-1]: p for p in paths}


def apply_plan(target: str, inventory: "Inventory", playbooks_dir: str | None = None, *,
               timeout: float = 60.0, progress: Callable[[str, str], None] = lambda kind, text: None,
               after_step: Callable[[int, str], None] = lambda i, line: None,
               wheels_from: str | None = None) -> Applied:
    """Audit ``target``, then run its plan step by step (see the module docstring).
    ``progress(kind, text)`` hears each step ("backups", "step", "ok", "failed",
    "restored"); ``after_step(i, line)`` is called after each step that is kept.
    ``wheels_from``: a directory on the host the plan's wheels are fetched from (no index)."""
    from dflashctl.hosts.transport import connect

    host_name, playbook = resolve_target(target, inventory, playbooks_dir)
    env = dict(playbook.env) if playbook else None
    imports: list[str] = []

    def audit() -> AuditReport:
        report = audit_host(host_name, inventory, playbook, target=target, timeout=timeout, deep=True,
                            imports=imports)
        report.wheels_from = wheels_from
        return report

    # Which modules to import comes from the packages (a quick audit, nothing imported), then the
    # audit every step is compared with imports them all.
    imports[:] = import_modules(audit_host(host_name, inventory, playbook, target=target, timeout=timeout))
    before = current = audit()
    transport = connect(host_name, inventory)
    host = transport.host
    done = Applied(before, before)
    # Its own directory on the host (mkdtemp, 0700) for the wheels: never a name another user
    # of the host could make first and fill. The backups go beside the environment (below).
    made = _envsave(transport, host, env, {"action": "workdir"})
    if made is None or made.get("errors") or not isinstance(made.get("dir"), str):
        done.stopped, done.why = "mkdtemp", f"could not make a private directory on {host_name}: {made}"
        progress("failed", done.why)
        return done
    done.workdir = made["dir"]
    steps = current.plan(wheels=f"{done.workdir}/wheels")
    for i, (argv, line) in enumerate(steps):
        progress("step", line)
        saved = None
        infos = removed_by(argv, current)
        loaded = [f.path for f in current.snapshot.loader]
        if infos or (loaded and not _fetch(argv)):
            if done.backups is None:
                answer = _envsave(transport, host, env, {"action": "start", "near": current.snapshot.prefix})
                if answer is None or answer.get("errors") or not answer.get("dir"):
                    done.stopped, done.why = line, f"could not make a backup directory on the host: {answer}"
                    progress("failed", done.why)
                    _drop(transport, host, env, done)
                    return done
                done.backups = answer["dir"]
                progress("backups", f"what each step removes is saved under {done.backups} on {host.name} "
                                    "until the audit after it shows it kept")
            saved = f"{done.backups}/step-{i}"
            answer = _envsave(transport, host, env, {"action": "save", "dir": saved, "dist_infos": infos,
                                                     "files": loaded})
            if answer is None or answer.get("errors"):
                done.stopped, done.why = line, "could not save what it removes first: " + \
                    ("; ".join((answer or {}).get("errors") or []) or "no answer")
                progress("failed", done.why)
                _drop(transport, host, env, done)
                return done
        result = transport.run(argv, env=env, check=False, timeout=STEP_TIMEOUT)
        why = None
        if result.exit_code != 0:
            tail = first_line(result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "")
            why = f"exit {result.exit_code}: {tail or 'no message'}"
            if "download" in argv:
                why += " (the wheel could not be fetched: nothing has been changed; " + air_gapped_hint(steps) + ")"
        else:
            after = audit()
            hurt = worse(current, after, step_targets(argv))
            if hurt:
                why = "it made the trainer's packages worse: " + "; ".join(hurt)
            elif after.counts()["error"] > current.counts()["error"]:
                new = [f.message for f in after.findings if f.severity == "error"
                       and f.message not in {g.message for g in current.findings}]
                why = f"the audit after it has {after.counts()['error']} error(s), {current.counts()['error']} " \
                      f"before: {new[0] if new else ''}"
            else:
                current = after
        if why is not None:
            done.stopped, done.why = line, why
            progress("failed", why)
            if saved is not None:
                answer = _envsave(transport, host, env, {"action": "restore", "dir": saved})
                done.restored = answer is not None and not answer.get("errors")
                if done.restored:
                    put_back = answer.get("restored", 0)
                    progress("restored", f"what {shlex.split(line)[-1]} removed is back ({put_back} file(s) "
                                         "written)" if put_back else "the step had changed nothing: nothing to put back")
                else:
                    progress("restored", f"could not restore everything; the backup stays in {saved}: "
                                         + "; ".join((answer or {}).get("errors") or ["no answer"]))
            if saved is None or done.restored:
                _drop(transport, host, env, done)
            done.after = audit()
            return done
        if saved is not None:
            _envsave(transport, host, env, {"action": "drop", "dir": saved})
        done.ran.append(line)
        progress("ok", line)
        after_step(i, line)
    _drop(transport, host, env, done)
    done.after = current
    return done


def _fetch(argv: list[str]) -> bool:
    """A step that only fetches wheels (changes nothing in the environment)."""
    return "-m" in argv and argv[argv.index("-m") + 1:argv.index("-m") + 3] == ["pip", "download"]


def air_gapped_hint(steps: list[tuple[list[str], str]]) -> str:
    """What to carry to a host that cannot fetch, and where to put it: the specs
    the plan fetches, downloaded elsewhere for the host's python, then --wheels."""
    specs = [a for argv, _ in steps if "download" in argv for a in argv[argv.index("--dest") + 2:]
             if not a.startswith("-") and a not in _option_values(argv)]
    return ("on a machine with an index, for the host's Python and platform: `python -m pip download --dest DIR "
            f"{' '.join(shlex.quote(s) for s in specs)}`; copy DIR to the host and apply again with `--wheels DIR` "
            "(the path on the host)")


def _drop(transport, host, env, done: Applied) -> None:
    """The run's wheels and backups are no longer needed: remove them."""
    if done.workdir is not None:
        _envsave(transport, host, env, {"action": "drop", "dir": done.workdir})
    if done.backups is not None:
        answer = _envsave(transport, host, env, {"action": "drop", "dir": done.backups})
        if answer is not None and answer.get("dropped"):
            done.backups_left = None
        else:
            done.backups_left = done.backups


def _envsave(transport, host, env, argument: dict) -> dict | None:
    argv = [*shlex.split(host.python), "-I", "-S", "-c", remote.source("envsave"), json.dumps(argument)]
    result = transport.run(argv, env=env, check=False, timeout=STEP_TIMEOUT)
    try:
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return None
