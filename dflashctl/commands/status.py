"""Command: `status` (every run, from the store: a live screen, a table, or JSON).

It reads the store only and never waits on a host; it never imports
``dflashctl.cli`` (it registers on ``dflashctl.commands._app``).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Optional

import typer
from rich.table import Table
from rich.text import Text

from dflashctl.commands._app import app, out, printable


@app.command("status")
def status_command(
    run: Optional[str] = typer.Argument(None, metavar="RUN", help="Only this run (id or an unambiguous prefix)."),
    once: bool = typer.Option(False, "--once", help="Print a table and exit (default when stdout is not a terminal)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON and exit."),
    interval: float = typer.Option(2.0, "--interval", min=0.2, help="Seconds between refreshes of the live screen."),
) -> None:
    """Live view of every run (a terminal UI; --once or --json to print).

    Per run: state, host, step, tok/s and its history, MFU, loss, acceptance length,
    ETA, restarts, last event; the selected run's events; GPU readings. Read from the
    store only (the supervisor writes it), so it never waits on a host."""
    from dflashctl.paths import store_path
    from dflashctl.store import Store
    from dflashctl.tui.model import load_status

    path = store_path()
    store = Store(path)
    view = load_status(store, time.time(), run)  # also checks RUN before any screen starts
    if as_json:
        print(json.dumps(view.to_dict(), indent=2))
        return
    if once or not sys.stdout.isatty():
        print_status(view)
        return
    store.close()
    from dflashctl.tui.app import StatusApp

    StatusApp(path, run=run, interval=interval).run()


def _table(title: str, columns, rows, style=None) -> Table:
    """A rich table of view rows; ``style(row)`` colours the second cell (state or severity)."""
    table = Table(title=Text(printable(title)), title_justify="left")
    for column in columns:
        table.add_column(column, no_wrap=column == "run", overflow="fold")
    for row in rows:
        cells = [Text(printable(c)) for c in row.cells()]
        if style is not None:
            cells[1].stylize(style(row))
        table.add_row(*cells)
    return table


def print_status(view) -> None:
    from dflashctl.tui.model import EVENT_COLUMNS, GPU_COLUMNS, RUN_COLUMNS, SEVERITY_STYLE, STATE_STYLE

    if not view.runs:
        out.print(printable(view.summary()), highlight=False, markup=False)
        return
    out.print(_table(view.summary(), RUN_COLUMNS, view.runs, lambda r: STATE_STYLE.get(r.state, "")))
    if view.events:
        out.print(_table(f"events of {view.selected}", EVENT_COLUMNS, view.events,
                         lambda e: SEVERITY_STYLE.get(e.severity, "")))
    if view.gpus:
        out.print(_table("GPUs (latest samples)", GPU_COLUMNS, view.gpus))
