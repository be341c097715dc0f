"""The standby trainer as a real process: it does a start's imports, waits, and
trains once told; it leaves quietly when the run is done or it is replaced.
(Under the supervisor: tests/e2e/test_standby.py.)"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from dflashctl.core import contract
from tests.harness.local import wait_for
from tests.harness.tiny import Trainer, tiny_config

pytestmark = pytest.mark.slow


def _ready(run_dir: str) -> dict | None:
    try:
        return json.loads(Path(run_dir, contract.STANDBY_FILE).read_text())
    except (OSError, ValueError):
        return None


def test_a_standby_imports_waits_and_trains_once_told(tmp_path):
    run_dir = tmp_path / "run"
    t = Trainer(tiny_config(train={"steps": 4, "log_every": 1, "checkpoint_every": 0}), run_dir, "--standby", "t1")
    try:
        ready = wait_for(lambda: _ready(str(run_dir)), 120, "standby.json")
        assert ready["token"] == "t1" and ready["pid"] == t.proc.pid and ready["import_s"] > 0
        time.sleep(1.0)
        assert t.proc.poll() is None and not (run_dir / contract.STATUS_FILE).exists()  # waiting, nothing written
        (run_dir / contract.standby_go("t1")).touch()
        assert t.wait(120) == contract.EXIT_DONE, t.output[-3000:]
    finally:
        if t.proc.poll() is None:
            t.proc.kill()
    assert (run_dir / contract.standby_went("t1")).exists() and "taken over as the trainer" in t.output
    status = json.loads((run_dir / contract.STATUS_FILE).read_text())
    assert status["phase"] == contract.PHASE_DONE and status["pid"] == t.proc.pid
    # Its start counts from the take-over: the imports were paid before.
    assert status["detail"]["startup_s"]["import"] < ready["import_s"]


def test_a_standby_leaves_quietly_when_the_run_is_done_or_it_is_replaced(tmp_path):
    run_dir = tmp_path / "run"
    t = Trainer(tiny_config(), run_dir, "--standby", "t2")
    try:
        wait_for(lambda: _ready(str(run_dir)), 120, "standby.json")
        (run_dir / contract.EXIT_CODE_FILE).write_text(f"{contract.EXIT_DONE}\n")  # the trainer it stood by for finished
        assert t.wait(30) == contract.EXIT_DONE
    finally:
        if t.proc.poll() is None:
            t.proc.kill()
    assert not (run_dir / contract.STATUS_FILE).exists() and not (run_dir / contract.standby_went("t2")).exists()
