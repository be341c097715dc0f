"""`status`: view models over a real SQLite store (freshness, phase, smoothing,
columns by width), `status --once` / `--json` through the CLI, and the defects
the status console must never show again (each test names the one it guards).
The live screen's keys and snapshots are in tests/integration/test_tui.py and
tests/integration/test_tui_snapshots.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflashctl.core.errors import ConfigError
from dflashctl.status.model import (
    JSON_SCHEMA,
    NA,
    SCHEMA,
    StatusReader,
    load_status,
)
from dflashctl.store import Store
from tests.harness import cli as dflashctl
from tests.harness.scenes import (
    DEMO,
    NOW,
    OLD,
    PROD,
    PROD_TOK_S,
    RUN_A,
    RUN_B,
    RUN_C,
    beat,
    build,
    check_schema,
    fill,
    training,
)


@pytest.fixture
def store(tmp_path):
    s = Store(str(tmp_path / "runs.db"))
    fill(s, time.time())
    return s


# --------------------------------------------------------------------------- view models


def test_status_view(store):
    now = time.time()
    view = load_status(store, now)
    # Needs attention first: the run that failed 50 s ago, the launching run nobody
    # watches, the regressed one (its regression warning stands); then active, then newest.
    assert [r.id for r in view.runs] == [RUN_B, RUN_C, RUN_A]
    assert view.selected == RUN_B and [e.message for e in view.events] == [
        "launch requested", "trainer started", "the trainer ended: crash"]
    demo, smoke, prod = view.runs
    assert (demo.attention, smoke.attention, prod.attention) == ("failed", None, "regressed")

    cells = {k: prod.cell(k) for k in ("state", "phase", "step", "progress", "tok_s", "loss", "accept", "mfu",
                                       "restarts", "eta")}
    assert cells == {"state": "regressed ↻1", "phase": "training", "step": "1,350/120,000", "progress": "1.1%",
                     "tok_s": "12.3K", "loss": "1.800", "accept": "4.70", "mfu": "42%", "restarts": "1",
                     "eta": prod.cell("eta")}
    assert prod.freshness.supervised and prod.freshness.live and prod.freshness.supervisor_pid == 1
    assert prod.last_event.message.startswith("4.3 Ktok/s = 34% of baseline")
    # ETA from the step rate over the window (50 steps / 10 s), not the trainer's own estimate.
    assert prod.eta_s == pytest.approx((120000 - 1350) / 5.0)
    # Nothing sampled yet, nobody watching: missing readings are values, the run says so.
    assert smoke.display_state == "unsupervised" and smoke.cell("step") == NA and smoke.cell("tok_s") == NA
    assert smoke.freshness.fix == f"dflashctl watch {RUN_C}"
    assert [n.fix for n in view.notices] == [f"dflashctl watch {RUN_C}"]
    assert demo.display_state == "failed" and demo.cell("mfu") == NA and demo.cell("eta") == "-"
    assert demo.exit_reason == "crash"

    # GPUs of the host with the active run, one row each, with roles; an unread field is N/A.
    (host,) = view.hosts
    assert host.host == "gpu1" and host.supervised and [g.index for g in host.gpus] == [0, 1]
    g0, g1 = host.gpus
    assert (g0.role, g0.run_id, g0.memory_text(), g0.power_text()) == ("target", RUN_A, "88/140G", "650/700W")
    assert (g1.role, g1.utilization_pct, g1.memory_text()) == ("drafter", None, NA)
    payload = json.loads(json.dumps(view.to_dict()))
    assert payload["schema"] == SCHEMA and payload["runs"][2]["tok_s_history"] == PROD_TOK_S


def test_one_run_by_prefix_and_unknown_runs(store):
    view = load_status(store, time.time(), run="demo-")
    assert [r.id for r in view.runs] == [RUN_B] and view.selected == RUN_B
    assert [e.message for e in view.events] == ["launch requested", "trainer started", "the trainer ended: crash"]
    assert view.hosts == []
    with pytest.raises(ConfigError, match="no run 'prod-2026112-' \\(did you mean 'prod-20261129-101500-ab12'"):
        load_status(store, time.time(), run="prod-2026112-")
    empty = load_status(Store(store.path + ".empty"), time.time())
    assert empty.runs == [] and empty.selected is None and "no runs yet" in empty.summary()


def test_phase_with_its_budget(tmp_path):
    """Defect: the phase was never shown; a run compiling for 30 minutes read
    `running` with N/A everywhere."""
    store = build("compiling", tmp_path)
    (prod,) = [r for r in StatusReader(store).load(NOW).runs if r.id == PROD]
    assert prod.phase.name == "compiling" and prod.phase.budget_s == 45 * 60 and prod.phase.elapsed_s == 720
    assert prod.cell("phase") == "compiling 12m/45m" and prod.phase.text() == "compiling 12 m / 45 m"
    assert prod.cell("eta") == NA  # no step rate while compiling
    # Over budget (its supervisor still ticking): said, and a notice.
    later = NOW + 40 * 60
    beat(store, [PROD], later - 3, {"gpu1": {"last_ok": later - 3, "error": None, "down_since": None}})
    view = StatusReader(store).load(later)
    (prod,) = [r for r in view.runs if r.id == PROD]
    assert prod.phase.over_budget and any("over budget" in n.text for n in view.notices)


def test_a_run_nobody_watches_never_shows_a_live_eta(tmp_path):
    """Defect: with its `watch` killed, a run kept showing `running 100/4,000 ... ETA
    2.4 m` for minutes; `launch --no-watch` left rows `running` with no hint."""
    store = build("unsupervised", tmp_path)
    view = StatusReader(store).load(NOW)
    (prod,) = [r for r in view.runs if r.id == PROD]
    assert (prod.display_state, prod.eta_s, prod.cell("eta")) == ("unsupervised", None, "stale")
    assert prod.freshness.note.startswith("unsupervised since 5 m ago")
    assert view.notices[0].fix == f"dflashctl watch {PROD}"
    # The phase clock stops at the last data: no ticking elapsed time on a dead run.
    assert StatusReader(store).load(NOW + 3600).runs[0].phase.elapsed_s == prod.phase.elapsed_s


def test_a_killed_supervisor_of_this_machine_is_seen_at_once(tmp_path):
    """A supervisor of this machine that was killed cannot say so; its pid is gone, so
    its runs read as unsupervised without waiting for its heartbeat to age."""
    store = build("healthy", tmp_path)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    import socket

    store.heartbeat("sup-1", pid=gone.pid, host=socket.gethostname(), started=NOW - 3600, interval=15.0,
                    now=NOW - 1, runs=[PROD, DEMO], hosts={"gpu1": {"last_ok": NOW - 1}})
    view = StatusReader(store).load(NOW)
    assert {r.id: r.display_state for r in view.runs if r.active} == {PROD: "unsupervised", DEMO: "unsupervised"}
    store.heartbeat("sup-1", pid=os.getpid(), host=socket.gethostname(), started=NOW - 3600, interval=15.0,
                    now=NOW - 1, runs=[PROD, DEMO], hosts={"gpu1": {"last_ok": NOW - 1}})
    assert StatusReader(store).load(NOW).runs[0].display_state == "running"


def test_unreachable_and_stale(tmp_path):
    view = StatusReader(build("unreachable", tmp_path / "u")).load(NOW)
    (prod,) = [r for r in view.runs if r.id == PROD]
    assert prod.display_state == "unreachable" and prod.cell("eta") == "stale"
    assert view.notices[0].text == "host gpu1 unreachable since 2.7 m ago: connection refused"
    assert view.hosts[0].status_text(NOW).startswith("unreachable since 2.7 m")
    view = StatusReader(build("stale", tmp_path / "s")).load(NOW)
    (prod,) = [r for r in view.runs if r.id == PROD]
    assert prod.display_state == "stale" and prod.cell("age") == "2m" and prod.eta_s is None


def test_a_finished_run_keeps_its_cause_as_last_event(tmp_path):
    """Defect: `watch --once` on a failed run wrote "supervisor re-attached", which then
    hid the crash cause as the last event."""
    store = Store(str(tmp_path / "runs.db"))
    store.create_run("demo", "local", {}, NOW - 100, run_id=DEMO)
    store.transition(DEMO, "running", "trainer started", NOW - 90)
    store.transition(DEMO, "failed", "the trainer ended: crash: CUDA out of memory", NOW - 50, exit_reason="crash")
    store.add_event(DEMO, "supervisor", "supervisor re-attached", NOW - 10)
    (run,) = StatusReader(store).load(NOW).runs
    assert run.cell("last_event").endswith("the trainer ended: crash: CUDA out of memory")


def test_detail_reads_the_whole_history_thresholds_and_env(tmp_path):
    store = build("restarting", tmp_path)
    store.add_env_snapshot("gpu1", NOW - 1400, {"torch": "2.13.0", "numpy": "2.1.0"}, run_id=PROD)
    training(store, PROD, NOW - 90000, NOW - 80000, every=5.0, gpu_every=10**9)  # a day ago: 2000 samples
    d = StatusReader(store).detail(PROD, NOW)
    assert len(d.series) <= 240 and sum(p["samples"] for p in d.series) == len(store.samples(PROD))
    assert d.series[0]["time"] < NOW - 80000 < d.series[-1]["time"]
    assert dict(d.thresholds.lines())["compile budget"] == "45 m" and d.thresholds.error is None
    assert (d.env.packages, d.env.torch) == (2, "2.13.0")
    assert [r["signature"] for r in d.restarts] == ["cuda_oom"]
    assert any(e.classification == "crash:cuda_oom" for e in d.events)
    assert d.run.phase.name == "restarting"


# --------------------------------------------------------------------------- the CLI


def _cli(store_path: str, *args: str, columns: int = 220, tz: str = "UTC") -> subprocess.CompletedProcess:
    """`dflashctl status ARGS` in this process (tests/harness/cli.py)."""
    return dflashctl.status(store_path, *args, columns=columns, tz=tz)


def test_cli_once_and_json(store):
    once = _cli(store.path, "--once")
    assert once.returncode == 0, once.stderr
    text = once.stdout
    for needle in (RUN_A, RUN_B, RUN_C, "1,350/120,000", "12.3K", f"events of {RUN_B}", "GPUs", "88/140G",
                   "unsupervised", f"dflashctl watch {RUN_C}"):
        assert needle in text, needle
    # Not a terminal: the table, not the live screen.
    assert [line.split()[:3] for line in _cli(store.path).stdout.splitlines()[2:6]] == \
        [line.split()[:3] for line in text.splitlines()[2:6]]

    payload = json.loads(_cli(store.path, "--json").stdout)
    assert [r["id"] for r in payload["runs"]] == [RUN_B, RUN_C, RUN_A]
    assert [r["attention"] for r in payload["runs"]] == ["failed", None, "regressed"]
    prod = payload["runs"][2]
    assert (prod["step"], prod["total_steps"], prod["restarts"], prod["active"]) == (1350, 120000, 1, True)
    assert prod["freshness"]["supervised"] and prod["phase"]["name"] == "training"
    assert prod["tok_s_history"] == PROD_TOK_S and len(payload["gpus"]) == 2

    one = json.loads(_cli(store.path, "demo", "--json").stdout)
    assert [r["id"] for r in one["runs"]] == [RUN_B] and one["events"][-1]["message"] == "the trainer ended: crash"
    missing = _cli(store.path, "nope", "--json")
    assert missing.returncode == 2 and "no run 'nope'" in missing.stderr and "Traceback" not in missing.stderr


@pytest.mark.parametrize("scene", ["healthy", "compiling", "restarting", "unreachable", "unsupervised", "empty"])
def test_json_follows_its_documented_schema(tmp_path, scene):
    store = build(scene, tmp_path)
    payload = json.loads(json.dumps(StatusReader(store).load(NOW).to_dict()))
    check_schema(JSON_SCHEMA, payload)
    printed = json.loads(_cli(store.path, "--json-schema").stdout)
    assert printed == json.loads(json.dumps(JSON_SCHEMA))


@pytest.mark.parametrize("columns", [80, 100, 160])
def test_once_is_readable_at_any_width(tmp_path, columns):
    """Defect: `status --once` folded every cell into 1-6 characters at 80-160 columns
    (246 lines for 6 runs at 80 columns); the old test pinned COLUMNS=220."""
    store = build("healthy", tmp_path)
    for i in range(3):  # six runs
        store.create_run("other", "gpu2", {"trainer": {"train": {"steps": 10}}}, NOW - 10 - i,
                         run_id=f"other-20270115-075959-000{i}")
    text = _cli(store.path, "--once", columns=columns).stdout
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= columns
    header = next(i for i, line in enumerate(lines) if line.startswith("run ") and "state" in line)
    table = lines[header: lines.index("", header)]
    assert len(table) == 1 + 6  # the header and one line per run: nothing folded
    for run_id in (PROD, DEMO, OLD, "other-20270115-075959-0001"):  # ids whole: they are copied into commands
        assert sum(line.startswith(run_id + " ") for line in table) == 1
    assert len(lines) < 40


def test_second_launch_of_a_playbook_is_refused(tmp_path):
    """Defect: two `launch demo` at once both started, silently."""
    from dflashctl.config import load_inventory, load_playbook
    from dflashctl.launch import launch_run
    from dflashctl.runs.runhost import LaunchError

    store = Store(str(tmp_path / "runs.db"))
    active = store.create_run("demo", "local", {}, time.time(), run_id=DEMO)
    inventory = load_inventory(None)
    with pytest.raises(LaunchError, match=f"playbook demo already has an active run: {DEMO}") as e:
        launch_run(load_playbook("demo", None, inventory), inventory, store)
    assert "--force" in e.value.hint and [r.id for r in store.list_runs()] == [active.id]


def test_stop_records_the_step_the_trainer_reached(tmp_path):
    """Defect: after `stop`, the store said the run stopped at step 100 (what a killed
    supervisor last stored) though the trainer checkpointed at step 800."""
    import yaml

    from dflashctl.config import load_inventory, load_playbook
    from dflashctl.core import contract
    from dflashctl.hosts.tmux import SOCKET_ENV, Tmux
    from dflashctl.runs.runhost import stop
    from tests.harness import environ
    from tests.harness.fake_trainer import CHECKPOINT, start_fake_run
    from tests.harness.local import metrics_lines, wait_for, write_playbook

    socket = f"dflash-stop-{os.getpid()}"
    inventory_path = tmp_path / "inventory.yaml"
    inventory_path.write_text(yaml.safe_dump({"hosts": {"local": {"transport": "local",
                                                                  "workdir": str(tmp_path / "work")}}}))
    with environ(**{SOCKET_ENV: socket}):
        inventory = load_inventory(str(inventory_path))
        store = Store(str(tmp_path / "runs.db"))
        pb = load_playbook(str(write_playbook(tmp_path / "playbooks", "stopme", "local",
                                              {"train": {"steps": 100000, "log_every": 1, "checkpoint_every": 1000}})),
                           inventory=inventory)
        run_id = start_fake_run(store, inventory, "local", pb.trainer.to_dict(), playbook=pb.name,
                                playbook_source=pb.source, socket=socket, step_s=0.02)
        try:
            run_dir = store.get_run(run_id).run_dir
            store.add_samples(run_id, [{"time": time.time(), "step": 1}])  # what a supervisor stored, then died
            wait_for(lambda: len(metrics_lines(run_dir)) >= 30, 30, "30 steps")
            stopped = stop(run_id, store, inventory, timeout=30)
            reached = int(Path(run_dir, CHECKPOINT).read_text())
            assert (stopped.state, stopped.exit_code) == ("stopped", contract.EXIT_STOPPED)
            assert reached >= 30 and store.samples(run_id)[-1].step == reached
            (last,) = store.events(run_id, kind="state")[-1:]
            assert f"at step {reached:,}" in last.message and last.detail["step"] == reached
            view = StatusReader(store).load(time.time())
            assert view.runs[0].step == reached
        finally:
            server = Tmux(inventory.get("local"), inventory, socket).server_pid()
            if server:
                os.kill(server, 15)


def test_an_unsupervised_runs_phase_is_the_same_in_its_row_and_its_detail(tmp_path):
    """Defect: a run nobody supervises read `compiling (probed)` in its row and
    `starting 0 s / 10 m` in its detail: both now say what the console's own probe saw
    (``RunView.phase_text``), or the phase last recorded with a `?`."""
    from dflashctl.status.runs import DirectProbe
    from dflashctl.tui.text import run_text

    store = Store(str(tmp_path / "runs.db"))
    now = time.time()
    run = store.create_run("demo", "local", {}, now - 60, run_dir=str(tmp_path / "run"))
    store.transition(run.id, "running", "trainer started (pid 42, phase starting)", now - 50)
    [view] = [r for r in load_status(store, now).runs if r.id == run.id]
    assert not view.freshness.supervised
    assert view.cell("phase") == "starting?" and "phase starting?" in run_text(view, [], 160, now).plain
    view.probe = DirectProbe(now, session_alive=True, trainer_alive=True, phase="compiling", step=None)
    shown = run_text(view, [], 160, now).plain
    assert view.cell("phase") == "compiling (probed)" and "phase compiling (probed)" in shown
    assert "starting" not in shown.split("phase ", 1)[1].split("·")[0]
