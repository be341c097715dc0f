"""The detail view's charts tab: a run's curves as plots from textual-plot (a
maintained Textual widget: braille lines, y labels and ticks, zoom and pan with
the mouse wheel, drag, ``+`` / ``-`` and the arrows, ``r`` resets it), one plot per
curve over one time axis (hours before the newest reading), restart and stall
marks as vertical lines, a y range that leaves a start-up spike off
(``charts.robust_range``), and the value under the mouse cursor on the line above.

Imported only when the tab is first shown: numpy and the plot widget cost the
console's first paint nothing.
"""

from __future__ import annotations

from bisect import bisect_left

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.message import Message
from textual.widgets import Static
from textual_plot import HiResMode, PlotWidget

from dflashctl.core.units import fmt_clock
from dflashctl.status.charts import ChartView
from dflashctl.tui.charts import robust_range

# The curves, as (key, title, line style): the run's series (ChartView.points), then
# those read apart (status.reader.more_curves). Measured τ (each eval) is drawn as
# points over the τ est curve.
CURVES = (("tok_s", "tok/s", "green"), ("loss", "loss", "yellow"), ("tau_est", "τ est · τ measured (white)", "cyan"),
          ("acc", "acc", "magenta"), ("lr", "lr", "blue"), ("grad_norm", "grad norm", "red"),
          ("gpu_mem", "GPU memory GiB (the run's fullest GPU)", "cyan"))
MORE = ("lr", "grad_norm", "gpu_mem")
MARK_STYLE = {"restart": "red", "stall": "yellow"}
HOUR = 3600.0


def hours_before(t: float, t1: float) -> float:
    return (t - t1) / HOUR


class CurvePlot(PlotWidget):
    """One curve of a run; the value nearest the mouse cursor goes to ``under``."""

    DEFAULT_CSS = "CurvePlot { height: 12; }"

    def __init__(self, key: str, title: str, style: str, **kw) -> None:
        super().__init__(**kw)
        self.key, self.title, self.style = key, title, style
        self.points: list[tuple[float, float]] = []
        self.t1 = 0.0
        self.chart: ChartView | None = None
        self.more: dict[str, list[tuple[float, float]]] = {}
        self.under = ""  # what the cursor is over: "tok/s 137 at 08:00:00"

    def on_mount(self) -> None:
        # PlotWidget's own on_mount (called after this one) resets the limits and
        # clears: a chart given before it is drawn after it.
        self.call_after_refresh(lambda: self.chart is not None and self.show(self.chart, self.more))

    def show(self, chart: ChartView, more: dict[str, list[tuple[float, float]]] | None = None) -> None:
        self.chart, self.more = chart, more or {}
        self.points = self.more.get(self.key, []) if self.key in MORE else chart.points(self.key)
        self.t1 = chart.t1
        self.clear()
        self.set_ylabel(self.title)
        self.set_xlabel("hours before " + fmt_clock(chart.t1))
        if not self.points:
            return
        xs = [hours_before(t, chart.t1) for t, _ in self.points]
        ys = [v for _, v in self.points]
        self.plot(xs, ys, line_style=self.style, hires_mode=HiResMode.BRAILLE)
        measured = self.more.get("tau", []) if self.key == "tau_est" else []
        if measured:
            self.scatter([hours_before(t, chart.t1) for t, _ in measured], [v for _, v in measured],
                         marker_style="bold white", marker="●")
            ys = ys + [v for _, v in measured]
        lo, hi = robust_range(ys)
        pad = (hi - lo) * 0.05 or abs(hi) * 0.05 or 1.0
        self.set_ylimits(lo - pad, hi + pad)
        self.set_xlimits(hours_before(chart.t0, chart.t1), 0.0)
        for mark in chart.marks:
            self.add_v_line(hours_before(mark.time, chart.t1), MARK_STYLE.get(mark.kind, "white"))

    def value_at(self, hours: float) -> tuple[float, float] | None:
        """The point nearest ``hours`` (before the newest reading)."""
        if not self.points:
            return None
        t = self.t1 + hours * HOUR
        times = [p[0] for p in self.points]
        i = bisect_left(times, t)
        near = [p for p in self.points[max(0, i - 1):i + 1]]
        return min(near, key=lambda p: abs(p[0] - t))

    def on_mouse_move(self, event) -> None:
        offset = event.get_content_offset(self)
        if offset is None or not self.points:
            return
        hours, _ = self.get_coordinate_from_pixel(offset.x, offset.y)
        point = self.value_at(hours)
        if point is not None:
            self.under = f"{self.title} {point[1]:.4g} at {fmt_clock(point[0])}"
            self.post_message(CursorMoved(self.under))


class CursorMoved(Message):
    """The value under the mouse cursor changed (``text`` says it)."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text


class RunPlots(VerticalScroll):
    """Every curve of a run, stacked, and the line that says what the cursor is over."""

    DEFAULT_CSS = """
    RunPlots > #plot-under { height: 1; padding: 0 1; }
    """

    def compose(self) -> ComposeResult:
        yield Static(Text("move the mouse over a curve for its value; wheel / + - zoom, drag pans, r resets",
                          style="dim"), id="plot-under")
        for key, title, style in CURVES:
            yield CurvePlot(key, title, style, id=f"plot-{key}")

    def show(self, chart: ChartView | None, more: dict[str, list[tuple[float, float]]] | None = None) -> None:
        if chart is None:
            return
        for plot in self.query(CurvePlot):
            plot.show(chart, more)

    def on_cursor_moved(self, message: CursorMoved) -> None:
        message.stop()
        self.query_one("#plot-under", Static).update(Text(message.text, style="bold"))
