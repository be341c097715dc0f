"""A run's history as its charts show it: zooms, the time window, restart and stall marks.

The series itself is the store's (``Store.sample_series``, buckets of samples).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

from dflashctl.core.contract import tau_estimate
from dflashctl.core.units import fmt_duration
from dflashctl.store import Event

# The charts' zooms, cycled by a key: the newest hour, the newest six hours, the whole run.
ZOOMS = ("1 h", "6 h", "all")
ZOOM_SPAN_S: dict[str, float | None] = {"1 h": 3600.0, "6 h": 6 * 3600.0, "all": None}


def next_zoom(zoom: str) -> str:
    """The zoom after ``zoom`` (1 h -> 6 h -> all -> 1 h); an unknown one gives 'all'."""
    return ZOOMS[(ZOOMS.index(zoom) + 1) % len(ZOOMS)] if zoom in ZOOMS else "all"


@dataclass(frozen=True)
class Mark:
    """Something a chart marks at its time: a restart or the start of a stall."""

    time: float
    kind: str  # "restart" | "stall"
    text: str = ""


def chart_window(first: float, newest: float, now: float, active: bool, zoom: str) -> tuple[float, float]:
    """The time span (t0, t1) a run's charts show at ``zoom``: up to ``now`` for an
    active run (a silence at the end is drawn as one), up to its newest sample for a
    finished one; from the run's first sample ('all') or the zoom's span before t1,
    never before the first sample."""
    t1 = max(now, newest) if active else newest
    span = ZOOM_SPAN_S.get(zoom)
    t0 = first if span is None else max(first, t1 - span)
    return t0, max(t1, t0)


def marks_of(restarts: Iterable[Any], state_events: Iterable[Event], t0: float, t1: float) -> list[Mark]:
    """The restarts (``Store.restarts``) and stalls (state events to ``stalled``) between
    ``t0`` and ``t1``, oldest first."""
    marks = [Mark(r.time, "restart", r.reason or "") for r in restarts]
    marks += [Mark(e.time, "stall", e.message or "") for e in state_events
              if (e.detail or {}).get("to") == "stalled"]
    return sorted((m for m in marks if t0 <= m.time <= t1), key=lambda m: m.time)


@dataclass
class ChartView:
    """A run's history as its charts draw it at one zoom: buckets of its samples
    (``Store.sample_series``) between ``t0`` and ``t1`` and the marks in that span."""

    zoom: str
    t0: float
    t1: float
    series: list[dict[str, Any]]
    marks: list[Mark] = field(default_factory=list)
    first: float | None = None  # the run's first sample (what 'all' starts at)

    def points(self, key: str) -> list[tuple[float, float]]:
        """(time, value) of one column of the series ('tok_s', 'loss', 'tau_est' = accept_len + 1)."""
        out = []
        for p in self.series:
            v = tau_estimate(p.get("accept_len")) if key == "tau_est" else p.get(key)
            if v is not None and math.isfinite(v) and self.t0 <= p["time"] <= self.t1:
                out.append((p["time"], float(v)))
        return out

    def title(self) -> str:
        """The zoom, for the charts' titles: 'zoom all: 2 h', 'zoom 1 h of 2 h', and
        'zoom 6 h: all 2 h' (a run shorter than the zoom)."""
        first = self.t0 if self.first is None else min(self.first, self.t0)
        whole = fmt_duration(self.t1 - first)
        if self.zoom == "all":
            return f"zoom all: {whole}"
        if self.t0 <= first:
            return f"zoom {self.zoom}: all {whole}"
        return f"zoom {self.zoom} of {whole}"
