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
            await until(pilot, lambda: app.screen.plotted is not None, "the plots")
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
