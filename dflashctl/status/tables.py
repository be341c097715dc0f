"""Tables printed by the commands (``runs``, ``hosts``, ``check``, ``cache ls``):
the columns that fit the terminal's width, each cell cut to its column (an
ellipsis marks the cut), never folded, so a table is one line per row at any
width and when piped. Long texts go in a detail line below a row or in ``--json``.

It lays out (``columns.choose`` picks the columns, as it does for the console);
the commands give it the cells (already ``printable``) and print the lines. It
imports Rich's ``Text`` only, never a console.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from rich.text import Text

from dflashctl.status.columns import Col, choose, fit, fit_middle, widths_for


def _cell(text: str, c: Col, last: bool) -> str:
    cut = fit_middle(text, c.width) if c.middle else fit(text, c.width)
    if c.justify == "right":
        return cut.rjust(c.width)
    return cut if last else cut.ljust(c.width)


Detail = tuple[str | None, str]  # (the column that shows it whole, or None; the text)


def lines(columns: Sequence[Col], rows: Sequence[Mapping[str, str]], width: int, *, gap: int = 2,
          styles: Sequence[Mapping[str, str]] | None = None,
          details: Sequence[Detail | list[Detail] | None] | None = None, header: bool = True) -> list[Text]:
    """The table at ``width`` cells: a header line, then one line per row (its
    cells cut to the chosen columns). A row's detail ``(key, text)`` (or each of a
    list of them) is printed on a line below it, indented and cut to the width,
    when the cell of column ``key`` does not show that row's text whole (cut, or its
    column left out); always when ``key`` is None."""
    width = max(20, width)
    chosen = choose(widths_for(columns, rows), width, gap)
    result: list[Text] = []
    if header:
        result.append(Text((" " * gap).join(_cell(c.header, c, i == len(chosen) - 1)
                                           for i, c in enumerate(chosen)).rstrip(), style="bold"))
    for n, row in enumerate(rows):
        line = Text()
        for i, c in enumerate(chosen):
            if i:
                line.append(" " * gap)
            style = (styles[n] if styles else {}).get(c.key, "")
            line.append(_cell(str(row.get(c.key, "")), c, i == len(chosen) - 1), style=style)
        line.rstrip()
        if len(line) > width:  # priority-0 columns wider than the terminal: cut the line
            line.truncate(width - 1)
            line.append("…")
        result.append(line)
        detail = details[n] if details else None
        for key, text in detail if isinstance(detail, list) else [detail or (None, "")]:
            shown = next((c.width for c in chosen if c.key == key), 0)
            if text and (key is None or len(str(row.get(key, ""))) > shown):
                result.append(Text(fit("  " + " ".join(text.split()), width), style="dim"))
    return result
