"""Durations, rates and clock times: parsed from what people type, printed for
people to read. One home for both directions, shared by config, the supervisor's
messages, the views and the command line.
"""

from __future__ import annotations

import math
import re
import time
from typing import Any

NA = "N/A"  # a missing reading, as the views show it

# --------------------------------------------------------------------------- values in messages


def describe(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return f"'{value}'"  # not repr(): a regex's backslashes would show doubled
    return number_text(value)


def number_text(value: Any) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


# --------------------------------------------------------------------------- durations

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_NUMBER = re.compile(r"\d+(?:\.\d*)?|\.\d+")
_DURATION = re.compile(r"(?:(?:\d+(?:\.\d*)?|\.\d+)[smhd])+")
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)([smhd])")
DURATION_HELP = "use seconds or a number with s, m, h or d: 45s, 30m, 36h, 7d, 1h30m"


def parse_duration(value: Any) -> float:
    """Seconds from a number or a text such as '45s', '30m', '36h', '7d', '1h30m'."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"expected a duration ({DURATION_HELP}), got {describe(value)}")
    if isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        if _NUMBER.fullmatch(text):
            seconds = float(text)
        elif _DURATION.fullmatch(text):
            seconds = sum(float(n) * _UNITS[u] for n, u in _DURATION_PART.findall(text))
        else:
            raise ValueError(f"{describe(value)} is not a duration ({DURATION_HELP})")
    else:
        seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{describe(value)} is not a duration: it must be zero or more")
    return seconds


# --------------------------------------------------------------------------- printing

def fmt_tok_s(value: float | None) -> str:
    """12800 -> '12.8 Ktok/s'."""
    if value is None:
        return "n/a"
    if value >= 1e6:
        return f"{value / 1e6:.1f} Mtok/s"
    if value >= 1e3:
        return f"{value / 1e3:.1f} Ktok/s"
    return f"{value:.0f} tok/s"


def fmt_duration(seconds: float | None) -> str:
    """45 -> '45 s', 750 -> '12.5 m', 3.3e6 -> '38.2 d', 604800 -> '7 d'."""
    if seconds is None or not math.isfinite(seconds):
        return "n/a"
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if abs(seconds) >= size:
            return f"{_trim(seconds / size)} {unit}"
    return f"{seconds:.0f} s"


def _trim(value: float) -> str:
    text = f"{value:.1f}"
    return text[:-2] if text.endswith(".0") else text


def fmt_bytes(size: int) -> str:
    """512 -> '512 B', 65536 -> '64 KiB', 10485760 -> '10 MiB', 1.5e9 -> '1.4 GiB'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{_trim(size / scale)} {unit}"
    return f"{size} B"


def fmt_clock(timestamp: float) -> str:
    """A unix time as local HH:MM:SS."""
    return time.strftime("%H:%M:%S", time.localtime(timestamp))


def short_duration(seconds: float | None) -> str:
    """``fmt_duration`` without the space: '12m', '1.5h' (for narrow cells)."""
    return fmt_duration(seconds).replace(" ", "") if seconds is not None else NA


def short_rate(tok_s: float | None) -> str:
    """12800 -> '12.8K', 1.2e6 -> '1.2M', 900 -> '900' (tok/s in a narrow cell)."""
    if tok_s is None or not math.isfinite(tok_s):
        return NA
    for unit, size in (("M", 1e6), ("K", 1e3)):
        if tok_s >= size:
            return f"{tok_s / size:.1f}{unit}"
    return f"{tok_s:.0f}"
