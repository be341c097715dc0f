"""The store at real volume: rollups written with the samples and readings, chart
series bounded by the points asked (not the run's length), the retention, each
run's size, and the `store` command. A real SQLite file."""

from __future__ import annotations

import json
import statistics

import pytest

from dflashctl.config import Retention
from dflashctl.store import Store
from dflashctl.supervise.supervisor import apply_retention
from dflashctl.supervise.supervisor_core import RunPolicy
from tests.harness import cli as dflashctl
from tests.harness.scenes import gpus

T0 = 1_800_000_000.0
POLL = 4.0


@pytest.fixture
def store(tmp_path):
    s = Store(str(tmp_path / "runs.db"))
    yield s
    s.close()


def _run(store: Store, hours: float, *, host: str = "gpu1") -> tuple[str, list[dict]]:
    """A run polled every 4 s for ``hours``: a metrics line and its host's 8 GPUs each poll."""
    run_id = store.create_run("prod", host, {"gpus": list(range(8))}, T0 - 60).id
    lines = []
    for i in range(int(hours * 3600 / POLL)):
        t = T0 + i * POLL
        line = {"time": t, "step": i, "tok_s": 1000.0 + (i % 10) * 10, "loss": 3.0 - i / 1e5,
                "phase": "compiling" if i < 5 else "training", "extra": {"lr": 1e-4, "grad_norm": 1.0 + i % 3}}
        lines.append(line)
        with store.batch():
            store.add_samples(run_id, [line], observed=t)
            store.add_readings(host, t, gpus(8, util=float(i % 100)), {"load1": 2.0, "mem_total_kib": 100,
                                                                      "mem_available_kib": 40})
    return run_id, lines


def test_rollups_hold_each_buckets_count_min_mean_and_max(store):
    run_id, lines = _run(store, 0.5)
    first = [ln for ln in lines if ln["time"] < (T0 // 60 + 1) * 60]  # the samples of the first minute bucket
    (row,) = store.conn.execute("SELECT n, min, mean, max FROM rollups WHERE owner = ? AND metric = 'tok_s' AND "
                                "width = 60 ORDER BY bucket LIMIT 1", [run_id]).fetchall()
    values = [ln["tok_s"] for ln in first]
    assert row[0] == len(values) and (row[1], row[3]) == (min(values), max(values))
    assert row[2] == pytest.approx(statistics.fmean(values))
    names = {r[0] for r in store.conn.execute("SELECT DISTINCT metric FROM rollups WHERE owner = ?", [run_id])}
    assert {"step", "tok_s", "train_tok_s", "loss", "lr", "grad_norm"} <= names
    n_train = store.conn.execute("SELECT sum(n) FROM rollups WHERE owner = ? AND metric = 'train_tok_s' AND "
                                 "width = 900", [run_id]).fetchone()[0]
    assert n_train == len(lines) - 5  # the compiling lines are not training throughput
    gpu = {r[0] for r in store.conn.execute("SELECT DISTINCT metric FROM rollups WHERE owner = 'host:gpu1'")}
    assert {"gpu0.util", "gpu7.mem", "gpu3.temp", "gpu5.power", "load1", "mem_used_kib"} <= gpu


def test_a_chart_of_a_long_run_reads_rollups_bounded_by_its_points(store):
    from dflashctl.status.model import StatusReader

    run_id, lines = _run(store, 8)  # 7,200 samples
    pol = RunPolicy.defaults("prod")
    pol.retention = Retention(full=3600.0)
    apply_retention(store, [(store.get_run(run_id), pol)])
    kept = store.samples(run_id)
    assert kept and kept[0].time >= lines[-1]["time"] - 3600
    assert store.history_from(run_id) == pytest.approx(lines[-1]["time"] - 3600)
    series = store.sample_series(run_id, 240)  # 2-minute buckets: from the one-minute rollups
    # The grid's widths are at most 2x apart (``SERIES_WIDTHS``): at least half the points.
    assert 120 <= len(series) <= 240 and {p["bucket"] for p in series} <= set(range(240))
    assert series[0]["start"] <= T0 + 60 and series[-1]["step"] == lines[-1]["step"]
    assert all(p["tok_s_min"] <= p["tok_s"] <= p["tok_s_max"] for p in series)
    # A zoom on the newest hour reads the samples still kept, finer than a minute.
    hour = store.sample_series(run_id, 240, since=lines[-1]["time"] - 3600)
    assert 120 <= len(hour) <= 240 and hour[-1]["samples"] >= 1
    grid = store.series_grid(run_id, 240, since=lines[-1]["time"] - 3600)
    assert grid.raw and grid.width < 60 and grid.count == max(p["bucket"] for p in hour) + 1
    # A live chart of it: a new sample reads the newest bucket again, and gives what reading it all gives.
    reader, newer = StatusReader(store), lines[-1]["time"] + 1.0
    assert reader.series(run_id) == series
    store.add_samples(run_id, [{**lines[-1], "time": newer, "step": lines[-1]["step"] + 1, "tok_s": 9e3}], observed=newer)
    grown = reader.series(run_id)
    assert grown == store.sample_series(run_id, 240) and grown[-1]["tok_s_max"] == 9e3 and grown[:-1] == series[:-1]
    # Each read goes by an index: the rollups' key, the samples' (run, time).
    plan = str(store.conn.execute("EXPLAIN QUERY PLAN SELECT * FROM rollups WHERE owner = ? AND width = ? AND "
                                  "bucket > ? AND bucket <= ? AND metric IN ('tok_s')", [run_id, 900, 0, 1]).fetchall())
    assert "PRIMARY KEY" in plan or "sqlite_autoindex" in plan, plan


def test_the_retention_keeps_windows_and_the_baseline_survives_it(store):
    run_id, lines = _run(store, 8)
    median_before = store.healthy_tok_s_history("prod", limit=1)  # not done yet: no history
    store.transition(run_id, "running", "started", T0)
    store.transition(run_id, "done", "ended", lines[-1]["time"] + 1, exit_code=0)
    raw = store.healthy_tok_s_history("prod")
    keep = Retention(full=3600.0, readings=600.0, fine=3 * 3600.0)
    pol = RunPolicy.defaults("prod")
    pol.retention = keep
    deleted = apply_retention(store, [(store.get_run(run_id), pol)])
    assert deleted["samples"] > 0 and deleted["host_readings"] > 0 and deleted["rollups"] > 0
    newest = lines[-1]["time"]
    assert min(s.time for s in store.samples(run_id)) >= newest - 3600
    assert store.readings("gpu1", 10_000)[0]["time"] >= newest - 600
    fine = store.conn.execute("SELECT min(bucket) FROM rollups WHERE owner = ? AND width = 60", [run_id]).fetchone()[0]
    coarse = store.conn.execute("SELECT min(bucket) FROM rollups WHERE owner = ? AND width = 900", [run_id]).fetchone()[0]
    assert fine >= newest - 3 * 3600 - 60 and coarse <= T0
    assert median_before == [] and store.healthy_tok_s_history("prod") == pytest.approx(raw, rel=0.02)
    assert apply_retention(store, [(store.get_run(run_id), pol)]) == {"samples": 0, "host_readings": 0,
                                                                      "rollups": 0}  # applied twice: nothing more


def test_a_host_shared_by_runs_keeps_the_longest_readings(store):
    a, _ = _run(store, 2)
    b = store.create_run("demo", "gpu1", {}, T0).id
    short, long_ = RunPolicy.defaults("prod"), RunPolicy.defaults("demo")
    short.retention, long_.retention = Retention(readings=600.0), Retention(readings=5400.0)
    apply_retention(store, [(store.get_run(a), short), (store.get_run(b), long_)])
    oldest = store.readings("gpu1", 100_000)[0]["time"]
    assert oldest == pytest.approx(T0 + 2 * 3600 - POLL - 5400, abs=POLL)


def test_each_runs_share_of_the_store_and_the_store_command(store, tmp_path):
    run_id, _ = _run(store, 1)
    other = store.create_run("demo", "local", {}, T0).id
    sizes = store.run_bytes([run_id, other])
    assert sizes[run_id] > 100_000 and sizes[other] < sizes[run_id] / 10
    env = {"DFLASHCTL_STORE": store.path}
    info = dflashctl.invoke("store", "info", "--json", env=env)
    assert info.returncode == 0, info.stderr
    doc = json.loads(info.stdout)
    assert doc["file_bytes"] > 0 and doc["tables"]["host_readings"] > 0 and doc["runs"][0]["id"] == run_id
    pruned = dflashctl.invoke("store", "prune", "--json", env=env)
    assert pruned.returncode == 0, pruned.stderr
    assert json.loads(pruned.stdout)["runs"] == 2
    vacuum = dflashctl.invoke("store", "vacuum", "--json", env=env)
    assert vacuum.returncode == 0 and json.loads(vacuum.stdout)["after_bytes"] > 0, vacuum.stderr
    runs = json.loads(dflashctl.invoke("runs", "--json", env=env).stdout)
    assert {r["id"]: r["summary"]["store_bytes"] > 0 for r in runs}[run_id]
    for sub in ("info", "prune", "vacuum"):
        assert "--json" in dflashctl.invoke("store", sub, "--help").stdout


def test_a_refresh_of_a_run_whose_data_did_not_move_reads_its_series_once(store, monkeypatch):
    from dflashctl.status.model import SERIES_POINTS, StatusReader

    run_id, lines = _run(store, 1)
    reader = StatusReader(store)
    reads = []
    real = store.sample_buckets
    # A spy on the real store's method (it still reads): how often a refresh goes to the series, and from where.
    monkeypatch.setattr(store, "sample_buckets", lambda *a, **kw: reads.append(a) or real(*a, **kw))
    assert reader.series(run_id) == reader.series(run_id) and len(reads) == 1 and reads[0][2:] == ()
    store.add_samples(run_id, [{"time": lines[-1]["time"] + 1.0, "step": 10**6}])  # the grid stays: 240 buckets
    grown = reader.series(run_id)
    assert grown[-1]["step"] == 10**6 and len(reads) == 2
    assert reads[1][2] == grown[-1]["bucket"] > 0  # only the newest bucket read again
    assert grown == store.sample_series(run_id, SERIES_POINTS)  # what reading it all gives
    newest = reader.readings("gpu1", 2, "gpu")
    store.add_readings("gpu1", lines[-1]["time"] + POLL, gpus(8, util=1.0))
    assert reader.readings("gpu1", 2, "gpu")[-1]["time"] > newest[-1]["time"]
