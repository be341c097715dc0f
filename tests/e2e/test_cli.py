"""The command line as a process: a user error is a message with an exit code, not
a traceback; and every controller module, imported in a fresh interpreter, leaves
no torch, triton or transformers in sys.modules."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import dflashctl
from dflashctl.cli import _load_commands
from dflashctl.commands._app import app
from tests import harness
from tests.harness import cli

REPO = str(harness.REPO)
_load_commands()
COMMANDS = sorted(c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands)


def test_the_controller_never_imports_torch():
    """Every controller module, commands and run-host modules included, imported in
    a fresh interpreter, leaves no torch, triton or transformers in sys.modules."""
    modules = [m.name for m in pkgutil.walk_packages(dflashctl.__path__, "dflashctl.") if not m.name.endswith("__main__")]
    assert len(modules) > 20
    assert {"dflashctl.cli", "dflashctl.commands._app", "dflashctl.commands.runs", "dflashctl.launch",
            "dflashctl.runs.runhost", "dflashctl.supervise.console", "dflashctl.supervise.supervisor", "dflashctl.core.signatures"} <= set(modules)
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'transformers'))\n"
        "print(bad); sys.exit(1 if bad else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_user_error_is_a_message_not_a_traceback(tmp_path):
    bad = tmp_path / "inventory.yaml"
    bad.write_text("hosts:\n  gpu1:\n    address: 10.0.0.5\n    jump: gatway\n")
    done = cli.run("--inventory", str(bad), "hosts", cwd=tmp_path, timeout=60,
                   env={"DFLASHCTL_HOME": str(tmp_path / "home"), "DFLASHCTL_DEBUG": None})
    assert done.returncode == 2
    assert "hosts.gpu1.jump: unknown host 'gatway'" in done.stderr
    assert "Traceback" not in done.stderr
