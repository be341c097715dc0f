"""Which GPUs a launch finds busy, from real nvidia-smi captures. (Launches:
tests/integration/test_launch.py, tests/e2e/test_launch.py.)"""

from __future__ import annotations

import pytest

from dflashctl.hosts.parsers import parse_compute_apps, parse_gpu_query
from dflashctl.hosts.probe import HostProbe
from dflashctl.launch import busy_gpus
from tests import harness

FIXTURES = harness.FIXTURES / "nvidia-smi"


def _probe_from_fixtures(mode: str) -> HostProbe:
    gpus = parse_gpu_query((FIXTURES / f"h200-{mode}-query.csv").read_text())
    apps = parse_compute_apps((FIXTURES / f"h200-{mode}-apps.csv").read_text())
    return HostProbe(host_time=0.0, hostname="h", python="3.12", elapsed=0.1, gpus=gpus, compute_apps=apps,
                     errors=[], runs=[])


@pytest.mark.parametrize(
    "mode, wanted, expected",
    [
        ("idle", [0], {}),
        ("load", [0], {0: "compute processes: pid 416 python3 1002 MiB"}),
        ("idle", [0, 3], {3: "not present (nvidia-smi shows 1 GPU(s))"}),
    ],
)
def test_busy_gpus_from_real_captures(mode, wanted, expected):
    assert busy_gpus(_probe_from_fixtures(mode), wanted) == expected


def test_memory_in_use_without_processes_is_busy():
    probe = _probe_from_fixtures("load")
    probe.compute_apps = []  # processes of another container are invisible here
    assert busy_gpus(probe, [0]) == {0: "1011 MiB in use"}
