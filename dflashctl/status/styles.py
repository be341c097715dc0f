"""Styles and small text formatters the views share: colours by state, sparklines, bars.

``spark`` and ``bar`` draw a value in text cells; ``_num`` and ``_ago`` print one, or N/A.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from dflashctl.core.units import NA, fmt_duration

# Styles are data (rich style names); the drawing code decides how to apply them.
STATE_STYLE = {
    "running": "green", "stalled": "bold yellow", "restarting": "yellow", "lost": "yellow", "failed": "bold red",
    "launching": "cyan", "done": "blue", "stopped": "dim", "unsupervised": "bold white on red",
    "unreachable": "bold red", "stale": "yellow", "store busy": "bold yellow",
}
SEVERITY_STYLE = {"info": "", "warning": "yellow", "error": "red", "critical": "bold red"}
PHASE_STYLE = {"compiling": "magenta", "starting": "cyan", "regenerating": "cyan", "indexing": "cyan",
               "checkpointing": "blue", "training": "green", "restarting": "yellow"}

_BARS = "▁▂▃▄▅▆▇█"


# --------------------------------------------------------------------------- small formatters


def spark(values: Sequence[float | None], width: int = 12, low: float | None = 0.0,
          high: float | None = None) -> str:
    """A one-line text sparkline of the last ``width`` values ('' without values).

    Scaled from ``low`` (0 by default, so 12.0 and 12.7 Ktok/s draw as nearly equal
    bars, not as empty and full ones) to ``high`` (the largest value by default);
    ``low=None`` scales from the smallest value (shows small changes, exaggerates
    noise)."""
    values = [v for v in values if v is not None and math.isfinite(v)][-width:]
    if not values:
        return ""
    low = min(values) if low is None else min(low, min(values))
    high = max(values) if high is None else max(high, max(values))
    if high - low <= 1e-12 * max(abs(high), 1.0):
        return _BARS[len(_BARS) // 2] * len(values)
    return "".join(_BARS[round((v - low) / (high - low) * (len(_BARS) - 1))] for v in values)


def bar(fraction: float | None, width: int) -> str:
    """A horizontal bar of ``width`` cells filled to ``fraction`` (eighths of a cell)."""
    if fraction is None or not math.isfinite(fraction) or width <= 0:
        return "·" * max(width, 0)
    eighths = round(max(0.0, min(1.0, fraction)) * width * 8)
    full, part = divmod(eighths, 8)
    return ("█" * full + (" ▏▎▍▌▋▊▉"[part] if part else "")).ljust(width, "░")[:width]


def _num(value: Any, fmt: str, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return NA
    return format(value, fmt) + unit


def _ago(now: float, t: float | None) -> str:
    return NA if t is None else f"{fmt_duration(max(0.0, now - t))} ago"
