"""The status console draws the operator to what went wrong (Textual's Pilot over
real SQLite stores, tests/harness/scenes.py): failed, crash-looping, stalled and
regressed runs sort first; a new error event rings the bell and raises a banner
once; a restarted run is marked; an event opens in full with the trainer's own
first error line; a message is folded, not cut before its fix."""

from __future__ import annotations

import pytest

from dflashctl.store import Store
from tests.harness.scenes import NOW, PROD, build, playbook, run_config, training, utc
from tests.harness.tui import app_for, cell, detail_loaded, loaded, run, screen_text, until

FAILED = "prod-20270115-060000-fa11"
LOOP = "prod-20270115-061000-100b"
SLOW = "prod-20270115-062000-5105"


@pytest.fixture(autouse=True)
def _utc():
    utc()


def attention_store(tmp_path) -> Store:
    """The healthy scene (PROD and DEMO training), plus older runs: one that failed
    10 min ago, one restarted twice at the same step (crash loop), one whose newest
    regression finding stands. All created before PROD: by age they sort last."""
    store = build("healthy", tmp_path)
    pb = playbook(tmp_path / "playbooks", "prod")
    store.create_run("prod", "gpu1", run_config(pb), NOW - 7200, run_id=FAILED, claim_gpus=False)
    store.transition(FAILED, "running", "trainer started (pid 10, phase training)", NOW - 7100)
    store.transition(FAILED, "failed", "crash (cuda_oom): not restarted", NOW - 600, exit_code=1,
                     exit_reason="crash")
    store.create_run("prod", "gpu1", run_config(pb), NOW - 6600, run_id=LOOP, claim_gpus=False)
    store.transition(LOOP, "running", "trainer started (pid 11, phase training)", NOW - 6500)
    for t in (NOW - 900, NOW - 400):
        store.add_restart(LOOP, t, "crash: CUDA out of memory", signature="cuda_oom", step_before=4000)
    training(store, LOOP, NOW - 300, NOW - 5, step0=4000)
    store.create_run("prod", "gpu1", run_config(pb), NOW - 6000, run_id=SLOW, claim_gpus=False)
    store.transition(SLOW, "running", "trainer started (pid 12, phase training)", NOW - 5900)
    training(store, SLOW, NOW - 600, NOW - 5, step0=1000, tok_s=4000.0)
    store.add_event(SLOW, "regression", "4.0 Ktok/s = 31% of baseline 13 Ktok/s for 3 windows", NOW - 60,
                    severity="warning")
    from tests.harness.scenes import beat
    beat(store, [PROD, LOOP, SLOW], NOW - 3, {"gpu1": {"last_ok": NOW - 4, "error": None, "down_since": None},
                                             "local": {"last_ok": NOW - 3, "error": None, "down_since": None}})
    return store


def test_failed_crash_looping_and_regressed_runs_sort_before_healthy_ones(tmp_path):
    store = attention_store(tmp_path)

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(200, 60)) as pilot:
            await loaded(pilot, app)
            table = app.query_one("#runs")
            order = [table.coordinate_to_cell_key((i, 0)).row_key.value for i in range(table.row_count)]
            assert order.index(FAILED) < order.index(PROD) and order.index(LOOP) < order.index(PROD)
            assert order.index(SLOW) < order.index(PROD)
            assert cell(app, LOOP, "state") == "crash loop"
            assert "bold red" in str(app.query_one("#runs").get_cell(LOOP, "state").style)
            assert cell(app, SLOW, "state") == "regressed"
            assert cell(app, PROD, "state") == "running"

    run(scenario())


def test_a_restarted_run_is_marked_in_its_state_whichever_columns_fit(tmp_path):
    store = build("restarting", tmp_path)
    store.transition(PROD, "running", "trainer started (pid 4444, phase training)", NOW - 200)
    training(store, PROD, NOW - 190, NOW - 5, step0=4000)

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(80, 24)) as pilot:
            await loaded(pilot, app)
            state = app.query_one("#runs").get_cell(PROD, "state")
            assert state.plain == "running ↻1" and "underline" in str(state.style)

    run(scenario())


def test_a_new_error_event_rings_the_bell_and_raises_a_banner_once(tmp_path):
    store = build("healthy", tmp_path)
    store.add_event(PROD, "crash", "an old crash, known before the screen started", NOW - 500, severity="error")

    async def scenario():
        app = app_for(store, tmp_path)
        rung = []
        app.bell = lambda: rung.append(app.loads)  # the terminal bell itself writes \a to a headless driver
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(pilot, app)
            assert not rung and "✖ new" not in screen_text(app)
            store.add_event(PROD, "crash", "the trainer exited (exit code 1); last error: torch.OutOfMemoryError: "
                            "CUDA out of memory", NOW - 1, severity="error",
                            detail={"signature": "cuda_oom", "matched_line": "torch.OutOfMemoryError: CUDA out of "
                                    "memory. Tried to allocate 2.50 GiB"})
            loads = app.loads
            await pilot.press("f5")
            await loaded(pilot, app, loads)
            assert len(rung) == 1
            await pilot.pause()
            text = screen_text(app)
            assert "✖ new error" in text and "allocate 2.50 GiB" in text  # the trainer's line, numbers kept
            for _ in range(2):  # refreshes that bring nothing new: no bell again
                loads = app.loads
                await pilot.press("f5")
                await loaded(pilot, app, loads)
            assert len(rung) == 1
            await pilot.press("escape")
            await pilot.pause()
            assert "✖ new" not in screen_text(app)

    run(scenario())


def test_an_event_opens_in_full_with_the_trainers_first_error_line(tmp_path):
    from dflashctl.tui.screens import DetailScreen, EventScreen

    store = build("restarting", tmp_path)
    line = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.50 GiB (GPU 3; 139.8 GiB total)"
    store.add_event(PROD, "crash", "the trainer exited (exit code 1); last error: " + "x" * 200, NOW - 270,
                    severity="error", detail={"signature": "cuda_oom", "matched_line": line})

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(pilot, app)
            await pilot.press("e")
            await detail_loaded(pilot, app)
            await pilot.pause()
            await pilot.press("end")
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, EventScreen), "the event window")
            await pilot.pause()
            text = screen_text(app)
            assert "first error line:" in text and "Tried to allocate 2.50 GiB" in text
            assert "signature: cuda_oom" in text
            await pilot.press("escape")
            await pilot.pause()
            assert isinstance(app.screen, DetailScreen)

    run(scenario())


def test_a_long_event_message_is_folded_so_its_fix_is_seen(tmp_path):
    store = build("healthy", tmp_path)
    store.add_event(PROD, "stall", "no new step for 6.0 m while the trainer process is alive but stopped "
                    "(state T: SIGSTOP or a debugger); nothing is restarted: resume it with `kill -CONT 4343`",
                    NOW - 2, severity="warning")

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(pilot, app)
            await pilot.press("down")  # PROD, under the newer DEMO
            await until(pilot, lambda: app.selected == PROD and "stall" in screen_text(app), "PROD's events")
            text = " ".join(screen_text(app).split())  # its folded lines, read as one
            assert "nothing is restarted: resume it with `kill -CONT 4343`" in text

    run(scenario())


