"""Launches that need no real trainer: GPUs busy on the host or held by an active
run refused (through jump -> container over real sshd), the run environment and
script, a dry run that prints every step and changes nothing (the command in this
process), a restart the store cannot record still counted as issued, and a changed
package set since the last good run reported (the fake trainer behind a host
python that runs the real interpreter for the env-audit). (The real tiny trainer
launched: tests/e2e/test_launch.py.)

Every tmux server here is on a socket private to this test process
(DFLASHCTL_TMUX_SOCKET), never a user's `dflash` one, and is killed by pid at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from dflashctl.config import load_inventory
from dflashctl.core import contract
from dflashctl.hosts.tmux import Tmux
from dflashctl.launch import launch_run, wanted_gpus
from dflashctl.runs.runhost import (
    LaunchError,
    render_run_script,
    renumber_placement,
    restart_run,
    run_environment,
    stop,
)
from dflashctl.store import GpuConflict, Store
from tests import harness
from tests.harness import cli
from tests.harness.fake_trainer import start_fake_run
from tests.harness.launch import RUN_SOCKET, LocalLaunch, tiny_playbook, uses_tmux

pytestmark = pytest.mark.usefixtures("private_tmux_socket_and_home")

FIXTURES = harness.FIXTURES / "nvidia-smi"


# --------------------------------------------------------------------------- GPU refusals


def test_busy_gpu_on_the_host_is_refused_unless_forced(ssh_env, tmp_path):
    inventory = ssh_env.inventory
    store = Store(str(tmp_path / "runs.db"))
    pb = tiny_playbook(tmp_path, inventory, "target", placement={"device": "cuda", "target": [0], "drafter": [0]})
    ssh_env.set_smi_mode("target", "load")
    try:
        with pytest.raises(LaunchError, match="GPU 0: compute processes: pid 416 python3 1002 MiB") as e:
            launch_run(pb, inventory, store)
        assert "--force" in e.value.hint
    finally:
        ssh_env.set_smi_mode("target", "idle")
    assert store.list_runs() == []  # nothing recorded, nothing started


def test_gpu_held_by_an_active_run_is_refused(ssh_env, tmp_path):
    inventory = ssh_env.inventory
    store = Store(str(tmp_path / "runs.db"))
    holder = store.create_run("other", "target", {"gpus": [0]}, time.time())
    pb = tiny_playbook(tmp_path, inventory, "target", placement={"device": "cuda", "target": [0], "drafter": [0]})
    with pytest.raises(GpuConflict, match=f"GPU 0 by run {holder.id}"):
        launch_run(pb, inventory, store)
    assert [r.id for r in store.list_runs()] == [holder.id]


# --------------------------------------------------------------------------- run.sh and placement


def test_run_environment_and_script(tmp_path):
    inventory = load_inventory(None)
    host = inventory.get("local").model_copy(update={"env": {"HOST_VAR": "h", "OMP_NUM_THREADS": "8"}})
    env = run_environment(host, {"OMP_NUM_THREADS": "2", "PYTHONPATH": "/extra"}, "/w/bundles/abc", [4, 6])
    assert env["OMP_NUM_THREADS"] == "2" and env["HOST_VAR"] == "h"  # the playbook wins over the host
    assert env["PYTHONPATH"] == "/w/bundles/abc:/extra"
    assert env["CUDA_VISIBLE_DEVICES"] == "4,6" and env["LANG"] == "C.UTF-8" and env["PYTHONUNBUFFERED"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in run_environment(host, {}, "/b", [])
    assert run_environment(host, {"CUDA_VISIBLE_DEVICES": "1"}, "/b", [4])["CUDA_VISIBLE_DEVICES"] == "1"

    trainer = {"placement": {"device": "cuda", "target": [4, 6], "drafter": [6]}}
    assert wanted_gpus(trainer) == [4, 6]
    assert renumber_placement(trainer, [4, 6])["placement"] == {"device": "cuda", "target": [0, 1], "drafter": [1]}
    assert wanted_gpus({"placement": {"device": "cpu", "target": [0], "drafter": [1]}}) == []

    # The host's python is a command line (like the probe's): words, so options may follow.
    script = render_run_script("r1", "/runs/it's here", "/opt/venv/bin/python -X faulthandler", {"A": "x y"},
                               "~/cache dir", "r1", "dflash")
    assert "cd '/runs/it'\"'\"'s here' || exit 1" in script
    assert "export A='x y'" in script
    assert "export TORCHINDUCTOR_CACHE_DIR=\"$HOME\"/'cache dir'" in script
    assert "/opt/venv/bin/python -X faulthandler -m trainer" in script
    assert "-m trainer --config config.json --run-dir '/runs/it'\"'\"'s here' --resume auto" in script
    assert subprocess.run(["sh", "-n"], input=script, text=True).returncode == 0  # valid shell


# --------------------------------------------------------------------------- local host


def _cli(args, cwd):
    """The command in this process, in ``cwd`` (tests/harness/cli.py)."""
    return cli.invoke(*args, cwd=cwd, env={"DFLASHCTL_INVENTORY": None, "DFLASHCTL_PLAYBOOKS": None})


def test_dry_run_prints_every_step_and_changes_nothing(tmp_path):
    env_store = tmp_path / "dry.db"
    os.environ["DFLASHCTL_STORE"] = str(env_store)
    try:
        out = _cli(["launch", "demo", "--dry-run"], cwd=tmp_path)
    finally:
        os.environ.pop("DFLASHCTL_STORE")
    assert out.returncode == 0, out.stderr
    text = out.stderr
    for needle in ("would record run demo-", "would run on local: sh -c", "dflashctl-check", "dflashctl-deploy",
                   "bytes on stdin", "run.sh:", "-m trainer --config config.json", "would start tmux session demo-"):
        assert needle in text
    assert not env_store.exists()
    assert not Tmux(load_inventory(None).get("local"), load_inventory(None), RUN_SOCKET).sessions()


def test_a_restart_the_store_cannot_record_still_counts_as_issued(tmp_path):
    """The new trainer is started; then the store refuses the restart's event (a full
    disk): restart_run still returns, saying so, so the supervisor never issues the
    same restart twice."""
    inventory = load_inventory(None)
    uses_tmux("local", inventory)
    store = Store(str(tmp_path / "runs.db"))
    pb = tiny_playbook(tmp_path, inventory, "local", name="unrecorded")
    run_id = start_fake_run(store, inventory, "local", pb.trainer.to_dict(), playbook=pb.name, socket=RUN_SOCKET)
    run = store.get_run(run_id)
    status_path = Path(run.run_dir) / contract.STATUS_FILE

    def trainer_pid(other_than=None):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status = contract.parse_status(status_path.read_text()) if status_path.exists() else None
            if status and status.pid and status.pid != other_than:
                return status.pid
            time.sleep(0.1)
        raise AssertionError("no trainer pid in status.json")

    first = trainer_pid()
    # A real SQLite error on exactly that write, as a full disk gives it.
    store.db.execute("CREATE TRIGGER refuse_restart_event BEFORE INSERT ON events WHEN NEW.kind = 'process' "
                     "BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END")
    store.db.conn.commit()
    said: list[str] = []
    try:
        result = restart_run(run_id, False, store, inventory, progress=lambda step, message: said.append(message))
        assert result.session == run_id and result.bundle_hash == run.bundle_hash
        assert any("not recorded in the run store: database or disk is full" in m for m in said), said
        assert trainer_pid(other_than=first) != first  # the new trainer runs
        assert Tmux(inventory.get("local"), inventory, RUN_SOCKET).has_session(run_id)
        assert not store.events(run_id, kind="process")
    finally:
        Tmux(inventory.get("local"), inventory, RUN_SOCKET).kill(run_id)


def test_a_changed_package_set_since_the_last_good_run_is_reported(tmp_path):
    # The launcher's env-audit runs the host's real Python; the trainer is the fake one
    # (what is tested is the drift against the last good run, not the trainer).
    inventory = LocalLaunch(tmp_path).inventory
    uses_tmux("local", inventory)
    store = Store(str(tmp_path / "runs.db"))
    pb = tiny_playbook(tmp_path, inventory, "local", name="drift", train={"steps": 5000, "log_every": 2})
    first = launch_run(pb, inventory, store)
    # A good run is one that trained for `healthy_after`: its samples say so.
    begin = time.time()
    store.add_samples(first.run_id, [{"time": begin, "step": 1, "phase": "training"},
                                     {"time": begin + pb.restart.healthy_after, "step": 2, "phase": "training"}])
    stop(first.run_id, store, inventory)
    # The package set the first launch recorded, as if the host had then had one more
    # package and an older torch (what an `apt`/`pip` "clean-up" between runs leaves).
    recorded = store.env_snapshots("local", limit=1)[0]
    then = dict(recorded["data"], **{"flashinfer-python": "0.2.5", "torch": "2.12.0"})
    store.db.execute("UPDATE env_snapshots SET data = ? WHERE id = ?", [json.dumps(then), recorded["id"]])
    store.db.conn.commit()

    said: list[str] = []
    second = launch_run(pb, inventory, store, progress=lambda step, message: said.append(message))
    try:
        (drift,) = [e for e in store.events(second.run_id) if e.kind == "drift"]
        assert drift.severity == "warning"
        assert "removed flashinfer-python 0.2.5" in drift.message and "torch 2.12.0 -> " in drift.message
        assert any("environment changed since the last good run" in m for m in said)
        assert not [e for e in store.events(first.run_id) if e.kind == "drift"]
    finally:
        stop(second.run_id, store, inventory)
