"""What a command did on a host, and how messages show a command and its stderr.

``Result`` is what ``Transport.run`` returns; ``_Outcome`` is what a transport's
``_execute`` reports to the interface about one command line's run.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Iterable

STDERR_TAIL_CHARS = 2000
# An argument longer than this (a script sent as `python -c TEXT`) is shown in
# messages by its size, not its text.
SHOWN_ARG_CHARS = 160


@dataclass
class Result:
    """What a command did on a host. ``command`` is the full line the host ran;
    ``notes``: what the transport had to do first (a connection replaced)."""

    host: str
    argv: list[str]
    command: str
    exit_code: int
    stdout_bytes: bytes
    stderr_bytes: bytes
    duration: float
    notes: list[str] = field(default_factory=list)

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", errors="replace")

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclass
class _Outcome:
    """One command line's run: ``finished`` is False when the client gave up. Its
    output went to the readers ``_execute`` was given."""

    finished: bool
    exit_code: int
    notes: list[str] = field(default_factory=list)


def stderr_tail(text: str, limit: int = STDERR_TAIL_CHARS) -> str:
    text = text.strip()
    return text if len(text) <= limit else "..." + text[-limit:]


def shown_argv(argv: Iterable[object]) -> str:
    """An argv as messages show it: shell-quoted, an argument of more than
    ``SHOWN_ARG_CHARS`` characters (a script) replaced by its size."""
    words = []
    for a in map(str, argv):
        words.append(f"<{len(a.encode('utf-8'))}-byte argument>" if len(a) > SHOWN_ARG_CHARS else shlex.quote(a))
    return " ".join(words)
