"""Host readings on their own clock: every poll stores the host's GPU and CPU/memory
readings whatever the trainer wrote. A fake-trainer run (a CPU run) on the local
host in real tmux that hangs after a few steps and writes nothing for 60 s; the
stand-in nvidia-smi (tests/harness/fake_nvidia_smi.py, the H200 captures) on PATH;
a real supervisor on a thread; a real SQLite store read as the console reads it."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import yaml

from dflashctl.config import load_inventory
from dflashctl.status.model import load_status
from tests import harness
from tests.harness import environ
from tests.harness.local import REPO, SOCKET, Background, LocalEnv, kill_tmux_servers, metrics_lines, wait_for

SILENCE_S = 60.0
POLL_S = 2.0


def eight_gpus(directory: Path) -> Path:
    """The H200 load captures as an 8-GPU host answers: the captured GPU row once per
    index (its own uuid), the captured process on GPU 5 (nobody's run: foreign)."""
    directory.mkdir()
    (gpu,) = (harness.FIXTURES / "nvidia-smi" / "h200-load-query.csv").read_text().splitlines()
    (app,) = (harness.FIXTURES / "nvidia-smi" / "h200-load-apps.csv").read_text().splitlines()
    fields = gpu.split(", ")
    uuids = [fields[1][:-1] + str(i) for i in range(8)]
    (directory / "h200-load-query.csv").write_text(
        "".join(", ".join([str(i), uuids[i], *fields[2:]]) + "\n" for i in range(8)))
    (directory / "h200-load-apps.csv").write_text(", ".join([*app.split(", ")[:3], uuids[5]]) + "\n")
    return directory


@pytest.fixture
def gpu_host(tmp_path):
    """The local host with 8 GPUs in the inventory and a nvidia-smi answering on PATH."""
    env = LocalEnv(tmp_path)
    env.inventory_path.write_text(yaml.safe_dump(
        {"hosts": {"local": {"transport": "local", "workdir": env.workdir, "gpus": 8}}}))
    env.inventory = load_inventory(str(env.inventory_path))
    env.host = env.inventory.get("local")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    smi = bindir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nexec {sys.executable} {REPO / 'tests' / 'harness' / 'fake_nvidia_smi.py'} \"$@\"\n")
    smi.chmod(0o755)
    with environ(PATH=f"{bindir}:{os.environ['PATH']}", DFLASHCTL_FAKE_SMI="load",
                 FAKE_SMI_CAPTURES=str(eight_gpus(tmp_path / "captures"))):
        yield env
    kill_tmux_servers([(env.host, env.inventory, SOCKET)])


def test_the_gpu_pane_stays_fresh_while_the_trainer_writes_nothing_for_60_s(gpu_host):
    """Defect: GPU readings were stored only with a new metrics line: during a 44 s
    stall all 8 GPU rows read 46 s old (red) while nvidia-smi answered every 5 s, and
    a host whose only runs were CPU runs showed no GPU at all."""
    env = gpu_host
    pb = env.playbook("silent", {"fault": {"kind": "hang", "after_steps": 6}}, poll_interval=POLL_S,
                      expect={"stall_window": 10 * SILENCE_S})
    run_id = env.start(pb)
    assert env.store.get_run(run_id).gpus == []  # a CPU run: the GPUs are the host's, not the run's
    watcher = env.supervisor(interval=POLL_S)
    watcher.attach(run_id)
    sup = Background(watcher)
    try:
        log = Path(env.run_dir(run_id), "trainer.log")
        wait_for(lambda: "fault: hanging" in (log.read_text() if log.exists() else ""), 60, "the trainer's silence")
        lines = len(metrics_lines(env.run_dir(run_id)))
        wait_for(lambda: len(env.store.samples(run_id)) == lines, 30, "its last metrics stored")
        samples = lines
        silent_since = time.time()
        ages: list[float] = []
        while time.time() - silent_since < SILENCE_S:
            now = time.time()
            (host,) = [h for h in load_status(env.store, now).hosts if h.host == "local"]
            assert [g.index for g in host.gpus] == list(range(8)), host.gpus
            stale = [g.index for g in host.gpus if g.stale(now)]
            assert not stale, f"GPU readings {stale} stale after {now - silent_since:.0f} s of silence"
            assert host.load is not None and not host.load.stale(now)
            ages.append(max(g.age_s(now) for g in host.gpus))
            time.sleep(POLL_S)
        assert len(metrics_lines(env.run_dir(run_id))) == lines  # the trainer wrote nothing all along
        assert len(env.store.samples(run_id)) == samples and env.store.get_run(run_id).state == "running"
        assert max(ages) <= 3 * POLL_S and len(ages) >= SILENCE_S / POLL_S / 2
        # The captured process belongs to no run here: foreign, on its GPU.
        assert [(g.index, [a.pid for a in g.apps if a.foreign]) for g in host.gpus if g.apps] == [(5, [416])]
        polls = env.store.readings("local", 1000)
        assert len([r for r in polls if r["time"] >= silent_since]) >= SILENCE_S / POLL_S / 2
    finally:
        sup.close()
        env.tmux.kill(run_id)


def test_a_host_is_read_on_every_poll_while_its_only_run_restarts(gpu_host):
    """Defect: a run whose restart was in flight was not probed at all, so neither
    was its host: the pane went blind exactly while the run restarted."""
    import threading

    env = gpu_host
    pb = env.playbook("crashy", {"fault": {"kind": "exit", "after_steps": 4, "message": "boom"}}, poll_interval=0.5)
    run_id = env.start(pb)
    release = threading.Event()
    sup = env.supervisor(interval=0.5, restart_fn=lambda *args, **kw: release.wait(60))  # a restart that takes long
    sup.attach(run_id)
    try:
        wait_for(lambda: sup.runs[run_id].job is not None, 60, "the restart in flight", tick=sup.tick)
        before = len(env.store.readings("local", 1000))
        for _ in range(3):
            sup.tick()
            assert sup.runs[run_id].job is not None  # still restarting: the run itself is not looked at
        polls = env.store.readings("local", 1000)[before:]
        assert len(polls) == 3 and all(len(p["gpu"]) == 8 and p["host_reading"]["cpus"] for p in polls)
    finally:
        release.set()
        sup.close()
        env.tmux.kill(run_id)
