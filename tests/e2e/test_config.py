"""Loading the configuration imports no torch (a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys

from tests import harness

REPO = harness.REPO
FIXTURES = REPO / "tests" / "fixtures" / "config"
SHIPPED_PLAYBOOKS = REPO / "playbooks"


def test_config_never_imports_torch():
    code = "import sys, dflashctl.config; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0
