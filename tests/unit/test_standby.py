"""standby.sh writes an exit code only when its trainer took over. (The standby as a
process: tests/trainer/test_standby.py; under the supervisor:
tests/e2e/test_standby.py.)"""

from __future__ import annotations

import pytest

from dflashctl.runs.runhost import STANDBY_SCRIPT, run_files

pytestmark = pytest.mark.slow


def test_standby_sh_writes_no_exit_code_unless_its_trainer_took_over():
    config = {"trainer": {"compile": {}}, "python": "python3", "env": {}, "gpus": []}
    script = run_files("r", "/runs/r", config, "sock", session="r", standby="abc")[STANDBY_SCRIPT]
    assert "--standby abc" in script and "rm -f exit_code" not in script
    assert "[ -f standby.abc.went ] && echo $code > exit_code.tmp" in script
