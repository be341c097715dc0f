"""One run on two hosts, end to end over the sshd harness: rank 0 on ``target2``
(behind two jump hosts), rank 1 on ``target`` (behind the jump, inside the ``pct
exec`` wrapper). The tiny CPU trainer runs as one torch.distributed process per
host (gloo, env:// rendezvous on rank 0's host); a SIGKILL of rank 1's process is
seen on its host, confirmed by rank 0's failure naming it, and the whole run is
restarted on both hosts from the checkpoint and finishes."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from dflashctl.core import contract
from dflashctl.hosts.bundle import build_bundle
from dflashctl.launch import launch_run
from dflashctl.runs.runhost import logs, stop
from dflashctl.supervise.supervisor import Supervisor
from tests.harness.local import Background, kinds, states, timeline, wait_for
from tests.harness.multihost import INTERVAL, STEPS, checkpoint_steps, rank_status

pytestmark = pytest.mark.slow


def test_a_run_on_two_hosts_survives_a_killed_rank_and_finishes(ssh_env, pair):
    store, playbook, playbooks_dir = pair
    result = launch_run(playbook, ssh_env.inventory, store, bundle=build_bundle())
    assert result.state == "running", result
    run = store.get_run(result.run_id)
    assert [(h["rank"], h["host"]) for h in run.hosts] == [(0, "target2"), (1, "target")]
    assert run.host == "target2" and run.hosts[1]["tmux_session"] == f"{run.id}-r1"
    dirs = [h["run_dir"] for h in run.hosts]
    assert dirs[0] != dirs[1]  # each host's own workdir

    sup = Supervisor(store, ssh_env.inventory, interval=INTERVAL, playbooks_dir=playbooks_dir)
    sup.attach(run.id)
    background = Background(sup)
    try:
        wait_for(lambda: checkpoint_steps(dirs[0]) and (rank_status(dirs[1], 1) or {}).get("step", 0) >= 7, 180,
                 "a checkpoint and rank 1 past it")
        rows = store.get_run(run.id).hosts
        assert all(r["seen"] is not None and r["alive"] for r in rows), rows  # both hosts polled
        pid = rank_status(dirs[1], 1)["pid"]
        saved = checkpoint_steps(dirs[0])[-1]  # the newest before the kill (later ones replace the older)
        os.kill(pid, signal.SIGKILL)

        ended = wait_for(lambda: kinds(store, run.id, "rank"), 15, "rank 1's end, seen on its host")[0]
        assert ended.detail["host"] == "target" and ended.detail["rank"] == 1
        crash = wait_for(lambda: kinds(store, run.id, "crash"), 60, "rank 0's failure")[0]
        assert crash.detail["host"] == "target" and crash.detail["rank"] == 1, crash
        assert "[host target, rank 1" in crash.message and crash.detail["signature"] == "rank_failed"
        wait_for(lambda: store.restarts(run.id) and store.restarts(run.id)[0].time_to_first_step_s is not None, 180,
                 "the restarted run's first step")
        restart = store.restarts(run.id)[0]
        assert restart.action == "restart" and restart.step_after > saved, timeline(store, run.id)  # from a checkpoint
        assert (rank_status(dirs[1], 1) or {}).get("pid") != pid  # rank 1 runs again on its host
        wait_for(lambda: store.get_run(run.id).state == "done", 240, "the run to finish")
    finally:
        background.close()
    final = store.get_run(run.id)
    assert states(store, run.id)[-4:] == ["running", "restarting", "running", "done"], timeline(store, run.id)
    assert len(kinds(store, run.id, "rank")) == 1, timeline(store, run.id)  # the end of the run is no rank's failure
    assert [(h["host"], h["step"]) for h in final.hosts] == [("target2", STEPS), ("target", STEPS)], final.hosts
    assert max(s.step for s in store.samples(run.id)) == STEPS
    # Both hosts' logs, each line named by its host; one host's alone.
    text = "".join(logs(run.id, store, ssh_env.inventory, n=400))
    assert "[target2] " in text and "[target] " in text and "distributed: rank 1 of 2" in text
    only = "".join(logs(run.id, store, ssh_env.inventory, n=400, host="target"))
    assert "distributed: rank 1 of 2" in only and "[target" not in only


def test_stop_ends_the_process_on_every_host_with_a_checkpoint(ssh_env, pair):
    store, playbook, _ = pair
    result = launch_run(playbook, ssh_env.inventory, store, bundle=build_bundle())
    run = store.get_run(result.run_id)
    dirs = [h["run_dir"] for h in run.hosts]
    wait_for(lambda: all((rank_status(d, r) or {}).get("step", 0) >= 2 for r, d in enumerate(dirs)), 180,
             "both ranks past step 2")
    said = []
    stopped = stop(run.id, store, ssh_env.inventory, progress=lambda step, message: said.append(message))
    assert stopped.state == "stopped", said
    # Rank 1 stops with rank 0, so by its turn it may be gone already (then its pane gets Ctrl-C).
    assert any("on target2" in m for m in said) and any("on target " in m or "on target;" in m for m in said), said
    for rank, d in enumerate(dirs):  # each host's process checkpointed and exited as stopped
        assert rank_status(d, rank)["phase"] == contract.PHASE_STOPPED, (
            rank_status(d, rank), Path(d, contract.LOG_FILE).read_text()[-3000:])
        assert Path(d, contract.EXIT_CODE_FILE).read_text().strip() == str(contract.EXIT_STOPPED)
    assert checkpoint_steps(dirs[0])[-1] == rank_status(dirs[0], 0)["step"]  # the last one: where they stopped


