"""A host's error in the GPU pane is shown, never obeyed. (A multi-host run's status
over real stores: tests/integration/test_status_hosts.py.)"""

from __future__ import annotations

MULTI = "multi-20270115-074000-mh01"
SINGLE = "demo-20270115-075000-sh01"
INTERVAL = 5.0  # the supervisor's poll interval: rows older than 3 of them are stale


def test_a_hosts_error_in_the_gpu_pane_is_shown_not_obeyed():
    from dflashctl.status.model import HostView
    from dflashctl.tui.text import gpu_text

    view = HostView("gpu2", ["r1"], down_since=100.0, error="ssh: \x1b]0;pwned\x07 refused\nsecond line", supervised=True)
    text = gpu_text([view], 120, 160.0).plain
    assert "\x1b" not in text and "\x07" not in text and "\n" not in text.split("\n  no GPU")[0]
    assert "unreachable since 1 m" in text and "\\x1b]0;pwned\\x07 refused second line" in text
