"""The live status console driven headless (Textual's Pilot) over real SQLite
stores (tests/harness/scenes.py): every key the footer and `?` promise, the
layout at 80x24 / 120x40 / 160 / 200 columns, refreshes that keep the cursor and
the sideways scroll, and the defects the console must never show again (each
test names the one it guards)."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from dflashctl.core import contract
from dflashctl.store import Store
from tests.harness import cli
from tests.harness.scenes import DEMO, NOW, OLD, PROD, build, utc
from tests.harness.tui import app_for, cell, detail_loaded, loaded, log_open, run, run_with_log, screen_text, until


@pytest.fixture(autouse=True)
def _utc():
    utc()


# --------------------------------------------------------------------------- keys


@pytest.mark.parametrize("key", ["q", "ctrl+c"])
def test_q_and_ctrl_c_quit(tmp_path, key):
    """Defect: Ctrl-C did not quit."""
    store = build("healthy", tmp_path)

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(pilot, app)
            await pilot.press(key)
            await pilot.pause()
            assert not app.is_running

    run(scenario())


def test_question_mark_shows_the_keys_and_escape_closes_them(tmp_path):
    """Defect: `?` did nothing; Escape did not close the key panel."""
    from dflashctl.tui.screens import HelpScreen

    store = build("healthy", tmp_path)

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(pilot, app)
            await pilot.press("question_mark")
            await pilot.pause()
            assert isinstance(app.screen, HelpScreen)
            text = screen_text(app)
            for promise in ("Home / End", "filter what is shown", "stop the run under the cursor",
                            "tau estimated in training: accept_len + 1", "DFLASHCTL_READONLY=1",
                            "unsupervised (no supervisor ticks for it"):
                assert promise in text, promise
            # A description that wraps goes on under itself, not under its key.
            lines = text.splitlines()
            at = next(i for i, line in enumerate(lines) if "stop the run under the cursor" in line)
            start = lines[at].index("stop the run")
            rest = lines[at + 1][start - 2:start]
            assert rest == "  " and lines[at + 1][start] != " ", lines[at:at + 2]
            await pilot.press("escape")
            await pilot.pause()
            assert not isinstance(app.screen, HelpScreen)
            # The footer names the keys.
            footer = screen_text(app).splitlines()[-1]
            for key in ("q Quit", "? Help", "/ Filter", "s Sort", "e Events", "l Logs", "x Stop", "r Restart"):
                assert key in footer, key

    run(scenario())


def test_the_panels_follow_the_cursor_and_home_end_go_to_the_first_and_last_run(tmp_path):
    """Defects: the panes changed only on Enter; Home/End scrolled sideways."""
    store = build("healthy", tmp_path)

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(pilot, app)
            table = app.query_one("#runs")
            assert [str(table.get_row_at(i)[0]) for i in range(3)] == [DEMO, PROD, OLD]
            assert str(app.query_one("#run").render()).startswith(DEMO)
            loads = app.loads
            await pilot.press("down")
            await loaded(pilot, app, loads)
            assert app.selected == PROD and str(app.query_one("#run").render()).startswith(PROD)
            assert "trainer started (pid 4343, phase compiling)" in str(app.query_one("#run").render())
            await pilot.press("end")
            assert table.cursor_row == 2 and app.selected == OLD and table.scroll_x == 0
            await pilot.press("home")
            assert table.cursor_row == 0 and app.selected == DEMO

    run(scenario())


def test_a_click_selects_a_run(tmp_path):
    store = build("healthy", tmp_path)

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(pilot, app)
            await pilot.click("#runs", offset=(5, 3))  # header, then the third run
            await pilot.pause()
            assert app.selected == OLD

    run(scenario())


def test_enter_opens_the_detail_and_escape_goes_back(tmp_path):
    from dflashctl.tui.screens import DetailScreen

    store = build("restarting", tmp_path)

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(pilot, app)
            await pilot.press("enter")
            await detail_loaded(pilot, app)
            text = screen_text(app)
            for needle in (PROD, "restarting", "history (", "tok/s  now"):
                assert needle in text, needle
            overview = app.screen.query_one("#overview-text").shown.plain  # under the charts: scrolled to
            for needle in ("compile budget", "45 m", "environment audit", "restarts (1)",
                           "cuda_oom: crash: CUDA out of memory"):
                assert needle in overview, needle
            await pilot.press("e")
            await pilot.pause()
            events = app.screen.query_one("#detail-events")
            classes = [str(events.get_row_at(i)[2]) for i in range(events.row_count)]
            assert "crash:cuda_oom" in classes and "state→restarting" in classes
            await pilot.press("escape")
            await pilot.pause()
            assert not isinstance(app.screen, DetailScreen)

    run(scenario())


def test_l_follows_the_trainers_log(tmp_path):
    """The log of a run on this machine, read through its transport in a worker."""
    store, run_dir = run_with_log(tmp_path, [f"step {i}/300 tok/s 900" for i in range(1, 41)])

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await log_open(pilot, app, 40)
            assert "step 40/300 tok/s 900" in screen_text(app)
            with open(run_dir / contract.LOG_FILE, "a") as f:
                f.write("step 41/300 tok/s 901\n")
            await until(pilot, lambda: app.screen.log_lines >= 41, "the new line")
            (run_dir / contract.EXIT_CODE_FILE).write_text("0\n")
            await until(pilot, lambda: "end of log" in screen_text(app), "the end of the log")

    run(scenario())


def test_filter_and_sort(tmp_path):
    """`/` filters (Enter keeps the filter, Escape clears it), `s` cycles the sort."""
    store = build("healthy", tmp_path)

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(pilot, app)
            table = app.query_one("#runs")
            await pilot.press("slash", "d", "o", "n", "e")
            await pilot.pause()
            assert table.row_count == 1 and str(table.get_row_at(0)[0]) == OLD
            await pilot.press("enter")
            assert app.focused is table and table.row_count == 1 and "filter 'done'" in screen_text(app)
            await pilot.press("escape")
            await pilot.pause()
            assert table.row_count == 3 and "filter '" not in screen_text(app).splitlines()[0]
            await pilot.press("s")  # by state
            await pilot.pause()
            assert app.sort == "state" and [str(table.get_row_at(i)[0]) for i in range(3)] == [OLD, DEMO, PROD]
            assert "sort state" in screen_text(app).splitlines()[0]
            await pilot.press("s", "s", "s")  # host, progress, tok/s
            await pilot.pause()
            assert app.sort == "tok/s" and str(table.get_row_at(2)[0]) == DEMO

    run(scenario())


def test_stop_asks_first_then_stops_for_real(tmp_path):
    """`x` asks; `n` leaves the run alone; `y` runs `dflashctl stop` (a real
    subprocess: the run's trainer is not there, so it is recorded stopped)."""
    from dflashctl.tui.screens import ConfirmScreen

    store = Store(str(tmp_path / "runs.db"))
    run_dir = tmp_path / "work" / "runs" / DEMO
    run_dir.mkdir(parents=True)
    store.create_run("demo", "local", {}, time.time() - 60, run_id=DEMO, run_dir=str(run_dir),
                     tmux_session=DEMO, tmux_socket=f"dflash-tui-{os.getpid()}")

    async def scenario():
        app = app_for(store, tmp_path, clock=time.time)
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(pilot, app)
            await pilot.press("x")
            await pilot.pause()
            assert isinstance(app.screen, ConfirmScreen) and f"Stop run {DEMO}?" in screen_text(app)
            await pilot.press("n")
            await pilot.pause()
            assert not isinstance(app.screen, ConfirmScreen) and app.actions_done == []
            await pilot.press("r")
            await pilot.pause()
            assert f"Restart run {DEMO}?" in screen_text(app)
            await pilot.press("escape")
            await pilot.pause()
            assert app.actions_done == [] and store.get_run(DEMO).state == "launching"
            await pilot.press("x", "y")
            await until(pilot, lambda: app.actions_done, "the stop", timeout=60)
            (args, code, output) = app.actions_done[0]
            assert args == ["stop", DEMO] and code == 0, output
            await until(pilot, lambda: cell(app, DEMO, "state") == "stopped", "the stopped run on screen")

    run(scenario())
    assert store.get_run(DEMO).state == "stopped"


# --------------------------------------------------------------------------- layout


@pytest.mark.parametrize("size", [(80, 24), (120, 40), (200, 60)])
def test_the_layout_fits_without_scrolling(tmp_path, size):
    """Defect: at 80x24 the layout needed 25 rows and scrolled; the run column was not
    frozen; the last event made the table 312 columns wide."""
    store = build("healthy", tmp_path)

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=size) as pilot:
            await loaded(pilot, app)
            width, height = size
            assert app.screen.virtual_size.height <= height and app.screen.max_scroll_y == 0
            for widget in app.screen.query("*"):
                if widget.display and widget.region.area:
                    assert widget.region.right <= width and widget.region.bottom <= height, widget
            table = app.query_one("#runs")
            assert table.fixed_columns == 1 and table.max_scroll_x == 0  # everything shown fits
            assert table.virtual_size.width <= width
            text = screen_text(app)
            assert len(text.splitlines()) == height
            assert "3.3%" in text and ("6.4h" in text) and "12.8K" in text

    run(scenario())


def test_a_refresh_keeps_the_cursor_and_the_sideways_scroll(tmp_path):
    """Defect: sideways scrolling snapped back to column 0 at every refresh."""
    store = build("healthy", tmp_path)

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(80, 24)) as pilot:
            await loaded(pilot, app)
            table = app.query_one("#runs")
            table.styles.width = 50  # narrower than its columns: it scrolls sideways
            await pilot.pause()
            table.scroll_to(x=table.max_scroll_x, animate=False)
            await pilot.press("down")
            await pilot.pause()
            x, row = table.scroll_x, table.cursor_row
            assert x > 0 and row == 1
            store.add_samples(PROD, [{"time": NOW - 1, "step": 9999, "tok_s": 12800.0, "phase": "training"}],
                              observed=NOW)
            loads = app.loads
            await pilot.press("f5")
            await loaded(pilot, app, loads)
            await pilot.pause()
            assert (table.scroll_x, table.cursor_row) == (x, row)
            # A new run changes the rows: still where it was.
            store.create_run("smoke", "gpu1", {}, NOW - 5000, run_id="smoke-20270115-063000-ffff")
            loads = app.loads
            await pilot.press("f5")
            await loaded(pilot, app, loads)
            await pilot.pause()
            assert table.scroll_x == x and str(table.get_row_at(table.cursor_row)[0]).startswith("prod-2027011")

    run(scenario())


def test_the_gpu_pane_is_readable_at_160_columns(tmp_path):
    """Defect: the GPU pane was a third of the width with host and a 26-character run id
    on every row; at 160 columns memory, temperature and power were cut off."""
    store = build("healthy", tmp_path)

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(160, 48)) as pilot:
            await loaded(pilot, app)
            rows = [line for line in screen_text(app).splitlines() if "util " in line and "mem " in line]
            assert len(rows) == 8
            for i, line in enumerate(rows):
                assert f" {i} {'target' if i < 5 else 'drafter'}" in line
                assert "/140G" in line and "°C" in line and "/700W" in line, line
                assert "gpu1" not in line and PROD not in line  # the host once, above; the run id shortened
            assert screen_text(app).count("gpu1 · 8 GPU(s)") == 1

    run(scenario())


def test_an_unsupervised_run_is_shown_in_colour_with_its_fix(tmp_path):
    store = build("unsupervised", tmp_path)

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(pilot, app)
            table = app.query_one("#runs")
            state = table.get_cell(PROD, "state")
            assert state.plain == "unsupervised" and "red" in str(state.style)
            assert cell(app, PROD, "eta") == "stale"
            text = screen_text(app)
            assert f"→ dflashctl watch {PROD}" in text and f"fix: dflashctl watch {PROD}  or press w" in text
        app = app_for(store, tmp_path, readonly=True)
        async with app.run_test(size=(120, 40)) as pilot:  # read-only: no key starts anything
            await loaded(pilot, app)
            text = screen_text(app)
            assert f"fix: dflashctl watch {PROD}" in text and "or press w" not in text

    run(scenario())


def test_a_run_nobody_watches_is_probed_by_the_screen_itself(tmp_path):
    """With no supervisor, the screen looks at the run itself, in a worker: here a
    trainer process that is alive but stopped (SIGSTOP), at step 812."""
    import signal
    import subprocess

    import yaml

    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"local": {"transport": "local", "workdir": str(tmp_path)}}}))
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        os.kill(trainer.pid, signal.SIGSTOP)
        run_dir = tmp_path / "runs" / DEMO
        run_dir.mkdir(parents=True)
        status = contract.Status(phase="training", pid=trainer.pid, started=time.time() - 60, step=812)
        contract.write_status(str(run_dir), status)
        store = Store(str(tmp_path / "runs.db"))
        store.create_run("demo", "local", {}, time.time() - 60, run_id=DEMO, run_dir=str(run_dir),
                         tmux_session=DEMO, tmux_socket=f"dflash-tui-{os.getpid()}")
        store.transition(DEMO, "running", "trainer started", time.time() - 50)

        async def scenario():
            app = app_for(store, tmp_path, clock=time.time, probe_unsupervised=True, inventory_path=str(inventory))
            async with app.run_test(size=(120, 40)) as pilot:
                await loaded(pilot, app)
                await until(pilot, lambda: DEMO in app.probes, "the screen's own probe", timeout=60)
                await pilot.pause()
                text = screen_text(app)
                assert "unsupervised" in text and "fix: dflashctl watch" in text
                assert "the trainer is alive but stopped (SIGSTOP), training at step 812" in text, app.probes
                # Its row too: the probe's phase and step, marked probed (not "starting 0s/5m", N/A).
                assert cell(app, DEMO, "phase") == "training (probed)" and cell(app, DEMO, "step") == "812 (probed)"

        run(scenario())
    finally:
        trainer.kill()
        trainer.wait()


# --------------------------------------------------------------------------- input safety


def _no_action_was_taken(app, store, states: dict[str, str]) -> None:
    from dflashctl.tui.screens import ConfirmScreen

    assert app.actions_done == [], app.actions_done
    assert not [w for w in app.workers if w.group == "control"]  # no dflashctl stop/restart under way
    assert not any(isinstance(s, ConfirmScreen) for s in app.screen_stack)
    assert {run_id: store.get_run(run_id).state for run_id in states} == states


@pytest.mark.parametrize("tab", ["overview", "events", "log"])
def test_slash_then_r_y_in_the_detail_view_changes_nothing(tmp_path, tab):
    """Defect: in the detail view `/` went to the main screen's hidden filter, so `r` `y`
    then stopped and restarted a healthy run. Now `/` opens the detail's own filter and
    every letter typed is text in it (the real `dflashctl` would run on a `y`)."""
    from textual.widgets import Input

    from dflashctl.tui.screens import DetailScreen

    store = build("healthy", tmp_path)
    states = {PROD: "running", DEMO: "running"}

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(pilot, app)
            await pilot.press("down", "enter")  # PROD, a healthy running run
            await detail_loaded(pilot, app)
            assert app.screen.run_id == PROD
            await pilot.press({"overview": "o", "events": "e", "log": "l"}[tab])
            await pilot.pause()
            await pilot.press("slash", "r", "y", "x", "y", "q")
            await pilot.pause(0.3)
            _no_action_was_taken(app, store, states)
            box = app.focused
            assert isinstance(box, Input) and box.screen is app.screen and box.value == "ryxyq"
            assert box.region.height == 1 and "ryxyq" in screen_text(app)  # what is typed is seen
            assert app.is_running and isinstance(app.screen, DetailScreen)
            await pilot.press("escape")  # clears the filter, stays in the detail
            await pilot.pause()
            assert isinstance(app.screen, DetailScreen) and box.value == "" and not box.display
            await pilot.press("escape")
            await pilot.pause()
            assert not isinstance(app.screen, DetailScreen)
            _no_action_was_taken(app, store, states)

    run(scenario())


def test_slash_error_in_the_events_tab_filters_the_events_and_opens_no_dialog(tmp_path):
    """Defect: `/error` in the events tab opened the restart dialog (`e`, `r`, ...)."""
    store = build("restarting", tmp_path)

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(pilot, app)
            await pilot.press("e")
            await detail_loaded(pilot, app)
            events = app.screen.query_one("#detail-events")
            every = events.row_count
            await pilot.press("slash", *"error")
            await pilot.pause(0.3)
            _no_action_was_taken(app, store, {PROD: "restarting"})
            rows = [" ".join(str(c) for c in events.get_row_at(i)) for i in range(events.row_count)]
            assert 0 < len(rows) < every and all("error" in r.lower() for r in rows), rows
            await pilot.press("enter")  # keeps the filter, back to the table: keys are keys again
            await pilot.pause()
            assert app.focused is events and events.row_count == len(rows)
            loads = app.screen.loads
            app.screen.reload()
            await until(pilot, lambda: app.screen.loads > loads, "a refresh")
            assert events.row_count == len(rows)  # a refresh keeps the filter

    run(scenario())


def test_the_main_filter_box_is_seen_above_the_footer(tmp_path):
    """Defect: the filter box was under the footer: what was typed was invisible."""
    from textual.widgets import Footer, Input

    store = build("healthy", tmp_path)

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(80, 24)) as pilot:
            await loaded(pilot, app)
            assert not app.query_one("#filter").display and app.focused is app.query_one("#runs")
            await pilot.press("slash", *"prod")
            await pilot.pause()
            box, footer = app.query_one("#filter", Input), app.query_one(Footer)
            assert box.region.height == 1 and box.region.bottom <= footer.region.y
            assert "prod" in screen_text(app).splitlines()[box.region.y]
            _no_action_was_taken(app, store, {PROD: "running"})

    run(scenario())


def test_the_log_tab_is_filtered_by_slash(tmp_path):
    store, _ = run_with_log(tmp_path, [f"step {i}/300 mark-{i}x" for i in range(1, 41)])

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await log_open(pilot, app, 40)
            await pilot.press("slash", *"mark-17x")
            log = app.screen.query_one("#log-text")
            await until(pilot, lambda: not log.rebuilding and log.rows.words == ["mark-17x"], "the filter")
            assert log.texts() == ["step 17/300 mark-17x"]
            await pilot.press("escape")
            await until(pilot, lambda: not log.rebuilding and not log.rows.words, "the filter cleared")
            assert len(log.texts()) == 40

    run(scenario())


def test_the_dialog_says_a_running_trainer_is_stopped_first_and_only_y_says_yes(tmp_path):
    """Defect: the restart dialog did not say that a running trainer is stopped first;
    Enter said yes (and Enter also opens runs and keeps filters)."""
    from dflashctl.tui.screens import ConfirmScreen

    store = build("healthy", tmp_path)

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(pilot, app)
            await pilot.press("down", "r")  # the row under the cursor: PROD
            await pilot.pause()
            assert isinstance(app.screen, ConfirmScreen)
            text = " ".join(screen_text(app).split())
            assert f"Restart run {PROD}?" in text
            assert app.screen.detail.startswith("Its trainer (running, step 3,950) on gpu1 is stopped first: SIGTERM, "
                                                "it writes a checkpoint and exits")
            assert "is stopped first:" in text and "a supervisor watches it" in text
            # Under the question, the runs screen's keys do nothing.
            await pilot.press("slash", "x", "r", "e", "s")
            await pilot.pause()
            assert sum(isinstance(s, ConfirmScreen) for s in app.screen_stack) == 1 and app.sort == "default"
            await pilot.press("enter")
            await pilot.pause()
            _no_action_was_taken(app, store, {PROD: "running"})
            await pilot.press("x")
            await pilot.pause()
            assert f"Stop run {PROD}?" in screen_text(app) and "gets SIGTERM" in " ".join(screen_text(app).split())
            await pilot.press("escape")
            # A finished run: nothing to stop, so no question.
            await pilot.press("end", "x")
            await pilot.pause()
            assert not isinstance(app.screen, ConfirmScreen)
            _no_action_was_taken(app, store, {PROD: "running", OLD: "done"})

    run(scenario())


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_readonly_removes_every_action(tmp_path, monkeypatch, how):
    from dflashctl.tui.screens import DetailScreen

    store = build("healthy", tmp_path)
    if how == "environment":
        monkeypatch.setenv("DFLASHCTL_READONLY", "1")

    async def scenario():
        app = app_for(store, tmp_path, **({"readonly": True} if how == "argument" else {}))
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(pilot, app)
            assert "read-only" in screen_text(app).splitlines()[0]
            footer = screen_text(app).splitlines()[-1]
            assert "Stop" not in footer and "Restart" not in footer and "Filter" in footer
            await pilot.press("down", "x", "y", "r", "y")
            await pilot.pause()
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, DetailScreen), "the detail")
            await pilot.press("x", "y", "r", "y")
            await pilot.pause()
            footer = screen_text(app).splitlines()[-1]
            assert "Stop" not in footer and "Restart" not in footer
            _no_action_was_taken(app, store, {PROD: "running"})

    run(scenario())


# --------------------------------------------------------------------------- resizes


def test_the_layout_follows_every_resize(tmp_path):
    """Defect: on_resize read the old size: 201x60 -> 120x40 kept the wide layout, the
    run pane 10 columns wide, folding letter by letter."""
    store = build("healthy", tmp_path)

    def layout(app) -> tuple[str, int]:
        classes = app.screen_stack[0].classes
        return next(m for m in ("compact", "normal", "wide") if f"-{m}" in classes), app.query_one("#run-box").size.width

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(pilot, app)
            normal = layout(app)
            assert normal[0] == "normal" and normal[1] >= 118
            await pilot.resize_terminal(201, 60)
            await pilot.pause(0.2)
            assert layout(app)[0] == "wide" and app.query_one("#gpu-box").region.x > 80
            await pilot.resize_terminal(120, 40)
            await pilot.pause(0.2)
            assert layout(app) == normal
            assert app.query_one("#gpu-box").region.x == 0
            run_line = next(line for line in screen_text(app).splitlines() if line.startswith(DEMO))
            assert "· demo on local · running" in run_line  # not folded letter by letter
            await pilot.resize_terminal(80, 24)
            await pilot.pause(0.2)
            assert layout(app)[0] == "compact"

    run(scenario())


def test_the_selected_runs_fix_is_shown_at_80x24(tmp_path):
    """Defect: at 80x24 the selected run's pane was hidden while 11 rows were empty."""
    store = build("unsupervised", tmp_path)

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(80, 24)) as pilot:
            await loaded(pilot, app)
            box = app.query_one("#run-box")
            assert box.display and box.region.height >= 6
            text = screen_text(app)
            assert f"{PROD} · prod on gpu1 · unsupervised" in text and "fix: dflashctl watch" in text

    run(scenario())


# --------------------------------------------------------------------------- truth in the corners


@pytest.mark.parametrize("locked", [True, False])
def test_a_live_supervisor_blocked_on_a_locked_store_shows_store_busy_not_unsupervised(tmp_path, monkeypatch,
                                                                                       locked):
    """Defect: a store whose write lock another process held showed every supervisor
    as dead ("0 supervisor(s) ticking", every run unsupervised, fix: a second `watch`)
    though their processes were alive, blocked on the lock. The supervisor here is a
    real process of this machine; the lock is a real SQLite write transaction."""
    import socket
    import sqlite3
    import subprocess

    monkeypatch.chdir(tmp_path)  # the header names the store relative to here
    store = build("unsupervised", tmp_path)  # its supervisor ticked last 5 m ago
    supervisor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    holder = sqlite3.connect(store.path, timeout=0, isolation_level=None)
    try:
        store.heartbeat("sup-1", pid=supervisor.pid, host=socket.gethostname(), started=NOW - 3600, interval=15.0,
                        now=NOW - 70, runs=[PROD], hosts={"gpu1": {"last_ok": NOW - 70, "error": None,
                                                                   "down_since": None}})
        if locked:
            holder.execute("BEGIN IMMEDIATE")  # another process's write transaction, never ending

        async def scenario():
            app = app_for(store, tmp_path)
            async with app.run_test(size=(120, 40)) as pilot:
                await loaded(pilot, app)
                text = screen_text(app)
                head = text.splitlines()[0]
                assert head.rstrip().endswith("· store runs.db")  # the store the screen reads
                state = cell(app, PROD, "state")
                assert state != "unsupervised" and (state == "store busy" or not locked)
                assert "dflashctl watch" not in text  # a second supervisor is not the fix
                if locked:
                    assert "1 alive, store busy 1.2m" in head
                    assert f"supervisor pid {supervisor.pid} alive, store busy 1.2 m" in text
                else:
                    assert f"supervisor pid {supervisor.pid} alive but silent for 1.2 m" in text

        run(scenario())
    finally:
        holder.close()
        supervisor.kill()
        supervisor.wait()


def test_status_with_a_store_that_does_not_exist_is_an_error_and_makes_none(tmp_path):
    """Defect: a mistyped store path was created empty and shown as "no runs yet"."""

    path = tmp_path / "typo" / "runs.db"
    for args in (["--once"], ["--json"]):
        done = cli.invoke("status", *args, env={"DFLASHCTL_STORE": str(path)})
        assert done.returncode != 0 and f"no run store at {path}" in done.stderr, done.stderr
        assert "DFLASHCTL_STORE" in done.stderr and "Traceback" not in done.stderr
        assert not path.exists() and not path.parent.exists()


@pytest.mark.parametrize("watched,code", [(True, 0), (False, 1)])
def test_status_check_exits_1_on_a_run_that_needs_attention(tmp_path, watched, code):
    """Defect: `status --once` exited 0 with failed and unsupervised runs: cron could not tell.
    (On this machine's clock: the command reads the real time.)"""

    store = Store(str(tmp_path / "runs.db"))
    now = time.time()
    store.create_run("demo", "local", {}, now - 60, run_id=DEMO)
    store.transition(DEMO, "running", "trainer started (pid 777, phase training)", now - 50)
    if watched:
        store.heartbeat("sup-1", pid=4242, host="ops", started=now - 60, interval=15.0, now=now - 2, runs=[DEMO],
                        hosts={"local": {"last_ok": now - 2, "error": None, "down_since": None}})
    for args in (["--once", "--check"], ["--json", "--check"]):
        done = cli.invoke("status", *args, env={"DFLASHCTL_STORE": store.path}, columns=160)
        assert done.returncode == code, done.stderr
        assert (f"check: 1 run(s) need attention: {DEMO} unsupervised" in done.stderr) == bool(code), done.stderr
    assert cli.invoke("status", "--once", env={"DFLASHCTL_STORE": store.path}).returncode == 0


# --------------------------------------------------------------------------- charts


def test_a_chart_of_a_two_hour_history_starts_at_the_runs_start(tmp_path):
    """Defect: `spark(values, width)` kept the newest `width` buckets: at 120 columns the
    start of the run (the loss drop, the slow first half hour) was not drawn under a
    title naming the whole history. Here 2 h of real samples in a real store: the first
    30 min at 2 Ktok/s, then 12 Ktok/s; the chart's first quarter is the low one and its
    time axis starts at the first sample."""
    from dflashctl.status.model import StatusReader
    from dflashctl.supervise.detectors import fmt_clock
    from dflashctl.tui.text import detail_text

    store = Store(str(tmp_path / "runs.db"))
    start = NOW - 7200
    store.create_run("demo", "local", {}, start - 60, run_id=DEMO)
    store.add_samples(DEMO, [{"time": start + 10 * i, "step": i, "tok_s": 2000.0 if i < 180 else 12000.0,
                              "loss": 4.0 - i / 720, "phase": "training"} for i in range(720)], observed=NOW)
    view = StatusReader(store).detail(DEMO, NOW)
    assert len(view.series) == 240 and view.series[0]["time"] - start < 30  # a bucket's time is its last sample's
    lines = detail_text(view, 120, NOW).plain.splitlines()
    top = lines.index(next(line for line in lines if line.startswith("tok/s  now"))) + 1
    rows = lines[top:top + 6]
    assert rows[0].startswith("12.0K┤") and rows[-1].startswith("    0┤"), rows
    plot = [row[6:] for row in rows]
    assert len(plot[0]) == 112  # the whole history in the width (118 less the labels), not its newest buckets
    # The first 30 of 120 minutes (28 of 112 columns) at a sixth of the top: only the bottom row is filled.
    assert set(plot[0][:26]) == {" "} and set(plot[0][30:]) == {"█"}, plot[0]
    assert set(plot[-1]) == {"█"}, plot[-1]
    axis = next(line for line in lines if line.lstrip().startswith(fmt_clock(start)))
    assert axis.rstrip().endswith(fmt_clock(NOW))  # an active run's charts run up to now


def test_the_run_pane_shows_samples_per_second_beside_tok_s_and_both_mfus(tmp_path):
    """The trainer's samples/s (a metrics line's extra) is shown with tok/s, the unit
    public trainers quote, and its MFU against the measured matmul rate beside the one
    against the nominal peak; a line without them shows neither."""
    store = build("healthy", tmp_path)
    store.add_samples(DEMO, [contract.Metrics(time=NOW - 1, step=95, total_steps=300, tok_s=930.0,
                                              extra={"samples_s": 34.72, "anchors_s": 17778.8, "mfu": 0.4668,
                                                     "mfu_measured": 0.5844})])

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(160, 40)) as pilot:
            await loaded(pilot, app)
            text = screen_text(app)
            assert "· 34.7 samples/s ·" in text
            assert "MFU 47% (58% of the measured matmul rate)" in text
        other = build("healthy", tmp_path / "plain")
        app = app_for(other, tmp_path / "plain")
        async with app.run_test(size=(160, 40)) as pilot:
            await loaded(pilot, app)
            assert "samples/s" not in screen_text(app) and "measured matmul" not in screen_text(app)

    run(scenario())


def test_the_detail_screen_shows_its_title_row_above_the_tabs(tmp_path):
    """The run's title line (run, state, the tab keys) is the screen's first row: the
    tabs take what the title and the footer leave, so the screen never scrolls it away."""
    store = build("healthy", tmp_path)

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(pilot, app)
            await pilot.press("enter")
            await detail_loaded(pilot, app)
            title = app.screen.query_one("#detail-title")
            tabs = app.screen.query_one("#tabs")
            assert title.region.y == 0 and title.region.height == 1 and tabs.region.y == 1
            assert tabs.region.bottom <= 39  # the footer's row stays the footer's

    run(scenario())


def test_moving_the_cursor_back_to_a_run_draws_its_charts_at_once(tmp_path):
    """Defect: the run pane drew no charts after a cursor move until that run's read came
    back (a blank beat on every move). A run read before keeps its last charts, drawn at
    once; a run never read shows none until its read, not another run's."""
    store = build("healthy", tmp_path)

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(pilot, app)
            first = app.selected
            pane = app.query_one("#run")
            # Each chart's title: its newest, lowest and highest value (the rows' width
            # follows the pane's, which a scrollbar may change between two draws).
            first_chart = [line.strip() for line in pane.shown.plain.splitlines() if "  now " in line]
            assert len(first_chart) == 3 and "┤" in pane.shown.plain  # tok/s, loss and τ est
            # The store answers in milliseconds; a read held back stands for a busy store,
            # so the pane is looked at before the read of the run under the cursor is back.
            release = threading.Event()
            real_load = app.reader.load

            def held_load(*args, **kw):
                view = real_load(*args, **kw)
                release.wait(20)
                return view

            app.reader.load = held_load
            await pilot.press("down")  # a run not read yet
            await pilot.pause()
            assert app.selected != first and app.view.selected == first
            assert "┤" not in pane.shown.plain  # none drawn: not the first run's charts
            release.set()
            await until(pilot, lambda: app.view.selected == app.selected, "the second run's read")
            assert "┤" in pane.shown.plain
            release.clear()
            await pilot.press("up")  # back to the run read before
            await pilot.pause()
            assert app.selected == first and app.view.selected != first
            shown = pane.shown.plain
            assert all(line in shown for line in first_chart), shown  # its charts at once, from its last read
            release.set()
            app.reader.load = real_load
            await until(pilot, lambda: app.view.selected == first, "the first run's read")

    run(scenario())
