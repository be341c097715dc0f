"""Command: `status` (every run, from the store: a live screen, a table, or JSON).

It reads the store; only a run no supervisor watches is probed on its host
(``--once``, bounded, as the live screen does). It never imports
``dflashctl.cli`` (it registers on ``dflashctl.commands._app``). Textual is
imported only for the live screen, so ``--once`` and ``--json`` start fast.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

import typer

from dflashctl.commands._app import G, app, out, parse_duration_option, printable


@app.command("status")
def status_command(
    run: Optional[str] = typer.Argument(None, metavar="RUN", help="Only this run (id or an unambiguous prefix)."),
    once: bool = typer.Option(False, "--once", help="Print a table and exit (default when stdout is not a terminal)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (schema: --json-schema) and exit."),
    json_schema: bool = typer.Option(False, "--json-schema", help="Print the JSON Schema of --json and exit."),
    interval: str = typer.Option("2", "--interval", metavar="DURATION",
                                 help="Time between refreshes of the live screen (2, 0.5, 2s, 1m)."),
    check: bool = typer.Option(False, "--check",
                               help="With --once or --json: exit 1 when a run is stalled, unsupervised, unreachable "
                                    "or its store busy, or failed in the last 24 h (for cron / CI); 0 otherwise."),
    readonly: Optional[bool] = typer.Option(None, "--readonly/--no-readonly",
                                            help="A screen with no stop / restart keys (default: "
                                                 "DFLASHCTL_READONLY=1 sets it)."),
) -> None:
    """Live console of every run, host and GPU (a terminal UI; `--once` or `--json` to print).

    Per run: state as the operator should read it (`unsupervised` when no supervisor
    watches it, with the command that fixes it; `unreachable`, `stale`), phase with
    its time against the playbook's budget (`compiling 12 m / 45 m`), progress, tok/s
    averaged over 5 minutes and as a share of the baseline, an ETA from the step rate
    over the same window (never for data that is not live), loss, tau (acceptance
    length), restarts, last event. Per host: each GPU's role, the run holding it,
    utilisation and memory, temperature, power, history. `?` in the screen lists the
    keys: Enter detail, `l` log, `e` events, `x` stop, `r` restart (both ask first; none with
    `--readonly` or DFLASHCTL_READONLY=1), `/` filter, `s` sort.

    Read from the store (the supervisors write it); a run nobody supervises is probed
    on its host (bounded: 10 s), so its row says what its host answers."""
    from dflashctl.core.paths import store_path

    if json_schema:
        from dflashctl.status.schema import JSON_SCHEMA

        print(json.dumps(JSON_SCHEMA, indent=2))
        return
    from dflashctl.status.reader import load_status
    from dflashctl.store import Store

    path = store_path()
    if not os.path.isfile(path):  # never made here: a mistyped path must not read as "no runs yet"
        from dflashctl.core.errors import ConfigError

        raise ConfigError(f"no run store at {path}" + (" (DFLASHCTL_STORE)" if os.environ.get("DFLASHCTL_STORE")
                                                       else ""),
                          hint="check DFLASHCTL_STORE (unset it for the default store), or launch a run first "
                               "(dflashctl launch demo): launching creates the store")
    store = Store(path)
    view = load_status(store, _now(), run, playbooks_dir=G.playbooks)  # also checks RUN before any screen starts
    if as_json:
        print(json.dumps(view.to_dict(), indent=2))
        _check(view, check)
        return
    if once or not sys.stdout.isatty() or check:
        probe_unwatched(view, store)
        print_status(view, out.width)
        _check(view, check)
        return
    store.close()
    seconds = parse_duration_option(interval, "--interval")
    if seconds < 0.2:
        from dflashctl.core.errors import ConfigError

        raise ConfigError(f"--interval: {interval} is too short", hint="give 0.2 seconds or more (2, 0.5, 2s, 1m)")
    from dflashctl.tui.actions import readonly_default
    from dflashctl.tui.app import StatusApp

    if readonly is None:
        readonly = readonly_default()
    StatusApp(path, run=run, interval=seconds, inventory_path=G.inventory, playbooks_dir=G.playbooks,
              readonly=readonly).run()


CHECK_STATES = ("stalled", "unsupervised", "unreachable", "store busy")
CHECK_FAILED_WITHIN_S = 24 * 3600.0


def needs_attention(view) -> list:
    """The runs ``--check`` fails on: active ones stalled, unsupervised, unreachable or
    blocked on a busy store, and runs that failed in the last 24 hours."""
    return [r for r in view.runs if r.display_state in CHECK_STATES or (
        r.state == "failed" and view.now - (r.phase.since or r.created) <= CHECK_FAILED_WITHIN_S)]


def _check(view, check: bool) -> None:
    if not check:
        return
    bad = needs_attention(view)
    if bad:
        print(f"check: {len(bad)} run(s) need attention: "
              + ", ".join(f"{r.id} {r.display_state}" for r in bad), file=sys.stderr)
        raise typer.Exit(1)


ONCE_PROBE_TIMEOUT_S = 10.0


def probe_unwatched(view, store) -> None:
    """Each active run no supervisor watches, probed on its host now, in parallel and
    bounded by ``ONCE_PROBE_TIMEOUT_S`` (nothing stored), as the live console does:
    its row shows the phase and step its host answers, never the store's last guess."""
    runs = [r for r in view.runs if r.active and not r.freshness.supervised]
    if not runs:
        return  # nothing to probe: no inventory read (pydantic stays unimported)
    from concurrent.futures import ThreadPoolExecutor

    from dflashctl.config import load_inventory
    from dflashctl.status.runs import DirectProbe

    with ThreadPoolExecutor(max_workers=min(8, len(runs))) as pool:
        found = pool.map(lambda r: DirectProbe.of(r.id, store, lambda: load_inventory(G.inventory),
                                                  _now, ONCE_PROBE_TIMEOUT_S), runs)
        for r, probe in zip(runs, found):
            r.probe = probe


def _now() -> float:
    import time

    return time.time()


def print_status(view, width: int) -> None:
    """The status as text at ``width`` columns: the summary, what needs the operator
    (with its fix), one line per run (the columns that fit; cells cut, never folded;
    a multi-host run's hosts indented below it), the selected run's newest events,
    the GPUs of hosts with active runs."""
    from rich.table import Table
    from rich.text import Text

    from dflashctl.status.columns import fit, fit_middle
    from dflashctl.status.runs import select_columns
    from dflashctl.status.styles import SEVERITY_STYLE
    from dflashctl.tui.text import gpu_text, run_hosts_text

    width = max(40, width)
    out.print(Text(printable(view.summary())), highlight=False)
    if not view.runs:
        return
    for n in view.notices:  # whole, wrapped if need be: the fix is a command to copy
        out.print(Text.assemble(("✖ " if n.severity == "error" else "▲ ", SEVERITY_STYLE.get(n.severity, "")),
                                printable(n.text), (f"  → {printable(n.fix)}" if n.fix else "", "bold")),
                  highlight=False)
    # Run ids are copied into other commands: their column is as wide as the longest.
    columns = select_columns(width, gap=1, run_width=max(len(r.id) for r in view.runs))

    def table(runs, header: bool) -> Table:
        # Fixed column widths: tables printed one after another line up as one.
        t = Table(box=None, pad_edge=False, padding=(0, 1), collapse_padding=True, show_edge=False,
                  header_style="bold", show_header=header)
        for c in columns:
            t.add_column(c.header, width=c.width, no_wrap=True, overflow="ellipsis", justify=c.justify)
        for r in runs:
            cells = []
            for c in columns:
                text = printable(r.cell(c.key))
                cells.append(Text(fit_middle(text, c.width) if c.key == "run" else fit(text, c.width),
                                  style=r.style(c.key)))
            t.add_row(*cells)
        return t

    # A multi-host run's hosts go right under its line: the table is cut there.
    pending, header = [], True
    for r in view.runs:
        pending.append(r)
        if r.hosts:
            out.print(table(pending, header))
            out.print(run_hosts_text(r.hosts, width), highlight=False)
            pending, header = [], False
    if pending:
        out.print(table(pending, header))
    if view.events:
        out.print(Text(f"\nevents of {printable(view.selected)}", style="bold"))
        for e in view.events[-10:]:
            time_text, severity, kind, message = e.cells()
            line = Text(f"{time_text} ")
            line.append(f"{severity:<7}", style=SEVERITY_STYLE.get(severity, ""))
            line.append(fit(printable(f" {kind:<14} {message}"), width - 17))
            out.print(line, highlight=False)
    if view.hosts:
        out.print(Text("\nGPUs", style="bold"))
        out.print(gpu_text(view.hosts, width, view.now, compact=width < 100), highlight=False)
