"""Processes the trainer starts beside itself (bytecode compiled ahead, warm-up
helpers): each in a session of its own, so that ending it ends everything it started.
Standard library only."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from typing import Optional


def cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def pythonpath(environ=os.environ) -> str:
    """PYTHONPATH for a ``python -m trainer...`` child: the directory holding this
    package first, then the caller's."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.pathsep.join(p for p in (root, environ.get("PYTHONPATH")) if p)


def start(argv: list[str], env: dict[str, str], log: Optional[str] = None) -> subprocess.Popen:
    """``argv`` in a new session (its own process group), stdin closed, stdout and
    stderr to the file ``log`` (created 0600) or nowhere."""
    out = subprocess.DEVNULL
    if log is not None:
        out = os.fdopen(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600), "wb")
    try:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    finally:
        if log is not None:
            out.close()  # the child holds its own copy


def log_tail(path: str, lines: int) -> str:
    """The last ``lines`` non-blank lines of a child's log (``start``'s ``log``), on one
    line, for trainer.log; read from its last 16 KiB."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 16384))
            text = f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"(its log is unreadable: {e.strerror})"
    return " | ".join(line.strip() for line in text.splitlines()[-lines:] if line.strip())


def end_with_parent(parent: int, every_s: float = 1.0) -> None:
    """In a child: end this process (exit 1) once its parent ``parent`` is gone (a
    trainer killed, or exiting at once, before it could end its children)."""

    def watch():
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(1)

    threading.Thread(target=watch, name="end-with-parent", daemon=True).start()


def end(proc: Optional[subprocess.Popen], grace_s: float = 5.0) -> Optional[str]:
    """End ``proc``'s process group (SIGTERM, then SIGKILL after ``grace_s``) and say
    how far it got: ``finished`` (it had exited) or ``stopped``; None for no process."""
    if proc is None:
        return None
    if proc.poll() is not None:
        return "finished"
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)  # the group start() made: its workers too
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=grace_s)
            break
        except subprocess.TimeoutExpired:
            continue
    return "stopped"
