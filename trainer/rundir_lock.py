"""One trainer owns a run directory: an exclusive lock on a file in it, held for the
process's life.

Two trainers in one run directory write the same status.json, metrics and
checkpoints; the second must never start. It can be asked to by anything that can
write the run directory: a standby's go file written by another process, a run.sh
started by hand beside the live one. ``take`` is called before the trainer writes
anything there; a second process gets ``Busy`` (exit code
``contract.EXIT_RUN_DIR_BUSY``, signature ``run_dir_busy``) and leaves the files of
the live one alone. The lock is ``flock`` on ``trainer.lock`` (``trainer.rankN.lock``
for rank N of a distributed run whose processes share a directory): the kernel drops
it when the process ends, however it ends, so a stale lock does not exist.

Standard library only: this runs before torch is imported.
"""

from __future__ import annotations

import fcntl
import os
import time
from typing import Optional

from dflashctl.core import contract

WAIT_S = 10.0  # how long a start waits for the previous owner to end before it gives up
_held: dict[str, int] = {}  # path -> fd of a lock this process holds (kept open for its life)


class Busy(RuntimeError):
    """The run directory is owned by a live trainer."""


def lock_path(run_dir: str, rank: int = 0) -> str:
    return os.path.join(run_dir, contract.lock_file(rank))


def _owner(fd: int) -> Optional[str]:
    try:
        return os.pread(fd, 64, 0).decode("ascii", "replace").strip() or None
    except OSError:
        return None


def take(run_dir: str, rank: int = 0, wait: float = WAIT_S) -> str:
    """Lock ``run_dir`` for this process (idempotent); ``Busy`` naming the owner's pid
    when another process still holds it after ``wait`` seconds (a restart's previous
    process may take a moment to end after its session was killed)."""
    path = lock_path(run_dir, rank)
    if path in _held:
        return path
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), 0o644)
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.05)
                continue
        owner = _owner(fd)
        os.close(fd)
        raise Busy(f"run directory {run_dir} is owned by another trainer (pid {owner or 'unknown'}, "
                   f"lock {os.path.basename(path)}): this process does not start beside it. Stop that trainer "
                   "first, or give this one another --run-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[path] = fd
    return path
