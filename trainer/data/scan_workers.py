"""The first scan of a large corpus, spread over processes: each worker parses whole
shards and keeps each one's scan in the run's ``data-index`` (trainer/data/index.py),
which the trainer then reads back as a restart would (checked, never unpickled). At
about 0.6 ms a 2,048-token line a corpus of a million samples takes ten minutes on one
CPU; the shards are independent, so a host's CPUs take it in parallel.

Only where it pays: two or more shards to scan and ``MIN_BYTES`` of them. A worker
that fails, or a shard past the error budget, costs time only: the trainer scans
what has no kept scan itself, which names the bad lines as a scan always does.

    python -m trainer.data.scan_workers --index-dir DIR --max-len N --min-loss-tokens N
        [--vocab-size N] --budget N SHARD...      (started by the trainer, not by hand)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Optional

from trainer import procgroup
from trainer.data import index

MIN_BYTES = 64 << 20  # below this one process scans in seconds: starting others would not pay
POLL_S = 0.5
LOG_PREFIX = "scan-worker-"
TAIL_LINES = 5  # of a failed worker's log, in trainer.log


def plan(sizes: dict[str, int], workers: int) -> list[list[str]]:
    """The shards in ``workers`` groups of about equal bytes: largest first, each to
    the group with the fewest bytes so far; no empty group."""
    groups: list[list[str]] = [[] for _ in range(max(1, min(workers, len(sizes))))]
    load = [0] * len(groups)
    for path in sorted(sizes, key=lambda p: (-sizes[p], p)):
        g = load.index(min(load))
        groups[g].append(path)
        load[g] += sizes[path]
    return groups


def scan_apart(cold: dict[str, str], index_dir: str, max_len: int, min_loss_tokens: int,
               vocab_size: Optional[int], budget: int, workers: int,
               progress: Callable[[dict], None] = lambda p: None,
               log: Callable[[str], None] = lambda line: None) -> dict[str, str]:
    """Scan the shards of ``cold`` (path -> why its kept scan was not used) in up to
    ``workers`` processes, keeping their scans in ``index_dir``; returns ``cold`` for
    the shards scanned so (empty where it does not pay). ``progress`` gets the
    shards and bytes done, every ``POLL_S``."""
    sizes = {path: os.path.getsize(path) for path in cold}
    if workers < 2 or len(cold) < 2 or sum(sizes.values()) < MIN_BYTES:  # read at each call: tests lower it
        return {}
    for path in cold:  # a scan kept for the shard as it was: gone, so that a file there is this start's
        try:
            os.unlink(index.index_file(index_dir, path))
        except FileNotFoundError:
            pass
    groups = plan(sizes, workers)
    argv = [sys.executable, "-m", "trainer.data.scan_workers", "--index-dir", index_dir, "--max-len", str(max_len),
            "--min-loss-tokens", str(min_loss_tokens), "--budget", str(budget)]
    if vocab_size is not None:
        argv += ["--vocab-size", str(vocab_size)]
    env = {**os.environ, "PYTHONPATH": procgroup.pythonpath()}
    logs = [os.path.join(index_dir, f"{LOG_PREFIX}{i}.log") for i in range(len(groups))]
    procs = []  # (process, its log)
    started = time.monotonic()
    log(f"data: scanning {len(cold)} shard(s), {sum(sizes.values()) / 1e6:,.0f} MB, in {len(groups)} processes")
    try:
        for group, path in zip(groups, logs):
            try:
                procs.append((procgroup.start(argv + group, env, log=path), path))
            except OSError as e:  # the shards of a worker that never started are scanned here
                log(f"data: a scan worker did not start ({e}); its shards are scanned here")
        while True:
            running = [proc for proc, _ in procs if proc.poll() is None]
            done = [p for p in cold if os.path.exists(index.index_file(index_dir, p))]
            progress({"shards_done": len(done), "shards": len(cold), "bytes_done": sum(sizes[p] for p in done),
                      "bytes": sum(sizes.values()), "elapsed_s": round(time.monotonic() - started, 1)})
            if not running:
                break
            time.sleep(POLL_S)
        for proc, path in procs:
            if proc.returncode:
                log(f"data: a scan worker failed (exit {proc.returncode}): "
                    f"{procgroup.log_tail(path, TAIL_LINES) or '(no output)'}; its shards are scanned here")
    finally:
        for proc, _ in procs:
            procgroup.end(proc)
        for path in logs:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    log(f"data: {len(done)} of {len(cold)} shard(s) scanned apart in {time.monotonic() - started:.1f}s")
    return cold


def main(argv: Optional[list[str]] = None) -> int:
    from trainer.data.records import DataError, ErrorBudget

    p = argparse.ArgumentParser(prog="python -m trainer.data.scan_workers")
    p.add_argument("--index-dir", required=True)
    p.add_argument("--max-len", type=int, required=True)
    p.add_argument("--min-loss-tokens", type=int, required=True)
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--budget", type=int, required=True)
    p.add_argument("shards", nargs="+")
    args = p.parse_args(argv)
    procgroup.end_with_parent(os.getppid())  # a trainer that exits at once (a stop while it starts) leaves none
    for path in args.shards:
        ident = index.identity(path, args.max_len, args.min_loss_tokens, args.vocab_size)
        try:
            scan = index.scan_shard(path, args.max_len, args.min_loss_tokens, args.vocab_size,
                              ErrorBudget(args.budget, lambda line: None))
        except DataError:  # past the budget: the trainer scans it itself and names the lines
            continue
        if index.identity(path, args.max_len, args.min_loss_tokens, args.vocab_size) == ident:
            index.save(args.index_dir, ident, scan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
