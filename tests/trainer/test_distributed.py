"""The trainer under torch.distributed on CPU (gloo): two real processes on this machine.

torchrun starts two ranks; their drafters must stay bit-identical and their global
loss must follow a single process with the same global batch. A rank killed with
SIGKILL must end the other within the collective timeout, failed, naming the dead rank.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dflashctl.core import contract
from tests.harness import free_port
from tests.harness.tiny import REPO, metrics_at, rank_env, read_metrics, run_trainer, tiny_config, write_config
from tests.harness.waiting import scaled

STEPS = 6


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # the process group of a process this test started
        proc.wait(30)


@pytest.mark.slow
def test_two_ranks_stay_identical_and_match_one_process(tmp_path):
    per_rank = tiny_config(train={"steps": STEPS, "log_every": 1, "checkpoint_every": 0})
    run_dir = str(tmp_path / "dist")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port('127.0.0.1')}", "-m", "trainer",
           "--config", write_config(tmp_path, per_rank), "--run-dir", run_dir]
    log = open(str(tmp_path / "torchrun.log"), "w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=rank_env(), start_new_session=True)
    try:
        code = proc.wait(150)
    finally:
        _kill_group(proc)
        log.close()
    output = open(str(tmp_path / "torchrun.log")).read()
    assert code == 0, output[-4000:]

    rank0, rank1 = read_metrics(run_dir), metrics_at(os.path.join(run_dir, "metrics.rank1.jsonl"))
    assert [m["step"] for m in rank0] == [m["step"] for m in rank1] == list(range(1, STEPS + 1))
    # Same drafter bits on both ranks after every step.
    assert [m["param_checksum"] for m in rank0] == [m["param_checksum"] for m in rank1]
    assert len({m["param_checksum"] for m in rank0}) == STEPS  # and it does change: the drafter trains
    assert {m["world_size"] for m in rank0 + rank1} == {2} and {m["rank"] for m in rank1} == {1}
    # Each rank trained on its own shard, and rank 0 reports the sums.
    assert [m["loss_rank"] for m in rank0] != [m["loss_rank"] for m in rank1]
    assert rank0[-1]["tokens"] == rank1[-1]["tokens"] > 0
    with open(os.path.join(run_dir, "status.rank1.json")) as f:
        assert json.load(f)["phase"] == contract.PHASE_DONE
    with open(os.path.join(run_dir, contract.STATUS_FILE)) as f:
        assert json.load(f)["phase"] == contract.PHASE_DONE
    assert not [n for n in os.listdir(run_dir) if n.startswith("metrics.rank0")]
    ckpt = os.path.join(run_dir, contract.CHECKPOINT_DIR, f"step-{STEPS:08d}", "meta.json")
    with open(ckpt) as f:
        meta = json.load(f)
    assert meta["world_size"] == 2 and meta["data"]["batches_done"] == 2 * STEPS

    # One process, two replicas: the same global batch (batches 2s, 2s+1 at step s).
    single_cfg = tiny_config(train={"steps": STEPS, "log_every": 1, "checkpoint_every": 0},
                             placement={"device": "cpu", "target": [0], "drafter": [0, 0]})
    single = run_trainer(single_cfg, tmp_path / "single", timeout=120)
    assert single.proc.returncode == 0, single.output[-3000:]
    one = single.metrics()
    assert [m["step"] for m in one] == list(range(1, STEPS + 1))
    for a, b in zip(one, rank0):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * max(1.0, abs(a["loss"])), (a["step"], a["loss"], b["loss"])
    assert one[-1]["tokens"] == rank0[-1]["tokens"]

    # A resume with another world size is refused, as a configuration error.
    refused = run_trainer(tiny_config(train={"steps": STEPS + 2, "log_every": 1, "checkpoint_every": 0}), run_dir,
                          timeout=120)
    assert refused.proc.returncode == contract.EXIT_CONFIG_ERROR, refused.output[-3000:]
    assert "2 process(es); this run has 1" in refused.output


def test_a_killed_rank_ends_the_other_naming_it(tmp_path):
    timeout = 20
    cfg = tiny_config(train={"steps": 100000, "log_every": 1, "checkpoint_every": 0},
                      distributed={"timeout": timeout})
    config = write_config(tmp_path, cfg)
    run_dir = str(tmp_path / "run")
    port = str(free_port("127.0.0.1"))
    procs, logs = [], []
    try:
        for rank in (0, 1):  # as torchrun on two hosts would start them: the variables, no local agent
            logs.append(open(str(tmp_path / f"rank{rank}.log"), "w"))
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "trainer", "--config", config, "--run-dir", run_dir], cwd=REPO,
                stdout=logs[-1], stderr=subprocess.STDOUT,
                env=rank_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                         MASTER_ADDR="127.0.0.1", MASTER_PORT=port)))
        deadline = time.monotonic() + scaled(90)  # two trainers starting on a loaded machine
        while len(metrics_at(os.path.join(run_dir, "metrics.rank1.jsonl"))) < 3:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                open(str(tmp_path / "rank0.log")).read()[-3000:]
            time.sleep(0.1)
        procs[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        code = procs[0].wait(timeout + 15)
        took = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
        for f in logs:
            f.close()
    output = open(str(tmp_path / "rank0.log")).read()
    assert code == contract.EXIT_CRASH, output[-3000:]
    assert took < timeout + 10, took
    with open(os.path.join(run_dir, contract.STATUS_FILE)) as f:
        status = json.load(f)
    assert status["phase"] == contract.PHASE_FAILED
    assert status["detail"]["failed_rank"] == 1, status
    assert "rank 1 on" in status["detail"]["message"] and "DistributedError" in status["error"]
    assert "rank 1 on" in output


def test_a_stop_asked_by_another_rank_is_no_signal_the_operators_first_still_checkpoints(tmp_path):
    # The operator's stop signals every host; a rank may already be stopping because a
    # peer's stop came through the all-reduce. That first signal of its own must not
    # count as the "second signal: exit at once" (no status, no final line).
    script = (
        "import signal, sys\n"
        "from trainer.train import StatusFile, StopRequest\n"
        f"stop = StopRequest(StatusFile({str(tmp_path)!r}, 'status.rank1.json'))\n"
        "stop.at_once = False  # training has made steps: a first signal checkpoints\n"
        "stop.event.set()  # as train() does when the all-reduced stop count says so\n"
        "stop._handle(signal.SIGTERM, None)\n"
        "print('still here', stop.signal_name)\n"
        "stop._handle(signal.SIGTERM, None)  # a second signal of its own: out at once\n"
        "print('not reached')\n"
    )
    answer = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "still here SIGTERM" in answer.stdout and "not reached" not in answer.stdout, answer.stderr[-2000:]
    assert answer.returncode == contract.EXIT_STOPPED
