"""The status console's history charts, the renderer alone
(``dflashctl.tui.charts``): marks in the columns of their time, one-row charts,
labels, gaps, and the rows the run pane gives them. (Charts from real stores and
their snapshots: tests/integration/test_tui_charts.py.)"""

from __future__ import annotations

from dflashctl.tui import charts
from tests.harness.scenes import NOW

START = NOW - 7200  # 06:00:00 UTC: the long run's first sample
STALL = START + 4200  # 07:10:00: stalled (no samples 07:05 .. 07:20)
CRASH = START + 5700  # 07:35:00: the trainer died; restarted at RESTART
RESTART = START + 5710
EARLY_RESTART = START + 1800  # 06:30:00: before the last hour


def test_marks_fall_in_the_columns_of_their_time():
    """Over 0 .. 7200 s in 100 columns (72 s each): a restart at 3600 s is column 50,
    a stall at 5400 s column 75, one at 7200 s the last; marks outside the span are
    not drawn. They cross the plot too (a filled cell keeps its bar, in the mark's colour)."""
    points = [(60.0 * i, 1.0 + (i % 3)) for i in range(121)]
    marks = [(3600.0, "restart"), (5400.0, "stall"), (7200.0, "stall"), (-5.0, "restart"), (7300.0, "restart")]
    text = charts.chart(points, 0.0, 7200.0, 106, 4, marks, fmt=lambda v: f"{v:.2f}", labels=5)
    lines = text.plain.splitlines()
    assert len(lines) == 6  # 4 rows, the marks row, the clock row
    axis = lines[4]
    assert axis[:6] == "     └" and len(axis) == 106
    drawn = {i - 6: ch for i, ch in enumerate(axis) if ch in "↻‖"}
    assert drawn == {50: "↻", 75: "‖", 99: "‖"}, drawn
    assert lines[0][6 + 50] in charts.BLOCKS + "┊"
    styles = {span.style for span in text.spans if span.start <= len(lines[0]) + 1 + 6 + 50 < span.end}
    assert charts.MARK_STYLE["restart"] in styles  # the second row's cell of column 50
    assert lines[5].startswith("      00:00:00") and lines[5].rstrip().endswith("02:00:00")


def test_one_row_chart_carries_its_marks_in_the_row():
    points = [(10.0 * i, 5.0) for i in range(61)]
    row = charts.chart(points, 0.0, 600.0, 60, 1, [(300.0, "restart"), (450.0, "stall")]).plain
    assert len(row) == 60 and row[30] == "↻" and row[45] == "‖"
    assert set(row) - {"↻", "‖"} == {charts.BLOCKS[4]}  # a flat series: half height


def test_y_labels_show_the_range():
    """The top row is labelled with the highest value, the bottom one with the lowest
    (or the floor given: tok/s from 0); a row between carries no label."""
    loss = [(60.0 * i, 4.0 - i / 60) for i in range(121)]  # 4.0 -> 2.0
    lines = charts.chart(loss, 0.0, 7200.0, 80, 5, fmt=lambda v: f"{v:.3f}", axis=False).plain.splitlines()
    assert [line[:6] for line in lines] == ["4.000┤", "     │", "     │", "     │", "2.000┤"]
    assert lines[0][6] == "█" and lines[0][-1] == " " and lines[-1][-1] == "▁"  # falls from the top to the floor
    rate = [(60.0 * i, 12000.0) for i in range(121)]
    lines = charts.chart(rate, 0.0, 7200.0, 80, 3, fmt=lambda v: f"{v / 1e3:.1f}K" if v else "0", low=0.0,
                         axis=False).plain.splitlines()
    assert lines[0].startswith("12.0K┤") and lines[-1].startswith("    0┤")


def test_a_long_silence_is_a_gap_a_sparse_series_is_a_line():
    """Samples every 60 s on columns of 30 s: no column between two samples is empty;
    a 10-minute silence (ten spacings) is drawn as one."""
    points = [(60.0 * i, 1.0) for i in range(61) if not 20 < i < 30]
    values = charts.columns(points, 0.0, 3600.0, 120)
    gap = [c for c, v in enumerate(values) if v is None]
    assert gap == list(range(41, 60)), gap  # the columns after 20 min (40) and before 30 min (60)
    assert charts.columns([(0.0, 1.0)], 0.0, 60.0, 4) == [1.0, None, None, None]


def test_the_run_pane_gives_its_rows_to_the_charts_after_the_events_minimum():
    """Compact: one-row charts. Otherwise as tall as leaves three event lines, at most 6
    rows; whatever the height, the figures, the charts and the events fit in it once it
    holds the figures and three events."""
    from dflashctl.tui.text import CHART_HEADER_LINES, MIN_EVENT_LINES, run_pane_layout

    assert run_pane_layout(5, compact=True) == (1, 1, MIN_EVENT_LINES)
    assert run_pane_layout(14, compact=True) == (1, 3, 6)
    assert run_pane_layout(22, compact=False) == (3, 3, 3) and run_pane_layout(55, compact=False)[0] == 6
    for height in range(CHART_HEADER_LINES + MIN_EVENT_LINES + 3, 120):
        for compact in (True, False):
            rows, count, events = run_pane_layout(height, compact)
            chart_lines = count * (rows + 1) + 2 if rows > 1 else count
            assert events >= MIN_EVENT_LINES and 1 <= rows <= 6
            assert CHART_HEADER_LINES + chart_lines + events <= max(height, CHART_HEADER_LINES + 3 + MIN_EVENT_LINES)


def test_a_start_up_spike_is_left_off_the_y_range_and_a_trend_keeps_its_range():
    """Defect: the tok/s chart was scaled to the start-up spike (1.8K flattened the
    steady 137 to one eighth of a row for the whole run)."""
    from dflashctl.tui.charts import chart, robust_range

    steady = [137.0 + (i % 5) - 2 for i in range(200)]
    lo, hi = robust_range([1800.0, 1500.0] + steady)
    assert 135 <= lo <= 137 and 137 <= hi < 200
    assert robust_range([10.0 - 0.04 * i for i in range(200)]) == (10.0 - 0.04 * 199, 10.0)  # a trend: all of it
    assert robust_range([5.0, 5.0]) == (5.0, 5.0) and robust_range([]) is None
    points = [(float(t), v) for t, v in enumerate([1800.0, 1500.0] + steady)]
    text = chart(points, 0.0, 201.0, 60, 4, fmt=lambda v: f"{v:.0f}").plain.splitlines()
    assert text[0].split("┤")[0].strip() == f"{hi:.0f}"  # the top label: the steady range, not 1800
    from dflashctl.tui.charts import BLOCKS

    body = [row.split("┤" if "┤" in row else "│", 1)[1] for row in text[:4]]
    heights = [sum(BLOCKS.index(row[c]) for row in body) for c in range(5, 55)]
    assert len(set(heights)) >= 3 and max(heights) >= 6  # its ups and downs, not all one eighth (as at 0..1800)


def test_a_live_window_is_drawn_again_when_its_end_moved_a_column_or_new_data_came(monkeypatch):
    """The run pane's charts end at the clock: a refresh 2 s later with the same series
    reuses the drawing (its axis says the end drawn), one a column's time later, or with
    a newer series, draws again."""
    from dflashctl.status.charts import ChartView
    from dflashctl.tui import text

    drawn: list[float] = []
    real = text._history_text

    def spy(chart, *args):  # the real drawing, counted
        drawn.append(chart.t1)
        return real(chart, *args)

    monkeypatch.setattr(text, "_history_text", spy)
    series = [{"time": START + 60.0 * i, "start": START + 60.0 * i, "tok_s": 100.0 + i, "loss": 3.0 - i / 100,
               "accept_len": 2.0} for i in range(120)]
    column = 7200.0 / 80  # 80 cells over the two hours

    def chart(t1: float, points: list) -> str:
        return text.history_text(ChartView("all", START, t1, points, [], START), 80, 4).plain

    first = chart(START + 7200, series)
    assert chart(START + 7202, series) == first and len(drawn) == 1
    chart(START + 7200 + column, series)
    assert len(drawn) == 2
    newer = [*series, {**series[-1], "time": START + 7260, "start": START + 7260, "tok_s": 500.0}]
    chart(START + 7200 + column + 2, newer)
    assert len(drawn) == 3
