"""`status` of a run on several hosts: each host's process as the supervisor last
saw it (``Store.update_run_hosts``), in the view model, `status --json` (and its
schema), the `--once` table (a line per host under the run's line) and the live
screen's run detail; a host not heard from for longer than the run's freshness
window is shown as stale with its age, an ended process with its exit code in
words. Real SQLite store files; the command runs in this process (tests/harness/cli.py)."""

from __future__ import annotations

import json
import re
import time

from dflashctl.status.model import JSON_SCHEMA, StatusReader
from dflashctl.store import Store
from tests.harness.cli import status as _cli
from tests.harness.scenes import NOW, check_schema, utc
from tests.harness.tui import app_for, detail_loaded, loaded, run, screen_text

MULTI = "multi-20270115-074000-mh01"
SINGLE = "demo-20270115-075000-sh01"
INTERVAL = 5.0  # the supervisor's poll interval: rows older than 3 of them are stale


def fill(store: Store, now: float, *, rank1_seen: float, rank1: dict, rank1_now: dict | None) -> None:
    """A run on two hosts (rank 0 on gpu1, rank 1 on target), training under a
    ticking supervisor: rank 0 answered 2 s ago; rank 1 answered at ``rank1_seen``
    with ``rank1`` (and 2 s ago ``rank1_now``, when given). Beside it, a run on one
    host."""
    hosts = [{"rank": 0, "host": "gpu1", "run_dir": "/w/r0", "tmux_session": MULTI},
             {"rank": 1, "host": "target", "run_dir": "/w/r1", "tmux_session": MULTI}]
    store.create_run("multi", "gpu1", {"trainer": {"train": {"steps": 1000}}, "gpus": [0]}, now - 600, run_id=MULTI,
                     hosts=hosts)
    store.transition(MULTI, "running", "trainer started (pid 9, phase training)", now - 590)
    store.add_samples(MULTI, [{"time": now - 2, "step": 120, "tok_s": 900.0, "phase": "training"}], observed=now - 2)
    store.update_run_hosts(MULTI, [{"rank": 1, **rank1}], rank1_seen)
    store.update_run_hosts(MULTI, [{"rank": 0, "phase": "training", "step": 120, "pid": 9, "alive": True}]
                           + ([{"rank": 1, **rank1_now}] if rank1_now else []), now - 2)
    store.create_run("demo", "local", {}, now - 60, run_id=SINGLE)
    store.transition(SINGLE, "running", "trainer started", now - 55)
    store.heartbeat("sup", pid=1, host="ops", started=now - 700, interval=INTERVAL, now=now - 1, runs=[MULTI, SINGLE],
                    hosts={h: {"last_ok": now - 2, "error": None, "down_since": None} for h in ("gpu1", "local")})


TRAINING = {"phase": "training", "step": 118, "pid": 7, "alive": True}
SILENT = {"answered": False, "error": "connection refused"}  # what the supervisor writes for a host that did not answer


def store_at(tmp_path, now: float, *, rank1_age: float = 2.0, rank1: dict = TRAINING,
             rank1_now: dict | None = None) -> Store:
    store = Store(str(tmp_path / "runs.db"))
    fill(store, now, rank1_seen=now - rank1_age, rank1=rank1, rank1_now=rank1_now)
    return store


def hosts_of(store: Store, now: float) -> dict:
    (multi,) = [r for r in StatusReader(store).load(now).runs if r.id == MULTI]
    return {h.rank: h for h in multi.hosts}


def json_hosts(store: Store) -> list[dict]:
    """The multi-host run's ``hosts`` in ``status --json``."""
    return json.loads(_cli(store.path, MULTI, "--json").stdout)["runs"][0]["hosts"]


def run_lines(text: str, run_id: str) -> list[str]:
    """The ``--once`` lines from ``run_id``'s line to the next run's (or the blank line)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(run_id + " "))
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith("  rank "))
    return lines[start:end]


# --------------------------------------------------------------------------- the CLI


def test_json_has_every_host_of_a_multi_host_run_and_none_of_a_single_host_one(tmp_path):
    store = store_at(tmp_path, time.time())
    done = _cli(store.path, "--json")
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    check_schema(JSON_SCHEMA, payload)
    runs = {r["id"]: r for r in payload["runs"]}
    assert runs[SINGLE]["hosts"] == []
    rank0, rank1 = runs[MULTI]["hosts"]
    assert {k: rank0[k] for k in ("rank", "host", "phase", "step", "alive", "exit_code", "error", "stale")} == \
        {"rank": 0, "host": "gpu1", "phase": "training", "step": 120, "alive": True, "exit_code": None, "error": None,
         "stale": False}
    assert (rank1["rank"], rank1["host"], rank1["step"]) == (1, "target", 118)
    assert 0 <= rank0["age_s"] < 3 * INTERVAL and rank0["seen"] is not None
    # The run's own keys stay as they were.
    required = JSON_SCHEMA["properties"]["runs"]["items"]["required"]
    assert set(required) - {"hosts"} <= set(runs[SINGLE]) and runs[MULTI]["host"] == "gpu1"


def test_once_lists_each_host_under_its_run(tmp_path):
    store = store_at(tmp_path, time.time())
    done = _cli(store.path, "--once", columns=120)
    assert done.returncode == 0, done.stderr
    head, rank0, rank1 = run_lines(done.stdout, MULTI)
    assert re.fullmatch(r"  rank 0  gpu1    training  step 120  seen \d+s ago", rank0), rank0
    assert re.fullmatch(r"  rank 1  target  training  step 118  seen \d+s ago", rank1), rank1
    assert run_lines(done.stdout, SINGLE) == [next(line for line in done.stdout.splitlines()
                                                   if line.startswith(SINGLE + " "))]
    narrow = _cli(store.path, "--once", columns=80).stdout
    assert max(len(line) for line in narrow.splitlines()) <= 80
    assert len(run_lines(narrow, MULTI)) == 3


def test_text_from_a_host_is_shown_not_obeyed(tmp_path):
    """Host names and probe errors come from outside: an escape sequence in one is
    shown as text, never handed to the operator's terminal."""
    now = time.time()
    store = store_at(tmp_path, now, rank1={**TRAINING, "error": "cannot read status.json: \x1b[2J\nwiped"})
    text = _cli(store.path, "--once", columns=160).stdout
    assert "\x1b" not in text
    (rank1,) = [line for line in run_lines(text, MULTI) if line.startswith("  rank 1")]
    assert rank1.endswith("cannot read status.json: \\x1b[2J wiped")


def test_a_host_not_seen_for_long_is_stale_with_its_age(tmp_path):
    now = time.time()
    store = store_at(tmp_path, now, rank1_age=300.0, rank1_now=SILENT)
    text = _cli(store.path, "--once", columns=160).stdout
    _, rank0, rank1 = run_lines(text, MULTI)
    assert re.fullmatch(r"  rank 1  target  training  step 118  stale: seen 5(\.1)?m ago  connection refused",
                        rank1), rank1
    assert "stale" not in rank0
    rank1 = json_hosts(store)[1]
    assert rank1["stale"] is True and 300 <= rank1["age_s"] < 320


def test_stale_means_older_than_the_runs_freshness_window(tmp_path):
    """The run's own rule (freshness: three poll intervals of its supervisor), not a
    second one."""
    store = store_at(tmp_path, NOW, rank1_age=3 * INTERVAL - 1)
    (multi,) = [r for r in StatusReader(store).load(NOW).runs if r.id == MULTI]
    assert multi.freshness.stale_after_s == 3 * INTERVAL
    assert [h.stale for h in multi.hosts] == [False, False]
    later = NOW + 2  # rank 1's row is now 16 s old, rank 0's 4 s
    assert [h.stale for h in hosts_of(store, later).values()] == [False, True]
    assert hosts_of(store, later)[1].seen_text() == "stale: seen 16s ago"


def test_an_ended_rank_shows_its_exit_code_in_words(tmp_path):
    now = time.time()
    store = store_at(tmp_path, now, rank1={"phase": "training", "step": 118, "alive": False, "exit_code": 1})
    text = _cli(store.path, "--once", columns=160).stdout
    (rank1,) = [line for line in run_lines(text, MULTI) if line.startswith("  rank 1")]
    assert rank1.startswith("  rank 1  target  ended: crash  step 118  seen ")
    rank1 = json_hosts(store)[1]
    assert (rank1["exit_code"], rank1["exit_reason"], rank1["alive"]) == (1, "crash", False)
    # Killed by a signal; gone with no exit code written.
    store = store_at(tmp_path / "killed", NOW, rank1={"alive": False, "exit_code": -9})
    assert hosts_of(store, NOW)[1].state_text() == "ended: killed by signal 9"
    store = store_at(tmp_path / "gone", NOW, rank1={"phase": "training", "alive": False})
    assert hosts_of(store, NOW)[1].state_text() == "not alive"


def test_a_host_never_heard_from_says_so(tmp_path):
    store = Store(str(tmp_path / "runs.db"))
    store.create_run("multi", "gpu1", {}, NOW - 10, run_id=MULTI,
                     hosts=[{"rank": 0, "host": "gpu1", "run_dir": "/w", "tmux_session": MULTI},
                            {"rank": 1, "host": "target", "run_dir": "/w", "tmux_session": MULTI}])
    (multi,) = StatusReader(store).load(NOW).runs
    assert [(h.age_s, h.stale, h.seen_text()) for h in multi.hosts] == [(None, False, "no answer yet")] * 2


# --------------------------------------------------------------------------- the live screen


def test_the_run_detail_lists_the_hosts(tmp_path):
    utc()
    store = store_at(tmp_path, NOW, rank1_age=300.0, rank1={"phase": "training", "step": 118, "alive": False,
                                                            "exit_code": 1}, rank1_now=SILENT)

    async def scenario():
        app = app_for(store, tmp_path, run=MULTI)
        async with app.run_test(size=(120, 50)) as pilot:
            await loaded(pilot, app)
            await pilot.press("enter")
            await detail_loaded(pilot, app)
            text = screen_text(app)
            assert "hosts (2)" in text
            assert "rank 0  gpu1    training  step 120  seen 2s ago" in text
            assert "rank 1  target  ended: crash  step 118  stale: seen 5m ago  connection refused" in text

    run(scenario())


