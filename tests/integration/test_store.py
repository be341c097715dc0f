"""The run store on a real SQLite file: migrations, the run state machine, samples,
the learned baseline, and concurrent writers (threads and processes)."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
import threading

import pytest

from dflashctl.core.contract import Metrics
from dflashctl.core.errors import ConfigError, DflashError
from dflashctl.core.states import ACTIVE_STATES, FINAL_STATES, STATES, TRANSITIONS
from dflashctl.store import GpuConflict, InvalidTransition, Store, migrations

T0 = 1_800_000_000.0


@pytest.fixture
def store(tmp_path):
    s = Store(str(tmp_path / "runs.db"))
    yield s
    s.close()


def _run(store, playbook="demo", host="local", gpus=(), now=T0, **kw):
    return store.create_run(playbook, host, {"gpus": list(gpus), "trainer": {"train": {"steps": 10}}}, now, **kw)


def _force_state(store, run_id, state):
    """Put a run straight into a state (test setup only: bypasses the state machine)."""
    with store._write() as db:
        db.execute("UPDATE runs SET state = ? WHERE id = ?", [state, run_id])


# --------------------------------------------------------------------------- schema


def test_fresh_file_gets_wal_and_named_migrations(tmp_path):
    path = str(tmp_path / "sub" / "runs.db")
    Store(path).close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    applied = [r[0] for r in conn.execute("SELECT name FROM _sqlite_migrations ORDER BY id")]
    assert applied == [m.name for m in migrations._migrations] == [
        "0001_core_tables", "0002_env_snapshots", "0003_sample_mfu", "0004_restart_outcome_numeric_samples",
        "0005_supervisor_heartbeats", "0006_evals", "0007_run_hosts", "0008_sample_host_reading",
        "0009_sample_rates", "0010_sample_mfu_measured", "0011_eval_attempts", "0012_host_readings_rollups"]
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"runs", "events", "samples", "restarts", "env_snapshots", "host_readings", "rollups"} <= tables
    conn.close()
    # Reopening applies nothing twice and keeps the data.
    s = Store(path)
    run = _run(s)
    s.close()
    assert Store(path).get_run(run.id).playbook == "demo"
    assert sqlite3.connect(path).execute("SELECT count(*) FROM _sqlite_migrations").fetchone()[0] == len(migrations._migrations)


def test_a_store_from_before_the_mfu_column_upgrades_and_keeps_its_samples(tmp_path):
    path = str(tmp_path / "runs.db")
    s = Store(path)
    run = _run(s)
    s.close()
    conn = sqlite3.connect(path)  # back to the schema of 0002: no samples.mfu, no record of 0003
    conn.execute("ALTER TABLE samples DROP COLUMN mfu")
    conn.execute("DELETE FROM _sqlite_migrations WHERE name = '0003_sample_mfu'")
    conn.execute("PRAGMA user_version = 0")  # dflashctl before schema versions never set it
    conn.execute("INSERT INTO samples (run_id, time, step, tok_s) VALUES (?, ?, 5, 100.0)", [run.id, T0 + 1])
    conn.commit()
    conn.close()
    s = Store(path)
    s.add_samples(run.id, [Metrics(time=T0 + 2, step=6, total_steps=10, tok_s=110.0, extra={"mfu": 0.36}),
                           {"time": T0 + 3, "step": 7, "mfu": "n/a"}])
    got = s.samples(run.id)
    assert [(x.step, x.tok_s, x.mfu) for x in got] == [(5, 100.0, None), (6, 110.0, 0.36), (7, None, None)]


def test_samples_keep_the_trainers_samples_and_anchor_blocks_per_second_and_both_mfus(store):
    """A metrics line's extra samples_s / anchors_s (the units public trainers quote)
    and mfu_measured (beside mfu, the nominal peak's) are stored beside tok/s; a
    hostile value is none, not a number."""
    run = _run(store)
    store.add_samples(run.id, [Metrics(time=T0 + 1, step=5, total_steps=10, tok_s=284460.9,
                                       extra={"samples_s": 34.72, "anchors_s": 17778.8, "mfu": 0.4668,
                                              "mfu_measured": 0.5844}),
                               {"time": T0 + 2, "step": 6, "extra": {"samples_s": "fast", "anchors_s": float("nan"),
                                                                     "mfu_measured": [1]}}])
    got = store.samples(run.id)
    assert [(x.step, x.samples_s, x.anchors_s, x.mfu, x.mfu_measured) for x in got] == [
        (5, 34.72, 17778.8, 0.4668, 0.5844), (6, None, None, None, None)]


def test_json_columns_round_trip_and_are_stored_as_json_text(store):
    run = store.create_run("demo", "local", {"gpus": [1, 2], "env": {"A": "é"}}, T0)
    store.set_supervisor(run.id, {"kind": "tmux", "session": "watch-x"})
    store.add_event(run.id, "note", "hello", T0 + 1, detail={"nested": [1, {"x": None}]})
    got = store.get_run(run.id)
    assert got.config == {"gpus": [1, 2], "env": {"A": "é"}} and got.supervisor["session"] == "watch-x"
    assert store.events(run.id, kind="note")[0].detail == {"nested": [1, {"x": None}]}
    raw = store.db.execute("SELECT config FROM runs WHERE id = ?", [run.id]).fetchone()[0]
    assert raw.startswith("{") and '"gpus":[1,2]' in raw  # JSON text, never a pickle


# --------------------------------------------------------------------------- runs


def test_get_run_by_unique_prefix_and_clear_errors(store):
    a = _run(store, run_id="demo-20261129-101500-aaaa")
    _run(store, run_id="demo-20261129-101500-abbb")
    _run(store, run_id="prod-20261129-101500-cccc")
    assert store.get_run("demo-20261129-101500-aa").id == a.id
    assert store.get_run("prod").id == "prod-20261129-101500-cccc"
    with pytest.raises(ConfigError, match="ambiguous: demo-20261129-101500-abbb, demo-20261129-101500-aaaa"):
        store.get_run("demo-20261129-101500-a")
    with pytest.raises(ConfigError, match="no run 'demo-20261129-101500-aaab' \\(did you mean"):
        store.get_run("demo-20261129-101500-aaab")
    # LIKE wildcards in a reference are literal characters.
    with pytest.raises(ConfigError, match="no run"):
        store.get_run("demo%")


def test_list_runs_filters_newest_first(store):
    old = _run(store, playbook="demo", now=T0)
    new = _run(store, playbook="demo", now=T0 + 10)
    other = _run(store, playbook="prod", host="gpu1", now=T0 + 5)
    store.transition(old.id, "failed", "crashed", T0 + 20)
    assert [r.id for r in store.list_runs()] == [new.id, other.id, old.id]
    assert [r.id for r in store.list_runs(playbook="demo")] == [new.id, old.id]
    assert [r.id for r in store.list_runs(active_only=True)] == [new.id, other.id]
    assert [r.id for r in store.active_runs_on_host("gpu1")] == [other.id]
    assert len(store.list_runs(limit=1)) == 1


# --------------------------------------------------------------------------- state machine


@pytest.mark.parametrize("current", STATES)
def test_every_edge_is_validated(store, current):
    for target in STATES:
        if target == current:
            continue
        run = _run(store)
        _force_state(store, run.id, current)
        before = len(store.events(run.id))
        if target in TRANSITIONS[current]:
            assert store.transition(run.id, target, f"{current} -> {target}", T0 + 1) is True
            got = store.get_run(run.id)
            assert got.state == target
            event = store.events(run.id)[-1]
            assert (event.kind, event.message, event.detail) == (
                "state", f"{current} -> {target}", {"from": current, "to": target})
        else:
            with pytest.raises(InvalidTransition, match=f"cannot go from {current} to {target}"):
                store.transition(run.id, target, "nope", T0 + 1)
            assert store.get_run(run.id).state == current
            assert len(store.events(run.id)) == before  # a refused edge writes nothing


def test_lifecycle_times_exit_and_revival(store):
    run = _run(store)
    assert run.state == "launching" and store.events(run.id)[0].detail == {"from": None, "to": "launching"}
    store.transition(run.id, "running", "started", T0 + 5)
    store.transition(run.id, "stalled", "no step for 5m", T0 + 400)
    assert store.events(run.id)[-1].severity == "warning"
    store.transition(run.id, "running", "steps again", T0 + 500)
    assert store.get_run(run.id).started == T0 + 5  # the first start stays
    store.transition(run.id, "failed", "CUDA OOM", T0 + 600, exit_code=1, exit_reason="crash")
    got = store.get_run(run.id)
    assert (got.ended, got.exit_code, got.exit_reason, got.active) == (T0 + 600, 1, "crash", False)
    assert store.events(run.id)[-1].severity == "error"
    # An operator restart revives a failed run: no longer ended.
    store.transition(run.id, "restarting", "operator restart", T0 + 700)
    got = store.get_run(run.id)
    assert (got.ended, got.exit_code, got.exit_reason, got.active) == (None, None, None, True)
    # Repeating the current state is a no-op, not an error, and writes no event.
    n = len(store.events(run.id))
    assert store.transition(run.id, "restarting", "again", T0 + 701) is False
    assert len(store.events(run.id)) == n
    with pytest.raises(InvalidTransition, match="unknown run state 'runing' \\(did you mean 'running'"):
        store.transition(run.id, "runing", "typo", T0)


def test_done_is_final(store):
    run = _run(store)
    store.transition(run.id, "running", "", T0)
    store.transition(run.id, "done", "", T0 + 1, exit_code=0)
    assert TRANSITIONS["done"] == frozenset() and set(FINAL_STATES) | set(ACTIVE_STATES) == set(STATES)
    with pytest.raises(InvalidTransition, match="allowed: none"):
        store.transition(run.id, "restarting", "", T0 + 2)


def test_events_filters(store):
    run = _run(store)
    store.add_event(run.id, "regression", "4.3 Ktok/s = 34% of baseline", T0 + 1, severity="warning")
    store.add_event(run.id, "crash", "OOM", T0 + 2, severity="critical")
    store.add_event(None, "host", "host-level note", T0 + 3)
    assert [e.kind for e in store.events(run.id, min_severity="warning")] == ["regression", "crash"]
    assert [e.kind for e in store.events(run.id, since=T0 + 1)] == ["crash"]
    assert [e.kind for e in store.events(run.id, limit=2)] == ["regression", "crash"]
    assert store.events(kind="host")[0].run_id is None
    with pytest.raises(ValueError, match="severity 'fatal'"):
        store.add_event(run.id, "x", "y", T0, severity="fatal")


# --------------------------------------------------------------------------- GPUs


def test_gpu_claims_are_exclusive_while_active(store):
    a = _run(store, host="gpu1", gpus=[0, 1])
    _run(store, host="gpu2", gpus=[0])  # another host: no conflict
    assert store.gpus_held("gpu1") == {0: a.id, 1: a.id}
    with pytest.raises(GpuConflict, match=f"GPU 1 by run {a.id}") as e:
        _run(store, host="gpu1", gpus=[1, 2])
    assert e.value.taken == {1: a.id}
    assert len(store.list_runs(host="gpu1")) == 1  # the refused run was not recorded
    forced = _run(store, host="gpu1", gpus=[1], claim_gpus=False)
    assert forced.gpus == [1]
    assert store.gpus_held("gpu1", exclude_run=forced.id) == {0: a.id, 1: a.id}
    # A lost run may still be training: it keeps its GPUs. A stopped one frees them.
    store.transition(a.id, "lost", "host unreachable", T0 + 1)
    assert 0 in store.gpus_held("gpu1")
    store.transition(a.id, "stopped", "operator", T0 + 2)
    store.transition(forced.id, "failed", "", T0 + 2)
    assert store.gpus_held("gpu1") == {}
    _run(store, host="gpu1", gpus=[0, 1])


# --------------------------------------------------------------------------- samples and baseline


def test_samples_and_metrics_position_move_together(store):
    run = _run(store)
    lines = [Metrics(time=T0 + i, step=10 * i, total_steps=100, tok_s=1000.0 + i, loss=2.0, phase="training")
             for i in range(1, 4)]
    assert store.add_samples(run.id, lines, metrics_offset=300, metrics_inode=77, gpu=[{"index": 0}]) == 3
    store.add_sample(run.id, {"time": T0 + 9, "step": 90, "tok_s": None, "phase": "checkpointing"})
    got = store.samples(run.id)
    assert [s.step for s in got] == [10, 20, 30, 90] and got[0].gpu is None and got[3].tok_s is None
    assert store.readings(run.host, 2) == [{"time": T0 + 3, "gpu": [{"index": 0}], "host_reading": None}]
    assert [s.step for s in store.samples(run.id, since=T0 + 2)] == [30, 90]
    assert [s.step for s in store.samples(run.id, limit=2)] == [30, 90]
    assert store.metrics_position(run.id) == (300, 77) and store.metrics_offset(run.id) == 300
    # A failing batch stores nothing and leaves the offset alone (one transaction).
    with pytest.raises(TypeError):  # its host's readings cannot be stored
        store.add_samples(run.id, [{"time": T0, "step": 1}, {"time": T0, "step": 2}], gpu=object(),
                          metrics_offset=999)
    assert len(store.samples(run.id)) == 4 and store.metrics_offset(run.id) == 300
    store.set_metrics_offset(run.id, 0, None)
    assert store.metrics_position(run.id) == (0, None)


def test_healthy_history_is_the_median_of_earlier_healthy_runs(store):
    def finished(tok_s, state="done", now=T0, regression=False, phase="training"):
        run = _run(store, now=now)
        store.add_samples(run.id, [{"time": now + i, "step": i, "tok_s": v, "phase": phase} for i, v in enumerate(tok_s)])
        # Compile warm-up is not training: it never counts.
        store.add_sample(run.id, {"time": now, "step": 0, "tok_s": 1.0, "phase": "compiling"})
        if regression:
            store.add_event(run.id, "regression", "slow", now + 50, severity="warning")
        store.transition(run.id, "running", "", now + 1)
        store.transition(run.id, state, "", now + 100)
        return run

    assert store.baseline_tok_s("demo") is None
    finished([12000, 12800, 13000], now=T0)
    finished([11000, 11500, 12000], now=T0 + 1000, state="stopped")
    finished([100, 100, 100], now=T0 + 2000, state="failed")  # failed: not healthy
    finished([4300, 4300, 4300], now=T0 + 3000, regression=True)  # flagged slow
    current = finished([9000], now=T0 + 4000)
    assert store.healthy_tok_s_history("demo", exclude_run=current.id) == [11500.0, 12800.0]
    assert store.baseline_tok_s("demo", exclude_run=current.id) is None  # two runs: an anecdote, not a baseline
    assert store.baseline_tok_s("demo", exclude_run=current.id, min_runs=2) == 12150.0
    assert store.baseline_tok_s("demo") == 11500.0  # three healthy runs: 9000, 11500, 12800
    assert store.healthy_tok_s_history("demo", limit=1) == [9000.0]
    assert store.healthy_tok_s_history("prod") == []


def test_restarts_and_env_snapshots(store):
    run = _run(store)
    rid = store.add_restart(run.id, T0 + 10, "crash", signature="cuda_oom", action="restart",
                            detect_delay_s=4.0, downtime_s=None, step_before=120)
    store.update_restart(rid, time_to_first_step_s=33.5, step_after=100, downtime_s=40.0)
    (r,) = store.restarts(run.id)
    assert (r.signature, r.step_before, r.step_after, r.time_to_first_step_s, r.downtime_s) == (
        "cuda_oom", 120, 100, 33.5, 40.0)
    assert store.restarts(run.id, since=T0 + 10) == []
    with pytest.raises(ValueError, match="cannot set reason"):
        store.update_restart(rid, reason="x")
    store.add_env_snapshot("gpu1", T0, {"torch": "2.11.0"}, run_id=run.id)
    store.add_env_snapshot("gpu1", T0 + 5, {"torch": "2.11.0", "sglang": "0.5"})
    assert [s["data"] for s in store.env_snapshots("gpu1")] == [{"torch": "2.11.0", "sglang": "0.5"}, {"torch": "2.11.0"}]


# --------------------------------------------------------------------------- concurrency


def test_threads_each_get_their_own_connection(store):
    run = _run(store)
    errors = []

    def work(tag):
        try:
            for i in range(50):
                store.add_event(run.id, "tick", f"{tag}-{i}", T0 + i)
            store.close()
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(f"t{n}",), name=f"writer-{n}") for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(store.events(run.id, kind="tick")) == 200


_WRITER = textwrap.dedent(
    """
    import os, sys, time
    from dflashctl.store import Store
    path, tag, go = sys.argv[1], sys.argv[2], sys.argv[3]
    while not os.path.exists(go):  # start together, so the two really overlap
        time.sleep(0.001)
    store = Store(path)  # both may be the first to open the file: migrations race too
    run = store.create_run("race", tag, {}, time.time(), run_id="race-" + tag)
    for i in range(300):
        store.add_event(run.id, "tick", f"{tag}-{i}", time.time())
        store.add_samples(run.id, [{"time": time.time(), "step": i, "tok_s": 1.0}], metrics_offset=i)
    store.transition(run.id, "running", "done writing", time.time())
    print("ok")
    """
)


def test_two_processes_writing_at_once_lose_nothing(tmp_path):
    path = str(tmp_path / "runs.db")  # not created yet
    go = tmp_path / "go"
    procs = [
        subprocess.Popen([sys.executable, "-c", _WRITER, path, tag, str(go)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for tag in ("a", "b")
    ]
    go.write_text("")
    results = [p.communicate(timeout=120) for p in procs]
    for p, (stdout, stderr) in zip(procs, results):
        assert p.returncode == 0 and stdout.strip() == "ok", stderr
    store = Store(path)
    for tag in ("a", "b"):
        messages = [e.message for e in store.events(f"race-{tag}", kind="tick")]
        assert messages == [f"{tag}-{i}" for i in range(300)]
        assert [s.step for s in store.samples(f"race-{tag}")] == list(range(300))
        assert store.metrics_offset(f"race-{tag}") == 299
        assert store.get_run(f"race-{tag}").state == "running"
    assert store.db.execute("SELECT count(*) FROM _sqlite_migrations").fetchone()[0] == len(migrations._migrations)
    assert os.path.exists(path + "-wal") or store.db.journal_mode == "wal"


def test_a_run_that_ended_shows_the_step_it_stopped_at_not_its_last_metrics_line(store):
    """Metrics lines come every log_every steps: a run stopped at step 37 whose newest
    line is step 30 ended at 37, as its final state's event (status.json's step) says."""
    run = _run(store)
    store.add_samples(run.id, [{"time": T0 + i, "step": 10 * i, "tok_s": 1.0, "phase": "training"} for i in (1, 2, 3)])
    running = _run(store)
    store.add_samples(running.id, [{"time": T0, "step": 5, "tok_s": 1.0, "phase": "training"}])
    store.transition(run.id, "running", "", T0 + 1)
    store.transition(run.id, "stopped", "the trainer stopped on request at step 37", T0 + 50,
                     detail={"outcome": "stopped", "step": 37})
    store.transition(running.id, "running", "", T0 + 1, detail={"step": 99})  # not an end: its samples say
    outcomes = store.run_outcomes([run.id, running.id])
    assert outcomes[run.id]["step"] == 37 and outcomes[running.id]["step"] == 5


def test_a_shared_connection_serves_every_thread_until_unshared_and_refuses_writes(store):
    """The console's readers: one connection for threads that come and go (each read
    used to open its own, which cost more than the read)."""
    run_id = store.create_run("prod", "gpu1", {}, 1000.0).id
    store.share()
    try:
        seen = []

        def read():
            seen.append((store.conn, store.get_run(run_id).host))
            store.close()  # what each worker does after its read: the shared one stays open

        threads = [threading.Thread(target=read) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [host for _, host in seen] == ["gpu1"] * 4 and len({id(c) for c, _ in seen}) == 1
        with pytest.raises(RuntimeError, match="for reads"):
            store.transition(run_id, "running", "started", 1001.0)
        assert store.get_run(run_id).state != "running"
        shared = store.conn
    finally:
        store.unshare()
    with pytest.raises(sqlite3.ProgrammingError):
        shared.execute("SELECT 1")  # closed
    store.transition(run_id, "running", "started", 1001.0)  # its own connection again: writes
    assert store.get_run(run_id).state == "running" and store.conn is not shared


def test_two_runs_of_one_playbook_in_one_second_never_share_an_id(store, monkeypatch):
    """An id's suffix is 16 random bits: two launches of one playbook in one second
    met once in a suite run. The draw is made to repeat here (the only way to make a
    1-in-65,536 event certain); the second run gets the next, unused draw."""
    import secrets

    draws, real = ["abcd", "abcd", "abcd", "ef01"], secrets.token_hex
    monkeypatch.setattr(secrets, "token_hex", lambda n: draws.pop(0) if n == 2 and draws else real(n))
    first, second = _run(store), _run(store)
    assert first.id.endswith("-abcd") and second.id.endswith("-ef01")
    assert {r.id for r in store.list_runs()} == {first.id, second.id}
    # An id given that the store has already is refused with the way out, not a database error.
    with pytest.raises(DflashError, match=f"run id {first.id} is taken already"):
        _run(store, run_id=first.id)
