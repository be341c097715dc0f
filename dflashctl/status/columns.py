"""Choosing the columns of a table for a terminal's width, and cutting cells to
them. One chooser for every table: the console's run list and the commands'
printed tables (``tables.lines``). Pure text: no Rich, no Textual.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Sequence


@dataclass(frozen=True)
class Col:
    key: str
    header: str
    width: int  # cells; a longer text is cut
    priority: int = 0  # lower: kept at narrower widths; 0: always shown
    justify: str = "left"
    grow: int = 0  # extra cells the column takes from what is left over, at most
    middle: bool = False  # cut in the middle (ids: the head and the unique tail stay)


def choose(columns: Sequence[Col], width: int, gap: int = 2) -> list[Col]:
    """The columns that fit ``width`` (each costs its width plus ``gap`` but the
    last), most important first, in their given order; then the growing columns
    take what is left, in order. Priority-0 columns are always kept."""
    kept: set[str] = set()
    used = -gap
    for c in sorted(columns, key=lambda c: c.priority):
        if c.priority == 0 or used + gap + c.width <= width:
            kept.add(c.key)
            used += gap + c.width
    chosen = [c for c in columns if c.key in kept]
    spare = width - used
    for i, c in enumerate(chosen):
        if c.grow and spare > 0:
            extra = min(c.grow, spare)
            chosen[i] = replace(c, width=c.width + extra)
            spare -= extra
    return chosen


def widths_for(columns: Sequence[Col], rows: Sequence[Mapping[str, str]]) -> list[Col]:
    """Each column narrowed to its longest cell or header (a column of short cells
    gives its room to the others), never below 1."""
    out = []
    for c in columns:
        longest = max([len(c.header), *(len(str(r.get(c.key, ""))) for r in rows)])
        out.append(replace(c, width=max(1, min(c.width, longest)), grow=max(0, min(c.grow, longest - c.width))))
    return out


def fit(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, an ellipsis marking the cut."""
    return text if len(text) <= width else (text[: width - 1] + "…" if width > 1 else text[:width])


def fit_middle(text: str, width: int) -> str:
    """``text`` cut in the middle (run ids: the playbook and the unique tail stay)."""
    if len(text) <= width or width < 5:
        return fit(text, width)
    tail = min(5, width // 3)
    return text[: width - tail - 1] + "…" + text[-tail:]
