"""Text from hosts, the store and users made safe to show on a terminal.

Control characters (ANSI escape sequences, carriage returns, bidirectional
overrides) are shown as ``\\x1b``-style escapes, never interpreted. Used by the
commands and by the status console alike; this module never prints and imports
neither Rich nor typer.
"""

from __future__ import annotations

from dflashctl.core.contract import printable  # noqa: F401  (one home: the trainer prints host text too)


def one_line(text: object, width: int | None = None) -> str:
    """``printable`` text on one line (a stream's record: an event, a log excerpt in a
    message): each line break shown as `` ⏎ `` and tabs as spaces; cut to ``width``
    characters when given, an ellipsis marking the cut."""
    flat = " ⏎ ".join(part.strip() for part in printable(text).replace("\t", " ").splitlines() if part.strip())
    if width is not None and len(flat) > width:
        return flat[: max(0, width - 1)] + "…"
    return flat
