"""The log view driven headless over a real store and a real trainer log: the focus
from every way into it (its keys work at once, the filter box closes on Enter),
and a filter over 20,000 held lines that never holds the screen's thread.

What the filter must never do is walk the held lines on the screen's thread: that is
checked by counting, per thread, the lines the rows are computed over. The time it
holds the screen is measured and printed (the CPU time the screen's thread spends
between two turns of its event loop, ``time.thread_time``; bench/RESULTS.md has the
figures): one repaint of the whole screen costs 50-160 ms of it on a 2-core VM,
depending on the day, so a fixed bound near that would fail on a slow machine with
nothing wrong; the bound held is a ceiling far under the defect (12-25 s a key).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from dflashctl.tui.logrows import Rows
from tests.harness.scenes import utc
from tests.harness.tui import app_for, log_open, loaded, run, run_with_log, screen_text, until
from tests.harness.waiting import time_scale

KEY_CEILING_S = 0.8  # the screen thread busy between two turns, at most (the goal, < 100 ms, is a figure)


@pytest.fixture(autouse=True)
def _utc():
    utc()


def _lines(n: int) -> list[str]:
    return [f"step {i}/900000 tok/s {900 + i % 7} loss {2 + (i % 13) / 10:.2f} rank0 shard-{i % 97:02d}"
            for i in range(1, n + 1)]


def _parts(app):
    from dflashctl.tui.widgets import FilterBox, LogLines

    return app.screen.query_one(LogLines), app.screen.query_one(FilterBox)


async def _keys_work(pilot, app) -> None:
    """The log's own keys reach it: `t` wraps, `t` again cuts."""
    log, _ = _parts(app)
    assert app.focused is log, app.focused
    await pilot.press("t")
    assert log.wrap
    await pilot.press("t")
    assert not log.wrap


@pytest.mark.parametrize("way", ["l from the runs", "l from the overview", "l from the events", "click on its tab",
                                 "/ then Enter in the log", "Escape out of its filter"])
def test_the_log_has_the_focus_from_every_way_into_it(tmp_path, way):
    """Defect: `l` from inside the detail view left the log's keys dead until Tab; the
    filter box sometimes stayed open after Enter."""
    from dflashctl.tui.screens import DetailScreen

    lines = [f"step {i}/300 tok/s 900" for i in range(1, 41)]
    store, _ = run_with_log(tmp_path, lines)

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            if way == "l from the runs":
                await log_open(pilot, app, 40)
            else:
                await loaded(pilot, app)
                await pilot.press("enter")
                await until(pilot, lambda: isinstance(app.screen, DetailScreen), "the detail")
                if way == "l from the events":
                    await pilot.press("e")
                if way == "click on its tab":
                    await pilot.click("#tabs Tab#--content-tab-log")
                else:
                    await pilot.press("l")
                await until(pilot, lambda: app.screen.log_lines >= 40, "the log")
            log, box = _parts(app)
            if way == "/ then Enter in the log":
                await pilot.press("slash", *"step 1", "enter")
                assert not box.shown and box.disabled
                await until(pilot, lambda: not log.rebuilding, "the filter")
                assert log.texts() == [line for line in lines if "1" in line]
            if way == "Escape out of its filter":
                await pilot.press("slash", *"step 1", "escape")
                assert not box.shown and box.value == ""
            await pilot.pause()
            await _keys_work(pilot, app)
            assert "step 40/300" in screen_text(app) or way == "/ then Enter in the log"

    run(scenario())


def test_slash_from_the_overview_filters_the_events_and_enter_closes_the_box(tmp_path):
    from dflashctl.tui.screens import DetailScreen
    from dflashctl.tui.widgets import EventsTable

    store, _ = run_with_log(tmp_path, ["one line"])

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(pilot, app)
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, DetailScreen) and app.screen.loads, "the detail")
            await pilot.press("slash", *"zzz")
            await pilot.pause(0.2)  # the tab switch to the events settles: the box keeps the focus
            _, box = _parts(app)
            assert app.focused is box and box.value == "zzz"
            await pilot.press("enter")
            await pilot.pause()
            assert not box.shown and isinstance(app.focused, EventsTable)

    run(scenario())


class _Watch:
    """Turns of the event loop, timed: for each gap between two turns, the CPU time
    the loop's thread spent (work that held the screen) and the wall time."""

    def __init__(self) -> None:
        self.cpu: list[float] = []
        self.wall: list[float] = []
        self.running = True

    async def run(self) -> None:
        while self.running:
            cpu, wall = time.thread_time(), time.perf_counter()
            await asyncio.sleep(0.005)
            self.cpu.append(time.thread_time() - cpu)
            self.wall.append(time.perf_counter() - wall)


def test_a_filter_over_20000_lines_returns_the_screen_within_100_ms_of_each_key(tmp_path):
    """Defect: each filter key redrew every held line on the screen's thread (12-25 s
    at 20,000 lines, the wrap toggle 31 s), the screen frozen meanwhile."""
    from dflashctl.tui.widgets import LogLines

    lines = _lines(LogLines.KEEP)
    store, _ = run_with_log(tmp_path, lines[:200])
    walked = {"screen": 0, "worker": 0}  # lines the rows were computed over, by thread
    extend = Rows.extend

    def counted(rows, chunk, first):  # the view's own code, counted: which thread walks the lines
        walked["screen" if threading.current_thread() is threading.main_thread() else "worker"] += len(chunk)
        return extend(rows, chunk, first)

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(160, 45)) as pilot:
            await log_open(pilot, app, 200)
            log, _ = _parts(app)
            log.add(lines[200:])  # what following a busy log brings: the view holds KEEP lines
            await until(pilot, lambda: not log.rebuilding, "the lines taken")
            assert len(log.kept) == LogLines.KEEP and log.texts()[-1] == lines[-1]
            watch = _Watch()
            task = asyncio.get_running_loop().create_task(watch.run())
            Rows.extend = counted
            typed = "shard-42 loss 2.3"
            await pilot.press("slash")
            for key in typed:
                await pilot.press(key)  # each returns once the app has handled the key and drawn
            await until(pilot, lambda: not log.rebuilding and log.filter_text == typed, "the filter", timeout=60)
            await pilot.press("enter", "t")  # kept; then wrap every shown line
            await until(pilot, lambda: not log.rebuilding and log.wrap, "the wrap", timeout=60)
            await pilot.press("m")  # every line again, the matches marked
            await until(pilot, lambda: not log.rebuilding and not log.only_matches, "all lines", timeout=60)
            watch.running = False
            await task
            Rows.extend = extend
            expected = [line for line in lines if "shard-42" in line and "loss 2.3" in line]
            await pilot.press("m")
            await until(pilot, lambda: not log.rebuilding and log.only_matches, "the matches", timeout=60)
            assert log.texts() == expected and len(log.rows.found) == len(expected) > 10
            worst_cpu, worst_wall = max(watch.cpu), max(watch.wall)
            print(f"{len(typed) + 3} keys over {len(lines):,} lines: {len(watch.cpu)} turns of the loop, screen "
                  f"thread busy at most {1000 * worst_cpu:.1f} ms between two, wall gap at most "
                  f"{1000 * worst_wall:.1f} ms (load scale {time_scale():.2f})")
            assert len(watch.cpu) > 20
            # 20 rebuilds of the rows over 20,000 lines, every line of them in the worker;
            # the defect walked them all on the screen's thread, key after key.
            print(f"lines walked: {walked}")
            assert walked["screen"] == 0 and walked["worker"] >= 10 * LogLines.KEEP, walked
            # The wall gap is printed, not held: on a loaded machine it counts the time
            # other processes had (988 ms seen at load scale 3.4, the thread busy 77 ms).
            assert worst_cpu < KEY_CEILING_S * time_scale(), sorted(watch.cpu)[-5:]

    try:
        run(scenario())
    finally:
        Rows.extend = extend
