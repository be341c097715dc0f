"""The console's smaller promises, over real SQLite stores and the real CLI: `r` on
a run that failed out of GPU memory says a restart would fail the same way; a
stalled run has no ETA; `status --once` shows a run nobody watches as its row in
the console does (probed, never `starting 0s/10m`); a finished run's pane never
says `done · done`; j k g G move in the runs; `a` on a finished run says why it
cannot attach."""

from __future__ import annotations

import os
import sys
import time

import pytest
import yaml

from dflashctl.core import contract
from dflashctl.store import Store
from tests.harness import cli
from tests.harness.scenes import DEMO, NOW, OLD, PROD, build, playbook, run_config, utc
from tests.harness.tui import app_for, cell, loaded, run, screen_text, until

FAILED = "prod-20270115-060000-ff01"


@pytest.fixture(autouse=True)
def _utc():
    utc()


def _with_failed_oom(tmp_path) -> Store:
    """The healthy scene, plus a run the supervisor stopped on cuda_oom, as it words
    that transition (the signature's hint after "not restarting")."""
    store = build("healthy", tmp_path)
    pb = playbook(tmp_path / "playbooks", "prod")
    store.create_run("prod", "gpu1", run_config(pb), NOW - 7200, run_id=FAILED, claim_gpus=False)
    store.transition(FAILED, "running", "trainer started (pid 10, phase training)", NOW - 7100)
    store.transition(FAILED, "failed", "crash (cuda_oom): CUDA out of memory; not restarting: GPU memory exhausted: "
                     "lower data.batch_size or the largest length bucket, or give the drafter more GPUs; a restart "
                     "would fail the same way", NOW - 600, exit_code=1, exit_reason="crash")
    return store


async def _to(pilot, app, run_id: str) -> None:
    table = app.query_one("#runs")
    for _ in range(table.row_count):
        if table.current == run_id:
            return
        await pilot.press("j")
    assert table.current == run_id


def test_r_on_a_run_that_failed_out_of_memory_says_a_restart_would_fail_the_same_way(tmp_path):
    from dflashctl.tui.screens import ConfirmScreen

    store = _with_failed_oom(tmp_path)

    async def scenario():
        app = app_for(store, tmp_path, control=lambda args: pytest.fail(f"ran {args}"))
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(pilot, app)
            await _to(pilot, app, FAILED)
            await pilot.press("r")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the question")
            question, detail = app.screen.question, app.screen.detail
            assert question.endswith("It failed on cuda_oom: a restart would fail the same way."), question
            assert "lower data.batch_size" in detail and "Restart only once that is fixed" in detail
            assert "a restart would fail" in " ".join(screen_text(app).split())  # shown, not only held
            await pilot.press("n")
            await pilot.pause()
            assert app.actions_done == [] and store.get_run(FAILED).state == "failed"

    run(scenario())


def test_a_stalled_run_has_no_eta(tmp_path):
    store = build("healthy", tmp_path)
    store.transition(PROD, "stalled", "no step for 12 m", NOW - 30)

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(200, 50)) as pilot:
            await loaded(pilot, app)
            assert cell(app, PROD, "eta") == "-" and "ETA none (stalled" in screen_text(app)
            assert app.view.runs[[r.id for r in app.view.runs].index(PROD)].eta_s is None

    run(scenario())
    import json

    done = cli.status(store.path, "--json")
    assert done.returncode == 0, done.stderr
    prod = next(r for r in json.loads(done.stdout)["runs"] if r["id"] == PROD)
    assert prod["eta_s"] is None and prod["display_state"] == "stalled"


def test_a_finished_runs_pane_says_done_once(tmp_path):
    store = build("healthy", tmp_path)

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(pilot, app)
            await _to(pilot, app, OLD)
            await until(pilot, lambda: f"{OLD} · prod on gpu1 · done" in screen_text(app), "the run's pane")
            assert "done · done" not in screen_text(app)

    run(scenario())


def test_j_k_g_G_move_in_the_runs(tmp_path):
    store = build("healthy", tmp_path)

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(pilot, app)
            table = app.query_one("#runs")
            assert table.cursor_row == 0
            await pilot.press("j", "j")
            assert table.cursor_row == 2
            await pilot.press("k")
            assert table.cursor_row == 1
            await pilot.press("g")
            assert table.cursor_row == 0
            await pilot.press("G")
            assert table.cursor_row == table.row_count - 1

    run(scenario())


def test_a_on_a_finished_run_says_why_it_cannot_attach(tmp_path, monkeypatch):
    monkeypatch.delenv("TMUX", raising=False)
    store = build("healthy", tmp_path)

    async def scenario():
        app = app_for(store, tmp_path, attach=lambda argv: pytest.fail(f"attached: {argv}"))
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(pilot, app)
            await _to(pilot, app, OLD)
            await pilot.press("a")
            await pilot.pause(0.2)
            said = [n.message for n in app._notifications]
            assert any(f"run {OLD} is done: its tmux session ended with its trainer" in m for m in said), said
            assert not app.attached

    run(scenario())


def test_once_shows_a_run_nobody_watches_as_its_row_in_the_console_does(tmp_path):
    """The run's host answers (a live trainer at step 812, training): `--once` probes
    it as the console does, and says so, instead of the store's `starting 0s/10m`."""
    import subprocess

    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"local": {"transport": "local", "workdir": str(tmp_path)}}}))
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        run_dir = tmp_path / "runs" / DEMO
        run_dir.mkdir(parents=True)
        contract.write_status(str(run_dir), contract.Status(phase="training", pid=trainer.pid,
                                                            started=time.time() - 60, step=812))
        store = Store(str(tmp_path / "runs.db"))
        store.create_run("demo", "local", {}, time.time() - 60, run_id=DEMO, run_dir=str(run_dir),
                         tmux_session=DEMO, tmux_socket=f"dflash-once-{os.getpid()}")
        store.transition(DEMO, "running", "trainer started", time.time() - 50)
        done = cli.invoke("--inventory", str(inventory), "status", "--once", columns=220,
                          env={"DFLASHCTL_STORE": store.path})
        assert done.returncode == 0, done.stderr
        out = done.stdout
        row = next(line for line in out.splitlines() if line.startswith(DEMO))
        assert "unsupervised" in row and "training (probed)" in row and "812 (probed)" in row, out
        assert "starting" not in row
        # Its detail says the same phase as its row (one phase for a run everywhere it is shown).
        detail = cli.invoke("--inventory", str(inventory), "status", DEMO, "--once", columns=220,
                            env={"DFLASHCTL_STORE": store.path})
        assert detail.returncode == 0, detail.stderr
        assert "training (probed)" in detail.stdout and "starting" not in detail.stdout, detail.stdout
    finally:
        trainer.kill()
        trainer.wait()


def test_E_lists_the_events_of_every_run_and_slash_filters_them(tmp_path):
    from dflashctl.tui.screens import EventScreen, FeedScreen

    store = build("healthy", tmp_path)
    store.add_event(DEMO, "note", "demo's own event", NOW - 20)
    store.add_event(PROD, "note", "prod's own event", NOW - 10)

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(160, 40)) as pilot:
            await loaded(pilot, app)
            await pilot.press("E")
            await until(pilot, lambda: isinstance(app.screen, FeedScreen) and app.screen.loads, "the feed")
            table = app.screen.query_one("#feed")
            runs = {str(table.get_row_at(i)[0]) for i in range(table.row_count)}
            assert {DEMO, PROD} <= runs
            assert str(table.get_row_at(table.row_count - 1)[4]) == "prod's own event"  # newest at the bottom
            await pilot.press("slash", *"demo's", "enter")
            await pilot.pause()
            assert table.row_count == 1 and str(table.get_row_at(0)[0]) == DEMO and app.focused is table
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, EventScreen), "the event in full")
            await pilot.press("escape", "escape", "escape")
            await until(pilot, lambda: not isinstance(app.screen, (EventScreen, FeedScreen)), "back")

    run(scenario())
