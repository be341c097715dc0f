"""A sample stores each GPU's processes with the run's trainer (and standby) named,
from real nvidia-smi captures. (The GPU pane: tests/integration/test_tui_gpus.py.)"""

from __future__ import annotations

import json

from dflashctl.hosts.parsers import parse_compute_apps, parse_gpu_query
from dflashctl.hosts.probe import HostProbe, ProbeResult, ProcessState
from dflashctl.supervise.supervisor_core import host_readings
from tests import harness
from tests.harness.scenes import NOW

CAPTURES = harness.FIXTURES / "nvidia-smi"


def _probe(trainer_pid: int, standby_pid: int | None = None) -> ProbeResult:
    return ProbeResult("/runs/x", None, NOW, process=ProcessState(trainer_pid, True, "R"), standby_pid=standby_pid)


def _host() -> HostProbe:
    return HostProbe(NOW, "gpu1", None, None, parse_gpu_query((CAPTURES / "h200-trainer-query.csv").read_text()),
                     parse_compute_apps((CAPTURES / "h200-trainer-apps.csv").read_text()), [], [])


def test_a_poll_stores_each_gpus_processes_with_the_trainer_and_its_run_named():
    readings = host_readings("gpu1", _host(), [("run-a", _probe(2546))], NOW)  # one trainer process, 88 GiB
    assert readings.host == "gpu1" and readings.observed == NOW and readings.reading is None
    (row,) = readings.gpu
    assert row["index"] == 0 and row["name"] == "NVIDIA H200"
    assert row["apps"] == [{"pid": 2546, "name": "/opt/torch/.venv/bin/python3", "used_memory_mib": 90214.0,
                            "role": "trainer", "run_id": "run-a"}]
    (row,) = host_readings("gpu1", _host(), [("run-a", _probe(9999))], NOW).gpu  # another process: foreign
    assert row["apps"][0]["role"] is None and row["apps"][0]["run_id"] is None
    (row,) = host_readings("gpu1", _host(), [("run-a", _probe(9999, standby_pid=2546))], NOW).gpu
    assert row["apps"][0]["role"] == "standby" and row["apps"][0]["run_id"] == "run-a"
    (row,) = host_readings("gpu1", _host(), [], NOW).gpu  # no run looked at (restarting): the GPUs still read
    assert row["apps"][0]["pid"] == 2546 and row["apps"][0]["role"] is None


def test_a_warm_up_helper_the_status_names_is_the_runs_own_and_nothing_else_in_its_place_is():
    from dataclasses import replace

    from dflashctl.core import contract

    def status(helpers) -> contract.Status:
        return contract.read_status(json.dumps({"phase": "compiling", "pid": 9999,
                                                "detail": {contract.STATUS_WARMUP_HELPERS: helpers}}))

    probe = _probe(9999)
    (row,) = host_readings("gpu1", _host(), [("run-a", replace(probe, status=status([2546])))], NOW).gpu
    assert row["apps"][0]["role"] == "warm-up helper" and row["apps"][0]["run_id"] == "run-a"
    for bad in ("2546", [True], [-2546, "2546", 2.5e3, None], {"pid": 2546}):  # what a hostile host might write
        (row,) = host_readings("gpu1", _host(), [("run-a", replace(probe, status=status(bad)))], NOW).gpu
        assert row["apps"][0]["role"] is None, bad
    assert contract.warmup_helper_pids(status(list(range(1, 1000)))) == list(range(1, contract.MAX_WARMUP_HELPERS + 1))
