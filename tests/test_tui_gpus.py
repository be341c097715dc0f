"""The GPU pane as nvitop shows a host: every GPU of each host the runs use (idle
ones dimmed, not only those a run holds), each GPU's compute processes with the
run's trainer named and any other process marked foreign, and the age of each
reading, red past three polls. Over real SQLite stores and real nvidia-smi
captures (tests/fixtures/nvidia-smi)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflashctl.hosts.parsers import parse_compute_apps, parse_gpu_query
from dflashctl.hosts.probe import ProbeResult, ProcessState
from dflashctl.status.model import load_status
from dflashctl.store import Store
from dflashctl.supervise.supervisor_core import gpu_rows
from dflashctl.tui.text import gpu_text
from tests.test_tui import app_for, loaded, run, screen_text
from tests.test_tui_scenes import INTERVAL, NOW, PROD, beat, gpus, playbook, run_config, utc

CAPTURES = Path(__file__).parent / "fixtures" / "nvidia-smi"


@pytest.fixture(autouse=True)
def _utc():
    utc()


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


def host_store(tmp_path, observed_ago: float) -> Store:
    """A run holding GPUs 0-1 of an 8-GPU host; GPU 0 runs its trainer, GPU 5 a
    process of nobody's run, the others idle; the newest reading ``observed_ago`` old."""
    store = Store(str(tmp_path / "runs.db"))
    pb = playbook(tmp_path / "playbooks", "prod")
    store.create_run("prod", "gpu1", run_config(pb, placement={"target": [0], "drafter": [1]}), NOW - 1300,
                     run_id=PROD)
    store.transition(PROD, "running", "trainer started (pid 4343, phase training)", NOW - 1250)
    rows = gpus(8)
    for g in rows:
        g["apps"] = []
        if g["index"] > 1:
            g.update(utilization_pct=0.0, memory_used_mib=0.0, power_draw_w=70.0)
    rows[0]["apps"] = [{"pid": 4343, "name": "python3", "used_memory_mib": 88000.0, "role": "trainer"}]
    rows[5].update(utilization_pct=40.0, memory_used_mib=20480.0)
    rows[5]["apps"] = [{"pid": 777, "name": "/usr/bin/python3 notebook.py", "used_memory_mib": 20480.0, "role": None}]
    t = NOW - observed_ago
    store.add_samples(PROD, [{"time": t, "step": 5000, "tok_s": 12800.0, "loss": 2.0, "phase": "training"}],
                      gpu=rows, observed=t)
    beat(store, [PROD], NOW - 3, {"gpu1": {"last_ok": NOW - 3, "error": None, "down_since": None}})
    return store


def test_every_gpu_of_the_host_with_its_processes_idle_ones_dimmed(tmp_path):
    store = host_store(tmp_path, observed_ago=5.0)
    (host,) = load_status(store, NOW).hosts
    assert [g.index for g in host.gpus] == list(range(8))
    assert [g.index for g in host.gpus if g.idle] == [2, 3, 4, 6, 7]
    text = gpu_text(load_status(store, NOW).hosts, 160, NOW)
    lines = text.plain.splitlines()
    assert any("pid    4343" in line and f"trainer of {PROD}" in line for line in lines)
    assert any("pid     777" in line and "foreign" in line for line in lines)
    idle_row = next(line for line in lines if line.startswith("  3 "))
    start = text.plain.index(idle_row)
    assert any("dim" in str(span.style) and span.start <= start < span.end for span in text.spans)

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(200, 60)) as pilot:
            await loaded(pilot, app)
            shown = screen_text(app)
            assert "foreign" in shown and "trainer of" in shown and "idle" in shown

    run(scenario())


def test_a_reading_older_than_three_polls_is_red_with_its_age(tmp_path):
    for ago, red in ((5.0, False), (3 * INTERVAL + 5, True)):
        store = host_store(tmp_path / str(ago), observed_ago=ago)
        text = gpu_text(load_status(store, NOW).hosts, 160, NOW)
        row = next(line for line in text.plain.splitlines() if line.startswith("  0 "))
        age = "5s" if not red else "50s"
        at = text.plain.index(row) + row.index(f" {age} ") + 1
        styles = [str(s.style) for s in text.spans if s.start <= at < s.end]
        assert any("red" in s for s in styles) == red, (age, styles)
