"""How much of each kind of answer is read from a host, and the reader that holds to it.

A host may be hostile: whatever it prints, the controller reads at most the limit of
that kind of answer, on stdout and on stderr, then ends the command and raises
``AnswerTooLarge`` (nothing of a cut answer is used). ``Transport.run`` reads every
command through ``Capture``; a caller names its kind with ``limit=``, else
``COMMAND`` holds. An answer streamed to a sink (a copy-back's artifact) is bounded
by the sink; its stderr still by the limit.

The kinds, in one place (docs/trust.md lists them):

    COMMAND         anything not named below: a tmux command, a signal, a port check
    probe(...)      the supervisor's probe: per run, twice its metrics chunk and its tails
    FACTS           `check`: host facts, a look, the run's inputs
    LOG             `logs`, the console's log pane: one read from the end or the offset
    METRICS_TAIL    `advise`, the metrics lines read on demand
    EVAL_REPORT     `eval`: eval.json and the exit status, each poll
    EVAL_LOG        the tail of eval.log when an evaluation failed
    CACHE_LOOK      a run directory's compile-cache manifest
    COPY_BACK       a copy-back's transfer: stdout to the store's receiver; stderr bounded
    AUDIT           `env-audit`: the collector's snapshot of a whole environment
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

STDERR_BYTES = 1 << 20  # stderr is for messages: a tail of it is what is shown


@dataclass(frozen=True)
class Limit:
    """The most that is read of one kind of answer. ``what`` names it in messages
    ("the probe"); ``stdout`` and ``stderr`` are bytes."""

    what: str
    stdout: int
    stderr: int = STDERR_BYTES


COMMAND = Limit("a command", 4 << 20)
FACTS = Limit("`check` (host facts)", 4 << 20)
LOG = Limit("a log read", 8 << 20)
METRICS_TAIL = Limit("a metrics read", 8 << 20)
EVAL_REPORT = Limit("the evaluation report", 16 << 20)
EVAL_LOG = Limit("the evaluation log's tail", 1 << 20)
CACHE_LOOK = Limit("the compile-cache look", 1 << 20)
COPY_BACK = Limit("a compile-cache transfer", 0)  # stdout goes to the receiver, which bounds it
AUDIT = Limit("the environment audit", 64 << 20)

# What one run adds to a probe answer besides its metrics chunk: pane and log tails
# (64 KiB each on the host, up to 6x as JSON escapes), status, process, errors.
PROBE_RUN_BYTES = 1 << 20
PROBE_HOST_BYTES = 1 << 20  # nvidia-smi rows, host readings, the host's errors


def probe(runs: Iterable[Any]) -> Limit:
    """The probe's limit for these runs (``ProbeArgs``): twice each one's metrics chunk
    (JSON escapes its quotes) and PROBE_RUN_BYTES per run, PROBE_HOST_BYTES per host."""
    return Limit("the probe", PROBE_HOST_BYTES + sum(2 * int(r.metrics_max_bytes) + PROBE_RUN_BYTES for r in runs))


class Capture:
    """One stream of a command, kept up to ``limit`` bytes. ``take`` returns False
    (and keeps nothing more) at the first chunk past it: the transport then ends the
    command. Thread-safe for one writer."""

    def __init__(self, limit: int):
        self.limit = limit
        self.size = 0
        self.over = False
        self._chunks: list[bytes] = []

    def take(self, chunk: bytes) -> bool:
        if self.over:
            return False
        if self.size + len(chunk) > self.limit:
            self.over = True
            self._chunks = []
            return False
        self._chunks.append(chunk)
        self.size += len(chunk)
        return True

    def value(self) -> bytes:
        data = b"".join(self._chunks)
        self._chunks = [data] if data else []
        return data
