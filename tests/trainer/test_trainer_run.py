"""The trainer as a real process (``python -m trainer``) on CPU, and its checkpoint,
optimiser and compile helpers."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from dflashctl.core import contract
from tests import harness
from tests.harness.tiny import Trainer, losses_by_step, read_status, run_trainer, tiny_config

REPO = str(harness.REPO)


@pytest.fixture
def trainers():
    """Trainer processes started by a test; any still running at its end is killed (by pid)."""
    started: list[Trainer] = []
    yield started
    for t in started:
        t.kill()


# ---------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_learns_the_synthetic_task(tmp_path):
    cfg = tiny_config(train={"steps": 160, "log_every": 20, "checkpoint_every": 0}, optim={"lr": 1e-2, "warmup_frac": 0.05})
    t = run_trainer(cfg, tmp_path / "run")
    assert t.proc.returncode == contract.EXIT_DONE, t.output[-3000:]
    m = t.metrics()
    assert [x["step"] for x in m] == list(range(20, 161, 20))
    first, last = m[0], m[-1]
    assert last["loss"] < first["loss"] - 1.0
    assert first["accept_len"] < 1.0 and last["accept_len"] > first["accept_len"] + 2.5
    assert last["acc"] > 0.6
    assert t.status()["phase"] == contract.PHASE_DONE
    for key in ("tok_s", "eta_s", "tokens"):
        assert last[key] is not None
    assert last["attention_path"] == "sdpa" and last["time_ms"]["fwd"] > 0 and len(last["acc_per_slot"]) == 8


def test_profile_steps_write_a_kernel_table_and_a_trace(tmp_path):
    cfg = tiny_config(train={"steps": 6, "log_every": 2, "checkpoint_every": 0, "profile_steps": 2, "profile_after": 2})
    t = run_trainer(cfg, tmp_path / "run")
    assert t.proc.returncode == contract.EXIT_DONE, t.output[-3000:]
    assert "profile: steps 3-4" in t.output
    table = (tmp_path / "run" / "profile.txt").read_text()
    assert "Self CPU time total" in table and "aten::" in table
    with open(tmp_path / "run" / "profile.json") as f:
        assert json.load(f)["traceEvents"]


@pytest.mark.slow
def test_sigkill_then_resume_matches_an_uninterrupted_run(tmp_path, trainers):
    cfg = tiny_config(train={"steps": 30, "log_every": 1, "checkpoint_every": 10})
    straight = run_trainer(cfg, tmp_path / "straight")
    assert straight.proc.returncode == 0, straight.output[-3000:]

    killed = Trainer(cfg, tmp_path / "killed")
    trainers.append(killed)
    killed.wait_for_step(13)  # past the checkpoint at 10, well before the one at 20
    killed.kill()
    assert killed.proc.returncode == -signal.SIGKILL
    assert read_status(killed.run_dir)["phase"] == contract.PHASE_TRAINING  # what a crash leaves behind

    resumed = run_trainer(cfg, tmp_path / "killed")
    assert resumed.proc.returncode == 0, resumed.output[-3000:]
    assert "resumed from" in resumed.output and "step-00000010" in resumed.output
    steps = [m["step"] for m in resumed.metrics()]
    back = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
    assert 13 <= steps[back - 1] < 20 and steps[back] == 11  # the second process went on from the checkpoint
    a, b = losses_by_step(straight.run_dir), losses_by_step(resumed.run_dir)
    assert sorted(a) == sorted(b) == list(range(1, 31))
    assert max(abs(a[s] - b[s]) for s in a) < 1e-5
    assert resumed.status()["phase"] == contract.PHASE_DONE


@pytest.mark.slow
def test_sigterm_checkpoints_and_stops_then_resumes(tmp_path, trainers):
    cfg = tiny_config(train={"steps": 100000, "log_every": 1, "checkpoint_every": 0},
                      placement={"device": "cpu", "target": [0], "drafter": [0, 1]})
    t = Trainer(cfg, tmp_path / "run")
    trainers.append(t)
    t.wait_for_step(3)
    t.proc.send_signal(signal.SIGTERM)
    assert t.wait(60) == contract.EXIT_STOPPED, t.output[-3000:]
    status = t.status()
    assert status["phase"] == contract.PHASE_STOPPED and status["error"] is None
    step = status["step"]
    assert step >= 3 and os.path.isdir(os.path.join(t.run_dir, "checkpoints", f"step-{step:08d}"))
    assert "SIGTERM received" in t.output

    again = run_trainer(cfg, tmp_path / "run", "--steps", str(step + 2))
    assert again.proc.returncode == 0, again.output[-3000:]
    assert [m["step"] for m in again.metrics()][-2:] == [step + 1, step + 2]
    sums = [m["replica_checksums"] for m in again.metrics()]
    assert all(len(c) == 2 and c[0] == c[1] for c in sums) and sums[-1] != sums[-2]  # equal replicas, moving weights


@pytest.mark.slow
def test_sigterm_during_the_start_up_stops_within_seconds_with_no_checkpoint(tmp_path, trainers):
    """Defect: a stop during the start-up waited for the whole start-up (models, the
    compile warm-up) and then wrote a checkpoint of step 0."""
    cfg = tiny_config(train={"steps": 100000, "log_every": 1, "checkpoint_every": 0})
    t = Trainer(cfg, tmp_path / "run")
    trainers.append(t)
    deadline = time.monotonic() + 180
    def phase():
        try:
            return t.status().get("phase")
        except (OSError, ValueError):  # not written yet, or being replaced
            return None

    while phase() not in (contract.PHASE_STARTING, contract.PHASE_COMPILING):
        assert time.monotonic() < deadline and t.proc.poll() is None, t.output[-3000:]
        time.sleep(0.05)
    t.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    assert t.wait(60) == contract.EXIT_STOPPED, t.output[-3000:]
    assert time.monotonic() - sent < 5.0 * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    status = t.status()
    assert status["phase"] == contract.PHASE_STOPPED and status["detail"]["checkpoint"] is False
    checkpoints = os.path.join(t.run_dir, "checkpoints")
    assert not (os.path.isdir(checkpoints) and os.listdir(checkpoints))  # no step made: nothing saved
    assert "no step made yet" in t.output


@pytest.mark.slow
def test_corrupt_shard_lines_are_skipped_within_budget(tmp_path):
    shards = write_synthetic_shards(tmp_path / "shards", bad_lines=2)
    cfg = tiny_config(data={"shards": shards, "error_budget": 5, "batch_size": 1},
                      train={"steps": 4, "log_every": 2, "checkpoint_every": 0})
    t = run_trainer(cfg, tmp_path / "run")
    assert t.proc.returncode == contract.EXIT_DONE, t.output[-3000:]
    assert f"data error: {shards}/a.jsonl:5: 'input_ids' has 3 tokens but 'loss_mask' has 2 -- skipped" in t.output
    assert f"data error: {shards}/b.jsonl:9: not valid JSON (truncated line?)" in t.output
    assert t.metrics()[-1]["data_errors"] == 2
    assert "data: 0 of 2 shard scan(s) read from <run>/data-index; 2 scanned (a.jsonl: none kept" in t.output
    # Started again on the same run directory: the shards' scans are read back, the bad lines counted again.
    again = run_trainer(cfg, tmp_path / "run")
    assert again.proc.returncode == contract.EXIT_DONE, again.output[-3000:]
    assert "data: 2 of 2 shard scan(s) read from <run>/data-index" in again.output, again.output[-3000:]
    assert f"data error: {shards}/b.jsonl:9: not valid JSON (truncated line?)" in again.output
    assert "2 bad records skipped" in again.output


@pytest.mark.slow
def test_corrupt_shards_over_budget_fail_cleanly(tmp_path):
    shards = write_synthetic_shards(tmp_path / "shards", bad_lines=2)
    cfg = tiny_config(data={"shards": shards, "error_budget": 1})
    t = run_trainer(cfg, tmp_path / "run", timeout=120)  # never a hang
    assert t.proc.returncode == contract.EXIT_DATA_ERROR, t.output[-3000:]
    status = t.status()
    assert status["phase"] == contract.PHASE_FAILED
    assert status["error"].startswith("DataError: N bad records, over data.error_budget=N; first: ")
    assert "a.jsonl:5" in status["detail"]["message"]
    assert "Traceback" not in t.output  # the user's data: a message, not a traceback


def write_synthetic_shards(directory, bad_lines: int) -> str:
    """Two shards of the synthetic task; ``bad_lines`` (1 or 2) corrupt records among them."""
    from trainer.data import SyntheticDataset

    ds = SyntheticDataset(16, 512, 256, 16, seed=5, reserved=(511,))
    os.makedirs(directory)
    lines = [json.dumps({"input_ids": ids, "loss_mask": m}) + "\n" for ids, m in ds.samples]
    with open(os.path.join(directory, "a.jsonl"), "w") as f:
        f.writelines(lines[:4] + ['{"input_ids": [1, 2, 3], "loss_mask": [0, 1]}\n'] + lines[4:8])
    with open(os.path.join(directory, "b.jsonl"), "w") as f:
        f.writelines(lines[8:])
        if bad_lines > 1:
            f.write(lines[0][:60])  # truncated last line: a writer killed mid-record
    return str(directory)


@pytest.mark.slow
def test_fault_exit_fails_with_its_signature_and_a_restart_recovers(tmp_path):
    message = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB"
    cfg = tiny_config(train={"steps": 6, "log_every": 1, "checkpoint_every": 2},
                      fault={"kind": "exit", "after_steps": 3, "message": message, "exit_code": 7})
    t = run_trainer(cfg, tmp_path / "run")
    assert t.proc.returncode == 7 and message in t.output
    status = t.status()
    assert status["phase"] == contract.PHASE_FAILED
    assert status["error"] == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate N.N GiB"
    assert max(m["step"] for m in t.metrics()) == 3

    again = run_trainer(cfg, tmp_path / "run")  # `once`: the marker disarms the fault
    assert again.proc.returncode == 0, again.output[-3000:]
    assert "step-00000002" in again.output and again.status()["phase"] == contract.PHASE_DONE


_TGKILL = {"x86_64": 234, "aarch64": 131}  # syscall numbers; Python has no tgkill of its own


def signal_a_worker_thread(pid: int, sig: int) -> None:
    import ctypes
    import platform

    if platform.machine() not in _TGKILL:
        pytest.skip(f"no tgkill number known for {platform.machine()}")
    tid = max(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(_TGKILL[platform.machine()], pid, tid, sig) == 0, os.strerror(ctypes.get_errno())


@pytest.mark.slow
def test_fault_hang_stops_progress_until_a_signal(tmp_path, trainers):
    cfg = tiny_config(train={"steps": 50, "log_every": 1, "checkpoint_every": 0}, fault={"kind": "hang", "after_steps": 2})
    t = Trainer(cfg, tmp_path / "run")
    trainers.append(t)
    t.wait_for_step(2)
    time.sleep(2.0)
    assert max(m["step"] for m in t.metrics()) == 2 and t.proc.poll() is None
    assert t.status()["phase"] == contract.PHASE_TRAINING
    t.proc.send_signal(signal.SIGUSR1)  # a hung run shows where every thread is, and goes on
    deadline = time.monotonic() + 20
    while "Thread 0x" not in t.output and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "Thread 0x" in t.output and "trainer/pipeline.py" in t.output and t.proc.poll() is None
    # SIGTERM as the kernel may deliver it: to one of the worker threads, not the main
    # one (a wait in the main thread with no timeout never wakes for that).
    signal_a_worker_thread(t.proc.pid, signal.SIGTERM)
    assert t.wait(60) == contract.EXIT_STOPPED, t.output[-3000:]
    assert t.status()["step"] == 2 and os.path.isdir(os.path.join(t.run_dir, "checkpoints", "step-00000002"))


# ---------------------------------------------------------------------------- command line


def test_help_documents_every_option_and_config_key():
    from trainer.config import TrainerConfig

    done = subprocess.run([sys.executable, "-m", "trainer", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    for option in ("--config", "--run-dir", "--resume", "--steps", "--print-config"):
        assert option in done.stdout
    for section in dataclasses.fields(TrainerConfig):
        if dataclasses.is_dataclass(getattr(TrainerConfig(), section.name)):
            for f in dataclasses.fields(getattr(TrainerConfig(), section.name)):
                assert f"  {section.name}.{f.name} = " in done.stdout
    assert "data.error_budget = 10\n      Bad records skipped" in done.stdout


def test_print_config_and_config_errors(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"data": {"buckets": [256]}, "train": {"steps": 5}}))
    done = subprocess.run([sys.executable, "-m", "trainer", "--config", str(path), "--steps", "9", "--print-config"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    resolved = json.loads(done.stdout)
    assert resolved["train"]["steps"] == 9 and resolved["data"]["error_budget"] == 10
    path.write_text(json.dumps({"data": {"bukets": [256]}}))
    done = subprocess.run([sys.executable, "-m", "trainer", "--config", str(path)], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == contract.EXIT_CONFIG_ERROR
    assert "data.bukets: unknown key (did you mean 'buckets'?)" in done.stderr


# ---------------------------------------------------------------------------- checkpoints


def _model_and_optimizer(seed: int = 0):
    import torch

    from trainer.config import TrainerConfig
    from trainer.optim import build_optimizer, build_scheduler

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)  # frozen parameters are not saved
    cfg = TrainerConfig()
    opt = build_optimizer(model.parameters(), cfg, torch.device("cpu"))
    return model, opt, build_scheduler(opt, cfg)


def _train_a_step(model, opt, sched):
    import torch

    model(torch.randn(3, 4)).square().mean().backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def test_checkpoint_save_keeps_last_k_and_resumes_state(tmp_path):
    import torch

    from trainer import checkpoint

    model, opt, sched = _model_and_optimizer()
    for step in (1, 2, 3, 4):
        _train_a_step(model, opt, sched)
        checkpoint.save(str(tmp_path), step, model, opt, sched, {"epoch": 0, "position": step}, keep=2)
    assert [s for s, _ in checkpoint.complete_checkpoints(str(tmp_path))] == [3, 4]

    other, opt2, sched2 = _model_and_optimizer(seed=1)
    meta = checkpoint.load(checkpoint.latest(str(tmp_path)), other, opt2, sched2)
    assert meta["step"] == 4 and meta["data"] == {"epoch": 0, "position": 4}
    assert torch.equal(other[1].weight, model[1].weight) and not torch.equal(other[0].weight, model[0].weight)
    assert sched2.last_epoch == sched.last_epoch == 4
    assert opt2.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])
    assert set(torch.load(os.path.join(tmp_path, "checkpoints", "step-00000004", "model.pt"))) == {"1.weight", "1.bias", "0.bias"}


def test_checkpoint_latest_ignores_incomplete_and_save_cleans_temp(tmp_path):
    from trainer import checkpoint

    model, opt, sched = _model_and_optimizer()
    checkpoint.save(str(tmp_path), 5, model, opt, sched, {})
    root = tmp_path / "checkpoints"
    (root / "step-00000009").mkdir()  # a directory without meta.json: not complete
    (root / ".tmp-step-00000010-123").mkdir()  # left by a crash during a save
    meta = json.loads((root / "step-00000005" / "meta.json").read_text())
    assert meta["files"] == ["model.pt", "optim.pt", "rng.pt"]
    assert checkpoint.latest(str(tmp_path)).endswith("step-00000005")
    (root / "step-00000005" / "optim.pt").unlink()  # a listed file missing: not complete either
    assert checkpoint.latest(str(tmp_path)) is None
    checkpoint.save(str(tmp_path), 6, model, opt, sched, {})
    assert not (root / ".tmp-step-00000010-123").exists()
    assert checkpoint.latest(str(tmp_path)).endswith("step-00000006")


def test_checkpoint_restores_python_and_torch_rng(tmp_path):
    import torch

    from trainer import checkpoint

    model, opt, sched = _model_and_optimizer()
    random.seed(7)
    torch.manual_seed(7)
    checkpoint.save(str(tmp_path), 1, model, opt, sched, {})
    expected = (random.random(), torch.rand(3))
    random.seed(99)
    torch.manual_seed(99)
    checkpoint.load(checkpoint.latest(str(tmp_path)), model)
    got = (random.random(), torch.rand(3))
    assert got[0] == expected[0] and torch.equal(got[1], expected[1])


# ---------------------------------------------------------------------------- optimiser, compile helpers


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    from trainer.optim import lr_factor

    f = [lr_factor(s, 100, 0.04, 0.1) for s in range(100)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(f[4:], f[5:])) and abs(f[-1] - 0.1) < 1e-3


def test_compile_cache_is_keyed_by_versions_and_device(tmp_path, monkeypatch):
    import torch

    from trainer import compile as compile_mod

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    path = compile_mod.setup_cache(str(tmp_path / "cache"), torch.device("cpu"))
    assert os.path.basename(path) == compile_mod.cache_key(torch.device("cpu"))
    assert os.path.basename(path).startswith(f"torch-{torch.__version__}_triton-") and path.endswith("_cpu")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == path and os.path.isdir(path)
    assert os.environ["TRITON_CACHE_DIR"] == os.path.join(path, "triton")


def test_flash_attention_4_keeps_its_kernels_in_the_compile_cache_unless_the_user_said_otherwise(tmp_path, monkeypatch):
    import torch

    from trainer import compile as compile_mod

    enabled, where = compile_mod.FLASH_CACHE_ENV
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", enabled, where):
        monkeypatch.delenv(name, raising=False)
    path = compile_mod.setup_cache(str(tmp_path / "cache"), torch.device("cpu"))
    assert os.environ[enabled] == "1"
    assert os.environ[where] == os.path.join(path, "flash-attn-cute")
    # no compile.cache_dir: inside the inductor cache this process uses
    monkeypatch.delenv(where)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    compile_mod.setup_cache(None, torch.device("cpu"))
    assert os.environ[where] == os.path.join(str(tmp_path / "inductor"), "flash-attn-cute")
    # a directory others can write into is refused: the cache stays off
    for name in (enabled, where):
        monkeypatch.delenv(name)
    shared = tmp_path / "shared-inductor"
    (shared / "flash-attn-cute").mkdir(parents=True)
    os.chmod(shared / "flash-attn-cute", 0o777)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(shared))
    compile_mod.setup_cache(None, torch.device("cpu"))
    assert enabled not in os.environ and where not in os.environ
    # what the user set wins
    monkeypatch.setenv(enabled, "0")
    monkeypatch.setenv(where, str(tmp_path / "mine"))
    compile_mod.setup_cache(str(tmp_path / "cache"), torch.device("cpu"))
    assert (os.environ[enabled], os.environ[where]) == ("0", str(tmp_path / "mine"))


def test_compile_discipline_settings_and_locked_first_steps():
    import threading

    import torch

    from trainer import compile as compile_mod
    from trainer.config import TrainerConfig

    cfg = TrainerConfig()
    cfg.data.buckets = [128, 256, 384]
    cfg.compile.serialized_warmup = False
    d = compile_mod.Discipline(cfg, n_devices=3, enabled=False, guard_eager_flex=False)
    assert d.mode == "locked_first_steps" and d.limit == 3 * 3 * 3 + cfg.compile.recompile_margin
    seen = {}

    def worker():  # Dynamo's config is per thread from torch 2.12: each thread sets its own
        d.enter_thread()
        seen["limit"] = torch._dynamo.config.recompile_limit
        seen["fail"] = torch._dynamo.config.fail_on_recompile_limit_hit

    th = threading.Thread(target=worker)
    th.start()
    th.join()
    assert seen == {"limit": d.limit, "fail": True}

    d.warmup([("cpu", 128, None), ("cpu", 256, None)], report=lambda p: None)
    with d.step_guard("cpu", 128) as g:
        assert g.locked and d.lock.locked()
    with d.step_guard("cpu", 256) as g:
        assert g.locked
    with d.step_guard("cpu", 128) as g:  # every shape went through once: threads run free
        assert not g.locked
    assert d.frames_ok_after_warmup is not None
    assert set(compile_mod.counters_report(d)) >= {"frames_ok", "unique_graphs", "recompiles", "fxgraph_cache_hit",
                                                   "fxgraph_cache_miss"}


def test_serialized_warmup_runs_jobs_one_at_a_time_and_reports():
    from trainer import compile as compile_mod
    from trainer.config import TrainerConfig

    d = compile_mod.Discipline(TrainerConfig(), 1, enabled=False, guard_eager_flex=False)
    ran, reports = [], []
    jobs = [(dev, b, (lambda dev=dev, b=b: ran.append((dev, b)))) for dev in ("cuda:0", "cuda:1") for b in (128, 256)]
    d.warmup(jobs, reports.append)
    assert ran == [(j[0], j[1]) for j in jobs]
    assert reports[-1]["done"] == reports[-1]["total"] == 4 and {"device", "bucket", "seconds"} <= set(reports[-1])
