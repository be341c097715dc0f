"""The live status console (``dflashctl status``): every run, the highlighted run's
figures and events, and every GPU of the hosts with active runs, refreshed from
the store on a timer.

Layouts by size: compact below 100 columns or 30 rows (runs, the highlighted
run's state and fix, then one short row per GPU: it fits 80x24 without
scrolling), normal (runs, the highlighted run, GPUs with bars and history), wide
from 180x45 (the run and GPU panels side by side). The highlighted run gets the
rows the GPUs do not need (its fix, state and events before empty rows). The run column is frozen; the columns shown are chosen by width, so cells
are never folded.

It reads the store in a thread worker, so a slow disk never freezes the screen;
the supervisors write what it shows. A run no supervisor watches is probed by the
screen itself every ``PROBE_EVERY_S`` (one round trip, nothing stored), so the
operator sees whether it is alive while the fix is on screen. That probe, reading
a run's log and the stop / restart actions (the ``dflashctl`` command, run as a
subprocess after a confirmation) all happen in workers: the screen never waits on
SSH. Keys: ``?``.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
from typing import Callable

from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Container, VerticalScroll
from textual.widgets import DataTable, Footer
from textual.worker import get_current_worker

from dflashctl.core.errors import DflashError, first_line
from dflashctl.status.charts import ChartView, next_zoom
from dflashctl.status.events import EventView
from dflashctl.status.reader import StatusReader
from dflashctl.status.runs import SORTS, DirectProbe, filter_runs, sort_runs
from dflashctl.status.views import StatusView
from dflashctl.store import Store
from dflashctl.tui.actions import attach_refusal, plan, readonly_default
from dflashctl.tui.screens import ConfirmScreen, DetailScreen, HelpScreen, RankScreen
from dflashctl.tui.text import banner_text, gpu_text, notice_text, run_pane_layout, run_text
from dflashctl.tui.widgets import FilterBox, Pane, RunsTable, deliver

COMPACT_WIDTH, COMPACT_HEIGHT = 100, 30
PROBE_EVERY_S = 10.0  # a run nobody supervises is probed by the screen this often
CHARTS_KEPT = 64  # runs x zooms whose last charts are kept for the cursor's return
PROBE_TIMEOUT_S = 20.0
WIDE_WIDTH, WIDE_HEIGHT = 180, 45


def shown_path(path: str) -> str:
    """A file's path as the header shows it: relative under the working directory,
    ``~/...`` under the home directory, else whole."""
    path = os.path.abspath(path)
    cwd = os.getcwd()
    if path.startswith(cwd + os.sep):
        return os.path.relpath(path, cwd)
    home = os.path.expanduser("~")
    return "~" + path[len(home):] if home not in ("", "/") and path.startswith(home + os.sep) else path


def mode_for(width: int, height: int) -> str:
    """The layout at a terminal size: compact, normal or wide."""
    if width < COMPACT_WIDTH or height < COMPACT_HEIGHT:
        return "compact"
    return "wide" if width >= WIDE_WIDTH and height >= WIDE_HEIGHT else "normal"


class StatusApp(App):
    TITLE = "dflashctl status"
    ENABLE_COMMAND_PALETTE = False
    CSS = """
    #title { height: 1; background: $boost; padding: 0 1; }
    #banner { height: auto; max-height: 3; padding: 0 1; display: none; background: $error 30%; }
    #banner.-shown { display: block; }
    #notices { height: auto; max-height: 2; padding: 0 1; display: none; }
    #notices.-shown { display: block; }
    #runs { height: auto; max-height: 50%; min-height: 3; }
    #lower { height: 1fr; layout: vertical; }
    #run-box { height: 1fr; min-height: 4; border-top: solid $primary-darken-2; }
    #gpu-box { height: auto; max-height: 50%; border-top: solid $primary-darken-2; }
    #gpus { text-wrap: nowrap; text-overflow: clip; }
    Screen.-compact #gpu-box { max-height: 70%; }
    Screen.-wide #lower { layout: horizontal; }
    Screen.-wide #run-box { height: 1fr; width: 1fr; }
    Screen.-wide #gpu-box { height: 1fr; max-height: 100%; width: 110; border-left: solid $primary-darken-2; }
    """
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("ctrl+c", "quit", "Quit", show=False, priority=True),
        Binding("question_mark", "help", "Help", key_display="?"),
        # Priority: acted on as the key is read, before the keys typed after it are handed
        # to a widget, so each of them reaches the filter box (tmux send-keys, a paste).
        Binding("slash", "filter", "Filter", key_display="/", priority=True),
        Binding("s", "sort", "Sort"),
        Binding("e", "events", "Events"),
        Binding("E", "feed", "All events", key_display="E", show=False),
        Binding("l", "logs", "Logs"),
        Binding("x", "stop_run", "Stop"),
        Binding("r", "restart_run", "Restart"),
        Binding("a", "attach_run", "Attach"),
        Binding("w", "watch_run", "Watch"),
        # The same keys, never in the footer: at 80 columns the footer has no room for
        # them (check_action hides the two above), the keys work all the same.
        Binding("a", "attach_run('compact')", show=False),
        Binding("w", "watch_run('compact')", show=False),
        Binding("z", "zoom", "Zoom"),
        Binding("f5,ctrl+r", "reload", "Refresh", show=False),
        Binding("escape", "back", "Back", show=False),
    ]

    def __init__(self, store_path: str, run: str | None = None, interval: float = 2.0, *,
                 clock: Callable[[], float] = time.time, inventory_path: str | None = None,
                 playbooks_dir: str | None = None, control: Callable[[list[str]], tuple[int, str]] | None = None,
                 probe_unsupervised: bool = True, readonly: bool | None = None,
                 attach: Callable[[list[str]], int] | None = None):
        super().__init__()
        # Read-only: no key stops or restarts anything (the bindings are gone, the actions refuse).
        self.readonly = readonly_default() if readonly is None else readonly
        self.store_path = store_path
        self.run_ref = run
        self.interval = interval
        self.clock = clock
        self.inventory_path = inventory_path
        self.playbooks_dir = playbooks_dir
        self.control = control or self._run_command
        self.attacher = attach  # runs an attach command outside tmux (default: the app suspended)
        self.attached: list[list[str]] = []  # the attach commands run (tests read them)
        self.attach_note = ""  # what the newest attach in a split said about detaching
        self.selected: str | None = None
        self._mode: str | None = None  # set from each resize's own size
        self.view: StatusView | None = None
        self.sort = SORTS[0]
        self.zoom = "all"  # the history charts' span (status.charts.ZOOMS), cycled by z
        # The charts each run had at its last read, per zoom: moving the cursor back to a
        # run draws them at once (their axis ends at the time they were read) instead of
        # none until the next read of that run comes back.
        self.charts: dict[tuple[str, str], ChartView] = {}
        self.filter_text = ""
        self.loads = 0  # completed reads of the store (tests wait on it)
        self.actions_done: list[tuple[list[str], int, str]] = []
        self._inventory = None
        self.probe_unsupervised = probe_unsupervised
        self.probes: dict[str, DirectProbe] = {}
        self.probing: set[str] = set()
        # Error events already announced: the first read takes what is there as known,
        # each later one that is new rings the bell once and raises the banner.
        self.seen_error: int | None = None
        self.banner: EventView | None = None
        self.bells = 0
        # What the workers use to reach a host, imported now, before the screen runs and
        # sys.stdout becomes Textual's capture (imports in a worker then would read it).
        import dflashctl.config  # noqa: F401
        import dflashctl.hosts.transport  # noqa: F401
        import dflashctl.runs.access  # noqa: F401
        import dflashctl.runs.logs  # noqa: F401

    # ----------------------------------------------------------------- layout

    def compose(self) -> ComposeResult:
        yield Pane(id="title")
        yield Pane(id="banner")
        yield Pane(id="notices")
        # Above the runs it filters, never under the footer: what is typed is seen.
        yield FilterBox(placeholder="filter: words in id, playbook, host, state, phase (Enter keeps, Esc clears)",
                        id="filter")
        yield RunsTable(id="runs")
        with Container(id="lower"):
            with VerticalScroll(id="run-box"):
                yield Pane(id="run")
            with VerticalScroll(id="gpu-box"):
                yield Pane(id="gpus")
        yield Footer(compact=True)

    @property
    def mode(self) -> str:
        return self._mode or mode_for(*self.size)

    def _apply_mode(self, width: int, height: int) -> None:
        self._mode = mode = mode_for(width, height)
        screen = self.screen_stack[0]
        for name in ("compact", "normal", "wide"):
            screen.set_class(name == mode, f"-{name}")

    def on_resize(self, event) -> None:
        # The event's size: ``self.size`` is still the old one while the event is handled.
        self._apply_mode(event.size.width, event.size.height)
        if self.view is not None:
            self.draw(event.size.width)

    def on_mount(self) -> None:
        self.store = Store(self.store_path)
        # One connection for the workers' reads, open until the screen ends: one opened
        # and closed per read cost more than the read (its schema read again, and the
        # last close checkpointed the WAL and deleted it). The screen only reads.
        self.store.share()
        self.reader = StatusReader(self.store, self.playbooks_dir)
        self._apply_mode(*self.size)
        self.query_one(RunsTable).focus()
        self.action_reload()
        self.set_interval(self.interval, self.action_reload)
        # What is alive now (the modules, the widgets) lives as long as the screen: out
        # of the collector's full passes, each of which walked all of it (70-80 ms of
        # the screen's thread on a busy 2-core machine, every few seconds of typing).
        gc.freeze()

    def on_unmount(self) -> None:
        gc.unfreeze()
        self.store.unshare()

    # ----------------------------------------------------------------- reading

    def action_reload(self) -> None:
        self.load(self.clock(), self.selected)

    @work(thread=True, exclusive=True, group="store")
    def load(self, now: float, selected: str | None) -> None:
        try:
            view = self.reader.load(now, self.run_ref, selected, zoom=self.zoom)
        except DflashError as e:
            deliver(self, self.notify, first_line(e), severity="error", timeout=10)
            return
        if not get_current_worker().is_cancelled:
            deliver(self, self.show, view)

    def show(self, view: StatusView) -> None:
        self.view = view
        if view.selected is not None and view.chart is not None:
            self.charts.pop((view.selected, self.zoom), None)
            self.charts[(view.selected, self.zoom)] = view.chart  # newest last
            while len(self.charts) > CHARTS_KEPT:
                self.charts.pop(next(iter(self.charts)))
        self.announce(view.errors)
        if self.selected is None or self.selected not in {r.id for r in view.runs}:
            self.selected = view.selected
        self.draw()
        self.loads += 1
        self.probe_unwatched(view)

    def announce(self, errors: list[EventView]) -> None:
        """A new error event (one not in an earlier read): the terminal bell, a toast,
        and the banner over the runs, once per event, never on a refresh that brings
        none."""
        newest = max((e.id for e in errors), default=0)
        if self.seen_error is None:
            self.seen_error = newest
            return
        new = [e for e in errors if e.id > self.seen_error]
        self.seen_error = max(self.seen_error, newest)
        if not new:
            return
        self.banner = new[-1]
        self.bell()
        self.bells += 1
        more = f" (+{len(new) - 1} more)" if len(new) > 1 else ""
        self.notify(f"{new[-1].run_id}: {new[-1].message}{more}", title="new error", severity="error", timeout=10)

    # ----------------------------------------------------------------- runs nobody watches

    def probe_unwatched(self, view: StatusView) -> None:
        """Look at each active run no supervisor watches, itself, every ``PROBE_EVERY_S``
        (one probe round trip in a worker; nothing is stored: the fix is to watch it)."""
        if not self.probe_unsupervised:
            return
        for run in view.runs:
            if run.active and not run.freshness.supervised and run.id not in self.probing:
                last = self.probes.get(run.id)
                if last is None or view.now - last.time >= PROBE_EVERY_S:
                    self.probing.add(run.id)
                    self.probe(run.id)

    @work(thread=True, group="probe")
    def probe(self, run_id: str) -> None:
        result = DirectProbe.of(run_id, self.reader.store, self.inventory, self.clock, PROBE_TIMEOUT_S)
        deliver(self, self._probed, run_id, result)

    def _probed(self, run_id: str, result: DirectProbe) -> None:
        self.probes[run_id] = result
        self.probing.discard(run_id)
        if self.view is not None:
            self.draw()  # its row (phase, step: probed) and, selected, its pane

    # ----------------------------------------------------------------- drawing

    def shown_runs(self):
        view = self.view
        if view is None:
            return []
        for r in view.runs:  # what the screen's own probe saw, drawn with the store's figures
            r.probe = self.probes.get(r.id)
        return sort_runs(filter_runs(view.runs, self.filter_text), self.sort)

    def draw(self, width: int | None = None) -> None:
        view = self.view
        width = width or self.size.width
        runs = self.shown_runs()
        self.query_one("#title", Pane).show(self.title_text(view, len(runs), width))
        banner = self.query_one("#banner", Pane)
        banner.set_class(self.banner is not None, "-shown")
        if self.banner is not None:
            banner.show(banner_text(self.banner, width - 2, lines=1 if self.mode == "compact" else 3))
        notices = self.query_one("#notices", Pane)
        notices.set_class(bool(view.notices), "-shown")
        notices.show(notice_text(view.notices, width - 2, lines=1 if self.mode == "compact" else 2))
        table = self.query_one(RunsTable)
        table.show(runs, width)
        if table.current is not None:
            self.selected = table.current
        self.draw_run()
        compact = self.mode == "compact"
        self.query_one("#gpus", Pane).redraw(lambda w, h: gpu_text(view.hosts, w, view.now, compact=compact))

    def title_text(self, view: StatusView, shown: int, width: int) -> Text:
        """The header: the summary (short where the long one leaves the store's path no
        room), sort, filter, read-only, the store's path (its tail where it does not fit;
        the key panel has it whole)."""
        path = shown_path(self.store_path)
        for short in ((False, True) if self.mode != "compact" else (True,)):
            title = Text.assemble(("dflashctl status", "bold"), " · ", view.summary(short=short))
            if self.sort != SORTS[0]:
                title.append(f" · sort {self.sort}", style="cyan")
            if self.filter_text:
                title.append(f" · filter '{self.filter_text}' ({shown}/{len(view.runs)})", style="cyan")
            if self.readonly:
                title.append(" · read-only", style="bold cyan")
            room = width - 2 - title.cell_len - len(" · store ")
            if room >= min(len(path), 24):
                break
        if room >= 8:
            title.append(f" · store {path if len(path) <= room else '…' + path[1 - room:]}", style="dim")
        return title

    def draw_run(self) -> None:
        view = self.view
        if view is None:
            return
        run = next((r for r in view.runs if r.id == self.selected), None)
        events = view.events if view.selected == self.selected else []
        chart = view.chart if view.selected == self.selected else self.charts.get((self.selected, self.zoom))
        compact = self.mode == "compact"
        probe = self.probes.get(self.selected) if self.selected else None

        def text(w: int, h: int) -> Text:
            rows, count, event_lines = run_pane_layout(h, compact)
            return run_text(run, events, w, view.now, event_lines=event_lines, probe=probe, chart=chart,
                            chart_rows=rows, chart_count=count, watch_key=not self.readonly)

        self.query_one("#run", Pane).redraw(text)

    def on_data_table_row_highlighted(self, message: DataTable.RowHighlighted) -> None:
        if message.data_table.id != "runs" or message.row_key is None:
            return
        key = message.row_key.value
        if key != self.selected:
            self.selected = key
            self.draw_run()
            self.action_reload()  # its events

    def on_runs_table_open(self, message: RunsTable.Open) -> None:
        self.push_screen(DetailScreen(message.run_id))

    # ----------------------------------------------------------------- keys

    def _current(self) -> str | None:
        if isinstance(self.screen, DetailScreen):
            return self.screen.run_id
        current = self.query_one(RunsTable).current
        if current is None:
            self.notify("no run here", severity="warning")
        return current

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_back(self) -> None:
        box = self.query_one(FilterBox)
        if self.banner is not None and not (box.shown or self.filter_text):
            self.banner = None  # Esc puts the banner away (the event stays in the run's events)
            if self.view is not None:
                self.draw()
            return
        if box.shown or self.filter_text:
            box.close()
            self.filter_text = ""
            self.query_one(RunsTable).focus()
            if self.view is not None:
                self.draw()

    def action_filter(self) -> None:
        self.query_one(FilterBox).open()

    def on_input_changed(self, message: FilterBox.Changed) -> None:
        if message.input.id == "filter":
            self.filter_text = message.value.strip()
            if self.view is not None:
                self.draw()

    def on_input_submitted(self, message: FilterBox.Submitted) -> None:
        if message.input.id == "filter":
            message.input.close(clear=not self.filter_text)  # the filter stays in force (the title says it)
            self.query_one(RunsTable).focus()

    def on_key(self, event) -> None:
        if event.key == "escape" and self.screen is self.screen_stack[0] and self.focused is self.query_one(FilterBox):
            event.stop()
            self.action_back()

    def action_sort(self) -> None:
        self.sort = SORTS[(SORTS.index(self.sort) + 1) % len(SORTS)]
        if self.view is not None:
            self.draw()
        self.notify(f"sort: {self.sort}", timeout=2)

    def action_events(self) -> None:
        self._detail("events")

    def action_feed(self) -> None:
        from dflashctl.tui.screens import FeedScreen

        self.push_screen(FeedScreen())

    def action_logs(self) -> None:
        self._detail("log")

    def _detail(self, tab: str) -> None:
        run = self._current()
        if run is not None:
            self.push_screen(DetailScreen(run, tab=tab))

    def action_zoom(self) -> None:
        """The history charts' next span (1 h, 6 h, all), here and in a run's detail."""
        self.zoom = next_zoom(self.zoom)
        self.notify(f"charts: {self.zoom}", timeout=2)
        if isinstance(self.screen, DetailScreen):
            self.screen.reload()
        self.action_reload()

    def action_stop_run(self) -> None:
        self._confirm("stop")

    def action_restart_run(self) -> None:
        self._confirm("restart")

    MAIN_ONLY = ("filter", "sort", "events", "feed", "logs", "back")  # keys of the runs screen

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Which of the app's keys work where: read-only, the stop / restart keys are gone
        from every screen; they act on the runs screen and a run's detail only, the runs
        screen's own keys on it only (never under a question or the key panel)."""
        screen = self.screen
        main = screen is self.screen_stack[0]
        if action in ("watch_run", "attach_run") and not parameters and main and self.mode == "compact":
            return False  # its footer-less twin binding takes the key
        if action in ("stop_run", "restart_run", "watch_run", "attach_run"):
            return not self.readonly and (main or isinstance(screen, DetailScreen))
        if action == "filter" and isinstance(self.focused, FilterBox):
            return False  # a '/' typed in the box is text
        if action in self.MAIN_ONLY:
            return main
        if action in ("help", "zoom"):
            return main or isinstance(screen, DetailScreen)
        return True

    def action_watch_run(self, _how: str = "") -> None:
        self._confirm("watch")

    def action_attach_run(self, _how: str = "") -> None:
        """``a``: the run's tmux session on its host, attached in a tmux popup (or a
        split, where no client can show a popup) when the console runs in tmux, else
        in this terminal with the console suspended until the detach. A run on several
        hosts asks which process (rank) first."""
        if self.readonly:
            self.notify("read-only console: no session is attached from here", severity="warning")
            return
        run_id = self._current()
        if run_id is None:
            return
        run = self._view_run(run_id)
        refused = attach_refusal(run) if run is not None else None
        if refused:
            self.notify(refused, severity="warning", timeout=8)
            return
        if run is not None and len(run.hosts) > 1:
            self.push_screen(RankScreen(run_id, [(h.rank, h.host) for h in run.hosts]),
                             lambda rank: rank is not None and self.attach_to(run_id, rank))
        else:
            self.attach_to(run_id)

    @work(thread=True, group="attach")
    def attach_to(self, run_id: str, rank: int = 0) -> None:
        """Attach to the session of process ``rank`` of the run (its only one: 0)."""
        from dflashctl.hosts.tmux import socket_name
        from dflashctl.tui.actions import attach_argv

        try:
            parts = {part.rank: part for part in self.reader.store.get_run(run_id).parts()}
            run = parts.get(rank)
            if run is None:
                raise DflashError(f"run {run_id} has no process of rank {rank}")
            if not run.tmux_session:
                raise DflashError(f"run {run_id} has no tmux session recorded" + (f" for rank {rank}" if rank else ""))
            argv = attach_argv(self.inventory().route(run.host), run.tmux_session, run.tmux_socket or socket_name())
        except DflashError as e:
            deliver(self, self.notify, f"attach {run_id}: {first_line(e)}", severity="error", timeout=8)
            return
        self.attached.append(argv)
        what = f"{run_id}{f' rank {rank}' if len(parts) > 1 else ''} on {run.host}"
        if os.environ.get("TMUX"):
            self._attach_in_tmux(argv, what)
        else:
            deliver(self, self._attach_here, argv)

    def _attach_in_tmux(self, argv: list[str], what: str) -> None:
        """In a popup over this pane (its keys all go to the session: C-b d detaches);
        where tmux cannot show one (no client attached to this session, an old tmux),
        in a split below it, where the operator's tmux reads its prefix first: the
        notification says the keys that detach the run's session, not theirs."""
        from dflashctl.tui.actions import in_tmux_argv, split_detach_key

        popup = subprocess.run(in_tmux_argv(argv, f" {what}: C-b d detaches "), capture_output=True, text=True,
                               stdin=subprocess.DEVNULL)
        if popup.returncode == 0:
            return
        prefix = subprocess.run(["tmux", "show-options", "-gv", "prefix"], capture_output=True, text=True,
                                stdin=subprocess.DEVNULL)
        key = split_detach_key(prefix.stdout if prefix.returncode == 0 else None)
        self.attach_note = f"{what} attached in a split below: {key} detaches it (C-b d alone detaches your own tmux)"
        split = subprocess.run(in_tmux_argv(argv, what, popup=False), capture_output=True, text=True,
                               stdin=subprocess.DEVNULL)
        if split.returncode:
            deliver(self, self.notify, f"tmux could not open a popup or a split: "
                                  f"{(split.stderr or popup.stderr).strip()}", severity="error", timeout=8)
        else:
            deliver(self, self.notify, self.attach_note, timeout=30)

    def _attach_here(self, argv: list[str]) -> None:
        if self.attacher is not None:
            self.attacher(argv)
            return
        from textual.app import SuspendNotSupported

        try:
            with self.suspend():
                print(f"attaching: {' '.join(argv)}  (C-b d detaches and comes back)", flush=True)
                subprocess.run(argv)
        except SuspendNotSupported:
            self.notify(f"this terminal cannot be handed over; run: {' '.join(argv)}", severity="warning",
                        timeout=15)
        self.refresh()

    def _view_run(self, run_id: str):
        """The run ``run_id`` as the newest read of the store shows it (None: not in it yet)."""
        return next((r for r in (self.view.runs if self.view else []) if r.id == run_id), None)

    def _confirm(self, command: str) -> None:
        """Ask, saying what happens to the trainer, then run ``dflashctl COMMAND RUN``
        on the run under the cursor (the one named in the question, whatever the
        refreshes do to the rows meanwhile)."""
        if self.readonly:  # check_action already refuses; this guards any other way in
            self.notify("read-only console: no run is stopped or restarted from here", severity="warning")
            return
        run_id = self._current()
        if run_id is None:
            return
        run = self._view_run(run_id)
        if run is None:
            self.notify(f"run {run_id} is not in the newest read of the store yet", severity="warning")
            return
        step = plan(command, run)
        if step.refused:
            self.notify(step.refused, severity="warning")
            return
        then = self.start_supervisor if command == "watch" else self.control_run
        self.push_screen(ConfirmScreen(step.question, step.detail), lambda yes: yes and then(step.argv))

    # ----------------------------------------------------------------- actions on runs

    def inventory(self):
        """The inventory (for reading a run's log on its host), loaded once."""
        if self._inventory is None:
            from dflashctl.config import load_inventory

            self._inventory = load_inventory(self.inventory_path)
        return self._inventory

    def command(self, args: list[str]) -> list[str]:
        argv = [sys.executable, "-m", "dflashctl"]
        if self.inventory_path:
            argv += ["--inventory", self.inventory_path]
        if self.playbooks_dir:
            argv += ["--playbooks", self.playbooks_dir]
        return argv + args

    def _run_command(self, args: list[str]) -> tuple[int, str]:
        done = subprocess.run(self.command(args), capture_output=True, text=True, stdin=subprocess.DEVNULL,
                              env={**os.environ, "DFLASHCTL_STORE": self.store_path})
        return done.returncode, (done.stdout + done.stderr).strip()

    @work(thread=True, group="control")
    def start_supervisor(self, args: list[str]) -> None:
        """``dflashctl watch RUN``, detached in its own local tmux session, as
        ``launch`` and ``restart`` start it (``launch.start_supervisor``), on this
        console's store."""
        from dflashctl.launch import start_supervisor

        run_id = args[1]
        store = Store(self.store_path)  # it records the supervisor: a write, on a connection of its own
        try:
            session = start_supervisor(run_id, False, store, self.inventory(),
                                       inventory_path=self.inventory_path, playbooks_dir=self.playbooks_dir,
                                       environ={**os.environ, "DFLASHCTL_STORE": os.path.abspath(self.store_path)})
            code, output = 0, f"supervisor started in tmux session {session}"
        except DflashError as e:
            code, output = 1, first_line(e)
        finally:
            store.close()
        self.actions_done.append((args, code, output))
        deliver(self, self.notify, f"dflashctl watch {run_id}: {output}",
                              severity="information" if code == 0 else "error", timeout=8)
        deliver(self, self.action_reload)

    @work(thread=True, group="control")
    def control_run(self, args: list[str]) -> None:
        """``dflashctl stop|restart RUN`` in a subprocess; its answer as a notification."""
        deliver(self, self.notify, f"{' '.join(args)}: running…", timeout=3)
        code, output = self.control(args)
        self.actions_done.append((args, code, output))
        lines = output.splitlines()
        # A failure says why (its error line) and what to do (its hint); a success its last word.
        last = " ".join(lines[-2:] if code and len(lines) > 1 and lines[-1].startswith("hint:") else lines[-1:])
        deliver(self, self.notify, f"{' '.join(args)}: {'done' if code == 0 else f'exit {code}'}"
                              + (f": {last}" if last else ""), severity="information" if code == 0 else "error",
                              timeout=8)
        deliver(self, self.action_reload)
