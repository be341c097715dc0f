"""What a run wrote on its hosts, read on demand: its trainer.log and metrics.jsonl.

``logs`` reads and follows every host's trainer.log (``dflashctl logs``, the
console's log pane); ``log_before`` reads earlier lines in one bounded read;
``metrics_tail`` reads the last metrics lines with every field the trainer wrote.
Each is one shell script run on the host per look: a huge file costs a bounded read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

from dflashctl.core import contract
from dflashctl.core.units import fmt_bytes
from dflashctl.hosts.transport.limits import LOG, METRICS_TAIL
from dflashctl.runs.access import POLL_SECONDS, LaunchError, host_transport
from dflashctl.runs.files import posixpath_join
from dflashctl.store import Store

if TYPE_CHECKING:
    from dflashctl.config import Inventory

# --------------------------------------------------------------------------- trainer.log

# The last $3 lines of $1 from its last $5 bytes (offset $2 < 0), or what follows
# offset $2, at most $5 bytes of it; $4: the exit code file. First line: the size,
# whether the trainer has ended, and the offset the text ends at. Seeks from the end:
# a huge log, or a huge last line, costs $5 bytes, not its size.
_READ_LOG = r"""
f=$1; off=$2; n=$3; ec=$4; max=$5
size=$(wc -c < "$f" 2>/dev/null || echo 0); size=$(echo $size)
ended=0; [ -f "$ec" ] && ended=1
if [ "$off" -lt 0 ]; then
  echo "$size $ended $size"; [ "$size" -gt 0 ] && tail -c "$max" "$f" | tail -n "$n"; exit 0
fi
[ "$size" -lt "$off" ] && off=0
end=$size; [ $((size - off)) -gt "$max" ] && end=$((off + max))
echo "$size $ended $end"
[ "$end" -gt "$off" ] && tail -c +"$((off + 1))" "$f" | head -c "$((end - off))"
exit 0
"""
LOG_WINDOW_BYTES = 4 << 20  # read from a log per look: its end for -n, what follows the offset when following


def logs(run_id: str, store: Store, inventory: "Inventory", follow: bool = False, n: int = 50,
         poll: float = POLL_SECONDS, host: str | None = None,
         stop: Callable[[], bool] | None = None, since: int | None = None) -> Iterator[str]:
    """The last ``n`` lines of the run's trainer.log; with ``follow``, then what is
    appended, until the trainer has ended, the caller stops iterating, or ``stop()``
    says so (checked at every poll: a log that grows no more never yields, so a
    caller in a thread could not stop it otherwise). A multi-host run: every host's
    log, each line prefixed with ``[host]``, or only ``host``'s (unprefixed).
    ``since``: a byte offset of a one-host log (``log_before``'s ``end``): what
    follows it, instead of the last ``n`` lines."""
    run = store.get_run(run_id)
    parts = run.parts()
    if host is not None:
        parts = [p for p in parts if p.host == host]
        if not parts:
            from dflashctl.core.errors import ConfigError

            raise ConfigError(f"run {run.id} has no process on host '{host}'",
                              hint=f"its hosts: {', '.join(run.host_names)}")
    prefix = len(parts) > 1
    readers = [(p, host_transport(p.host, inventory)) for p in parts]
    offsets, ended = [-1 if since is None else int(since)] * len(readers), [False] * len(readers)
    while True:
        for i, (part, transport) in enumerate(readers):
            if ended[i]:  # (follow only: without it there is one pass)
                continue
            answer = transport.run(["sh", "-c", _READ_LOG, "dflashctl-logs", posixpath_join(part.run_dir, contract.LOG_FILE),
                                    str(offsets[i]), str(int(n)), posixpath_join(part.run_dir, contract.EXIT_CODE_FILE),
                                    str(LOG_WINDOW_BYTES)], limit=LOG)
            size, done, end, data = _read_header(answer.stdout_bytes, 3, part.host)
            text = data.decode("utf-8", errors="replace")
            if offsets[i] < 0 and size > len(data) >= LOG_WINDOW_BYTES:  # the first line began before the window
                text = f"[cut: a line longer than {fmt_bytes(LOG_WINDOW_BYTES)}, its end] " + text
            if text:
                yield "".join(f"[{part.host}] {line}" for line in text.splitlines(keepends=True)) if prefix else text
            # Nothing more will come once the exit code is written and the log has been read.
            ended[i] = bool(done) and offsets[i] == size
            offsets[i] = end
        if not follow or all(ended) or (stop is not None and stop()):
            return
        time.sleep(poll)


# The lines of $1 that end at or before byte $2 (-1: its size), from at most $3
# bytes before it, at most $4 of them; a line cut by the $3 bound is left out (read
# from one byte earlier: a line starting exactly there is kept). First line: the
# size, that end, and how many bytes follow. Seeks: a huge log costs $3, not its size.
_READ_LOG_BEFORE = r"""
f=$1; end=$2; max=$3; n=$4
size=$(wc -c < "$f" 2>/dev/null || echo 0); size=$(echo $size)
if [ "$end" -lt 0 ] || [ "$end" -gt "$size" ]; then end=$size; fi
lo=$((end - max)); [ "$lo" -lt 0 ] && lo=0
part() {
  if [ "$lo" -gt 0 ]; then tail -c +"$lo" "$f" | head -c "$((end - lo + 1))" | sed 1d
  elif [ "$end" -gt 0 ]; then head -c "$end" "$f"; fi | tail -n "$n"
}
echo "$size $end $(part | wc -c)"
part
exit 0
"""


@dataclass(frozen=True)
class LogSlice:
    """Lines of a trainer.log: the bytes ``start``..``end`` of it."""

    start: int
    end: int
    text: str
    cut: bool = False  # a line longer than the bound stopped the read (nothing earlier is read)


def log_before(run_id: str, store: Store, inventory: "Inventory", end: int | None = None, *,
               max_bytes: int = 1 << 20, max_lines: int = 2000) -> LogSlice:
    """The lines of a one-host run's trainer.log before byte ``end`` (None: its end
    now): at most ``max_lines`` of them, from at most ``max_bytes`` back, so a huge
    log costs one bounded read. ``start == 0``: the log's first line is in it."""
    run = store.get_run(run_id)
    if run.hosts:
        from dflashctl.core.errors import ConfigError

        raise ConfigError(f"run {run.id} runs on {len(run.hosts)} hosts: earlier lines are read one host at a time",
                          hint=f"dflashctl logs {run.id} --host HOST -n N")
    answer = host_transport(run.host, inventory).run(
        ["sh", "-c", _READ_LOG_BEFORE, "dflashctl-log-before", posixpath_join(run.run_dir, contract.LOG_FILE),
         str(-1 if end is None else int(end)), str(int(max_bytes)), str(int(max_lines))], limit=LOG)
    size, last, count, text = _read_header(answer.stdout_bytes, 3, run.host)
    start = last - count
    return LogSlice(start, last, text.decode("utf-8", errors="replace"), cut=count == 0 and start > 0)


def _read_header(data: bytes, fields: int, host: str) -> tuple:
    """(the first line's ``fields`` integers..., the bytes after it) of a read script's
    answer; LaunchError when the first line is not that (not the script's answer)."""
    head, _, rest = data.partition(b"\n")
    words = head.split()
    if len(words) != fields or not all(w.isdigit() for w in words):
        raise LaunchError(f"host {host} answered a log read with {head[:80]!r}, not its size line",
                          hint=f"check that `sh`, `wc`, `tail` and `head` work on {host}")
    return (*(int(w) for w in words), rest)


# --------------------------------------------------------------------------- metrics.jsonl


def metrics_tail(run_id: str, store: Store, inventory: "Inventory", n: int = 50) -> list[contract.Metrics]:
    """The run's last ``n`` metrics lines, read on its host now (with every field the
    trainer wrote, which samples in the store do not keep); bad lines skipped."""
    run = store.get_run(run_id)
    transport = host_transport(run.host, inventory)
    path = posixpath_join(run.run_dir, contract.METRICS_FILE)
    # A file not (yet) there is an answer, not tail's error text: the trainer writes it from its first log interval.
    # From the file's last bytes only: a huge last line costs LOG_WINDOW_BYTES, not its size.
    result = transport.run(["sh", "-c", '[ -e "$2" ] || { echo absent; exit 3; }; tail -c "$3" "$2" | tail -n "$1"',
                            "dflashctl-tail", str(int(n)), path, str(LOG_WINDOW_BYTES)], timeout=30, check=False,
                           limit=METRICS_TAIL)
    if result.exit_code == 3 and result.stdout.strip() == "absent":
        raise LaunchError(f"run {run.id} has no metrics yet: {path} is not on {run.host}",
                          hint="the trainer writes a line every train.log_every steps once it trains: "
                               f"`dflashctl logs {run.id}` shows how far it got")
    if result.exit_code != 0:
        raise LaunchError(f"cannot read {path} on {run.host}: {(result.stderr or result.stdout).strip()[-200:]}")
    from dflashctl.hosts.parsers import read_metrics_chunk

    return read_metrics_chunk(result.stdout).rows
