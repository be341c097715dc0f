"""A disk that fills during a run, through the jump host and the `pct exec` wrapper:
the run directory sits on a small tmpfs (tests/harness/disk.py), filled to its last
byte while the fake trainer trains. Its next write fails; so do trainer.log's,
status.json's and run.sh's exit_code, so the output says nothing. The probe's free
disk still names it: ``disk_full``, stopped with the path, the free space and the
fix, never restarted."""

from __future__ import annotations

import os
import subprocess

import pytest
import yaml

from dflashctl.config import load_inventory, load_playbook
from dflashctl.store import Store
from dflashctl.supervise.supervisor import Supervisor
from tests.harness.disk import fill, mount_tmpfs
from tests.harness.fake_trainer import start_fake_run
from tests.harness.local import SOCKET, end_trainer, kill_tmux_servers, kinds, read_status, wait_for, write_playbook

pytestmark = pytest.mark.slow

INTERVAL = 0.5
WORKDIR = "~/dflash-full"  # its own workdir: the tmpfs hides no other test's runs


@pytest.fixture
def small_disk(ssh_env, tmp_path):
    """The harness inventory with `target`'s workdir moved, and a 1 MiB tmpfs on its runs/."""
    raw = yaml.safe_load(open(ssh_env.inventory_path))
    raw["hosts"]["target"]["workdir"] = WORKDIR
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump(raw))
    runs = ssh_env.home("target") / WORKDIR[2:] / "runs"
    mount_tmpfs(str(runs), "1m", mode="0700")  # a run directory root must be private
    yield load_inventory(str(path)), runs
    subprocess.run(["umount", "-l", str(runs)], check=False)


def test_a_disk_filling_during_a_run_is_disk_full_and_stops_it(small_disk, tmp_path):
    inventory, runs = small_disk
    playbooks = tmp_path / "playbooks"
    path = write_playbook(playbooks, "full", "target", {"train": {"steps": 100000, "log_every": 1,
                                                                   "checkpoint_every": 5}},
                          poll_interval=INTERVAL, expect={"stall_window": 60, "startup_budget": 60},
                          restart={"backoff_initial": 0.1, "backoff_max": 0.2, "jitter": 0})
    pb = load_playbook(str(path), inventory=inventory)
    store = Store(str(tmp_path / "runs.db"))
    run_id = start_fake_run(store, inventory, "target", pb.trainer.to_dict(), playbook=pb.name,
                            playbook_source=pb.source, socket=SOCKET, step_s=0.05)
    run_dir = store.get_run(run_id).run_dir
    local_dir = str(runs / run_id)
    sup = Supervisor(store, inventory, interval=INTERVAL, playbooks_dir=str(playbooks))
    sup.attach(run_id)
    pid = None
    try:
        wait_for(lambda: store.get_run(run_id).state == "running", 60, "running", every=INTERVAL, tick=sup.tick)
        pid = read_status(local_dir).pid
        fill(str(runs))
        wait_for(lambda: store.get_run(run_id).state == "failed", 60, "the run stopped", every=INTERVAL,
                 tick=sup.tick)
        for _ in range(4):  # a few more polls: nothing restarts it
            sup.tick()
        run = store.get_run(run_id)
        [crash] = kinds(store, run_id, "crash")
        assert crash.detail["signature"] == "disk_full", crash.detail
        assert run.exit_reason.startswith("disk_full: ") and "not restarting: the run host's disk is full" in \
            run.exit_reason, run.exit_reason
        assert f"{run_dir} has " in run.exit_reason and " free of 1 MiB" in run.exit_reason
        [stopped] = [e for e in store.events(run_id) if e.severity == "critical"]
        assert f"{run_dir} has " in stopped.message and "then `dflashctl restart RUN`" in stopped.message
        assert not store.restarts(run_id) and not kinds(store, run_id, "process")
        assert not os.path.exists(os.path.join(local_dir, "exit_code"))  # the output said nothing: the disk did
        assert read_status(local_dir).pid == pid  # no other trainer was started
    finally:
        sup.close()
        kill_tmux_servers([(inventory.get("target"), inventory, SOCKET)])
        end_trainer(local_dir)
