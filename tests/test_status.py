"""`status`: view models over a real SQLite store, the Textual app driven headless,
and `status --once` / `--json` through the CLI."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

from dflashctl.errors import ConfigError
from dflashctl.parsers import GpuReading
from dflashctl.store import Store
from dflashctl.tui.model import NA, load_status, spark

PROD = "prod-20261129-101500-ab12"
DEMO = "demo-20261129-101600-cd34"
SMOKE = "smoke-20261129-102300-ef56"
PROD_TOK_S = [12000.0 + 100 * i for i in range(8)]


def fill(store: Store, now: float) -> None:
    """Three runs as the supervisor leaves them: one training on two GPUs (with a
    restart and a regression warning), one failed, one still launching."""
    store.create_run("prod", "gpu1", {"trainer": {"train": {"steps": 120000}}, "gpus": [0, 1]}, now - 500, run_id=PROD)
    store.transition(PROD, "running", "trainer started", now - 490)
    samples = [
        {"time": now - 480 + 10 * i, "step": 1000 + 50 * i, "tok_s": tok_s, "loss": 2.5 - 0.1 * i,
         "accept_len": 3.0 + 0.1 * i, "eta_s": 5 * 86400 - 100 * i, "phase": "training", "mfu": 0.41 + 0.001 * i}
        for i, tok_s in enumerate(PROD_TOK_S)
    ]
    store.add_samples(PROD, samples[:-1])
    gpus = [
        GpuReading(index=0, uuid="GPU-0", name="NVIDIA H200", memory_used_mib=90112, memory_total_mib=143771,
                   utilization_pct=100, temperature_c=61, power_draw_w=650.5, power_limit_w=700),
        GpuReading(index=1, uuid="GPU-1", name="NVIDIA H200", memory_used_mib=None, memory_total_mib=143771),
    ]
    store.add_sample(PROD, samples[-1], gpu=[g.__dict__ for g in gpus])  # as the supervisor stores them
    store.add_restart(PROD, now - 300, "crash: CUDA out of memory", signature="cuda_oom")
    store.add_event(PROD, "regression", "4.3 Ktok/s = 34% of baseline; ETA 38.2 d > 7 d", now - 100, severity="warning")

    store.create_run("demo", "local", {"trainer": {"train": {"steps": 200}}, "gpus": []}, now - 400, run_id=DEMO)
    store.transition(DEMO, "running", "trainer started", now - 390)
    store.add_samples(DEMO, [{"time": now - 380 + i, "step": 10 * i, "tok_s": 900.0, "loss": 4.0, "phase": "training"}
                             for i in range(1, 4)])
    store.transition(DEMO, "failed", "the trainer ended: crash", now - 50, exit_code=1, exit_reason="crash")

    store.create_run("smoke", "gpu1", {"trainer": {"train": {"steps": 400}}, "gpus": []}, now - 10, run_id=SMOKE)


@pytest.fixture
def store(tmp_path):
    s = Store(str(tmp_path / "runs.db"))
    fill(s, time.time())
    return s


# --------------------------------------------------------------------------- view models


def test_status_view(store):
    now = time.time()
    view = load_status(store, now)
    assert [r.id for r in view.runs] == [SMOKE, PROD, DEMO]  # active first, newest first
    assert view.selected == SMOKE and [e.message for e in view.events] == ["launch requested"]
    smoke, prod, demo = (r.cells() for r in view.runs)

    assert prod[:5] == (PROD, "running", "gpu1", "1,350/120,000 (1.1%)", "12.7 Ktok/s")
    assert prod[5] == "▁▂▃▄▅▆▇█" and prod[6:11] == ("42 %", "1.8000", "3.70", "5 d", "1")
    assert prod[11].endswith("4.3 Ktok/s = 34% of baseline; ETA 38.2 d > 7 d")
    # Nothing sampled yet: missing readings are values; a CPU run has no MFU.
    assert smoke == (SMOKE, "launching", "gpu1", NA, NA, NA, NA, NA, NA, NA, "0", smoke[11])
    assert smoke[11].endswith("launch requested")
    assert demo[1] == "failed" and demo[6] == NA and demo[9] == "-" and view.runs[2].exit_reason == "crash"

    # GPU readings of the active run's latest sample; an unread field is N/A.
    assert [g.cells() for g in view.gpus] == [
        ("gpu1", PROD, "0", "NVIDIA H200", "100 %", "88.0/140 GiB", "61 C", "650 W"),
        ("gpu1", PROD, "1", "NVIDIA H200", NA, NA, NA, NA),
    ]
    assert json.loads(json.dumps(view.to_dict()))["runs"][1]["tok_s_history"] == PROD_TOK_S


def test_one_run_by_prefix_and_unknown_runs(store):
    view = load_status(store, time.time(), run="demo-")
    assert [r.id for r in view.runs] == [DEMO] and view.selected == DEMO
    assert [e.message for e in view.events] == ["launch requested", "trainer started", "the trainer ended: crash"]
    assert view.gpus == []
    with pytest.raises(ConfigError, match="no run 'prod-2026112-' \\(did you mean 'prod-20261129-101500-ab12'"):
        load_status(store, time.time(), run="prod-2026112-")
    empty = load_status(Store(store.path + ".empty"), time.time())
    assert empty.runs == [] and empty.selected is None and "no runs yet" in empty.summary()


def test_spark():
    assert spark([]) == "" and spark([5.0, 5.0]) == "▅▅"
    assert spark([1.0, 2.0, 3.0]) == "▁▅█"
    assert spark(list(range(30)), width=4) == "▁▃▆█"


# --------------------------------------------------------------------------- the app


async def _loaded(pilot, app, after: int) -> None:
    """Wait until the app has shown a store read newer than ``after``."""
    for _ in range(200):
        if app.loads > after:
            return
        await pilot.pause(0.05)
    raise AssertionError("the status app never showed the store")


def test_app_shows_runs_events_throughput_and_gpus(store):
    from dflashctl.tui.app import StatusApp
    from textual.widgets import DataTable, Sparkline, Static

    async def scenario():
        app = StatusApp(store.path, interval=60)  # refreshes are driven by the test
        async with app.run_test(size=(120, 40)) as pilot:
            await _loaded(pilot, app, 0)
            runs = app.query_one("#runs", DataTable)
            assert runs.row_count == 3
            assert [str(c) for c in runs.get_row(PROD)[:5]] == [
                f"  {PROD}", "running", "gpu1", "1,350/120,000 (1.1%)", "12.7 Ktok/s"]
            assert str(runs.get_row(SMOKE)[0]) == f"▶ {SMOKE}"  # selected
            assert "3 run(s), 2 active" in str(app.query_one("#summary", Static).content)
            gpus = app.query_one("#gpus", DataTable)
            assert [str(c) for c in gpus.get_row_at(0)] == [
                "gpu1", PROD, "0", "NVIDIA H200", "100 %", "88.0/140 GiB", "61 C", "650 W"]
            assert list(app.query_one("#throughput-spark", Sparkline).data) == []

            # Enter on the second row shows that run's events and throughput.
            loads = app.loads
            await pilot.press("down", "enter")
            await _loaded(pilot, app, loads)
            assert app.selected == PROD
            assert str(app.query_one("#events-title", Static).content) == f"events of {PROD}"
            events = app.query_one("#events", DataTable)
            assert [str(c) for c in events.get_row_at(events.row_count - 1)][1:] == [
                "warning", "regression", "4.3 Ktok/s = 34% of baseline; ETA 38.2 d > 7 d"]
            assert list(app.query_one("#throughput-spark", Sparkline).data) == PROD_TOK_S
            label = str(app.query_one("#throughput-label", Static).content)
            assert "now 12.7 Ktok/s, min 12.0 Ktok/s, max 12.7 Ktok/s over 8 samples" in label

            # The supervisor writes a new sample; a refresh shows it, the cursor stays put.
            store.add_sample(PROD, {"time": time.time(), "step": 2400, "tok_s": 12800.0, "phase": "training"})
            loads = app.loads
            await pilot.press("r")
            await _loaded(pilot, app, loads)
            assert str(runs.get_row(PROD)[3]) == "2,400/120,000 (2.0%)" and runs.cursor_row == 1
            assert list(app.query_one("#throughput-spark", Sparkline).data) == [*PROD_TOK_S, 12800.0]

            await pilot.press("q")
            await pilot.pause()
            assert not app.is_running

    asyncio.run(scenario())


# --------------------------------------------------------------------------- the CLI


def _cli(store: Store, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DFLASHCTL_STORE": store.path, "COLUMNS": "220"}
    return subprocess.run([sys.executable, "-m", "dflashctl", "status", *args], env=env, capture_output=True,
                          text=True, timeout=60)


def test_cli_once_and_json(store):
    once = _cli(store, "--once")
    assert once.returncode == 0, once.stderr
    text = once.stdout
    for needle in (PROD, DEMO, SMOKE, "1,350/120,000 (1.1%)", "12.7 Ktok/s", "▁▂▃▄▅▆▇█", f"events of {SMOKE}",
                   "GPUs (latest samples)", "NVIDIA H200", "88.0/140 GiB"):
        assert needle in text, needle
    # Not a terminal: the table, not the live screen.
    assert _cli(store).stdout.splitlines()[2:6] == text.splitlines()[2:6]

    payload = json.loads(_cli(store, "--json").stdout)
    assert [r["id"] for r in payload["runs"]] == [SMOKE, PROD, DEMO]
    prod = payload["runs"][1]
    assert (prod["step"], prod["total_steps"], prod["restarts"], prod["active"]) == (1350, 120000, 1, True)
    assert prod["tok_s_history"] == PROD_TOK_S and len(payload["gpus"]) == 2

    one = json.loads(_cli(store, "demo", "--json").stdout)
    assert [r["id"] for r in one["runs"]] == [DEMO] and one["events"][-1]["message"] == "the trainer ended: crash"
    missing = _cli(store, "nope", "--json")
    assert missing.returncode == 2 and "no run 'nope'" in missing.stderr and "Traceback" not in missing.stderr


def test_data_code_imports_no_ui_and_no_torch():
    code = ("import sys, dflashctl.commands, dflashctl.tui.model, dflashctl.envaudit; "
            "print(sorted({'textual', 'torch'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "[]", done.stderr
    help_text = subprocess.run([sys.executable, "-m", "dflashctl", "status", "--help"], capture_output=True,
                               text=True, timeout=60, env={**os.environ, "COLUMNS": "120"}).stdout
    assert "--once" in help_text and "--json" in help_text and "--interval" in help_text
