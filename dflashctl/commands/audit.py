"""Command: `env-audit` (what the trainer's Python on a host loads, and what is wrong with it)."""

from __future__ import annotations

import json
import sqlite3
import time

import typer
from rich.markup import escape

from dflashctl.cli import G, app, err, out
from dflashctl.errors import DflashError

_STYLE = {"critical": "bold red", "error": "bold red", "warning": "yellow", "info": "cyan"}


@app.command("env-audit")
def env_audit_command(
    target: str = typer.Argument(..., metavar="PLAYBOOK|HOST",
                                 help="A playbook (audits its host with its env) or a host of the inventory."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of text."),
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds the audit may take on the host."),
) -> None:
    """Find packages in a host's trainer environment that would break a run.

    One round trip. Reports stray stacks (sglang, vllm, flashinfer, xformers...),
    wheels built for another CUDA major than torch's, libraries installed twice
    (wheel and system), user site-packages or PYTHONPATH shadowing the environment,
    missing torch requirements, a triton torch does not accept. Exit code 0 clean,
    1 warnings, 2 errors. Suggested fixes never remove a package torch requires."""
    from dflashctl.config import load_inventory
    from dflashctl.envaudit import audit_target

    report = audit_target(target, load_inventory(G.inventory), G.playbooks, timeout=timeout)
    _record(report)
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        _print(report)
    raise typer.Exit(report.exit_code)


def _record(report) -> None:
    """Keep the package set for drift checks; a store problem must not hide the audit."""
    from dflashctl.envaudit import record_snapshot
    from dflashctl.paths import store_path
    from dflashctl.store import Store

    try:
        with Store(store_path()) as store:
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
    counts = report.counts()
    verdict = {0: "[green]clean[/]", 1: "[yellow]warnings[/]", 2: "[bold red]errors[/]"}[report.exit_code]
    out.print(f"{verdict}: {counts['error']} error(s), {counts['warning']} warning(s), {counts['info']} info "
              f"({report.seconds:.1f}s)", highlight=False)
