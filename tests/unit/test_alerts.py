"""An alerter without hooks starts no thread; hook time limits come from the
playbook. (Hooks for real, hostile ones included: tests/integration/test_alerts.py.)"""

from __future__ import annotations

import threading

import pytest

from dflashctl.config import Alerts
from dflashctl.supervise.alerts import (
    NO_HOOK,
    Alerter,
    make_event,
)


def test_no_hooks_no_thread() -> None:
    alerter = Alerter(Alerts())
    assert alerter.send(make_event("crash", "critical", "x")) == NO_HOOK
    assert not [t for t in threading.enumerate() if t.name.startswith("dflashctl-alerts")]
    alerter.close()
    with pytest.raises(ValueError, match="severity 'fatal'"):
        make_event("crash", "fatal", "x")


def test_hook_time_limits_come_from_the_playbook() -> None:
    alerter = Alerter(Alerts(command="true", timeout="2m", connect_timeout="5s"))
    try:
        assert (alerter.timeout, alerter.connect_timeout) == (120.0, 5.0)
    finally:
        alerter.close()
    assert (Alerts().timeout, Alerts().connect_timeout) == (30.0, 10.0)
    with pytest.raises(ValueError):
        Alerts(timeout=0)
