"""The console's text panes paint only what changed: a refresh that moves an age in a
header repaints that row, not the charts under it; a line that wraps onto more rows
moves the rest down; a resize lays every line out again at the new width. Real
Textual, headless; the rows painted are counted by wrapping ``Pane.render_line``
(a spy on the real method: what is painted is still the real widget's output)."""

from __future__ import annotations

from rich.text import Text
from textual.app import App, ComposeResult

from dflashctl.tui.widgets import Pane
from tests.harness.scenes import NOW, build, utc
from tests.harness.tui import app_for, loaded, run, screen_text, until


def _painted(monkeypatch) -> list[tuple[str | None, int]]:
    """(pane id, row) of every row any Pane paints from now on."""
    painted: list[tuple[str | None, int]] = []
    real = Pane.render_line

    def render_line(self, y):
        painted.append((self.id, y))
        return real(self, y)

    monkeypatch.setattr(Pane, "render_line", render_line)
    return painted


class _One(App):
    CSS = "Pane { width: 40; }"

    def compose(self) -> ComposeResult:
        yield Pane(id="p")


def _text(lines: list[str]) -> Text:
    out = Text()
    for i, line in enumerate(lines):
        out.append(("\n" if i else "") + line, style="bold" if i == 0 else "")
    return out


def test_a_pane_repaints_the_changed_line_only_and_reflows_when_a_line_wraps(monkeypatch):
    painted = _painted(monkeypatch)
    lines = [f"line {i}: steady" for i in range(12)]

    async def scenario():
        app = _One()
        async with app.run_test(size=(60, 20)) as pilot:
            pane = app.query_one(Pane)
            pane.show(_text(lines))
            await until(pilot, lambda: "line 11: steady" in screen_text(app), "the first paint")
            painted.clear()
            lines[3] = "line 3: moved"
            pane.show(_text(lines))
            await until(pilot, lambda: "line 3: moved" in screen_text(app), "the changed line")
            assert {y for _, y in painted} == {3}
            assert pane.size.height == 12

            painted.clear()
            pane.show(_text(lines))  # the same text again: nothing to paint
            await pilot.pause()
            assert painted == []

            lines[5] = "line 5: " + "long " * 12  # 68 cells: two rows at 40
            pane.show(_text(lines))
            await until(pilot, lambda: pane.size.height == 13, "the pane one row taller")
            shown = [row.rstrip() for row in screen_text(app).splitlines()]
            assert shown[5].startswith("line 5: long") and shown[6].startswith("long")
            assert shown[7] == "line 6: steady" and shown[12] == "line 11: steady"

            pane.styles.width = 80  # wider: the long line fits one row again
            await until(pilot, lambda: pane.size.height == 12, "the pane laid out at 80")
            assert screen_text(app).splitlines()[6].rstrip() == "line 6: steady"

    run(scenario())


def test_a_console_refresh_two_seconds_later_repaints_only_the_rows_that_moved(tmp_path, monkeypatch):
    utc()
    store = build("healthy", tmp_path)
    painted = _painted(monkeypatch)
    clock = {"now": NOW}

    async def scenario():
        app = app_for(store, tmp_path, clock=lambda: clock["now"])
        async with app.run_test(size=(200, 60)) as pilot:
            await loaded(pilot, app)
            run_pane = app.query_one("#run", Pane)
            rows = run_pane.size.height
            assert rows >= 20 and "┤" in run_pane.shown.plain  # the charts are there
            painted.clear()
            clock["now"] += 2  # the ages in the headers move; nothing new in the store
            loads = app.loads
            app.action_reload()
            await loaded(pilot, app, loads)
            repainted = {y for pane, y in painted if pane == "run"}
            assert repainted, "the run's ages did not move"
            # The header's ages and the charts' cells that the sliding window moved; the
            # events under the charts stay as painted.
            shown = [run_pane.render_line(y).text for y in range(rows)]
            kept = [y for y, line in enumerate(shown) if "state→" in line]
            assert len(kept) >= 2 and not repainted & set(kept), f"rows {sorted(repainted)} of {rows} repainted"

    run(scenario())


def test_a_console_refresh_repaints_the_rows_of_runs_whose_cells_changed_only(tmp_path, monkeypatch):
    from dflashctl.tui.widgets import RunsTable

    utc()
    store = build("healthy", tmp_path)
    painted: list[int] = []
    real = RunsTable.render_line

    def render_line(self, y):  # a spy on the real method, as _painted's
        painted.append(y)
        return real(self, y)

    monkeypatch.setattr(RunsTable, "render_line", render_line)
    clock = {"now": NOW}

    async def scenario():
        app = app_for(store, tmp_path, clock=lambda: clock["now"])
        async with app.run_test(size=(200, 60)) as pilot:
            await loaded(pilot, app)
            table = app.query_one(RunsTable)
            finished = [i for i, key in enumerate(table.ids) if table.get_cell(key, "state").plain == "done"]
            assert finished and len(table.ids) >= 3
            painted.clear()
            clock["now"] += 2  # the active runs' ages move
            loads = app.loads
            app.action_reload()
            await loaded(pilot, app, loads)
            assert painted, "no run's row changed"
            assert 0 not in painted, "the header was painted again"
            assert not {1 + i for i in finished} & set(painted), f"a finished run's row was painted: {painted}"

    run(scenario())
