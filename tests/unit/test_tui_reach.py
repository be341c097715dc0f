"""The attach command of a local run: tmux attach, with TMUX unset. (The console's
reach for real: tests/integration/test_tui_reach.py.)"""

from __future__ import annotations

import os

SOCKET = f"dflash-reach-{os.getpid()}"


def test_the_attach_command_of_a_local_run_is_tmux_attach_with_tmux_unset():
    from dflashctl.config import Host
    from dflashctl.tui.actions import attach_argv

    argv = attach_argv([Host(name="local", transport="local")], "demo-1", "dflash")
    assert argv == ["env", "-u", "TMUX", "tmux", "-L", "dflash", "attach-session", "-t", "=demo-1"]
