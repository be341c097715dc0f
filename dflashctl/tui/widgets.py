"""Widgets of the status console. Each draws one part of a view model
(``dflashctl.status.model``), with the text of ``dflashctl.tui.text``; none reads the
store or a host (the app hands them snapshots)."""

from __future__ import annotations

import re
from typing import Callable
from bisect import bisect_left, bisect_right

from rich.text import Text
from textual import work
from textual.binding import Binding
from textual.containers import Vertical
from textual.geometry import Region, Size
from textual.message import Message
from textual.message_pump import MessagePump
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.types import NoActiveAppError
from textual.widget import Widget
from textual.widgets import DataTable, Input, Static
from textual.worker import get_current_worker

from dflashctl.status.columns import Col, fit, fit_middle
from dflashctl.status.events import EventView
from dflashctl.status.runs import COMPACT_RUN_WIDTH, RunView, select_columns
from dflashctl.status.styles import SEVERITY_STYLE
from dflashctl.tui.logrows import Rows, matches, words_of

# --------------------------------------------------------------------------- widgets


def deliver(node: MessagePump, callback: Callable[..., object], *args, **kwargs) -> None:
    """From a worker's thread, call ``callback`` on the console's thread, unless by then
    ``node`` (the app, or the screen or widget the callback draws on) is gone: a worker
    that finishes as its screen is popped or the console quits has nothing left to draw
    on, and its query would fail and take the console down with it."""
    try:
        app = node.app
    except NoActiveAppError:  # a node taken off its screen, seen from a thread that knows no app
        return

    def live() -> None:
        if app.is_running and (node is app or node.is_attached):
            callback(*args, **kwargs)

    if app.is_running:
        try:
            app.call_from_thread(live)
        except RuntimeError:  # the loop closed between the look and the call: nothing to draw on
            if app.is_running:
                raise


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


# vi's keys beside the arrows, in every list and in the log: j / k a row down / up.
VI_KEYS = [Binding("j", "cursor_down", show=False), Binding("k", "cursor_up", show=False)]


def _current_key(table: DataTable) -> str | None:
    if not table.row_count:
        return None
    return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value


def _differs(shown: Text, new: Text) -> bool:
    return (shown.plain, str(shown.style)) != (new.plain, str(new.style))


class RunsTable(DataTable):
    """One row per run, the run column frozen; Enter opens the run's detail view,
    Home / End go to the first / last run. Refreshing keeps the cursor on its run
    and the sideways scroll where it was."""

    BINDINGS = [
        Binding("enter", "open", "Detail"),
        Binding("home,g", "first", "First run", show=False),
        Binding("end,G", "last", "Last run", show=False),
        *VI_KEYS,
    ]

    _row_only = False  # within _update_row

    class Open(Message):
        def __init__(self, run_id: str) -> None:
            super().__init__()
            self.run_id = run_id

    def __init__(self, **kw) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, fixed_columns=1, **kw)
        self.columns_shown: list[Col] = []
        self.ids: list[str] = []

    def layout_for(self, width: int) -> list[Col]:
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
            for row, run_id in enumerate(ids):
                changed = [(c.key, value) for c, value in zip(columns, cells[run_id])
                           if _differs(self.get_cell(run_id, c.key), value)]
                if changed:
                    self._update_row(row, run_id, changed)
            return
        self.clear()
        for run_id in ids:
            self.add_row(*cells[run_id], key=run_id)
        self.ids = ids
        if keep_key in ids:
            self.move_cursor(row=ids.index(keep_key), animate=False, scroll=True)
        if keep_x:
            self.call_after_refresh(self.scroll_to, x=keep_x, animate=False)

    def _update_row(self, row: int, run_id: str, changed: list[tuple[str, Text]]) -> None:
        """The changed cells of one row, and that row alone painted again: an age ticking
        in one run's row repaints neither the header nor the other runs (``update_cell``
        alone repaints the whole table, every cell rendered again)."""
        self._row_only = True
        try:
            for key, value in changed:
                self.update_cell(run_id, key, value)
        finally:
            self._row_only = False
        self.refresh_row(row)

    def refresh(self, *regions, **kw):
        if self._row_only and not regions and not kw:
            return self  # update_cell's whole repaint; _update_row repaints its row
        return super().refresh(*regions, **kw)

    @staticmethod
    def _cell(run: RunView, c: Col) -> Text:
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
    """Events, newest at the bottom, each with its class (and its run, ``with_run``:
    the feed across runs); Enter opens one in full (``screens.EventScreen``). A read
    that brings the same events changes nothing on screen."""

    BINDINGS = [*VI_KEYS, Binding("g", "scroll_top", show=False), Binding("G", "scroll_bottom", show=False)]

    def __init__(self, with_run: bool = False, **kw) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kw)
        self.with_run = with_run
        self.events: list[EventView] = []
        self._shown: list[tuple[int, str]] | None = None

    def event_at(self, key: str) -> EventView | None:
        try:
            return self.events[int(key)]
        except (ValueError, IndexError):
            return None

    def on_mount(self) -> None:
        if self.with_run:
            self.add_column("run", key="run")
        self.add_column("time", key="time")
        self.add_column("severity", key="severity")
        self.add_column("class", key="class")
        self.add_column("message", key="message")

    def show(self, events: list[EventView]) -> None:
        shown = [(e.id, e.message) for e in events]
        if shown == self._shown:
            return
        self._shown = shown
        at_end = self.cursor_row >= self.row_count - 1
        self.events = list(events)
        self.clear()
        for i, e in enumerate(events):
            time_text, severity, kind, message = e.cells()
            cells = [time_text, Text(severity, style=SEVERITY_STYLE.get(severity, "")), kind, message]
            self.add_row(*([e.run_id or "-"] if self.with_run else []), *cells, key=str(i))
        if events and at_end:
            self.move_cursor(row=len(events) - 1, animate=False)


class Pane(Widget):
    """A block of text drawn from a view; ``draw`` gets the width and the height of
    the box it is drawn in. Only what changed is drawn again: text equal to what is
    shown is a comparison (most refreshes change nothing: a supervisor polls every
    15 s, the screen reads every 2 s), and of a text that changed only its changed
    lines are laid out and painted (an age ticking in a header repaints that line, not
    the charts under it). The screen is laid out again only when the number of rows
    changes. Lines wrap at the pane's width unless its ``text-wrap`` is ``nowrap``."""

    DEFAULT_CSS = "Pane { height: auto; }"

    def __init__(self, draw=None, **kw) -> None:
        super().__init__(**kw)
        self.draw = draw
        self.shown: Text | None = None
        self._lines: list[Text] = []  # the shown text's lines
        self._rows: list[list[Strip]] = []  # each line's rows at ``_width``
        self._width = 0

    def redraw(self, draw=None) -> None:
        if draw is not None:
            self.draw = draw
        if self.draw is not None:
            box = self.parent if self.parent is not None else self
            self.show(self.draw(max(20, self.size.width or self.app.size.width), box.size.height))

    def show(self, text: Text) -> None:
        """``text`` in the pane, unless it is what the pane shows."""
        if text == self.shown:
            return
        self.shown = text
        lines = text.split("\n", allow_blank=True) if text.plain else []
        old, width = self._lines, self._row_width()
        if width != self._width or len(lines) != len(old):
            self._lines, self._width = list(lines), width
            self._rows = [self._layout(line) for line in lines]
            self.refresh(layout=True)
            return
        self._lines, y, grown = list(lines), 0, False
        for i, (was, line) in enumerate(zip(old, lines)):
            if was != line or was.style != line.style:
                rows = self._layout(line)
                grown |= len(rows) != len(self._rows[i])
                if not grown:
                    self.refresh(Region(0, y, width, len(rows)))
                self._rows[i] = rows
            y += len(self._rows[i])
        if grown:
            self.refresh(layout=True)

    def _row_width(self) -> int:
        return max(1, self.content_size.width or (self.app.size.width if self.is_attached else 80))

    def _layout(self, line: Text) -> list[Strip]:
        """One line's rows: wrapped at the pane's width, or cut there (``nowrap``)."""
        console, width = self.app.console, self._width
        base = console.get_style(line.style) if line.style else None

        def strip(part: Text) -> Strip:
            row = Strip(part.render(console), part.cell_len)  # the spans' styles: the line's own is ours to apply
            return row.apply_style(base) if base else row

        if self.styles.text_wrap == "nowrap" or line.cell_len <= width:
            return [strip(line).crop(0, width)]
        parts = list(line.wrap(console, width))
        for part in parts[:-1]:
            part.rstrip()  # the space a line breaks at is not drawn (nor its reverse video)
        return [strip(part) for part in parts]

    def render(self) -> Text:
        """The text shown, whole (what is painted comes line by line from ``render_line``)."""
        return self.shown if self.shown is not None else Text()

    def on_resize(self) -> None:
        if self._row_width() != self._width and self.shown is not None:
            text, self.shown = self.shown, None
            self.show(text)
        self.redraw()

    def get_content_width(self, container: Size, viewport: Size) -> int:
        return max((line.cell_len for line in self._lines), default=0)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        if width != self._width and self._lines:
            self._width = max(1, width)
            self._rows = [self._layout(line) for line in self._lines]
        return sum(map(len, self._rows))

    def render_line(self, y: int) -> Strip:
        style, width = self.rich_style, self.content_size.width
        for rows in self._rows:
            if y < len(rows):
                return rows[y].apply_style(style).extend_cell_length(width, style)
            y -= len(rows)
        return Strip.blank(width, style)


class LogLines(ScrollView, can_focus=True):
    """A trainer's log, followed as it grows. Scrolling up (keys, wheel) pauses the
    following: new lines are kept and counted, never scrolled to ("paused, N new
    lines, End to follow" under it) until End. ``/`` (the screen's filter box) shows
    only the lines with every word typed; ``m`` shows every line again with those
    words marked, ``n`` / ``N`` jump to the next / previous line that has them. ``t``
    wraps long lines (or not). ``h``, or scrolling up at the top, asks the screen
    for earlier lines (``Earlier``); the screen reads them in bounded chunks and
    ``prepend``s them. At most ``KEEP`` lines are held (the newest, as it follows).

    Only the rows on screen are drawn (Textual's line API). Which lines a filter
    shows and where wrapped lines are cut (``logrows.Rows``) is computed in a thread
    worker, ``CHUNK`` lines at a time, a newer key cancelling an older computation:
    the screen's thread never walks the held lines. Until it is done the rows
    computed before stay on screen and the marker says "filtering…"."""

    KEEP = 20000
    CHUNK = 1000  # lines per step of the rows' worker; an append of at most this many is taken at once
    CACHED = 512  # rows drawn kept for redrawing
    DEFAULT_CSS = """
    LogLines { background: $surface; color: $foreground; overflow-y: scroll; }
    LogLines:focus { background-tint: $foreground 5%; }
    """
    BINDINGS = [
        Binding("end,G", "follow", "Follow", key_display="End"),
        Binding("t", "wrap", "Wrap"),
        Binding("h", "earlier", "Earlier"),
        Binding("n", "next_match", "Next"),
        Binding("N", "previous_match", "Prev", key_display="N"),
        Binding("m", "only_matches", "Matches only"),
        Binding("j", "scroll_down", show=False),
        Binding("k", "scroll_up", show=False),
        Binding("g", "scroll_home", show=False),
    ]

    class Earlier(Message):
        """Earlier lines are asked for (``h``, or scrolled up at the top)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.kept: list[str] = []
        self.base = 0  # the absolute index of kept[0] (logrows)
        self.filter_text = ""
        self.only_matches = True  # the filter hides the other lines (m: shows them, the words marked)
        self.wrap = False
        self.paused = False
        self.unseen = 0  # lines added while paused
        self._match: int | None = None  # absolute index of the line n / N went to
        self.history = ""  # what the screen says of the earlier lines ("start of the log", ...)
        self.rows = Rows()
        self.rebuilding = False  # a worker computes the rows anew
        self._generation = 0  # of the newest rows asked for; an older worker's are dropped
        self._wrapped_at = 0
        self._pattern: re.Pattern | None = None
        self._cache: dict[tuple[int, int], Strip] = {}

    # -- what is held and shown

    @property
    def match(self) -> int | None:
        """The index in ``kept`` of the line n / N went to (None: none)."""
        return None if self._match is None else self._match - self.base

    def texts(self) -> list[str]:
        """The text of every row shown, in order (what the view scrolls over)."""
        rows, out = self.rows, []
        for r, (index, start) in enumerate(zip(rows.line, rows.start)):
            line = self.kept[index - self.base]
            out.append(line[start:rows.end_of(r, len(line))])
        return out

    def _new_rows(self) -> Rows:
        width = self.scrollable_content_region.width if self.wrap else 0
        self._wrapped_at = width
        return Rows(words_of(self.filter_text), self.only_matches, max(1, width) if self.wrap else 0)

    def rebuild(self) -> None:
        """The rows anew (after a filter, wrap, width or history change), in a worker."""
        self._generation += 1
        self.rebuilding = True
        words = words_of(self.filter_text)
        self._pattern = re.compile("|".join(map(re.escape, words)), re.IGNORECASE) if words else None
        self._rows_worker(self._generation, self._new_rows(), list(self.kept), self.base)
        self.show_marker()

    @work(thread=True, exclusive=True, group="log-rows")
    def _rows_worker(self, generation: int, rows: Rows, lines: list[str], first: int) -> None:
        worker = get_current_worker()
        for at in range(0, len(lines), self.CHUNK):
            if worker.is_cancelled or generation != self._generation:
                return
            rows.extend(lines[at:at + self.CHUNK], first + at)
        if rows.upto is None:
            rows.upto = first
        if not worker.is_cancelled:
            deliver(self, self._install, generation, rows)

    def _install(self, generation: int, rows: Rows) -> None:
        if generation != self._generation:
            return
        end = self.base + len(self.kept)
        start = max(rows.upto, self.base)
        if end - start > self.CHUNK:  # many lines came meanwhile: the worker takes them too
            self._rows_worker(generation, rows, self.kept[start - self.base:], start)
            return
        top = self._top_line()
        rows.extend(self.kept[start - self.base:], start)
        rows.drop_before(self.base)
        self.rows, self.rebuilding = rows, False
        self._cache.clear()
        self._resized()
        if self.paused and top is not None:
            self.scroll_to(y=rows.row_at_or_after(top), animate=False, immediate=True)
        self.show_marker()

    def _top_line(self) -> int | None:
        top = int(self.scroll_y)
        return self.rows.line[top] if top < len(self.rows) else None

    def _resized(self) -> None:
        """The scrolled size after the rows changed; following: the end in view."""
        self.virtual_size = Size(0 if self.wrap else self.rows.widest, len(self.rows))
        self.refresh()
        if not self.paused:
            self.scroll_end(animate=False, immediate=True, x_axis=False)

    def add(self, lines: list[str]) -> int:
        """Append lines read from the log; returns how many were taken."""
        lines = [line.expandtabs() if "\t" in line else line for line in lines]
        first = self.base + len(self.kept)
        self.kept.extend(lines)
        rows, shown = self.rows, len(lines)
        if len(lines) > self.CHUNK and not self.rebuilding:
            self.rebuild()
        elif not self.rebuilding or rows.upto == first:  # the rows on screen take them now
            found = len(rows.found)
            rows.extend(lines, first)
            if rows.words and rows.only_matches:
                shown = len(rows.found) - found
        if len(self.kept) > self.KEEP:
            drop = len(self.kept) - self.KEEP
            del self.kept[:drop]
            self.base += drop
            before = len(rows)
            rows.drop_before(self.base)
            self._cache.clear()
            if self._match is not None and self._match < self.base:
                self._match = None
            self.history = ""  # the oldest are gone again: earlier lines can be read again
            if self.paused:
                self.scroll_to(y=max(0, self.scroll_y - (before - len(rows))), animate=False, immediate=True)
        self._resized()
        if self.paused:
            self.unseen += shown
            self.show_marker()
        return len(lines)

    def prepend(self, lines: list[str], note: str = "") -> int:
        """Earlier lines, before the first held; the view stays on what it showed
        (the following pauses: the operator is reading back). Lines past ``KEEP`` are
        not taken (the note says so)."""
        room = max(0, self.KEEP - len(self.kept))
        taken = lines[len(lines) - room:] if room < len(lines) else lines
        taken = [line.expandtabs() if "\t" in line else line for line in taken]
        self.history = note
        if taken:
            self.kept[:0] = taken
            self.base -= len(taken)
            self.paused = True
            self.rebuild()
        self.show_marker()
        return len(taken)

    def set_filter(self, text: str) -> None:
        self.filter_text, self._match = text, None
        self.rebuild()

    def show_marker(self) -> None:
        parent = self.parent
        if parent is None:
            return
        marker = parent.query_one("#log-marker", Static)
        parts = []
        if self.paused:
            parts.append(f"paused, {self.unseen:,} new line{'s' if self.unseen != 1 else ''}, End to follow")
        if self.rebuilding:
            parts.append("filtering…" if self.filter_text else "wrapping…")
        elif self.filter_text and not self.only_matches:
            found = len(self.rows.found)
            at = "" if self.match is None else f" (at line {self.match + 1:,} of {len(self.kept):,})"
            parts.append(f"'{self.filter_text}': {found:,} line{'s' if found != 1 else ''}{at}, n / N")
        if self.history:
            parts.append(self.history)
        marker.update(Text(" · ".join(parts), style="bold black on yellow" if self.paused else "dim"))
        marker.display = bool(parts)

    # -- drawing: the rows on screen only

    def _text(self, index: int, line: str) -> Text:
        text = Text(line)
        pattern = self._pattern
        if pattern is not None and self.rows.words and matches(line, self.rows.words):
            text.highlight_regex(pattern, "reverse bold" if index == self._match else "bold yellow")
        return text

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        width = self.scrollable_content_region.width
        rows, r = self.rows, scroll_y + y
        if r >= len(rows):
            return Strip.blank(width, self.rich_style)
        key = (rows.line[r], rows.start[r])
        strip = self._cache.get(key)
        if strip is None:
            line = self.kept[key[0] - self.base]
            end = rows.end_of(r, len(line))
            text = self._text(key[0], line)
            if key[1] or end < len(line):
                text = text[key[1]:end]
            strip = Strip(list(text.render(self.app.console)), text.cell_len)
            if len(self._cache) >= self.CACHED:
                self._cache.clear()
            self._cache[key] = strip
        return strip.crop_extend(scroll_x, scroll_x + width, self.rich_style).apply_style(self.rich_style)

    # -- keys

    def pause(self) -> None:
        if not self.paused:
            self.paused, self.unseen = True, 0
            self.show_marker()

    def action_follow(self) -> None:
        self.paused, self.unseen = False, 0
        self.scroll_end(animate=False, immediate=True, x_axis=False)
        self.show_marker()

    def _up(self) -> None:
        if self.scroll_y <= 0:
            self.post_message(self.Earlier())
        self.pause()

    def action_scroll_up(self) -> None:
        self._up()
        super().action_scroll_up()

    def action_page_up(self) -> None:
        self._up()
        super().action_page_up()

    def action_scroll_home(self) -> None:
        self._up()
        super().action_scroll_home()

    def on_mouse_scroll_up(self, event) -> None:
        # Beside Widget's own handler (which scrolls): Textual calls each class's.
        self._up()

    def on_resize(self, event) -> None:
        # Wrapped lines are wrapped again at the new width.
        if self.wrap and event.size.width != self._wrapped_at:
            self.rebuild()

    def action_wrap(self) -> None:
        self.wrap = not self.wrap
        self.rebuild()
        self.app.notify(f"log: long lines {'wrapped' if self.wrap else 'cut (scroll sideways)'}", timeout=2)

    def action_earlier(self) -> None:
        self.post_message(self.Earlier())

    def action_only_matches(self) -> None:
        self.only_matches = not self.only_matches
        self.rebuild()

    def _jump(self, step: int) -> None:
        if not words_of(self.filter_text):
            self.app.notify("no search: / then the words to find", severity="warning", timeout=3)
            return
        found = self.rows.found
        if not found:
            what = "is still being looked for" if self.rebuilding else "is in no line held"
            self.app.notify(f"'{self.filter_text}' {what}", severity="warning", timeout=3)
            return
        if step > 0:
            i = 0 if self._match is None else bisect_right(found, self._match)
            self._match = found[i] if i < len(found) else found[0]
        else:
            i = len(found) if self._match is None else bisect_left(found, self._match)
            self._match = found[i - 1] if i > 0 else found[-1]
        self.pause()
        self._cache.clear()
        self.refresh()
        self.show_marker()
        row = self.rows.first_row_of(self._match)
        if row is not None:
            self.scroll_to(y=max(0, row - self.scrollable_content_region.height // 3), animate=False,
                           immediate=True)

    def action_next_match(self) -> None:
        self._jump(1)

    def action_previous_match(self) -> None:
        self._jump(-1)


class LogView(Vertical):
    """``LogLines`` and the line under it that says it is paused (new lines waiting),
    what a search found, and how far back the log is held."""

    DEFAULT_CSS = """
    LogView { height: 1fr; }
    LogView > LogLines { height: 1fr; }
    LogView > #log-marker { height: 1; display: none; padding: 0 1; }
    """

    def __init__(self, log_id: str = "log-text", **kw) -> None:
        super().__init__(**kw)
        self.log_id = log_id

    def compose(self):
        yield LogLines(id=self.log_id)
        yield Static(id="log-marker")
