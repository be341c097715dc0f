"""The command line as a whole: every command explains itself, the controller never
imports torch, and a user error is a message with an exit code, not a traceback."""

from __future__ import annotations

from dflashctl.cli import _load_commands
from dflashctl.commands._app import app
from tests import harness

REPO = str(harness.REPO)
_load_commands()
COMMANDS = sorted(c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands)


