"""The detail view's charts tab (textual-plot) over a real store: `c` shows a plot
per curve the store holds, its y range leaves the start-up spike off, and the
value under the mouse cursor is said above the plots."""

from __future__ import annotations

import pytest

from tests.harness.scenes import PROD, build, utc
from tests.harness.tui import app_for, loaded, run, screen_text, until


@pytest.fixture(autouse=True)
def _utc():
    utc()


def test_c_shows_the_curves_with_a_y_range_off_the_spike_and_the_value_under_the_cursor(tmp_path):
    from dflashctl.tui.plots import CURVES, CurvePlot
    from dflashctl.tui.screens import DetailScreen

    store = build("healthy", tmp_path)
    first = min(s.time for s in store.recent_samples(PROD, 10_000))
    store.add_samples(PROD, [{"time": first - 5, "step": 1, "tok_s": 180_000.0, "phase": "training"}])  # a spike

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(120, 60)) as pilot:
            await loaded(pilot, app)
            while app.query_one("#runs").current != PROD:
                await pilot.press("j")
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, DetailScreen) and app.screen.loads, "the detail")
            await pilot.press("c")
            await until(pilot, lambda: app.screen.plots_drawn, "the plots")
            await pilot.pause(0.3)
            plots = {p.key: p for p in app.screen.query(CurvePlot)}
            assert set(plots) == {key for key, _, _ in CURVES}
            tok = plots["tok_s"]
            assert max(v for _, v in tok.points) == 180_000.0
            assert tok._y_max < 20_000  # the spike is off the range; the steady 12.8K fills it
            assert "180000" not in screen_text(app) and tok._y_min > 10_000
            await pilot.hover(tok, offset=(60, 5))
            await until(pilot, lambda: "tok/s 1.2" in screen_text(app) or "tok/s 1.3" in screen_text(app),
                        "the value under the cursor")

    run(scenario())


def test_the_curves_beyond_the_series_lr_grad_norm_gpu_memory_and_measured_tau(tmp_path):
    """lr and grad norm from the metrics lines' extra (the run's rollups), GPU memory
    from the host's readings (its rollups), measured τ from the evals."""
    from dflashctl.tui.plots import CurvePlot
    from dflashctl.tui.screens import DetailScreen
    from tests.harness.scenes import NOW

    store = build("healthy", tmp_path)
    store.add_samples(PROD, [{"time": NOW - 600 + 10 * i, "step": 3900 + i, "tok_s": 12800.0, "phase": "training",
                              "extra": {"lr": 1e-4 * (1 - i / 100), "grad_norm": 0.5 + i / 100}} for i in range(40)])
    store.add_eval(PROD, NOW - 300, {"step": 3920, "tau": 3.9})

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(120, 60)) as pilot:
            await loaded(pilot, app)
            while app.query_one("#runs").current != PROD:
                await pilot.press("j")
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, DetailScreen) and app.screen.loads, "the detail")
            await pilot.press("c")
            await until(pilot, lambda: app.screen.plots_drawn, "the plots")
            plots = {p.key: p for p in app.screen.query(CurvePlot)}
            lr, grad = plots["lr"].points, plots["grad_norm"].points
            assert lr and max(v for _, v in lr) <= 1e-4 and min(v for _, v in lr) > 0.5e-4
            assert grad and 0.5 <= min(v for _, v in grad) and max(v for _, v in grad) < 0.9
            assert plots["gpu_mem"].points and all(80 < v < 141 for _, v in plots["gpu_mem"].points)  # GiB
            assert plots["tau_est"].more["tau"] == [(NOW - 300, 3.9)]

    run(scenario())
