"""Text from hosts, the store and users made safe to show on a terminal.

Control characters (ANSI escape sequences, carriage returns, bidirectional
overrides) are shown as ``\\x1b``-style escapes, never interpreted. Used by the
commands and by the status console alike; this module never prints and imports
neither Rich nor typer.
"""

from __future__ import annotations


def _visible(char: str) -> str:
    return f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"


# C0 and C1 control characters (ESC starts ANSI sequences; 0x9b is a one-byte CSI)
# but newline and tab, and the invisible bidirectional overrides that reorder text.
_CONTROL = {
    code: _visible(chr(code))
    for code in [*range(0x20), *range(0x7F, 0xA0), 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
    if chr(code) not in "\n\t"
}


def printable(text: object) -> str:
    """User data as plain text for a terminal: control characters (ANSI escape
    sequences, carriage returns, bidirectional overrides) shown as ``\\x1b``-style
    escapes instead of being interpreted; newlines and tabs kept."""
    return str(text).translate(_CONTROL)


def one_line(text: object, width: int | None = None) -> str:
    """``printable`` text on one line (a stream's record: an event, a log excerpt in a
    message): each line break shown as `` ⏎ `` and tabs as spaces; cut to ``width``
    characters when given, an ellipsis marking the cut."""
    flat = " ⏎ ".join(part.strip() for part in printable(text).replace("\t", " ").splitlines() if part.strip())
    if width is not None and len(flat) > width:
        return flat[: max(0, width - 1)] + "…"
    return flat
