"""One meaning of tau everywhere: τ est (accept_len + 1, the training estimate) and
τ (measured by eval) side by side in `status` (view, table, detail, --json) and
`runs` (table, --json), over a real SQLite store, with the console saying why when
they part by more than contract.TAU_GAP_MARGIN."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from dflashctl.status.model import StatusReader, load_status
from dflashctl.store import Store
from dflashctl.tui.text import detail_text
from tests.harness import cli

RUN = "demo-20261201-101500-ab12"


def _store(tmp_path, measured: float | None) -> Store:
    now = time.time()
    store = Store(str(tmp_path / "runs.db"))
    store.create_run("demo", "local", {"trainer": {"train": {"steps": 300}}, "gpus": []}, now - 100, run_id=RUN)
    store.transition(RUN, "running", "trainer started", now - 90)
    store.add_samples(RUN, [{"time": now - 20 + i, "step": 290 + 10 * i, "tok_s": 500.0, "loss": 1.0,
                             "accept_len": 6.0 + 0.5 * i, "phase": "training"} for i in range(2)], observed=now - 5)
    store.transition(RUN, "done", "the trainer ended: done", now - 10, exit_code=0, exit_reason="done")
    if measured is not None:
        store.add_eval(RUN, now - 5, report={"step": 300, "tau": measured, "prompts": 8, "complete": True,
                                             "speed": {"speedup": 0.5}})
    return store


def test_status_shows_both_taus_and_why_they_part(tmp_path):
    store = _store(tmp_path, measured=1.0)
    view = load_status(store, time.time())
    [run] = view.runs
    assert run.tau_est == pytest.approx(7.5) and run.tau == 1.0
    assert run.cell("accept") == "7.50" and run.cell("tau") == "1.00" and run.style("tau") == "yellow"
    assert any("not written by this target" in n.text for n in view.notices)
    now = time.time()
    detail = detail_text(StatusReader(store).detail(RUN, now), 120, now).plain
    assert "τ est 7.50" in detail and "τ 1.00 (eval at step 300" in detail
    assert "not written by this target" in detail


def test_agreeing_taus_raise_no_notice(tmp_path):
    store = _store(tmp_path, measured=7.3)
    [run] = load_status(store, time.time()).runs
    assert run.tau_note is None and run.style("tau") == ""


def _cli(store: Store, *args: str) -> subprocess.CompletedProcess:
    """The command in this process (tests/harness/cli.py)."""
    return cli.invoke(*args, env={"DFLASHCTL_STORE": store.path}, columns=200)


def test_runs_and_status_json_carry_both_taus(tmp_path):
    store = _store(tmp_path, measured=1.0)
    listed = _cli(store, "runs")
    assert "τ est" in listed.stdout and "7.50" in listed.stdout and " 1.00 " in listed.stdout and "0.50x" in listed.stdout, listed.stdout
    assert "not written by this target" in listed.stdout
    [entry] = json.loads(_cli(store, "runs", "--json").stdout)
    assert entry["tau_est"] == pytest.approx(7.5) and entry["tau"] == 1.0 and "regenerate" in entry["tau_note"]
    status = json.loads(_cli(store, "status", "--json").stdout)
    [run] = status["runs"]
    assert run["tau_est"] == pytest.approx(7.5) and run["tau"] == 1.0 and run["tau_eval"]["step"] == 300
    once = _cli(store, "status", "--once")
    assert "τ est" in once.stdout and "τ " in once.stdout, once.stdout
