"""The status console's history charts: the renderer (``dflashctl.tui.charts``, pure),
the history read at a zoom (``StatusReader.chart``) from a real SQLite store, the
run pane and the detail view drawn from it, the zoom key driven headless (Pilot),
and SVG snapshots of a two-hour run with a stall and a restart."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from dflashctl.store import Store
from tests.harness.scenes import NOW, PROD, beat, playbook, run_config, training, utc
from tests.harness.tui import app_for, detail_loaded, loaded, until

START = NOW - 7200  # 06:00:00 UTC: the long run's first sample
STALL = START + 4200  # 07:10:00: stalled (no samples 07:05 .. 07:20)
CRASH = START + 5700  # 07:35:00: the trainer died; restarted at RESTART
RESTART = START + 5710
EARLY_RESTART = START + 1800  # 06:30:00: before the last hour


@pytest.fixture(autouse=True)
def _utc():
    utc()


def long_run(root: Path) -> Store:
    """A real store: a run of two hours, its first hour at 6 Ktok/s and its second at
    12.8 Ktok/s, restarted at 06:30 and 07:35 (a crash, 2 min down), stalled from 07:05
    (marked at 07:10) to 07:20, samples every 30 s up to 10 s ago, watched."""
    store = Store(str(root / "runs.db"))
    source = playbook(root / "playbooks", "prod")
    store.create_run("prod", "gpu1", run_config(source), START - 300, run_id=PROD)
    store.transition(PROD, "running", "trainer started (pid 4343, phase compiling)", START - 200)
    training(store, PROD, START, START + 1790, step0=1000, every=30.0, tok_s=6000.0, gpu_every=1000)
    store.add_restart(PROD, EARLY_RESTART, "crash: NCCL timeout", signature="nccl_timeout")
    training(store, PROD, START + 1830, START + 3590, step0=9000, every=30.0, tok_s=6000.0, gpu_every=1000)
    training(store, PROD, START + 3600, START + 3900, step0=18000, every=30.0, gpu_every=1000)
    store.transition(PROD, "stalled", "no step for 5 m", STALL)
    store.transition(PROD, "running", "steps again", START + 4800)
    training(store, PROD, START + 4800, CRASH - 10, step0=19500, every=30.0, gpu_every=1000)
    store.add_event(PROD, "crash", "crash: CUDA out of memory (cuda_oom)", CRASH, severity="error",
                    detail={"signature": "cuda_oom"})
    store.transition(PROD, "restarting", "restart 1/5 in 10 s: crash: CUDA out of memory", CRASH + 5)
    store.add_restart(PROD, RESTART, "crash: CUDA out of memory", signature="cuda_oom", step_before=24000)
    store.transition(PROD, "running", "trainer started (pid 4444, phase training)", CRASH + 120)
    training(store, PROD, CRASH + 120, NOW - 10, step0=23000, every=30.0)
    beat(store, [PROD], NOW - 3, {"gpu1": {"last_ok": NOW - 4, "error": None, "down_since": None}})
    return store


def detail(store: Store, zoom: str = "all"):
    from dflashctl.status.model import StatusReader

    return StatusReader(store).detail(PROD, NOW, zoom=zoom)


def chart_lines(text: str, name: str) -> list[str]:
    """The rows of chart ``name`` (its title line excluded) in a drawn history."""
    lines = text.splitlines()
    top = lines.index(next(line for line in lines if line.startswith(f"{name}  now"))) + 1
    rows = []
    for line in lines[top:]:
        if "┤" not in line[:8] and "│" not in line[:8]:
            break
        rows.append(line)
    return rows


def axis_rows(text: str) -> tuple[str, str]:
    """The marks row (└──↻──) and the clock row under the charts."""
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if line.lstrip().startswith("└"))
    return lines[i], lines[i + 1]


# --------------------------------------------------------------------------- the history read at a zoom


def test_a_two_hour_chart_starts_at_the_runs_start_and_marks_the_restarts_and_the_stall(tmp_path):
    """All of a 2 h run in 120 columns (1 min each): the clock starts at its first sample
    and ends now; the restarts (06:30, 07:35) and the stall (07:10) are marked in their
    minute's column; the silent stall (07:05 .. 07:20) is a gap in the plot."""
    store = long_run(tmp_path)
    d = detail(store)
    assert d.chart.t0 == START and d.chart.t1 == NOW
    assert [(m.kind, m.time) for m in d.chart.marks] == [("restart", EARLY_RESTART), ("stall", STALL),
                                                         ("restart", RESTART)]
    from dflashctl.tui.text import detail_text

    text = detail_text(d, 128, NOW).plain  # 126 cells of charts: 5 of labels, the axis, 120 columns
    marks, clock = axis_rows(text)
    assert {i - 6: ch for i, ch in enumerate(marks) if ch in "↻‖"} == {30: "↻", 70: "‖", 95: "↻"}
    assert clock.startswith(" " * 6 + "06:00:00") and clock.rstrip().endswith("08:00:00")
    rate = chart_lines(text, "tok/s")
    assert rate[0].startswith("13.1K┤") and rate[-1].startswith("    0┤")
    bottom = rate[-1][6:]
    assert len(bottom) == 120
    assert bottom[66:80].replace("┊", "") == " " * 13  # 07:06 .. 07:19: no sample
    assert " " not in bottom[:29] + bottom[31:65] + bottom[81:94]
    assert "zoom all: 2 h" in text and "↻ restart ×2  ‖ stall" in text


def test_zoom_one_hour_shows_only_the_last_hour(tmp_path):
    """1 h: from 07:00 to now, its own buckets (as fine as the whole run's), the stall and
    the second restart marked, the first restart (06:30) and the slow first hour gone."""
    from dflashctl.tui.text import detail_text

    store = long_run(tmp_path)
    d = detail(store, "1 h")
    c = d.chart
    assert (c.zoom, c.t0, c.t1) == ("1 h", NOW - 3600, NOW)
    # Its own buckets: 15 s each, one sample (every 30 s) in each, not the whole run's 30 s ones.
    assert min(p["start"] for p in c.series) >= NOW - 3600 and {p["samples"] for p in c.series} == {1}
    assert len(c.series) == len(store.samples(PROD, since=NOW - 3600 - 1e-6))
    assert [m.kind for m in c.marks] == ["stall", "restart"]
    text = detail_text(d, 128, NOW).plain
    marks, clock = axis_rows(text)
    assert {i - 6: ch for i, ch in enumerate(marks) if ch in "↻‖"} == {20: "‖", 70: "↻"}  # 30 s a column
    assert clock.startswith(" " * 6 + "07:00:00")
    assert "tok/s  now 12.5K · min 12.5K · max 13.1K · zoom 1 h of 2 h" in text  # no 6 Ktok/s sample
    whole = detail_text(detail(store, "all"), 128, NOW).plain
    assert "min 5.7K" in whole


def test_zoom_six_hours_of_a_shorter_run_is_all_of_it(tmp_path):
    store = long_run(tmp_path)
    c = detail(store, "6 h").chart
    assert (c.t0, c.t1) == (START, NOW) and c.title() == "zoom 6 h: all 2 h"


def test_a_finished_runs_chart_ends_at_its_last_sample(tmp_path):
    from dflashctl.status.model import chart_window

    assert chart_window(100.0, 900.0, 5000.0, False, "all") == (100.0, 900.0)
    assert chart_window(100.0, 900.0, 5000.0, True, "all") == (100.0, 5000.0)
    assert chart_window(100.0, 9000.0, 9000.0, True, "1 h") == (5400.0, 9000.0)


# --------------------------------------------------------------------------- the console


def pane_text(app, selector: str) -> str:
    return app.screen.query_one(selector).shown.plain


def test_z_cycles_the_zoom_on_the_runs_screen_and_in_the_detail(tmp_path):
    """z: 1 h, 6 h, all, in the run pane and in a run's detail (which opens at the zoom
    in force); a z typed in the filter box is text, not a zoom."""
    from dflashctl.tui.screens import DetailScreen

    store = long_run(tmp_path)

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(pilot, app)
            pane = pane_text(app, "#run")
            assert "zoom all: 2 h" in pane and axis_rows(pane)[1].lstrip().startswith("06:00:00")
            loads = app.loads
            await pilot.press("z")
            await until(pilot, lambda: app.loads > loads and "zoom 1 h of 2 h" in pane_text(app, "#run"),
                        "the run pane at 1 h")
            assert app.zoom == "1 h" and axis_rows(pane_text(app, "#run"))[1].lstrip().startswith("07:00:00")
            await pilot.press("enter")
            await detail_loaded(pilot, app)
            assert "zoom 1 h of 2 h" in pane_text(app, "#overview-text")
            loads = app.screen.loads
            await pilot.press("z")
            await until(pilot, lambda: app.screen.loads > loads
                        and "zoom 6 h: all 2 h" in pane_text(app, "#overview-text"), "the detail at 6 h")
            await pilot.press("escape")
            await until(pilot, lambda: not isinstance(app.screen, DetailScreen), "the runs screen")
            await pilot.press("slash", "z")
            await pilot.pause()
            assert app.zoom == "6 h" and app.query_one("#filter").value == "z"

    asyncio.run(scenario())


def test_compact_layout_draws_one_row_charts_with_their_marks(tmp_path):
    store = long_run(tmp_path)

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(80, 24)) as pilot:
            await loaded(pilot, app)
            lines = pane_text(app, "#run").splitlines()
            rate = next(line for line in lines if line.startswith("tok/s ") and "zoom" in line)
            assert "↻" in rate and "‖" in rate and rate.endswith("zoom all: 2 h") and len(rate) <= 80
            assert not any("┤" in line for line in lines)  # one row each: no y labels

    asyncio.run(scenario())


# --------------------------------------------------------------------------- snapshots

SIZES = [(120, 40), (200, 60)]


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
@pytest.mark.parametrize("screen", ["runs", "detail"])
def test_snapshot_of_a_long_run(snap_compare, tmp_path, monkeypatch, screen, size):
    """The run pane and the detail view of the two-hour run: the charts, their y labels,
    the marks and the clock (look at them in snapshot_report.html before accepting)."""
    monkeypatch.chdir(tmp_path)  # paths drawn relative: 'runs.db', 'playbooks/prod.yaml' on every machine
    store = long_run(Path("."))
    app = app_for(store, Path("."))

    async def shown(pilot):
        await loaded(pilot, app)
        if screen == "detail":
            await pilot.press("enter")
            await detail_loaded(pilot, app)
        await pilot.pause()

    assert snap_compare(app, terminal_size=size, run_before=shown)
