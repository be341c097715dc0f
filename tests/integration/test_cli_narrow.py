"""The command line in a narrow terminal and in scripts: `runs`, `events`,
`watch --once` and `logs` at COLUMNS=80 and piped (stdout not a terminal: the
commands run in this process with their output captured, tests/harness/cli.py),
over a real store and a real fake-trainer run in tmux. No record is folded over
several lines, tables fit the width, and every field of the --json forms is
there. (That every command's exit codes are documented: tests/unit/test_cli_narrow.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from dflashctl.core import contract
from dflashctl.hosts.tmux import SOCKET_ENV
from tests.harness import cli as dflashctl
from tests.harness.local import REPO, SOCKET, LocalEnv, kill_tmux_servers, metrics_lines, wait_for
from tests.harness.scenes import RUN_A, RUN_B, RUN_C, fill

LONG_REASON = ("crash: CUDA out of memory while allocating 2.00 GiB on GPU 0 (139.8 GiB total, 137.9 GiB in use); "
               "lower data.batch_size or the largest bucket, then launch again")
MULTILINE = "Traceback (most recent call last):\n  File \"trainer/run.py\", line 9\nRuntimeError: shard 7 is corrupt"


def _cli(*args: str, columns: int | None, **env: str) -> subprocess.CompletedProcess:
    """The command in this process, its output captured (not a terminal: as piped)."""
    return dflashctl.invoke(*args, env=env, columns=columns, cwd=REPO)


@pytest.fixture
def store(tmp_path):
    from dflashctl.store import Store

    s = Store(str(tmp_path / "runs.db"))
    now = time.time()
    fill(s, now)
    s.update_run(RUN_B, exit_reason=LONG_REASON)
    s.add_event(RUN_A, "crash", MULTILINE, now - 1, severity="error")
    s.add_eval(RUN_A, now, {"step": 1350, "tau": 3.41, "speed": {"speedup": 2.05}})
    return s


@pytest.mark.parametrize("columns", [80, None])
def test_runs_fits_the_width_and_says_what_each_run_achieved(store, columns):
    """Defect: at 80 columns `runs` shrank its columns to `sta…` and folded a failed
    run's exit reason over 20 lines; it showed no step, loss, acceptance or restarts."""
    done = _cli("runs", columns=columns, DFLASHCTL_STORE=store.path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    width = columns or 200
    assert max(len(line) for line in lines) <= width
    header = lines[0].replace("τ est", "τ_est").split()
    assert header[:2] == ["run", "state"] and {"step", "loss", "τ_est", "τ", "rst"} <= set(header)
    rows = [line for line in lines[1:] if not line.startswith(("  ", "τ "))]  # the legend and τ notes close it
    assert [row.split()[0] for row in rows] == [RUN_C, RUN_B, RUN_A]  # one line per run, ids whole
    prod = next(row for row in rows if row.startswith(RUN_A))
    cells = dict(zip(header, prod.split()))  # the cells up to `created` hold no space
    assert [cells[k] for k in ("state", "step", "loss", "τ_est", "τ", "rst")] == \
        ["running", "1,350/120,000", "1.800", "4.70", "3.41", "1"]
    # The failed run's whole reason is on one detail line below it (cut to the width at 80).
    [detail] = [line for line in lines if line.startswith("  ")]
    assert lines[lines.index(detail) - 1].startswith(RUN_B) and detail.startswith("  exit: crash: CUDA out of memory")
    if columns is None:  # piped: 200 columns, room for the duration, host, speed-up and the reason's start
        assert {"took", "host", "created", "speedup", "exit"} <= set(header) and "2.05x" in prod

    payload = json.loads(_cli("runs", "--json", columns=columns, DFLASHCTL_STORE=store.path).stdout)
    by_id = {r["id"]: r for r in payload}
    summary = by_id[RUN_A]["summary"]
    assert set(summary) == {"step", "total_steps", "loss", "accept_len", "tau_est", "tau", "restarts", "duration_s",
                            "store_bytes"}
    assert summary["store_bytes"] > 0
    assert (summary["step"], summary["total_steps"], summary["restarts"], summary["tau"]) == (1350, 120000, 1, 3.41)
    assert summary["loss"] == pytest.approx(1.8) and summary["accept_len"] == pytest.approx(3.7)
    assert 400 < summary["duration_s"] < 600
    assert by_id[RUN_B]["exit_reason"] == LONG_REASON and by_id[RUN_B]["summary"]["step"] == 30
    assert by_id[RUN_C]["summary"]["step"] is None and by_id[RUN_C]["eval"] is None
    for field in ("id", "playbook", "host", "state", "created", "started", "ended", "exit_code", "config", "hosts"):
        assert field in by_id[RUN_A], field


@pytest.mark.parametrize("columns", [80, None])
def test_events_are_one_line_each(store, columns):
    """Defect: 7 events became 8 lines in a file and 3 lines per event at 80 columns,
    so `grep crash` lost the tail of a traceback."""
    done = _cli("events", RUN_A, columns=columns, DFLASHCTL_STORE=store.path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    events = store.events(RUN_A)
    assert len(lines) == len(events) == 4
    crash = next(line for line in lines if " crash " in line)
    if columns:
        assert max(len(line) for line in lines) <= columns and crash.endswith("…")
    else:  # piped: whole, the traceback's lines joined
        assert crash.endswith('Traceback (most recent call last): ⏎ File "trainer/run.py", line 9 ⏎ '
                              "RuntimeError: shard 7 is corrupt")
    payload = json.loads(_cli("events", RUN_A, "--json", columns=columns, DFLASHCTL_STORE=store.path).stdout)
    assert [e["id"] for e in payload] == [e.id for e in events]
    assert all(set(e) == {"id", "run_id", "time", "kind", "severity", "message", "detail"} for e in payload)
    assert payload[-1]["message"] == MULTILINE


@pytest.fixture(scope="module")
def local_env(tmp_path_factory):
    env = LocalEnv(tmp_path_factory.mktemp("narrow"))
    yield env
    kill_tmux_servers([(env.host, env.inventory, SOCKET)])


@pytest.mark.parametrize("columns", [80, None])
def test_watch_once_and_logs_of_a_crashed_run(local_env, columns):
    """A run whose trainer died with a long error: `watch --once` is one line for the
    run (and one per finding), `logs` the log's lines as written; --json lines whole."""
    pb = local_env.playbook(f"narrow{columns or 'piped'}", {
        "train": {"steps": 100, "log_every": 1, "checkpoint_every": 1000},
        "fault": {"kind": "exit", "after_steps": 2, "exit_code": 1,
                  "message": "RuntimeError: " + "a very long trainer error message " * 6}})
    run_id = local_env.start(pb)
    env = {"DFLASHCTL_STORE": local_env.store_path, SOCKET_ENV: SOCKET}
    try:
        wait_for(lambda: len(metrics_lines(local_env.run_dir(run_id))) >= 2, 30, "metrics")
        wait_for(lambda: os.path.exists(os.path.join(local_env.run_dir(run_id), contract.EXIT_CODE_FILE)), 30,
                 "the trainer's exit")
        args = ("-i", str(local_env.inventory_path), "-p", str(local_env.playbooks), "watch", run_id, "--once")
        seen = _cli(*args, columns=columns, **env)
        lines = seen.stdout.splitlines()
        assert lines and lines[0].startswith(f"{run_id}  "), seen.stdout + seen.stderr
        assert all(line.startswith("  ") for line in lines[1:])  # each finding on its own line, nothing folded
        if columns:
            assert max(len(line) for line in lines) <= columns and lines[0].endswith("…")
        else:  # piped: whole
            assert "newest sample" in lines[0] and not lines[0].endswith("…")
        as_json = _cli(*args, "--json", columns=columns, **env)
        records = [json.loads(line) for line in as_json.stdout.splitlines()]
        [observation] = [r for r in records if r["kind"] == "observation"]
        for field in ("run_id", "state", "phase", "step", "total_steps", "tok_s", "sample_time", "findings"):
            assert field in observation, field
        assert observation["run_id"] == run_id and observation["step"] == 2

        shown = _cli("-i", str(local_env.inventory_path), "logs", run_id, "-n", "200", columns=columns, **env)
        assert shown.returncode == 0, shown.stderr
        written = open(os.path.join(local_env.run_dir(run_id), contract.LOG_FILE)).read().splitlines()
        assert shown.stdout.splitlines() == written[-200:]  # as written: never folded, never cut
    finally:
        local_env.tmux.kill(run_id)


def test_the_supervisor_stream_is_in_time_order_and_loses_no_event(local_env):
    """Defect: `watch` / `launch --foreground` printed a tick's metrics lines before
    the events written meanwhile (out of time order), and of two events stored in
    one interval with the later id holding the earlier time, only one was printed."""
    from dflashctl.supervise.console import format_line

    pb = local_env.playbook("ordered")
    run_id = local_env.start(pb)
    store = local_env.store
    emitted: list[tuple[str, object]] = []
    sup = local_env.supervisor(metrics=True, emit=lambda kind, payload: emitted.append((kind, payload)))
    sup.attach(run_id)
    try:
        wait_for(lambda: any(k == "metrics" for k, _ in emitted), 30, "a metrics line", tick=sup.tick)
        now = time.time()
        first = store.add_event(run_id, "note", "written first, stamped later", now + 0.01)
        second = store.add_event(run_id, "note", "written second, stamped earlier", now)
        seen = len(emitted)
        wait_for(lambda: metrics_lines(local_env.run_dir(run_id))[-1].time > now + 0.2, 30, "newer metrics lines")
        sup.tick()
        tick = emitted[seen:]
        times = [p.time if k == "event" else p[1].time for k, p in tick]
        assert times == sorted(times), [format_line(k, p) for k, p in tick]
        notes = [p.id for k, p in tick if k == "event" and p.kind == "note"]
        assert notes == [second, first]  # both, the earlier first
        assert any(k == "metrics" and p[1].time > now + 0.01 for k, p in tick)  # after both notes
        sup.tick()
        assert not [p for k, p in emitted[seen + len(tick):] if k == "event" and p.kind == "note"]  # each once
    finally:
        local_env.tmux.kill(run_id)
        sup.close()


