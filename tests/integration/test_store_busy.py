"""Actions that cannot half-happen: a stop while another process holds the store's
write lock sends nothing, says why, and leaves the run supervised. A fake-trainer run
on the local host in real tmux, its supervisor a real `dflashctl watch` in its own
tmux session (as the launcher starts it), a real SQLite store locked by a real
second connection, the console driven headless."""

from __future__ import annotations

import os
import sqlite3
import time

import pytest

from dflashctl.hosts.tmux import SOCKET_ENV, Tmux
from dflashctl.launch import start_supervisor, supervisor_session
from dflashctl.store import Store
from tests.harness import cli as dflashctl
from tests.harness import environ
from tests.harness.local import REPO, SOCKET, LocalEnv, kill_tmux_servers, metrics_lines, read_status, wait_for
from tests.harness.tui import loaded, run, until


@pytest.fixture
def supervised(tmp_path):
    """A training fake-trainer run whose supervisor ticks in its tmux session."""
    env = LocalEnv(tmp_path)
    with environ(**{SOCKET_ENV: SOCKET, "DFLASHCTL_STORE": env.store_path}):
        run_id = env.start(env.playbook("busy"))
        pid = env.trainer_pid(run_id)
        start_supervisor(run_id, False, env.store, env.inventory, inventory_path=str(env.inventory_path),
                         playbooks_dir=str(env.playbooks))
        since = time.time()
        wait_for(lambda: _ticked_since(env.store, run_id, since), 60, "the supervisor's first ticks")
        wait_for(lambda: metrics_lines(env.run_dir(run_id)), 30, "metrics")
        try:
            yield env, run_id, pid
        finally:
            kill_tmux_servers([(env.host, env.inventory, SOCKET)])


def _ticked_since(store: Store, run_id: str, since: float) -> bool:
    return any(run_id in (b.get("runs") or []) and (b.get("last_tick") or 0) > since and not b.get("stopped")
               for b in store.supervisors())


def _locked(path: str) -> sqlite3.Connection:
    """A second connection holding the store's write lock (as a long writer would)."""
    conn = sqlite3.connect(path, timeout=0, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    return conn


def _untouched(env: LocalEnv, run_id: str, pid: int) -> None:
    """Nothing was sent, and the run is still supervised: the trainer alive and
    training, its session and its supervisor's session there, the supervisor
    recording again once the lock is gone, no stop recorded."""
    os.kill(pid, 0)
    assert read_status(env.run_dir(run_id)).phase == "training"
    tmux = Tmux(env.host, env.inventory, SOCKET)
    assert tmux.has_session(run_id) and tmux.has_session(supervisor_session(run_id))
    released = time.time()
    wait_for(lambda: _ticked_since(env.store, run_id, released), 60, "the supervisor recording again")
    run = env.store.get_run(run_id)
    assert run.state == "running" and (run.supervisor or {}).get("session") == supervisor_session(run_id)
    assert not [e for e in env.store.events(run_id) if e.kind == "stop_requested"]


def test_stop_on_the_command_line_while_the_store_is_locked_sends_nothing(supervised):
    env, run_id, pid = supervised
    lock = _locked(env.store_path)
    try:
        done = dflashctl.invoke("-i", str(env.inventory_path), "-p", str(env.playbooks), "stop", run_id, cwd=REPO,
                                env={"DFLASHCTL_STORE": env.store_path, SOCKET_ENV: SOCKET}, columns=200)
    finally:
        lock.rollback()
        lock.close()
    assert done.returncode != 0
    assert f"run {run_id} not stopped, nothing was sent" in done.stderr and "is busy" in done.stderr, done.stderr
    assert "its supervisor still watches it" in done.stderr and "Traceback" not in done.stderr + done.stdout
    _untouched(env, run_id, pid)


def test_x_then_y_while_the_store_is_locked_sends_nothing_and_says_why(supervised):
    """Defect: `x` `y` on a row showing `store busy` killed the supervisor, then failed
    with a raw `database is locked`; the trainer ran on unsupervised, unrecorded."""
    from dflashctl.tui.app import StatusApp
    from dflashctl.tui.screens import ConfirmScreen

    env, run_id, pid = supervised

    async def scenario():
        app = StatusApp(env.store_path, interval=600, inventory_path=str(env.inventory_path),
                        playbooks_dir=str(env.playbooks), probe_unsupervised=False)
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(pilot, app)
            await pilot.press("x")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the stop question")
            lock = _locked(env.store_path)  # taken while the operator reads the question
            try:
                await pilot.press("y")
                await until(pilot, lambda: app.actions_done, "the stop's answer", timeout=60)
                (args, code, output) = app.actions_done[0]
                assert args == ["stop", run_id] and code != 0 and "nothing was sent" in output, output
                await until(pilot, lambda: any("nothing was sent" in n.message for n in app._notifications),
                            "the reason on screen")
                # The row now shows the supervisor blocked by the lock: the key is refused, not asked.
                time.sleep(1.0)  # past three of the supervisor's 0.2 s polls
                app.action_reload()
                await until(pilot, lambda: app.view and any(r.freshness.store_busy for r in app.view.runs),
                            "the row showing the store busy")
                await pilot.press("x")
                await pilot.pause()
                assert not isinstance(app.screen, ConfirmScreen)
                assert any("the run store is busy" in n.message for n in app._notifications)
                assert len(app.actions_done) == 1
            finally:
                lock.rollback()
                lock.close()

    with environ(**{SOCKET_ENV: SOCKET}):
        run(scenario())
    _untouched(env, run_id, pid)
