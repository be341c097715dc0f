"""The rows of the console's log view, computed from the lines it holds: which lines
match the filter's words, which are shown, and where each shown line is cut into
screen rows when long lines wrap. Pure (no Textual): the view computes them in a
worker, a chunk of lines at a time (``Rows.extend``), so a filter key or the wrap
toggle over 20,000 lines never holds the screen's thread.

Lines are named by their absolute index: the first line ever held is 0, earlier
lines read later (``h``) are negative, so rows stay right while the oldest lines
are dropped (``drop_before``) or earlier ones put before them.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

from rich.cells import cell_len, chop_cells


def words_of(text: str) -> list[str]:
    """The filter's words, any case (the console's one filter: ``status.events.matching``)."""
    return text.lower().split()


def matches(line: str, words: list[str]) -> bool:
    low = line.lower()
    return all(w in low for w in words)


def wrap_starts(line: str, width: int) -> list[int]:
    """Where each screen row of ``line`` starts (character offsets) at ``width``
    cells; ``[0]`` for a line that fits or for no wrapping (``width`` <= 0)."""
    if width <= 0 or len(line) <= width and (line.isascii() or cell_len(line) <= width):
        return [0]
    if line.isascii():
        return list(range(0, len(line), width))
    starts, at = [], 0
    for piece in chop_cells(line, width):
        starts.append(at)
        at += len(piece)
    return starts or [0]


@dataclass
class Rows:
    """The shown rows: ``line[r]`` (absolute index) and ``start[r]`` (character offset
    in that line) of row ``r``; ``found``: every held line that matches the words,
    shown or not (``n`` / ``N``, the count in the marker); ``widest``: the widest shown
    line in cells (the sideways scroll, unwrapped)."""

    words: list[str] = field(default_factory=list)
    only_matches: bool = True
    wrap_width: int = 0  # 0: long lines are cut, not wrapped
    line: list[int] = field(default_factory=list)
    start: list[int] = field(default_factory=list)
    found: list[int] = field(default_factory=list)
    widest: int = 0
    upto: int | None = None  # the absolute index after the last line taken (None: none yet)

    def extend(self, lines: list[str], first: int) -> None:
        """Take ``lines``, the first of them of absolute index ``first`` (following
        those already taken)."""
        words, wrap = self.words, self.wrap_width
        for offset, text in enumerate(lines):
            index = first + offset
            hit = bool(words) and matches(text, words)
            if hit:
                self.found.append(index)
            if words and self.only_matches and not hit:
                continue
            if wrap > 0:
                for s in wrap_starts(text, wrap):
                    self.line.append(index)
                    self.start.append(s)
            else:
                self.line.append(index)
                self.start.append(0)
                width = len(text) if text.isascii() else cell_len(text)
                if width > self.widest:
                    self.widest = width
        self.upto = first + len(lines)

    def drop_before(self, index: int) -> None:
        """Forget the rows and matches of lines before absolute index ``index``."""
        cut = bisect_left(self.line, index)
        if cut:
            del self.line[:cut]
            del self.start[:cut]
        cut = bisect_left(self.found, index)
        if cut:
            del self.found[:cut]

    def end_of(self, row: int, length: int) -> int:
        """Where row ``row``'s piece of its line ends (``length``: the line's length)."""
        nxt = row + 1
        if nxt < len(self.line) and self.line[nxt] == self.line[row]:
            return self.start[nxt]
        return length

    def first_row_of(self, index: int) -> int | None:
        """The first row of line ``index``, or None when it is not shown."""
        r = bisect_left(self.line, index)
        return r if r < len(self.line) and self.line[r] == index else None

    def row_at_or_after(self, index: int) -> int:
        """The first row of line ``index`` or of the first shown line after it."""
        return bisect_left(self.line, index)

    def __len__(self) -> int:
        return len(self.line)
