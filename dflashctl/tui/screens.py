"""Screens over the status console's main screen: the key panel (``?``), a yes/no
confirmation (before ``stop`` and ``restart``), and a run's detail view (Enter,
``e`` events, ``l`` log): overview with its whole history as charts, thresholds
and environment audit; every event with its class; the trainer's log, followed.

They read through the app (``app.reader``, a ``StatusReader``) in thread workers
and draw snapshots; the log is read from the run host in a worker too, so no
screen ever waits on the store or on SSH.
"""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Footer, Static, TabbedContent, TabPane
from textual.worker import get_current_worker

from dflashctl.core.contract import TAU_GAP_MARGIN
from dflashctl.core.errors import DflashError, first_line
from dflashctl.status.events import EventView, filter_events
from dflashctl.status.styles import STATE_STYLE
from dflashctl.status.views import DetailView
from dflashctl.tui.text import detail_text, event_text
from dflashctl.tui.widgets import EventsTable, FilterBox, LogLines, LogView, Pane, deliver

KEYS = [
    ("↑ ↓  PgUp PgDn", "move between runs (j k too); the panels below follow the cursor"),
    ("Home / End", "first / last run (g G too)"),
    ("Enter", "the run's detail: overview, c charts (zoom, the value under the cursor)"),
    ("e / E", "the run's events, each with its class (Enter on one: in full, with the trainer's first error line) / "
              "the events of every run"),
    ("l", "the log, followed: scroll up pauses (End follows), t wrap, h earlier, / m n N find"),
    ("a / w", "attach to its tmux session (popup, split or here; several hosts: a digit picks the rank) / "
              "start a supervisor (asks)"),
    ("x", "stop the run under the cursor (asks first, saying what happens): the trainer checkpoints and exits"),
    ("r", "restart the run under the cursor from its last checkpoint (asks first; a running trainer is stopped "
          "first); y in the question says yes, anything else no"),
    ("/", "filter what is shown: runs by id, playbook, host, state or phase; in a run's detail its events or log "
          "lines (typed keys go to the filter box; Enter keeps it, Esc clears)"),
    ("s", "sort: needs attention first, state, host, progress, tok/s, ETA, newest"),
    ("z", "zoom the history charts (the run's pane and its detail): the last 1 h, 6 h, the whole run; "
          "↻ marks a restart, ‖ a stall"),
    ("F5 / Ctrl+R", "read the store now"),
    ("Esc", "back: close a panel, put away the new-error banner, clear the filter, leave a detail view"),
    ("? ", "this panel"),
    ("--readonly", "status --readonly (or DFLASHCTL_READONLY=1): no stop / restart / attach / watch keys"),
    ("q / Ctrl+C", "quit"),
]

LEGEND = [
    ("state", "as stored, or unsupervised (no supervisor ticks for it: the fix is shown), unreachable (its host "
              "does not answer), stale (no fresh answer yet)"),
    ("phase", "starting, compiling, training, checkpointing, restarting: time in it / the playbook's budget"),
    ("done", "share of the steps done; step: step / total"),
    ("ETA", "from the step rate over the newest 5 minutes of data; 'stale' when the data is not live"),
    ("tok/s", "mean over the newest 5 minutes of training samples; %base: share of the baseline"),
    ("τ est", "tau estimated in training: accept_len + 1, the tokens one target forward would yield"),
    ("τ", "tau measured by speculative decoding (dflashctl eval); yellow: more than "
           f"{100 * TAU_GAP_MARGIN:.0f}% below τ est (the status line says why)"),
    ("age", "how old the newest sample is; rst: restarts"),
    ("GPUs", "per host: role (target / drafter), the run holding it, utilisation and memory bars, temperature, "
             "power, utilisation history"),
    ("hosts", "a run on several hosts (its detail, and status --once): per rank its host, phase (or how its process "
              "ended), step and when its host last answered; 'stale:' past three poll intervals"),
]


class HelpScreen(ModalScreen):
    """The key panel: every key, and what each column means."""

    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 90%; max-width: 110; height: 90%; border: round $accent;
                                  background: $surface; padding: 0 1; }
    """
    BINDINGS = [Binding("escape,question_mark,q", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        def table(rows, style: str) -> Table:
            # Two columns: a long description wraps under itself, not under its key.
            grid = Table.grid(padding=(0, 2))
            grid.add_column(style=style, no_wrap=True)
            grid.add_column(ratio=1)
            for name, what in rows:
                grid.add_row(f"  {name}", what)
            return grid

        footnote = Text(f"\nstore: {getattr(self.app, 'store_path', '')}\nmouse: click a run to select it, a key in "
                        "the footer to press it; ↑ ↓ PgUp PgDn scroll this panel, Esc closes it", style="dim")
        with VerticalScroll():
            yield Static(Group(Text("keys", style="bold underline"), table(KEYS, "bold cyan"),
                               Text("\ncolumns", style="bold underline"), table(LEGEND, "bold"), footnote),
                         id="help-text")


class ConfirmScreen(ModalScreen[bool]):
    """A yes/no question: only ``y`` says yes; n, Esc or Enter no (Enter submits a
    filter or opens a run elsewhere: a stray one must never stop a trainer), and
    every other key is swallowed here."""

    DEFAULT_CSS = """
    ConfirmScreen { align: center middle; }
    ConfirmScreen > Vertical { width: 70; max-width: 95%; height: auto; border: thick $warning;
                               background: $surface; padding: 1 2; }
    """
    BINDINGS = [Binding("y", "answer(True)", "Yes"), Binding("n,escape,enter", "answer(False)", "No")]

    def __init__(self, question: str, detail: str = "") -> None:
        super().__init__()
        self.question, self.detail = question, detail

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(Text(self.question, style="bold"), id="question")
            if self.detail:
                yield Static(Text(self.detail, style="dim"))
            yield Static(Text.assemble(("y", "bold green"), " yes   ", ("n", "bold red"), " / Esc / Enter no"))

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class RankScreen(ModalScreen["int | None"]):
    """Which process of a run on several hosts ``a`` attaches to: a digit picks its
    rank; Esc or Enter picks none (a stray Enter must not attach anywhere)."""

    DEFAULT_CSS = """
    RankScreen { align: center middle; }
    RankScreen > Vertical { width: 70; max-width: 95%; height: auto; border: thick $accent;
                            background: $surface; padding: 1 2; }
    """
    BINDINGS = [Binding("escape,enter", "pick(None)", "None")] + [
        Binding(str(d), f"pick({d})", show=False) for d in range(10)]

    def __init__(self, run_id: str, hosts: list[tuple[int, str]]) -> None:
        super().__init__()
        self.run_id, self.hosts = run_id, hosts  # (rank, host), by rank

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(Text(f"Attach to which process of {self.run_id}?", style="bold"))
            for rank, host in self.hosts:
                yield Static(Text.assemble((f"{rank}", "bold green"), f"  rank {rank} on {host}"))
            yield Static(Text("Esc / Enter: none", style="dim"))

    def action_pick(self, rank: "int | None") -> None:
        if rank is None or any(r == rank for r, _ in self.hosts):
            self.dismiss(rank)


class EventScreen(ModalScreen[None]):
    """One event in full (Enter on an event): its whole message, the trainer's own
    first error line and the signature it matched. Esc, Enter or q closes it."""

    DEFAULT_CSS = """
    EventScreen { align: center middle; }
    EventScreen > VerticalScroll { width: 100; max-width: 95%; height: auto; max-height: 90%;
                                   border: thick $error; background: $surface; padding: 1 2; }
    """
    BINDINGS = [Binding("escape,enter,q", "close", "Close")]

    def __init__(self, event: EventView) -> None:
        super().__init__()
        self.event = event

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(event_text(self.event), id="event-text")

    def action_close(self) -> None:
        self.dismiss(None)


class FeedScreen(Screen):
    """The events of every run, newest at the bottom (``E``), read again on the
    console's interval in a worker: what happened across runs in one place. ``/``
    filters them (run, time, severity, class, message), Enter shows one in full,
    Esc goes back."""

    DEFAULT_CSS = """
    #feed-title { height: 1; background: $boost; padding: 0 1; }
    #feed { height: 1fr; }
    """
    BINDINGS = [
        Binding("escape", "back", "Back"),
        Binding("slash", "filter", "Filter", key_display="/", priority=True),
        Binding("q", "app.quit", "Quit", show=False),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.events: list[EventView] = []
        self.filter_text = ""
        self.loads = 0

    def compose(self) -> ComposeResult:
        yield Static(id="feed-title")
        yield FilterBox(placeholder="filter the events: words in run, class, message (Enter keeps, Esc clears)",
                        id="feed-filter")
        yield EventsTable(with_run=True, id="feed")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.set_focus(self.query_one(EventsTable))
        self.reload()
        self.set_interval(self.app.interval, self.reload)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        return not (action == "filter" and isinstance(self.focused, FilterBox))

    def reload(self) -> None:
        self.load()

    @work(thread=True, exclusive=True, group="feed")
    def load(self) -> None:
        from dflashctl.status.events import feed

        app = self.app
        try:
            events = feed(app.reader.store)
        except DflashError as e:
            deliver(app, app.notify, first_line(e), severity="error", timeout=10)
            return
        if not get_current_worker().is_cancelled:
            deliver(self, self.show, events)

    def show(self, events: list[EventView]) -> None:
        self.events = events
        shown = filter_events(events, self.filter_text)
        title = Text.assemble(("events of every run", "bold"), f" · the newest {len(events):,}",
                              (f" · filter '{self.filter_text}' ({len(shown):,})" if self.filter_text else "", "cyan"),
                              ("   Enter: one in full · / filter · Esc back", "dim"))
        self.query_one("#feed-title", Static).update(title)
        self.query_one(EventsTable).show(shown)
        self.loads += 1

    def action_filter(self) -> None:
        self.query_one(FilterBox).open()

    def action_back(self) -> None:
        box = self.query_one(FilterBox)
        if box.shown or self.filter_text:
            box.close()
            self.filter_text = ""
            self.set_focus(self.query_one(EventsTable))
            self.show(self.events)
            return
        self.app.pop_screen()

    def on_key(self, event) -> None:
        if event.key == "escape" and self.focused is self.query_one(FilterBox):
            event.stop()
            self.action_back()

    def on_input_changed(self, message: FilterBox.Changed) -> None:
        message.stop()
        self.filter_text = message.value.strip()
        self.show(self.events)

    def on_input_submitted(self, message: FilterBox.Submitted) -> None:
        message.stop()
        self.query_one(FilterBox).close(clear=not self.filter_text)
        self.set_focus(self.query_one(EventsTable))

    def on_data_table_row_selected(self, message) -> None:
        if message.row_key is not None:
            message.stop()
            event = self.query_one(EventsTable).event_at(message.row_key.value)
            if event is not None:
                self.app.push_screen(EventScreen(event))


class DetailScreen(Screen):
    """One run in full; its tabs: overview, events, log. ``/`` filters the events or
    the log lines (from the overview: the events); while the filter box has the
    focus every printable key is text in it, never a command."""

    DEFAULT_CSS = """
    #detail-title { height: 1; background: $boost; padding: 0 1; }
    #tabs { height: 1fr; }  /* what the title and the footer leave: never scrolls the title away */
    #overview-box { height: 1fr; }
    """
    LOG_TAIL = 200  # lines of the log read first
    HISTORY_LINES, HISTORY_BYTES = 2000, 1 << 20  # at most this much earlier log per read (h)
    BINDINGS = [
        Binding("escape", "back", "Back"),
        Binding("slash", "filter", "Filter", key_display="/", priority=True),  # as in the app: see there
        # Not in the footer (the title line names them): it has the log's keys.
        Binding("o", "tab('overview')", "Overview", show=False),
        Binding("e", "tab('events')", "Events", show=False),
        Binding("l", "tab('log')", "Log", show=False),
        Binding("c", "tab('charts')", "Charts", show=False),
        Binding("x", "app.stop_run", "Stop"),
        Binding("r", "app.restart_run", "Restart"),
        Binding("a", "app.attach_run", "Attach"),
        Binding("w", "app.watch_run", "Watch"),
        Binding("q", "app.quit", "Quit", show=False),
    ]

    def __init__(self, run_id: str, tab: str = "overview") -> None:
        super().__init__()
        self.run_id, self.tab = run_id, tab
        self.view: DetailView | None = None
        self.loads = 0
        self.log_lines = 0
        self.following = False
        self.log_start: int | None = None  # byte offset of the first line held (None: not known)
        self.filter_text = ""
        self.plotted: str | None = None  # the zoom the charts tab was drawn at (None: not yet)
        self.plots_drawn = 0

    def compose(self) -> ComposeResult:
        yield Static(Text(f"run {self.run_id}"), id="detail-title")
        yield FilterBox(placeholder="filter the events or log lines: words they contain (Enter keeps, Esc clears)",
                        id="detail-filter")
        with TabbedContent(initial=self.tab, id="tabs"):
            with TabPane("overview", id="overview"):
                with VerticalScroll(id="overview-box"):
                    yield Pane(id="overview-text")
            with TabPane("events", id="events"):
                yield EventsTable(id="detail-events")
            with TabPane("charts", id="charts"):
                yield Vertical(id="charts-box")  # the plots, mounted when the tab is first shown
            with TabPane("log", id="log"):
                yield LogView(id="log-view")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self._focus_tab()
        self.reload()
        self.set_interval(self.app.interval, self.reload)
        if self.tab == "log":
            self.follow_log()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "filter" and isinstance(self.focused, FilterBox):
            return False  # a '/' typed in the box is text
        return True

    def action_back(self) -> None:
        box = self.query_one(FilterBox)
        if box.shown or self.filter_text:  # Esc clears the filter first
            box.close()
            self._set_filter("")
            self._focus_tab()
            return
        self.app.pop_screen()

    def action_filter(self) -> None:
        tabs = self.query_one(TabbedContent)
        if tabs.active == "overview":
            tabs.active = "events"
        self.query_one(FilterBox).open()

    def _focus_tab(self) -> None:
        """The focus on the active tab's own widget (the log's or the events' keys then
        work at once); left in the filter box while it is open."""
        box = self.query_one(FilterBox)
        if box.shown:
            self.set_focus(box)
            return
        active = self.query_one(TabbedContent).active
        if active == "events":
            self.set_focus(self.query_one(EventsTable))
        elif active == "log":
            self.set_focus(self.query_one(LogLines))

    def on_input_changed(self, message: FilterBox.Changed) -> None:
        if message.input.id == "detail-filter":
            message.stop()
            self._set_filter(message.value.strip())

    def on_input_submitted(self, message: FilterBox.Submitted) -> None:
        if message.input.id == "detail-filter":
            message.stop()
            self.query_one(FilterBox).close(clear=not self.filter_text)  # the filter stays in force
            self._focus_tab()

    def on_key(self, event) -> None:
        if event.key == "escape" and self.focused is self.query_one(FilterBox):
            event.stop()
            self.action_back()

    def _set_filter(self, text: str) -> None:
        if text == self.filter_text:
            return
        self.filter_text = text
        if self.view is not None:
            self.query_one(EventsTable).show(filter_events(self.view.events, text))
        self.query_one(LogLines).set_filter(text)

    def on_data_table_row_selected(self, message) -> None:
        if message.data_table.id == "detail-events" and message.row_key is not None:
            message.stop()
            event = self.query_one(EventsTable).event_at(message.row_key.value)
            if event is not None:
                self.app.push_screen(EventScreen(event))

    def action_tab(self, tab: str) -> None:
        self.query_one(TabbedContent).active = tab
        if tab == "log" and not self.following:
            self.follow_log()
        self._focus_tab()

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        # Every way to a tab (its key, a click on it, `/` from the overview) ends with
        # the focus on what the tab shows: TabbedContent leaves it on the tab bar.
        if event.pane.id == "log" and not self.following:
            self.follow_log()
        if event.pane.id == "charts":
            self.show_plots()
        self._focus_tab()

    def show_plots(self) -> None:
        """The charts tab: the plots of the newest read (mounted the first time; drawn
        again on opening the tab and on z, never under a zoom the operator made)."""
        from dflashctl.tui.plots import RunPlots

        box = self.query_one("#charts-box", Vertical)
        if not box.children:
            box.mount(RunPlots(id="plots"))
            self.call_after_refresh(self.show_plots)
            return
        if self.view is not None and self.view.chart is not None:
            self.plotted = self.app.zoom
            self.read_curves(self.view.chart)

    @work(thread=True, exclusive=True, group="curves")
    def read_curves(self, chart) -> None:
        """The curves beyond the run's series (lr, grad norm, GPU memory, measured τ),
        read for the chart's span, then every plot drawn."""
        from dflashctl.status.reader import more_curves

        app = self.app
        try:
            more = more_curves(app.reader.store, app.reader.store.get_run(self.run_id), chart.t0, chart.t1)
        except DflashError as e:
            deliver(app, app.notify, f"charts: {first_line(e)}", severity="warning", timeout=8)
            more = {}
        if not get_current_worker().is_cancelled:
            deliver(self, self._draw_plots, chart, more)

    def _draw_plots(self, chart, more) -> None:
        from dflashctl.tui.plots import RunPlots

        self.query_one(RunPlots).show(chart, more)
        self.plots_drawn += 1

    def reload(self) -> None:
        self.load(self.app.clock())

    @work(thread=True, exclusive=True, group="detail")
    def load(self, now: float) -> None:
        app = self.app
        try:
            view = app.reader.detail(self.run_id, now, zoom=app.zoom)
        except DflashError as e:
            deliver(app, app.notify, first_line(e), severity="error", timeout=10)
            return
        if not get_current_worker().is_cancelled:
            deliver(self, self.show, view, now)

    def show(self, view: DetailView, now: float) -> None:
        self.view = view
        run = view.run
        title = Text.assemble(("run ", "dim"), (run.id, "bold"), f" · {run.playbook} on {run.host} · ",
                              (run.display_state, STATE_STYLE.get(run.display_state, "")),
                              ("   o overview · e events · c charts · l log · / filter · Esc back", "dim"))
        self.query_one("#detail-title", Static).update(title)
        hosts = self.app.view.hosts if getattr(self.app, "view", None) is not None else []
        host = next((h for h in hosts if h.host == run.host), None)  # the main screen's newest read of it
        self.query_one("#overview-text", Pane).redraw(lambda width, height: detail_text(view, width, now, height,
                                                                                        host))
        self.query_one(EventsTable).show(filter_events(view.events, self.filter_text))
        if self.query_one(TabbedContent).active == "charts" and self.plotted != self.app.zoom:
            self.show_plots()
        self.loads += 1

    @work(thread=True, exclusive=True, group="log")
    def follow_log(self) -> None:
        """The trainer's log, read on the run's host and followed until the trainer
        ends: its last lines first (where they start is kept, for ``h``), then what is
        appended after them."""
        from dflashctl.core.terminal import printable
        from dflashctl.runs.logs import log_before, logs

        self.following = True
        app, worker = self.app, get_current_worker()
        log = self.query_one(LogLines)
        try:
            since, tail = None, self.LOG_TAIL
            if not app.reader.store.get_run(self.run_id).hosts:
                first = log_before(self.run_id, app.reader.store, app.inventory(), max_lines=self.LOG_TAIL,
                                   max_bytes=self.HISTORY_BYTES)
                self.log_start, since = first.start, first.end
                if first.text:
                    deliver(self, self._append, printable(first.text))
            for chunk in logs(self.run_id, app.reader.store, app.inventory(), follow=True, n=tail,
                              stop=lambda: worker.is_cancelled, since=since):
                if worker.is_cancelled:
                    return
                deliver(self, self._append, printable(chunk))
        except DflashError as e:
            deliver(log, log.add, [f"cannot read the log: {first_line(e)}"])
        except Exception as e:  # noqa: BLE001  (a host answer we cannot read: shown, never a crash of the screen)
            deliver(log, log.add, [f"cannot read the log: {type(e).__name__}: {e}"])
        if not worker.is_cancelled:
            deliver(log, log.add, ["(the trainer has ended: end of log)"])

    def _append(self, text: str) -> None:
        self.log_lines += self.query_one(LogLines).add(text.rstrip("\n").split("\n"))  # lines read

    def _history_note(self, note: str) -> None:
        log = self.query_one(LogLines)
        log.history = note
        log.show_marker()

    def on_log_lines_earlier(self, message: LogLines.Earlier) -> None:
        message.stop()
        log = self.query_one(LogLines)
        if self.log_start is None:
            note = "earlier lines: not known yet" if not self.following else \
                f"earlier lines: by host (dflashctl logs {self.run_id} --host HOST -n N)"
            self._history_note(note)
        elif self.log_start == 0:
            self._history_note("the log's first line is held")
        elif len(log.kept) >= log.KEEP:
            self._history_note(f"{len(log.kept):,} lines held, the most: older ones with "
                               f"dflashctl logs {self.run_id} -n N")
        else:
            self._history_note("reading earlier lines…")
            self.read_earlier(self.log_start)

    @work(thread=True, exclusive=True, group="log-history")
    def read_earlier(self, end: int) -> None:
        """The lines before byte ``end`` of the log, one bounded read (``HISTORY_LINES``,
        ``HISTORY_BYTES``), put before the lines held."""
        from dflashctl.core.terminal import printable
        from dflashctl.runs.logs import log_before

        app = self.app
        try:
            got = log_before(self.run_id, app.reader.store, app.inventory(), end, max_lines=self.HISTORY_LINES,
                             max_bytes=self.HISTORY_BYTES)
        except Exception as e:  # noqa: BLE001  (shown, never a crash of the screen)
            deliver(self, self._history_note, f"earlier lines: {first_line(e)}")
            return
        deliver(self, self._prepend, got, printable(got.text).rstrip("\n").split("\n") if got.text else [])

    def _prepend(self, got, lines: list[str]) -> None:
        log = self.query_one(LogLines)
        if got.cut:
            note = f"a line of more than {self.HISTORY_BYTES // 1024:,} KiB: earlier lines with dflashctl logs"
        elif got.start == 0:
            note = "the log's first line is held"
        else:
            note = f"{len(lines):,} earlier lines read; h for more"
        taken = log.prepend(lines, note)
        if not got.cut:
            self.log_start = got.start if taken == len(lines) else None
        self.log_lines += taken
