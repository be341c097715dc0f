"""The trainer's log and pane text: tracebacks, restart markers, tails.

Pure functions of text that a host wrote (untrusted): nothing here raises on any
input. Shared by the crash signatures (``core.signatures``), the detectors and
the run-host actions, so it lives below all of them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TRACEBACK = re.compile(r"Traceback \(most recent call last\):")
_CHAINED = re.compile(
    r"During handling of the above exception, another exception occurred:"
    r"|The above exception was the direct cause of the following exception:"
)
_MAX_MESSAGE_LINES = 30


@dataclass
class Traceback:
    """The last Python traceback in some output."""

    text: str  # from the "Traceback" line to the end of the exception message
    exception: str  # the exception line, e.g. "torch.OutOfMemoryError: CUDA out of memory. ..."
    lines_after: int  # non-blank lines printed after it (0: it is the last thing printed)


def tail_lines(text: str | None, n: int) -> str:
    """The last ``n`` lines, trailing blank lines (a pane's empty rows) dropped first."""
    if not text or n <= 0:
        return ""
    lines = text.rstrip().splitlines()
    return "\n".join(lines[-n:])


RESTART_MARKER = "--- dflashctl:"  # the trainer.log line written before each restart (by the supervisor or an operator)


def this_attempt(log: str | None) -> str:
    """What trainer.log holds of its current process: the text after the last restart
    marker (the whole text when it has none). Every process of a run appends to the
    same file, so an earlier attempt's error is never this one's."""
    log = log or ""
    cut = log.rfind(RESTART_MARKER)
    if cut < 0:
        return log
    end = log.find("\n", cut)
    return log[end + 1 :] if end >= 0 else ""


def last_traceback(text: str | None) -> Traceback | None:
    """The last traceback in ``text``, or None. Line prefixes that a launcher adds
    (``[rank0]: ``) are removed; chained exceptions give the final one."""
    if not text:
        return None
    lines = text.splitlines()
    start = None
    for i in range(len(lines) - 1, -1, -1):
        if _TRACEBACK.search(lines[i]):
            start = i
            break
    if start is None:
        return None
    prefix = lines[start][: _TRACEBACK.search(lines[start]).start()]
    body = [l[len(prefix) :] if prefix and l.startswith(prefix) else l for l in lines[start:]]
    # Frames are indented; the first non-indented line after the header is the exception.
    exc_at = next((j for j in range(1, len(body)) if body[j].strip() and not body[j][0].isspace()), None)
    if exc_at is None:  # cut off before the exception line (output still arriving)
        return Traceback(text="\n".join(body).rstrip(), exception="", lines_after=0)
    end = exc_at + 1
    while end < len(body) and body[end].strip() and end - exc_at < _MAX_MESSAGE_LINES:
        end += 1
    after = sum(1 for l in body[end:] if l.strip())
    return Traceback(text="\n".join(body[:end]), exception=body[exc_at].strip(), lines_after=after)


def last_error_start(text: str | None) -> int | None:
    """Offset of the line where the last error report begins: the first
    traceback of the last chain ("During handling of the above exception ..."),
    so the original cause is included. None when there is no traceback."""
    if not text:
        return None
    starts = [m.start() for m in _TRACEBACK.finditer(text)]
    if not starts:
        return None
    i = len(starts) - 1
    while i > 0 and _CHAINED.search(text, starts[i - 1], starts[i]):
        i -= 1
    return text.rfind("\n", 0, starts[i]) + 1
