"""A sample stores each GPU's processes with the run's trainer (and standby) named,
from real nvidia-smi captures. (The GPU pane: tests/integration/test_tui_gpus.py.)"""

from __future__ import annotations

from dflashctl.hosts.parsers import parse_compute_apps, parse_gpu_query
from dflashctl.hosts.probe import ProbeResult, ProcessState
from dflashctl.supervise.supervisor_core import gpu_rows
from tests import harness
from tests.harness.scenes import NOW

CAPTURES = harness.FIXTURES / "nvidia-smi"


def _probe(trainer_pid: int, standby_pid: int | None = None) -> ProbeResult:
    return ProbeResult("/runs/x", None, NOW, process=ProcessState(trainer_pid, True, "R"), standby_pid=standby_pid,
                       gpus=parse_gpu_query((CAPTURES / "h200-trainer-query.csv").read_text()),
                       compute_apps=parse_compute_apps((CAPTURES / "h200-trainer-apps.csv").read_text()))


def test_a_sample_stores_each_gpus_processes_with_the_trainer_named():
    (row,) = gpu_rows(_probe(2546))  # the capture: one trainer process, pid 2546, 88 GiB
    assert row["index"] == 0 and row["name"] == "NVIDIA H200"
    assert row["apps"] == [{"pid": 2546, "name": "/opt/torch/.venv/bin/python3", "used_memory_mib": 90214.0,
                            "role": "trainer"}]
    (row,) = gpu_rows(_probe(9999))  # the same process, while the run's trainer is another: not the run's
    assert row["apps"][0]["role"] is None
    (row,) = gpu_rows(_probe(9999, standby_pid=2546))  # the pid standby.json names: the run's standby
    assert row["apps"][0]["role"] == "standby"
