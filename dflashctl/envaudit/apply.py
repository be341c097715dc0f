"""``dflashctl env-audit --apply``: the plan run on the host as the printed plan
says, one step at a time, and checked after each.

Before a step that removes or replaces a distribution (an uninstall, a dist-info
removed, an install or reinstall over an installed copy), what it will remove is
saved on the host (dflashctl/hosts/remote/envsave.py: the dist-info and every file its
RECORD lists). The step runs through the host's transport (jump hosts, container
wrapper, the playbook's environment); then the host is audited again. A step that
fails, or after which the audit has more errors than before it, is undone (the
saved files put back, a dist-info it created removed) and nothing after it runs.

The order of the plan does the rest: every wheel is fetched before anything is
removed, so a host without an index stops at its first step with nothing changed.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from dflashctl.core.errors import first_line
from dflashctl.envaudit.host import audit_host, resolve_target
from dflashctl.envaudit.report import AuditReport
from dflashctl.hosts import remote

if TYPE_CHECKING:
    from dflashctl.config import Inventory

STEP_TIMEOUT = 600.0


@dataclass
class Applied:
    """What ``apply_plan`` did."""

    before: AuditReport
    after: AuditReport
    ran: list[str] = field(default_factory=list)  # the steps that ran and were kept
    stopped: str | None = None  # the step it stopped at, None when every step ran
    why: str | None = None  # why it stopped (the step's error, or what the audit found worse)
    restored: bool = False  # the stopped step's removals were put back

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
    from packaging.requirements import InvalidRequirement, Requirement

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


def apply_plan(target: str, inventory: "Inventory", playbooks_dir: str | None = None, *,
               timeout: float = 60.0, progress: Callable[[str, str], None] = lambda kind, text: None,
               after_step: Callable[[int, str], None] = lambda i, line: None) -> Applied:
    """Audit ``target``, then run its plan step by step (see the module docstring).
    ``progress(kind, text)`` hears each step ("step", "ok", "failed", "restored");
    ``after_step(i, line)`` is called after each step that is kept."""
    from dflashctl.hosts.transport import connect

    host_name, playbook = resolve_target(target, inventory, playbooks_dir)
    env = dict(playbook.env) if playbook else None

    def audit() -> AuditReport:
        return audit_host(host_name, inventory, playbook, target=target, timeout=timeout)

    before = current = audit()
    transport = connect(host_name, inventory)
    host = transport.host
    done = Applied(before, before)
    # Its own directory on the host (mkdtemp, 0700): backups and wheels never go under a
    # name another user of the host could make first and fill.
    made = _envsave(transport, host, env, {"action": "workdir"})
    if made is None or made.get("errors") or not isinstance(made.get("dir"), str):
        done.stopped, done.why = "mkdtemp", f"could not make a private directory on {host_name}: {made}"
        progress("failed", done.why)
        return done
    workdir = made["dir"]
    for i, (argv, line) in enumerate(current.plan(wheels=f"{workdir}/wheels")):
        progress("step", line)
        saved = None
        infos = removed_by(argv, current)
        if infos:
            saved = f"{workdir}/step-{i}"
            answer = _envsave(transport, host, env, {"action": "save", "dir": saved, "dist_infos": infos})
            if answer is None or answer.get("errors"):
                done.stopped, done.why = line, f"could not save what it removes first: {answer}"
                progress("failed", done.why)
                return done
        result = transport.run(argv, env=env, check=False, timeout=STEP_TIMEOUT)
        why = None
        if result.exit_code != 0:
            tail = first_line(result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "")
            why = f"exit {result.exit_code}: {tail or 'no message'}"
            if "download" in argv:
                why += " (the wheel could not be fetched: nothing has been changed; put it into " \
                       f"{argv[argv.index('--dest') + 1]} on the host, or give the host an index, and apply again)"
        else:
            after = audit()
            if after.counts()["error"] > current.counts()["error"]:
                worse = [f.message for f in after.findings if f.severity == "error"
                         and f.message not in {g.message for g in current.findings}]
                why = f"the audit after it has {after.counts()['error']} error(s), {current.counts()['error']} " \
                      f"before: {worse[0] if worse else ''}"
            else:
                current = after
        if why is not None:
            done.stopped, done.why = line, why
            progress("failed", why)
            if saved is not None:
                answer = _envsave(transport, host, env, {"action": "restore", "dir": saved})
                done.restored = answer is not None and not answer.get("errors")
                progress("restored", f"what {shlex.split(line)[-1]} removed is back" if done.restored
                         else f"could not restore {saved}: {answer}")
            done.after = audit()
            return done
        done.ran.append(line)
        progress("ok", line)
        after_step(i, line)
    done.after = current
    return done


def _envsave(transport, host, env, argument: dict) -> dict | None:
    argv = [*shlex.split(host.python), "-I", "-S", "-c", remote.source("envsave"), json.dumps(argument)]
    result = transport.run(argv, env=env, check=False, timeout=STEP_TIMEOUT)
    try:
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return None
