"""The GPU pane as nvitop shows a host: every GPU of each host the runs use (idle
ones dimmed, not only those a run holds), each GPU's compute processes with the
run's trainer named and any other process marked foreign, and the age of each
reading, red past three polls. Over real SQLite stores and real nvidia-smi
captures (tests/fixtures/nvidia-smi)."""

from __future__ import annotations

import pytest

from dflashctl.status.model import load_status
from dflashctl.tui.text import gpu_text
from tests import harness
from tests.harness.scenes import INTERVAL, NOW, PROD, host_store, utc
from tests.harness.tui import app_for, loaded, run, screen_text, until

CAPTURES = harness.FIXTURES / "nvidia-smi"


@pytest.fixture(autouse=True)
def _utc():
    utc()


def test_every_gpu_of_the_host_with_its_processes_idle_ones_dimmed(tmp_path):
    store = host_store(tmp_path, observed_ago=5.0)
    (host,) = load_status(store, NOW).hosts
    assert [g.index for g in host.gpus] == list(range(8))
    assert [g.index for g in host.gpus if g.idle] == [2, 3, 4, 6, 7]
    text = gpu_text(load_status(store, NOW).hosts, 160, NOW)
    lines = text.plain.splitlines()
    assert any("pid    4343" in line and f"trainer of {PROD}" in line for line in lines)
    assert any("pid     777" in line and "foreign" in line for line in lines)
    idle_row = next(line for line in lines if line.startswith("  3 "))
    start = text.plain.index(idle_row)
    assert any("dim" in str(span.style) and span.start <= start < span.end for span in text.spans)

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(200, 60)) as pilot:
            await loaded(pilot, app)
            shown = screen_text(app)
            assert "foreign" in shown and "trainer of" in shown and "idle" in shown

    run(scenario())


def test_a_reading_older_than_three_polls_is_red_with_its_age(tmp_path):
    for ago, red in ((5.0, False), (3 * INTERVAL + 5, True)):
        store = host_store(tmp_path / str(ago), observed_ago=ago)
        text = gpu_text(load_status(store, NOW).hosts, 160, NOW)
        row = next(line for line in text.plain.splitlines() if line.startswith("  0 "))
        age = "5s" if not red else "50s"
        at = text.plain.index(row) + row.index(f" {age} ") + 1
        styles = [str(s.style) for s in text.spans if s.start <= at < s.end]
        assert any("red" in s for s in styles) == red, (age, styles)


def _with_processes(tmp_path):
    """host_store, and a newer poll whose host reading holds the processes the probe
    reads (dflashctl.hosts.parsers.read_processes' rows: GPU processes, the busiest)
    and whose GPU 0 is held at its power cap (the H200 capture's throttle mask)."""
    from tests.harness.scenes import gpus

    store = host_store(tmp_path, observed_ago=5.0)
    mask = (CAPTURES / "h200-load-na-fields.csv").read_text().split(",")[4].strip()
    rows = gpus(8)
    for g in rows:
        g["apps"] = []
    rows[0].update(clocks_sm_mhz=1440.0, extra={"clocks.max.sm": 1980.0, "clocks.mem": 3201.0,
                                                "clocks_throttle_reasons.active": mask})
    rows[0]["apps"] = [{"pid": 4343, "name": "python3", "used_memory_mib": 88000.0, "role": "trainer"}]
    rows[5]["apps"] = [{"pid": 777, "name": "python3", "used_memory_mib": 20480.0, "role": None}]
    processes = [
        {"pid": 4343, "ppid": 4300, "user": "alice", "cpu_pct": 101.0, "rss_kib": 12_900_000, "elapsed_s": 180000.0,
         "cmd": "python -m trainer.train --run-dir /runs/x", "sm_pct": 97.0, "top": True},
        {"pid": 777, "ppid": 1, "user": "bob", "cpu_pct": 3.0, "rss_kib": 800_000, "elapsed_s": 3600.0,
         "cmd": "/usr/bin/python3 notebook.py", "sm_pct": 40.0, "top": False},
        {"pid": 999, "ppid": 1, "user": "carol", "cpu_pct": 350.0, "rss_kib": 2_000_000, "elapsed_s": 60.0,
         "cmd": "tar czf backup.tgz /data", "sm_pct": None, "top": True},
        {"pid": 4300, "ppid": 4200, "user": "alice", "cpu_pct": 0.0, "rss_kib": 4_000, "elapsed_s": 180100.0,
         "cmd": "bash run.sh", "top": False},  # the trainer's parents, as the probe sends them
        {"pid": 4200, "ppid": 1, "user": "alice", "cpu_pct": 0.0, "rss_kib": 5_000, "elapsed_s": 180200.0,
         "cmd": "tmux -L dflash new-session -d -s prod", "top": False},
    ]
    host = {"cpus": 192, "load1": 40.0, "cpu_total": 10_000, "cpu_idle": 5_000, "mem_total_kib": 2_000_000_000,
            "mem_available_kib": 1_000_000_000, "processes": processes}
    store.add_samples(PROD, [{"time": NOW - 4, "step": 5001, "tok_s": 12800.0, "loss": 2.0, "phase": "training"}],
                      gpu=rows, observed=NOW - 4, host_reading=host)
    return store


def test_each_gpu_process_says_who_how_much_since_when_and_what_and_the_busiest_are_named(tmp_path):
    """What an operator opened nvitop and htop for: per GPU process its user, SM and
    CPU share, RSS, elapsed time and command line; why a GPU's clocks are held down;
    which processes eat the host's CPU."""
    store = _with_processes(tmp_path)
    lines = gpu_text(load_status(store, NOW).hosts, 200, NOW).plain.splitlines()
    trainer = next(line for line in lines if "pid    4343" in line)
    assert "alice sm 97% cpu 101% rss 12.3G up 2.1 d" in trainer and "python -m trainer.train" in trainer
    foreign = next(line for line in lines if "pid     777" in line)
    assert "foreign bob sm 40% cpu 3% rss 781M up 1 h" in foreign and "notebook.py" in foreign
    assert next(line for line in lines if line.startswith("  0 ")).endswith("pwr-cap")
    busiest = next(line for line in lines if "busiest:" in line)
    assert busiest.index("350% carol tar czf") < busiest.index("101% alice")  # most CPU first

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(200, 60)) as pilot:
            await loaded(pilot, app)
            shown = screen_text(app)
            assert "alice sm 97% cpu 101%" in shown and "busiest: 350% carol" in shown

    run(scenario())


def test_the_detail_view_shows_how_the_runs_processes_hang_together(tmp_path):
    """supervisor -> trainer (who, how much, since when, what) -> its parents on the
    host: run.sh, the tmux server."""
    from dflashctl.tui.screens import DetailScreen

    store = _with_processes(tmp_path)

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(200, 60)) as pilot:
            await loaded(pilot, app)
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, DetailScreen) and app.screen.loads, "the detail")
            await pilot.pause()
            lines = screen_text(app).splitlines()
            at = next(i for i, line in enumerate(lines) if "processes on gpu1" in line)
            block = "\n".join(lines[at:at + 5])
            assert f"supervisor  pid 4242" in block and "tmux session watch-" in block
            assert "trainer     pid 4343  alice sm 97% cpu 101% rss 12.3G" in block
            assert "↑ pid 4300 alice  bash run.sh" in block and "↑ pid 4200 alice  tmux -L dflash" in block

    run(scenario())

