"""Widgets of the status console. Each draws one part of a view model
(``dflashctl.tui.model``), with the text of ``dflashctl.tui.text``; none reads the
store or a host (the app hands them snapshots)."""

from __future__ import annotations

from rich.text import Text
from textual.binding import Binding
from textual.message import Message
from textual.widgets import DataTable, Input, Static

from dflashctl.tui.model import (
    COMPACT_RUN_WIDTH, SEVERITY_STYLE, Column, EventView, RunView, fit, fit_middle, select_columns,
)

# --------------------------------------------------------------------------- widgets


class FilterBox(Input):
    """The ``/`` filter of a screen: hidden and disabled until opened, so it never
    takes the focus (nor a key) unseen; open, it has the focus and every printable
    key is text in it, never a command."""

    DEFAULT_CSS = """
    FilterBox { display: none; padding: 0 1; }
    FilterBox.-shown { display: block; }
    """

    def __init__(self, **kw) -> None:
        super().__init__(disabled=True, compact=True, **kw)

    @property
    def shown(self) -> bool:
        return self.has_class("-shown")

    def open(self) -> None:
        self.disabled = False
        self.add_class("-shown")
        # At once, not after a refresh (``focus()`` is deferred): keys typed right after
        # `/` (a paste, a fast typist, send-keys) are already queued behind it, and each
        # must reach the box, not the view's keys.
        self.screen.set_focus(self)

    def close(self, clear: bool = True) -> None:
        """Hide it (its text kept unless ``clear``); the caller moves the focus."""
        if clear:
            self.value = ""
        self.remove_class("-shown")
        self.disabled = True


def _current_key(table: DataTable) -> str | None:
    if not table.row_count:
        return None
    return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value


class RunsTable(DataTable):
    """One row per run, the run column frozen; Enter opens the run's detail view,
    Home / End go to the first / last run. Refreshing keeps the cursor on its run
    and the sideways scroll where it was."""

    BINDINGS = [
        Binding("enter", "open", "Detail"),
        Binding("home", "first", "First run", show=False),
        Binding("end", "last", "Last run", show=False),
    ]

    class Open(Message):
        def __init__(self, run_id: str) -> None:
            super().__init__()
            self.run_id = run_id

    def __init__(self, **kw) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, fixed_columns=1, **kw)
        self.columns_shown: list[Column] = []
        self.ids: list[str] = []

    def layout_for(self, width: int) -> list[Column]:
        compact = width < 100
        return select_columns(width - 2, gap=2, run_width=COMPACT_RUN_WIDTH if compact else 25)

    def show(self, runs: list[RunView], width: int) -> None:
        columns = self.layout_for(width)
        keep_key, keep_x = _current_key(self), self.scroll_x
        if [c.key for c in columns] != [c.key for c in self.columns_shown] or \
                [c.width for c in columns] != [c.width for c in self.columns_shown]:
            self.clear(columns=True)
            for c in columns:
                self.add_column(Text(c.header, justify=c.justify), width=c.width, key=c.key)
            self.columns_shown, self.ids = columns, []
        ids = [r.id for r in runs]
        cells = {r.id: [self._cell(r, c) for c in columns] for r in runs}
        if ids == self.ids:
            for run_id in ids:
                for c, value in zip(columns, cells[run_id]):
                    old = self.get_cell(run_id, c.key)
                    if (old.plain, str(old.style)) != (value.plain, str(value.style)):
                        self.update_cell(run_id, c.key, value)
            return
        self.clear()
        for run_id in ids:
            self.add_row(*cells[run_id], key=run_id)
        self.ids = ids
        if keep_key in ids:
            self.move_cursor(row=ids.index(keep_key), animate=False, scroll=True)
        if keep_x:
            self.call_after_refresh(self.scroll_to, x=keep_x, animate=False)

    @staticmethod
    def _cell(run: RunView, c: Column) -> Text:
        text = run.cell(c.key)
        text = fit_middle(text, c.width) if c.key == "run" else fit(text, c.width)
        return Text(text, style=run.style(c.key), justify=c.justify, no_wrap=True, overflow="ellipsis")

    @property
    def current(self) -> str | None:
        return _current_key(self)

    def action_open(self) -> None:
        if self.current is not None:
            self.post_message(self.Open(self.current))

    def action_first(self) -> None:
        if self.row_count:
            self.move_cursor(row=0, animate=False)

    def action_last(self) -> None:
        if self.row_count:
            self.move_cursor(row=self.row_count - 1, animate=False)


class EventsTable(DataTable):
    """A run's events, newest at the bottom, each with its class; Enter opens one
    in full (``screens.EventScreen``)."""

    def __init__(self, **kw) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kw)
        self.events: list[EventView] = []

    def event_at(self, key: str) -> EventView | None:
        try:
            return self.events[int(key)]
        except (ValueError, IndexError):
            return None

    def on_mount(self) -> None:
        self.add_column("time", key="time")
        self.add_column("severity", key="severity")
        self.add_column("class", key="class")
        self.add_column("message", key="message")

    def show(self, events: list[EventView]) -> None:
        at_end = self.cursor_row >= self.row_count - 1
        self.events = list(events)
        self.clear()
        for i, e in enumerate(events):
            time_text, severity, kind, message = e.cells()
            self.add_row(time_text, Text(severity, style=SEVERITY_STYLE.get(severity, "")), kind, message, key=str(i))
        if events and at_end:
            self.move_cursor(row=len(events) - 1, animate=False)


class Pane(Static):
    """A block of text drawn from a view; ``draw`` gets the width and the height of
    the box it is drawn in. Text equal to what is shown is not drawn again (most
    refreshes change nothing: a supervisor polls every 15 s, the screen reads
    every 2 s)."""

    def __init__(self, draw=None, **kw) -> None:
        super().__init__(**kw)
        self.draw = draw
        self.shown: Text | None = None

    def redraw(self, draw=None) -> None:
        if draw is not None:
            self.draw = draw
        if self.draw is not None:
            box = self.parent if self.parent is not None else self
            text = self.draw(max(20, self.size.width or self.app.size.width), box.size.height)
            if text != self.shown:
                self.shown = text
                self.update(text)

    def on_resize(self) -> None:
        self.redraw()
