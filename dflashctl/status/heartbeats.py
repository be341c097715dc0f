"""The supervisors' heartbeats as this machine sees them: a killed one stopped, a blocked one busy.

A supervisor of this machine whose process has ended reads as stopped at its last
tick; one alive but late, while another holds the store's write lock, as blocked.
"""

from __future__ import annotations

import os
import socket
import sqlite3
import urllib.parse
from typing import Any

from dflashctl.store import Store


def _process_gone(pid: Any) -> bool:
    """Whether process ``pid`` of this machine has ended (a zombie has)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # alive, another user's
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return stat[stat.rindex(")") + 2:].split()[0] in ("Z", "X")
    except (OSError, ValueError, IndexError):
        return False


def store_write_busy(path: str) -> bool:
    """Whether another connection holds the store's write lock now (tried without
    waiting, nothing written; a file that is not there is not busy, and is not made)."""
    try:
        conn = sqlite3.connect(f"file:{urllib.parse.quote(os.path.abspath(path))}?mode=rw", uri=True, timeout=0)
    except sqlite3.Error:
        return False
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.rollback()
        return False
    except sqlite3.OperationalError as e:
        return "locked" in str(e) or "busy" in str(e)
    finally:
        conn.close()


def heartbeats_now(store: Store, now: float | None = None) -> list[dict]:
    """The supervisors' heartbeats; one of a supervisor of this machine whose process
    has ended (killed: it could not say so) reads as stopped at its last tick, so its
    runs show as unsupervised at once, not only after its heartbeat grows old. One
    whose process is alive is marked ``alive``; if it is late (``now`` given), and
    the store's write lock is held by another, ``store_busy`` too: it is blocked, not
    gone."""
    here = socket.gethostname()
    out = []
    busy: bool | None = None
    for b in store.supervisors():
        if b.get("stopped") or b.get("host") != here:
            out.append(b)
        elif _process_gone(b.get("pid")):
            out.append({**b, "stopped": b.get("last_tick")})
        else:
            b = {**b, "alive": True}
            late = now is not None and now - (b.get("last_tick") or 0) > 3 * max(1.0, b.get("interval") or 1)
            if late:
                busy = store_write_busy(store.path) if busy is None else busy
                b["store_busy"] = busy
            out.append(b)
    return out
