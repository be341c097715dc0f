"""Warm-up helpers (trainer/warmup_helpers.py): which buckets they take, their
orchestration with real helper processes, and the trainer starting one for real on
the CPU (where nothing compiles, so the helper only proves the plumbing: started on
the same config for its buckets, waited for, its directory removed)."""

from __future__ import annotations

import os
import sys
import time

import pytest

from dflashctl.core import contract
from tests.harness.tiny import run_trainer, tiny_config
from trainer import warmup_helpers as wh


def test_the_largest_bucket_stays_here_and_the_others_are_dealt_out_largest_first():
    assert wh.plan([512], None, 64) == []  # one bucket: nothing to share
    assert wh.plan([512, 1024], None, 16) == [[512]]
    assert wh.plan([512, 1024], None, 7) == []  # one helper per 8 CPUs
    assert wh.plan([256, 512, 1024, 2048], None, 16) == [[1024, 256], [512]]
    assert wh.plan([256, 512, 1024, 2048], None, 64) == [[1024], [512], [256]]  # at most one a bucket
    assert wh.plan([256, 512, 1024, 2048], 1, 2) == [[1024, 512, 256]]  # a number asked for ignores the CPUs
    assert wh.plan([512, 1024], 0, 64) == []
    assert wh.plan([1024, 512, 1024], None, 16) == [[512]]


def test_a_helper_holds_its_share_of_half_the_free_memory_of_the_tightest_device():
    gib = 1 << 30
    assert wh.memory_fraction([(100 * gib, 140 * gib)], 1) == pytest.approx(0.3571, abs=1e-4)
    assert wh.memory_fraction([(100 * gib, 140 * gib), (28 * gib, 140 * gib)], 2) == pytest.approx(0.05)
    assert wh.memory_fraction([], 2) == 1.0


def test_the_role_is_read_from_the_environment_and_bad_values_are_named():
    assert wh.role({}) is None
    assert wh.role({wh.BUCKETS_ENV: "512,256", wh.SHARE_ENV: "2"}) == wh.Role((512, 256), 2)
    assert wh.role({wh.BUCKETS_ENV: "512"}) == wh.Role((512,), 1)
    for bad in ({wh.BUCKETS_ENV: "512,x"}, {wh.BUCKETS_ENV: "512", wh.SHARE_ENV: "0"}, {wh.BUCKETS_ENV: ""}):
        with pytest.raises(ValueError, match=wh.BUCKETS_ENV):
            wh.role(bad)


def test_an_emptied_cuda_visible_devices_hides_the_gpu_from_the_plan():
    from trainer.config import TrainerConfig
    from trainer.train import helper_plan, will_compile

    assert not wh.gpu_visible({"CUDA_VISIBLE_DEVICES": ""}) and not wh.gpu_visible({"CUDA_VISIBLE_DEVICES": "-1"})
    cfg = TrainerConfig()
    cfg.data.buckets = [512, 1024]
    assert will_compile(cfg) == wh.gpu_visible()  # auto: compiled where a GPU is in sight
    cfg.compile.enabled = "on"
    assert will_compile(cfg) and helper_plan(cfg, True, False) == wh.plan([512, 1024], None, len(os.sched_getaffinity(0)))
    assert helper_plan(cfg, True, True) == []  # torch.distributed: each rank is a process already
    cfg.compile.serialized_warmup = False
    assert helper_plan(cfg, True, False) == []
    cfg.compile.serialized_warmup, cfg.compile.warmup_processes = True, 1
    assert helper_plan(cfg, False, False) == [[512]]  # asked for by number: even where nothing compiles


def _helpers(*scripts: tuple[list[int], str]) -> tuple[wh.Helpers, list[str]]:
    """Real processes in the helpers' places (Python one-liners instead of trainers:
    what they run does not matter to the orchestration, only how they end)."""
    lines: list[str] = []
    commands = [(buckets, [sys.executable, "-c", code, "{dir}"], dict(os.environ), {"note.txt": "x"})
                for buckets, code in scripts]
    return wh.Helpers.start(commands, lines.append), lines


def _jobs(ran: list, buckets=(1024, 512, 256)):
    return [(f"target@{b}", b, lambda b=b: ran.append(b)) for b in buckets]


def test_a_cold_cache_runs_the_own_bucket_first_and_waits_for_the_helper_before_its_buckets():
    helpers, lines = _helpers(([512, 256], "import time; time.sleep(1.5); print('done')"))
    ran: list = []
    try:
        jobs = helpers.arrange(_jobs(ran, (256, 512, 1024)), counts=lambda: (3, 0), should_stop=lambda: False)
        assert [j[1] for j in jobs] == [1024, 256, 512]
        t0 = time.monotonic()
        for _, _, fn in jobs:
            fn()
        assert time.monotonic() - t0 >= 1.0  # waited for the helper
        assert ran == [1024, 256, 512] and helpers.decided == "cold"
        assert helpers.helpers[0].ended == "finished"
        assert any("waited" in line and "finished" in line for line in lines), lines
    finally:
        helpers.close()
    assert not os.path.exists(helpers.helpers[0].directory)


def test_a_warm_cache_stops_the_helpers_after_the_first_compiled_call():
    helpers, lines = _helpers(([512], "import time; time.sleep(60)"))
    proc = helpers.helpers[0].proc
    ran: list = []
    outcomes = iter([(0, 0), (0, 2)])  # the first job compiled nothing and loaded nothing (eager), the second loaded
    try:
        jobs = helpers.arrange(_jobs(ran, (2048, 1024, 512)), counts=lambda: next(outcomes), should_stop=lambda: False)
        jobs[0][2]()
        assert proc.poll() is None and helpers.decided is None  # undecided: the helper runs on
        assert helpers.detail() == {contract.STATUS_WARMUP_HELPERS: [proc.pid]}  # status.json names it
        jobs[1][2]()
        assert helpers.decided == "warm" and proc.poll() is not None and helpers.detail()[contract.STATUS_WARMUP_HELPERS] == []
        t0 = time.monotonic()
        jobs[2][2]()  # the helper's bucket, here, without waiting
        assert time.monotonic() - t0 < 5 and ran == [2048, 1024, 512]
        assert any("compile cache is warm" in line for line in lines), lines
    finally:
        helpers.close()


def test_out_of_memory_here_while_a_helper_runs_stops_it_and_runs_the_job_again():
    helpers, lines = _helpers(([512], "import time; time.sleep(60)"))
    calls, resets = [], []

    def job():
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError("CUDA out of memory")

    try:
        [(_, _, own)] = helpers.arrange([("drafter", 1024, job)], counts=lambda: (1, 0), should_stop=lambda: False,
                                        out_of_memory=MemoryError, reset=lambda: resets.append(1))
        own()
        assert len(calls) == 2 and resets == [1] and not helpers.running()
        assert any("ran out of GPU memory" in line for line in lines), lines
        with pytest.raises(MemoryError):  # no helper left to blame: the error is this process's
            helpers.arrange([("drafter", 1024, lambda: (_ for _ in ()).throw(MemoryError("again")))],
                            counts=lambda: (1, 0), should_stop=lambda: False)[0][2]()
    finally:
        helpers.close()


def test_a_failed_helper_is_named_with_its_last_lines_and_its_buckets_run_here():
    helpers, lines = _helpers(([512], "import sys; print('loading the target'); print('Boom: no such model'); sys.exit(3)"))
    ran: list = []
    try:
        for _, _, fn in helpers.arrange(_jobs(ran, (1024, 512)), counts=lambda: (1, 0), should_stop=lambda: False):
            fn()
        assert ran == [1024, 512]
        failed = [line for line in lines if "failed (exit 3)" in line]
        assert failed and "Boom: no such model" in failed[0] and "this process compiles them" in failed[0], lines
    finally:
        helpers.close()


def test_a_stop_request_while_waiting_stops_the_helpers():
    helpers, lines = _helpers(([512], "import time; time.sleep(60)"))
    try:
        t0 = time.monotonic()
        helpers.wait(should_stop=lambda: time.monotonic() - t0 > 0.5)
        assert time.monotonic() - t0 < 10 and helpers.helpers[0].ended == "stopped"
        assert any("this trainer is stopping" in line for line in lines), lines
    finally:
        helpers.close()


def test_a_helper_ends_itself_when_its_trainer_is_gone(tmp_path):
    """The helper's side: its trainer killed before it could stop it (SIGKILL)."""
    import subprocess

    out = tmp_path / "helper.pid"
    parent = subprocess.Popen([sys.executable, "-c", (
        "import os, subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', 'from trainer import warmup_helpers as w; import time; "
        f"w.end_with_parent(every_s=0.1); time.sleep(60)'], env={{**os.environ, '{wh.PARENT_ENV}': str(os.getpid())}})\n"
        f"open({str(out)!r}, 'w').write(str(child.pid)); time.sleep(60)\n")])
    try:
        deadline = time.monotonic() + 20
        while not (out.exists() and out.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(out.read_text())
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and os.path.exists(f"/proc/{child}") \
                and open(f"/proc/{child}/stat").read().split()[2] != "Z":
            time.sleep(0.05)
        alive = os.path.exists(f"/proc/{child}") and open(f"/proc/{child}/stat").read().split()[2] != "Z"
        assert not alive
    finally:
        parent.kill()


@pytest.mark.slow
def test_the_trainer_starts_a_helper_on_the_same_config_waits_for_it_and_trains(tmp_path, monkeypatch):
    """On the CPU nothing compiles, so the helper only warms its bucket eagerly; what
    is real here is the rest: the trainer's own command line, on the same config,
    for the smaller bucket only, in a directory of its own that is removed after."""
    cfg = tiny_config(compile={"warmup_processes": 1}, train={"steps": 4, "log_every": 1, "checkpoint_every": 0})
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # where the helper's directory goes
    t = run_trainer(cfg, tmp_path / "run")
    assert t.proc.returncode == contract.EXIT_DONE, t.output[-3000:]
    started = [line for line in t.output.splitlines() if "warm-up helpers: 1 process(es) compile bucket(s) [[128]]" in line]
    assert started, t.output[-3000:]
    waited = [line for line in t.output.splitlines() if "warm-up helpers: waited" in line]
    assert waited and "[128] finished" in waited[0], t.output[-3000:]
    assert [m["step"] for m in t.metrics()] == [1, 2, 3, 4]
    assert not [n for n in os.listdir(tmp_path / "tmp") if n.startswith("dflash-warmup-helper-")]  # removed
    pid = int(started[0].rsplit("pids [", 1)[1].split("]")[0])
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


@pytest.mark.slow
def test_a_start_that_fails_before_its_warm_up_leaves_no_helper_behind(tmp_path, monkeypatch):
    cfg = tiny_config(compile={"warmup_processes": 1}, data={"shards": str(tmp_path / "no-such-shards")})
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    t = run_trainer(cfg, tmp_path / "run")
    assert t.proc.returncode == contract.EXIT_DATA_ERROR, t.output[-3000:]
    started = [line for line in t.output.splitlines() if "warm-up helpers: 1 process(es)" in line]
    assert started, t.output[-3000:]
    pid = int(started[0].rsplit("pids [", 1)[1].split("]")[0])
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    assert not [n for n in os.listdir(tmp_path / "tmp") if n.startswith("dflash-warmup-helper-")]


def test_a_bad_helper_setting_is_a_config_error(tmp_path):
    cfg = tiny_config(compile={"warmup_processes": -1})
    t = run_trainer(cfg, tmp_path / "run")
    assert t.proc.returncode == contract.EXIT_CONFIG_ERROR
    assert "compile.warmup_processes: -1 is negative" in t.output
