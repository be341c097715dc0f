"""Processes the trainer starts beside itself (bytecode compiled ahead, warm-up
helpers): each in a session of its own, so that ending it ends everything it started.
Standard library only."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Optional


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
