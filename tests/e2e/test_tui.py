"""`dflashctl status` on a terminal (a pseudo-terminal here) is the live screen, and
`q` ends it with exit code 0."""

from __future__ import annotations

import os
import time

from tests.harness import cli
from tests.harness.scenes import PROD, build


def test_the_status_command_starts_the_screen_on_a_terminal(tmp_path):
    """`dflashctl status` on a terminal is the live screen (a pseudo-terminal here)."""
    import pty
    import select

    store = build("healthy", tmp_path)
    leader, follower = pty.openpty()
    env = {"DFLASHCTL_STORE": store.path, "TERM": "xterm-256color", "LINES": "40"}
    proc = cli.popen("status", "--interval", "1", env=env, columns=120, stdin=follower, stdout=follower,
                     stderr=follower, close_fds=True)
    os.close(follower)
    seen = b""
    try:
        deadline = time.monotonic() + 60
        while b"dflashctl status" not in seen or PROD.encode() not in seen:
            assert time.monotonic() < deadline, seen[-2000:]
            if select.select([leader], [], [], 0.5)[0]:
                try:
                    seen += os.read(leader, 65536)
                except OSError:
                    break
        os.write(leader, b"q")
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:  # read on: a full terminal blocks the app
            if select.select([leader], [], [], 0.2)[0]:
                try:
                    os.read(leader, 65536)
                except OSError:
                    break
        assert proc.wait(timeout=5) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)
