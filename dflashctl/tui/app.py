"""The live status screen (``dflashctl status``): every run, the selected run's
events and throughput, and GPU readings, refreshed from the store on a timer.

It reads only the store, in a thread worker so a slow disk never freezes the
screen; the supervisor writes what it shows. Keys: q quit, r refresh now, Enter
(or a click) on a run shows its events.
"""

from __future__ import annotations

import time

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer, Header, Static

from dflashctl.errors import DflashError
from dflashctl.store import Store
from dflashctl.tui.model import StatusView, load_status
from dflashctl.tui.widgets import EventsTable, GpuTable, RunsTable, Throughput


class StatusApp(App):
    TITLE = "dflashctl status"
    CSS = """
    #summary { height: 1; padding: 0 1; }
    #runs { height: 1fr; min-height: 5; }
    #bottom { height: 14; }
    #events-box { width: 2fr; }
    #gpus-box { width: 1fr; }
    .title { height: 1; padding: 0 1; text-style: bold; }
    """
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("r", "reload", "Refresh"),
    ]

    def __init__(self, store_path: str, run: str | None = None, interval: float = 2.0):
        super().__init__()
        self.store_path = store_path
        self.run_ref = run
        self.interval = interval
        self.selected: str | None = None
        self.view: StatusView | None = None
        self.loads = 0  # completed reads of the store (tests wait on it)

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="summary")
        yield RunsTable(id="runs")
        yield Throughput(id="throughput")
        with Horizontal(id="bottom"):
            with Vertical(id="events-box"):
                yield Static("events", id="events-title", classes="title")
                yield EventsTable(id="events")
            with Vertical(id="gpus-box"):
                yield Static("GPUs (latest samples)", classes="title")
                yield GpuTable(id="gpus")
        yield Footer()

    def on_mount(self) -> None:
        self.store = Store(self.store_path)
        self.query_one(RunsTable).focus()
        self.action_reload()
        self.set_interval(self.interval, self.action_reload)

    def on_unmount(self) -> None:
        self.store.close()

    def action_reload(self) -> None:
        self.load(self.selected)

    @work(thread=True, exclusive=True, group="store")
    def load(self, selected: str | None) -> None:
        try:
            view = load_status(self.store, time.time(), self.run_ref, selected)
        except DflashError as e:
            self.call_from_thread(self.notify, str(e), severity="error", timeout=10)
            return
        finally:
            self.store.close()  # this worker thread's connection; the next read opens its own
        self.call_from_thread(self.show, view)

    def show(self, view: StatusView) -> None:
        self.view = view
        self.selected = view.selected
        self.query_one("#summary", Static).update(view.summary())
        self.query_one(RunsTable).show(view.runs, view.selected)
        self.query_one(Throughput).show(view.selected_run)
        self.query_one("#events-title", Static).update(
            f"events of {view.selected}" if view.selected else "events")
        self.query_one(EventsTable).show(view.events)
        self.query_one(GpuTable).show(view.gpus)
        self.loads += 1

    def on_data_table_row_selected(self, message: RunsTable.RowSelected) -> None:
        if message.data_table.id == "runs" and message.row_key.value != self.selected:
            self.selected = message.row_key.value
            self.action_reload()
