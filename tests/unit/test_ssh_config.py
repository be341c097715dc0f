"""ProxyJump values of ~/.ssh/config read into their hops. (Hosts reached through
the ssh config for real: tests/integration/test_ssh_config.py.)"""

from __future__ import annotations

import pytest

from dflashctl.config import proxy_jump_hops


@pytest.mark.parametrize(
    "value, hops",
    [
        (None, []),
        ("none", []),
        ("gw", [("gw", None, None)]),
        ("root@gw:2222,j2", [("gw", "root", 2222), ("j2", None, None)]),
        ("ssh://me@bastion:22", [("bastion", "me", 22)]),
    ],
)
def test_proxy_jump_hops(value, hops):
    assert [(h["host"], h["user"], h["port"]) for h in proxy_jump_hops(value)] == hops
