"""Command: `status` (every run, from the store: a live screen, a table, or JSON)."""

from __future__ import annotations

import json
import sys
import time
from typing import Optional

import typer
from rich.table import Table
from rich.text import Text

from dflashctl.cli import app, out


@app.command("status")
def status_command(
    run: Optional[str] = typer.Argument(None, metavar="RUN", help="Only this run (id or an unambiguous prefix)."),
    once: bool = typer.Option(False, "--once", help="Print a table and exit (default when stdout is not a terminal)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON and exit."),
    interval: float = typer.Option(2.0, "--interval", min=0.2, help="Seconds between refreshes of the live screen."),
) -> None:
    """Every run: state, host, step, tok/s and its history, loss, acceptance length,
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


def print_status(view) -> None:
    from dflashctl.tui.model import EVENT_COLUMNS, GPU_COLUMNS, RUN_COLUMNS, SEVERITY_STYLE, STATE_STYLE

    if not view.runs:
        out.print(view.summary(), highlight=False)
        return
    runs = Table(title=view.summary(), title_justify="left")
    for column in RUN_COLUMNS:
        runs.add_column(column, no_wrap=column == "run", overflow="fold")
    for r in view.runs:
        cells = [Text(c) for c in r.cells()]
        cells[1].stylize(STATE_STYLE.get(r.state, ""))
        runs.add_row(*cells)
    out.print(runs)
    if view.events:
        events = Table(title=f"events of {view.selected}", title_justify="left")
        for column in EVENT_COLUMNS:
            events.add_column(column, overflow="fold")
        for e in view.events:
            cells = [Text(c) for c in e.cells()]
            cells[1].stylize(SEVERITY_STYLE.get(e.severity, ""))
            events.add_row(*cells)
        out.print(events)
    if view.gpus:
        gpus = Table(title="GPUs (latest samples)", title_justify="left")
        for column in GPU_COLUMNS:
            gpus.add_column(column)
        for g in view.gpus:
            gpus.add_row(*map(Text, g.cells()))
        out.print(gpus)
