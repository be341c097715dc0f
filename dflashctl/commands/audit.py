"""Command: `env-audit` (what the trainer's Python on a host loads, and what is wrong with it).

The audit itself is ``dflashctl.envaudit``; this module parses options, records
the snapshot and prints: the text form (each finding, its fix and its exact
commands, then the whole plan) or the JSON document, which is printed even when
the audit could not run (its ``error`` says why; exit code 3). It never imports
``dflashctl.cli`` (it registers on ``dflashctl.commands._app``).
"""

from __future__ import annotations

import json
import sqlite3
import time

import typer

from dflashctl.commands._app import G, app, err, escape, fail, out, parse_duration_option
from dflashctl.core.errors import DflashError

_STYLE = {"critical": "bold red", "error": "bold red", "warning": "yellow", "info": "cyan"}


@app.command("env-audit")
def env_audit_command(
    target: str = typer.Argument(..., metavar="PLAYBOOK|HOST",
                                 help="A playbook (audits its host with its env) or a host of the inventory."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of text (always a document)."),
    timeout: str = typer.Option("60s", "--timeout", help="How long the audit may take on the host (60, 60s, 2m)."),
    deep: bool = typer.Option(False, "--deep", help="Also `import torch` on the host, in a subprocess with a "
                                                    "timeout: its real version, CUDA and the libraries it maps."),
    apply: bool = typer.Option(False, "--apply", help="Run the plan on the host, one step at a time, auditing "
                                                      "again after each (the trainer's imports tried too): a step "
                                                      "that fails, makes an import or a version of torch's and the "
                                                      "trainer's packages worse, or leaves more errors is undone "
                                                      "and nothing after it runs."),
    wheels: str = typer.Option(None, "--wheels", metavar="DIR",
                               help="A directory on the host holding the wheels the plan installs (carried to a "
                                    "host with no index): the plan fetches from it instead of an index."),
) -> None:
    """Find what in a host's trainer environment would break a run, and how to fix it.

    One round trip; the host's own import system is asked which torch, triton and
    transformers it imports and from where. Reports a torch that cannot be imported
    or whose CUDA libraries the loader cannot find, modules shadowed by another copy,
    missing torch requirements and unmet requirements of every package (pip check),
    files missing from torch's wheels or listed by two packages, wheels built for
    another CUDA major than torch's, libraries installed twice at other versions,
    stray inference stacks. Fixes are exact commands for the host's python, checked
    never to delete a file torch needs. Exit code 0 clean, 1 warnings, 2 errors,
    3 the audit could not run (an unknown playbook or host included: 2 means errors
    found)."""
    from dflashctl.config import load_inventory
    from dflashctl.envaudit import EXIT_NOT_RUN, audit_target, failed_document

    if apply:
        _apply(target, parse_duration_option(timeout, "--timeout"), as_json, wheels)
    store = _store()
    try:
        report = audit_target(target, load_inventory(G.inventory), G.playbooks, timeout=parse_duration_option(timeout, "--timeout"), deep=deep,
                              store=store)
    except DflashError as e:
        if as_json:
            print(json.dumps(failed_document(target, str(e), getattr(e, "hint", None)), indent=2))
            raise typer.Exit(EXIT_NOT_RUN) from None
        fail(e)
        raise typer.Exit(EXIT_NOT_RUN) from None
    report.wheels_from = wheels
    if store is not None:
        _record(store, report)
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        _print(report)
    raise typer.Exit(report.exit_code)


def _apply(target: str, timeout: float, as_json: bool, wheels: str | None = None) -> None:
    """--apply: run the plan, say each step, exit with the last audit's code (3 when it stopped)."""
    from dflashctl.config import load_inventory
    from dflashctl.envaudit import EXIT_NOT_RUN
    from dflashctl.envaudit.apply import apply_plan

    marks = {"step": "[bold]run[/]   ", "ok": "[green]ok[/]    ", "failed": "[bold red]failed[/]",
             "restored": "[yellow]undone[/]", "backups": "[dim]backups[/]"}
    say = (lambda kind, text: None) if as_json else \
        (lambda kind, text: out.print(f"{marks[kind]} {escape(text)}", highlight=False, soft_wrap=True))
    try:
        done = apply_plan(target, load_inventory(G.inventory), G.playbooks, timeout=timeout, progress=say,
                          wheels_from=wheels)
    except DflashError as e:
        fail(e)
        raise typer.Exit(EXIT_NOT_RUN) from None
    if as_json:
        print(json.dumps({"applied": done.ran, "stopped": done.stopped, "why": done.why, "restored": done.restored,
                          "backups": done.backups, "backups_left": done.backups_left,
                          "after": done.after.to_dict()}, indent=2))
    elif done.ok:
        _print(done.after)
    else:
        out.print(f"[bold red]stopped[/] at {escape(done.stopped or '')}: {escape(done.why or '')}; nothing after "
                  "it ran", highlight=False, soft_wrap=True)
    if done.backups_left:
        out.print(f"[yellow]backups kept[/] in {escape(done.backups_left)} on the host (remove it by hand once the "
                  "environment is right)", highlight=False, soft_wrap=True)
    raise typer.Exit(done.after.exit_code if done.ok else EXIT_NOT_RUN)


def _store():
    """The run store (for drift and to record the snapshot); a store problem must not hide the audit."""
    from dflashctl.core.paths import store_path
    from dflashctl.store import Store

    try:
        return Store(store_path())
    except (DflashError, sqlite3.Error, OSError) as e:
        err.print(f"[yellow]warning:[/] run store not available: {escape(str(e))}", highlight=False)
        return None


def _record(store, report) -> None:
    """Keep the package set for drift checks."""
    from dflashctl.envaudit import record_snapshot

    try:
        with store:
            record_snapshot(store, report, time.time())
    except (DflashError, sqlite3.Error, OSError) as e:
        err.print(f"[yellow]warning:[/] env snapshot not recorded: {escape(str(e))}", highlight=False)


def _print(report) -> None:
    s = report.snapshot
    torch = report.torch.label if report.torch else "no torch"
    where = f"{report.host}" + (f" ({s.hostname})" if s.hostname else "")
    head = f"{report.target}: " if report.target != report.host else ""
    out.print(f"[bold]{escape(head + where)}[/]: python {escape(s.python_version or '?')} "
              f"{escape(s.python or '')} (prefix {escape(s.prefix or '?')}), {escape(torch)}, "
              f"{len(s.packages())} packages, {len(s.ldconfig)} CUDA-family libraries in the ldconfig cache",
              highlight=False, soft_wrap=True)
    for f in report.findings:
        style = _STYLE.get(f.severity, "")
        out.print(f"[{style}]{f.severity.upper():<8}[/] [dim]{f.code}[/]  {escape(f.message)}",
                  highlight=False, soft_wrap=True)
        if f.fix:
            out.print(f"         [green]fix:[/] {escape(f.fix)}", highlight=False, soft_wrap=True)
        for command in f.commands:
            out.print(f"           {escape(command)}", highlight=False, soft_wrap=True)
    if report.drift is not None:
        out.print(f"[yellow]DRIFT[/]    {escape(report.drift.message)}", highlight=False, soft_wrap=True)
    steps = report.plan()
    if len(steps) > 1:
        out.print(f"[bold]to apply every fix, in this order[/] (on {escape(report.host)}; stop at the first command "
                  "that fails: the wheels are fetched first, so nothing has changed when one cannot be fetched):",
                  highlight=False, soft_wrap=True)
        for _, line in steps:
            out.print(f"  {escape(line)}", highlight=False, soft_wrap=True)
    counts = report.counts()
    verdict = {0: "[green]clean[/]", 1: "[yellow]warnings[/]", 2: "[bold red]errors[/]"}[report.exit_code]
    out.print(f"{verdict}: {counts['error']} error(s), {counts['warning']} warning(s), {counts['info']} info "
              f"({report.seconds:.1f}s)", highlight=False)
