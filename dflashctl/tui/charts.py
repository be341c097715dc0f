"""Charts of a run's history as rich ``Text``: pure functions of (points, t0, t1,
width, height, marks), drawn by the status console's run pane and detail view
(``dflashctl.tui.text``) and testable as text.

A chart spans the time ``t0`` .. ``t1`` in its columns (each the mean of the
points in its slice of time: a run's start is its first column whatever its
length), scaled between y labels (its lowest and highest value, or from a given
floor such as 0 tok/s; values far off the rest, a start-up spike, are left off the
range and drawn clipped: ``robust_range``) with eighths of a cell per row; marks (restarts, stalls)
are drawn at their time's column: a line through the plot, a glyph on the axis
row under it. A silence longer than a few of the series' usual spacings stays a
gap; a shorter one holds the earlier value (a series sparser than the columns
draws as a line, not as dots).

Never here: Textual, the store, the clock (every time is an argument).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Iterable, Sequence

from rich.text import Text

from dflashctl.core.units import fmt_clock

BLOCKS = " ▁▂▃▄▅▆▇█"  # eighths of a cell, from the bottom
MARK_GLYPH = {"restart": "↻", "stall": "‖"}
MARK_STYLE = {"restart": "bold red", "stall": "bold yellow"}
MARK_NAME = {"restart": "restart", "stall": "stall"}
MARK_ORDER = ("stall", "restart")  # where two fall in one column, the later one here is drawn
GAP_FACTOR = 3.0  # a silence longer than this many usual spacings of the series is a gap

Point = tuple[float, float]
Marks = Iterable[tuple[float, str]]  # (time, kind): kind one of MARK_GLYPH


def column_of(t: float, t0: float, t1: float, width: int) -> int:
    """The column (0 .. width-1) of time ``t`` on a chart from ``t0`` to ``t1``."""
    if width <= 1 or t1 <= t0:
        return max(0, width - 1)
    return min(width - 1, max(0, int((t - t0) / (t1 - t0) * width)))


def columns(points: Iterable[Point], t0: float, t1: float, width: int) -> list[float | None]:
    """``points`` (time, value) in ``width`` columns of equal time from ``t0`` to ``t1``:
    each the mean of its points, None where the series is silent for longer than
    ``GAP_FACTOR`` of its usual spacing (a column between two closer points, or
    after the last one up to ``t1``, holds the earlier value). (``column_of`` inlined:
    a live chart is drawn again with each new sample.)"""
    if width <= 0:
        return []
    pts = sorted((t, v) for t, v in points if t0 <= t <= t1 and v is not None and math.isfinite(v))
    last = width - 1
    if width <= 1 or t1 <= t0:
        cols = [last] * len(pts)
    else:
        span = t1 - t0  # column_of's own arithmetic: the same column to the last bit
        cols = [min(last, int((t - t0) / span * width)) for t, _ in pts]
    sums, counts = [0.0] * width, [0] * width
    for c, (_, v) in zip(cols, pts):
        sums[c] += v
        counts[c] += 1
    out: list[float | None] = [s / n if n else None for s, n in zip(sums, counts)]
    if len(pts) < 2:
        return out
    times = [t for t, _ in pts]
    limit = GAP_FACTOR * statistics.median([b - a for a, b in zip(times, times[1:])])
    for i in range(len(pts) - 1):  # a short silence between two points holds the earlier value
        ca, cb = cols[i], cols[i + 1]
        if cb - ca > 1 and times[i + 1] - times[i] <= limit:
            for c in range(ca + 1, cb):
                if out[c] is None:
                    out[c] = out[ca]
    if t1 - times[-1] <= limit:  # and so does a short one after the last, up to the window's end
        ca, cb = cols[-1], column_of(t1, t0, t1, width)
        for c in range(ca + 1, cb + 1):
            if out[c] is None:
                out[c] = out[ca]
    return out


def _mark_columns(marks: Marks, t0: float, t1: float, width: int) -> dict[int, str]:
    shown: dict[int, str] = {}
    for t, kind in sorted(marks, key=lambda m: (m[0], MARK_ORDER.index(m[1]) if m[1] in MARK_ORDER else -1)):
        if kind in MARK_GLYPH and t0 <= t <= t1:
            c = column_of(t, t0, t1, width)
            if kind == "restart" or shown.get(c) != "restart":
                shown[c] = kind
    return shown


ROBUST_K = 8.0  # a value further than this many robust deviations from the median is off the y range


def robust_range(values: Iterable[float | None], k: float = ROBUST_K) -> tuple[float, float] | None:
    """The y range a chart of ``values`` shows: their lowest and highest, except that
    values further than ``k`` robust deviations (1.4826 x the median absolute
    deviation) from the median are left off it, so a start-up spike (1.8K tok/s
    before a steady 137) does not flatten the rest of the run to one row; a trend
    (a loss from 10 down to 2) keeps its whole range. None without values."""
    known = sorted([v for v in values if v is not None and math.isfinite(v)])
    if not known:
        return None
    median = _median_of_sorted(known)
    spread = 1.4826 * _median_of_sorted(sorted([abs(v - median) for v in known]))
    if spread <= 0:
        return known[0], known[-1]
    return max(known[0], median - k * spread), min(known[-1], median + k * spread)


def _median_of_sorted(known: list[float]) -> float:
    n = len(known)
    return known[n // 2] if n % 2 else (known[n // 2 - 1] + known[n // 2]) / 2


def _scale(values: Sequence[float | None], low: float | None) -> tuple[float, float] | None:
    scale = robust_range(values)
    if scale is None:
        return None
    return (scale[0] if low is None else min(low, scale[0])), scale[1]


def label_width(points: Iterable[Point], fmt: Callable[[float], str], low: float | None = None) -> int:
    """Cells the y labels of a chart of ``points`` take (charts stacked over one time
    axis share the widest)."""
    values = [v for _, v in points]
    scale = _scale(values, low)
    return 0 if scale is None else max(len(fmt(scale[0])), len(fmt(scale[1])))


def chart(points: Iterable[Point], t0: float, t1: float, width: int, height: int, marks: Marks = (), *,
          style: str = "green", fmt: Callable[[float], str] = lambda v: f"{v:.3g}", low: float | None = None,
          labels: int | None = None, axis: bool = True) -> Text:
    """A chart of ``points`` from ``t0`` to ``t1`` in ``width`` cells and ``height`` rows.

    ``height`` 1: one row of cells, a mark's glyph in its column, no labels (the
    compact layout). Taller: ``height`` rows of bars with the y labels (``fmt`` of
    the highest value on the top row, of the lowest, or ``low``, on the bottom
    one; ``labels`` cells wide), marks as lines through the plot; with ``axis``,
    an axis row with each mark's glyph and the time axis under it."""
    pts = [(t, v) for t, v in points if t0 <= t <= t1 and v is not None and math.isfinite(v)]
    if height <= 1:
        values = columns(pts, t0, t1, max(1, width))
        cells = _cells(values, 1, _scale([v for _, v in pts], low))[0]
        mark_cols = _mark_columns(marks, t0, t1, len(values))
        return _runs([(MARK_GLYPH[k], MARK_STYLE[k]) if (k := mark_cols.get(c)) else (cell, style)
                      for c, cell in enumerate(cells)])
    scale = _scale([v for _, v in pts], low)  # the labels say the series' own lowest and highest values
    lw = (0 if scale is None else max(len(fmt(scale[0])), len(fmt(scale[1])))) if labels is None else labels
    plot = max(1, width - lw - 1)
    values = columns(pts, t0, t1, plot)
    rows = _cells(values, height, scale)
    mark_cols = _mark_columns(marks, t0, t1, plot)
    out = Text()
    for r, cells in enumerate(rows):
        if r:
            out.append("\n")
        label = fmt(scale[1]) if scale and r == 0 else fmt(scale[0]) if scale and r == height - 1 else ""
        out.append(f"{label:>{lw}}{'┤' if label else '│'}", style="dim")
        out.append_text(_runs([(("┊" if cell == " " else cell), MARK_STYLE[k]) if (k := mark_cols.get(c))
                               else (cell, style) for c, cell in enumerate(cells)]))
    if axis:
        out.append("\n")
        out.append_text(axis_row(t0, t1, plot, marks, lw))
        out.append("\n")
        out.append(time_axis(t0, t1, plot, lw + 1), style="dim")
    return out


def _runs(cells: Iterable[tuple[str, str]]) -> Text:
    """(character, style) cells as Text, one span per run of one style (a row of a
    hundred cells is a few spans, not a hundred)."""
    out = Text()
    text, style = "", None
    for ch, st in cells:
        if st != style and text:
            out.append(text, style=style)
            text = ""
        text, style = text + ch, st
    if text:
        out.append(text, style=style)
    return out


def _cells(values: Sequence[float | None], height: int, scale: tuple[float, float] | None) -> list[list[str]]:
    """Rows (top first) of block cells: each value filled to its share of ``scale``
    in eighths of the ``height`` rows; a value is never drawn empty (at least an
    eighth), a gap is."""
    rows = [[" "] * len(values) for _ in range(height)]
    if scale is None:
        return rows
    lo, hi = scale
    eighths = height * 8
    for c, v in enumerate(values):
        if v is None:
            continue
        level = eighths // 2 if hi - lo <= 1e-12 * max(abs(hi), 1.0) else round((v - lo) / (hi - lo) * eighths)
        level = max(1, min(eighths, level))
        for r in range(height):  # r = 0 is the bottom row
            fill = max(0, min(8, level - 8 * r))
            rows[height - 1 - r][c] = BLOCKS[fill]
    return rows


def axis_row(t0: float, t1: float, width: int, marks: Marks = (), offset: int = 0) -> Text:
    """The row under a chart's plot: its corner after ``offset`` label cells, then one
    cell per column, each mark's glyph (↻ restart, ‖ stall) in its time's column."""
    mark_cols = _mark_columns(marks, t0, t1, width)
    return _runs([(" " * offset + "└", "dim")] + [(MARK_GLYPH[k], MARK_STYLE[k]) if (k := mark_cols.get(c))
                                                   else ("─", "dim") for c in range(width)])


def clock_of(t: float, span: float) -> str:
    """A time axis label: HH:MM:SS, with the day ('01-15 08:00') on an axis over a day."""
    return time.strftime("%m-%d %H:%M", time.localtime(t)) if span > 86400 else fmt_clock(t)


def time_axis(t0: float, t1: float, width: int, offset: int = 0) -> str:
    """A line of ``offset`` blank cells then ``width`` cells under a chart from ``t0`` to
    ``t1``: the clock at its start (the first column), middle and end (the last)."""
    span = max(0.0, t1 - t0)
    left = clock_of(t0, span)
    if width < 3 * len(left) + 2 or t1 <= t0:
        return " " * offset + left
    mid, right = clock_of((t0 + t1) / 2, span), clock_of(t1, span)
    line = [" "] * width
    for at, text in ((0, left), ((width - len(mid)) // 2, mid), (width - len(right), right)):
        line[at:at + len(text)] = text
    return " " * offset + "".join(line)[:width]


def legend(marks: Marks) -> Text:
    """What the glyphs of the marks shown mean ('↻ restart ×2  ‖ stall'), '' without marks."""
    kinds = [k for _, k in marks if k in MARK_GLYPH]
    out = Text()
    for kind in ("restart", "stall"):
        n = kinds.count(kind)
        if n:
            out.append("  " if out else "")
            out.append(MARK_GLYPH[kind], style=MARK_STYLE[kind])
            out.append(f" {MARK_NAME[kind]}" + (f" ×{n}" if n > 1 else ""), style="dim")
    return out
