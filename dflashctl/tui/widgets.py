"""Widgets of the status screen. Each draws one part of a ``StatusView``; none reads
the store or a host (the app hands them snapshots)."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.widgets import DataTable, Sparkline, Static

from dflashctl.detectors import fmt_tok_s
from dflashctl.tui.model import (
    EVENT_COLUMNS,
    GPU_COLUMNS,
    RUN_COLUMNS,
    SEVERITY_STYLE,
    STATE_STYLE,
    EventView,
    GpuView,
    RunView,
)


def _current_key(table: DataTable) -> str | None:
    if not table.row_count:
        return None
    return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value


class RunsTable(DataTable):
    """One row per run; Enter (or a click) selects the run whose events are shown."""

    BINDINGS = [Binding("enter", "select_cursor", "Show events")]

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.add_columns(*RUN_COLUMNS)

    def show(self, runs: list[RunView], selected: str | None) -> None:
        keep = _current_key(self) or selected
        self.clear()
        for run in runs:
            cells = list(run.cells())
            cells[0] = Text(("▶ " if run.id == selected else "  ") + cells[0])
            cells[1] = Text(cells[1], style=STATE_STYLE.get(run.state, ""))
            self.add_row(*cells, key=run.id)
        ids = [r.id for r in runs]
        if keep in ids:
            self.move_cursor(row=ids.index(keep), animate=False)


class EventsTable(DataTable):
    """The selected run's recent events, newest at the bottom."""

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.add_columns(*EVENT_COLUMNS)

    def show(self, events: list[EventView]) -> None:
        self.clear()
        for event in events:
            time_text, severity, kind, message = event.cells()
            self.add_row(time_text, Text(severity, style=SEVERITY_STYLE.get(severity, "")), kind, message)
        if events:
            self.move_cursor(row=len(events) - 1, animate=False)


class GpuTable(DataTable):
    """GPU readings from the latest samples of active runs."""

    def on_mount(self) -> None:
        self.add_columns(*GPU_COLUMNS)

    def show(self, gpus: list[GpuView]) -> None:
        self.clear()
        for i, gpu in enumerate(gpus):
            self.add_row(*gpu.cells(), key=f"{gpu.run_id}:{gpu.index}:{i}")


class Throughput(Vertical):
    """The selected run's tok/s history as a sparkline, with its figures."""

    DEFAULT_CSS = """
    Throughput { height: 3; }
    Throughput > Sparkline { height: 2; }
    """

    def compose(self) -> ComposeResult:
        yield Static(id="throughput-label")
        yield Sparkline([], summary_function=max, id="throughput-spark")

    def show(self, run: RunView | None) -> None:
        label = self.query_one("#throughput-label", Static)
        spark = self.query_one("#throughput-spark", Sparkline)
        history = run.tok_s_history if run else []
        spark.data = history
        if run is None:
            label.update("tok/s: no run selected")
        elif not history:
            label.update(f"tok/s of {run.id}: no samples yet")
        else:
            label.update(f"tok/s of {run.id}: now {fmt_tok_s(run.tok_s)}, min {fmt_tok_s(min(history))}, "
                         f"max {fmt_tok_s(max(history))} over {len(history)} samples")
