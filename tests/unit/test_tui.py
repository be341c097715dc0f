"""DFLASHCTL_READONLY takes on or off, nothing else. (The console driven headless:
tests/integration/test_tui.py.)"""

from __future__ import annotations

import pytest


def test_a_readonly_environment_value_that_is_neither_on_nor_off_is_an_error():
    from dflashctl.core.errors import ConfigError
    from dflashctl.tui.actions import readonly_default

    assert readonly_default({"DFLASHCTL_READONLY": "1"}) and not readonly_default({})
    with pytest.raises(ConfigError, match="DFLASHCTL_READONLY='ture'"):
        readonly_default({"DFLASHCTL_READONLY": "ture"})
