"""The command line as a whole, in process: every documented command exists and
explains itself. (As a process: tests/e2e/test_cli.py.)"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from dflashctl.cli import _load_commands
from dflashctl.commands._app import app
from tests import harness

REPO = str(harness.REPO)
_load_commands()
COMMANDS = sorted(c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands)


def test_the_documented_commands_exist():
    assert {"launch", "watch", "status", "env-audit", "runs", "events", "logs", "stop", "restart", "hosts", "check"} <= set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command):
    result = CliRunner().invoke(app, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output and len(result.output.splitlines()) > 5
