"""The supervisor against what a host, a disk or a clock can write: each case once
blinded it (supervision stopped, a dead trainer went unnoticed). Real parts as in
tests/integration/test_supervisor.py: the fake trainer under run.sh in tmux, the
real probe, a real SQLite file (on a real, tiny tmpfs for the full disk)."""

from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from dflashctl.core import contract
from dflashctl.store import Store
from tests.harness.disk import fill, mount_tmpfs
from tests.harness.local import LocalEnv, read_status, wait_for

pytestmark = pytest.mark.usefixtures("private_tmux_socket")


@contextmanager
def running(env: LocalEnv, name: str, **playbook):
    """A fake-trainer run, attached to a fresh supervisor and seen running; ended after."""
    run_id = env.start(env.playbook(name, **playbook))
    sup = env.supervisor()
    sup.attach(run_id)
    try:
        wait_for(lambda: env.store.get_run(run_id).state == "running" and env.store.samples(run_id), 20, "running",
                 tick=sup.tick)
        yield run_id, sup
    finally:
        env.tmux.kill(run_id)
        sup.close()


def _append(run_dir: str, text: str) -> None:
    with open(os.path.join(run_dir, contract.METRICS_FILE), "a") as f:
        f.write(text)


def test_poisoned_metrics_lines_are_skipped_and_a_later_kill_is_still_seen_within_a_tick(local_env):
    store = local_env.store
    with running(local_env, "poisoned") as (run_id, sup):
        run_dir = local_env.run_dir(run_id)
        _append(run_dir, "[" * 50000 + "\n" + '{"v":1,"time":1.0,"step":9223372036854775808}\n'
                + '{"v":1,"time":%r,"step":3,"total_steps":Infinity}\n{"v":1,"time":%r,"step":"x"}\n'
                % (time.time(), time.time()))
        wait_for(lambda: [e for e in store.events(run_id, kind="metrics") if "bad line(s)" in e.message], 10,
                 "the bad lines reported", tick=sup.tick)
        written = Path(run_dir, contract.METRICS_FILE).stat().st_size
        sup.tick()
        assert store.metrics_position(run_id)[0] >= written - 4096  # the read position moved past them
        assert not [e for e in store.events(run_id) if "could not handle" in e.message]
        pid = local_env.trainer_pid(run_id)
        os.kill(pid, signal.SIGKILL)
        ticks = []
        wait_for(lambda: store.restarts(run_id), 10, "the kill detected", tick=lambda: ticks.append(sup.tick()))
        assert len(ticks) <= 3  # detected at the first poll after the kill (run.sh needs a moment)
        assert [e for e in store.events(run_id, kind="crash")]


def test_an_exit_code_written_while_the_trainer_lives_does_not_end_the_run(local_env):
    store = local_env.store
    with running(local_env, "fakedone") as (run_id, sup):
        Path(local_env.run_dir(run_id), contract.EXIT_CODE_FILE).write_text("0\n")
        wait_for(lambda: store.events(run_id, kind="conflict"), 10, "the claim reported", tick=sup.tick)
        for _ in range(5):
            sup.tick()
            time.sleep(0.1)
        run = store.get_run(run_id)
        assert run.state == "running" and run.supervisor is not None
        assert "exit_code says 0" in store.events(run_id, kind="conflict")[0].message
        assert local_env.trainer_pid(run_id)  # still the same live trainer


@pytest.fixture
def env_on_small_fs(tmp_path):
    """A LocalEnv whose store lives on a 2 MiB tmpfs (the runs and tmux stay on disk)."""
    fs = str(tmp_path / "fs")
    mount_tmpfs(fs, "2m")
    (tmp_path / "env").mkdir()
    env = LocalEnv(tmp_path / "env")
    env.store = Store(os.path.join(fs, "runs.db"))
    yield env, fs
    env.store.close()
    os.system(f"umount -l {fs}")


def test_with_the_store_on_a_full_disk_a_crash_is_still_alerted_and_restarted(env_on_small_fs, webhook):
    env, fs = env_on_small_fs
    with running(env, "diskfull", alerts={"webhook": webhook.url, "min_severity": "error"}) as (run_id, sup):
        first = env.trainer_pid(run_id)
        filler = fill(fs)
        try:
            os.kill(first, signal.SIGKILL)
            wait_for(lambda: {a.get("kind") for a in webhook.received} >= {"crash", "store"}, 20,
                     "the crash and the store alerts", tick=sup.tick)
            # Ticking on: under load the restart can fall to a later tick than the alerts.
            def restarted():  # status.json names another trainer (read, not waited on: the ticks make it)
                status = read_status(env.run_dir(run_id))
                return status is not None and status.pid not in (None, first)

            wait_for(restarted, 20, "a new trainer", tick=sup.tick)
        finally:
            os.unlink(filler)
        wait_for(lambda: env.store.restarts(run_id) and env.store.events(run_id, kind="crash"), 20,
                 "the kept writes stored once space is back", tick=sup.tick)
    store_alert = next(a for a in webhook.received if a.get("kind") == "store")
    assert "MiB free" in store_alert["message"] and "kept in memory" in store_alert["message"]
