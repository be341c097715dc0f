"""The threaded pipeline on CPU with the tiny preset: real threads, real models."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

from dflashctl.core import contract
from tests.harness.tiny import Trainer, read_status, tiny_config
from trainer import pipeline as pl
from trainer.anchors import sample_anchors
from trainer.attention import select_attention_path
from trainer.compile import Discipline
from trainer.config import from_dict
from trainer.data import build_source
from trainer.optim import build_optimizer, build_scheduler
from trainer.step import compute_loss
from trainer.train import resolve_devices


def make_pipeline(targets=(0,), drafters=(0, 1), compute=compute_loss, anchors=sample_anchors, queue_depth=2, steps=6,
                  **sections):
    cfg = from_dict(tiny_config(placement={"device": "cpu", "target": list(targets), "drafter": list(drafters),
                                           "queue_depth": queue_depth}, train={"steps": steps}, **sections))
    _, target_devs, drafter_devs = resolve_devices(cfg)
    target_models, replicas = pl.build_models(cfg, target_devs, drafter_devs, torch.float32)
    source = build_source(cfg, target_models[0].vocab_size, replicas[0].mask_token_id)
    optimizer = build_optimizer(replicas[0].trainable_parameters(), cfg, torch.device("cpu"))
    pipe = pl.Pipeline(cfg=cfg, source=source, targets=target_models, target_devices=target_devs, replicas=replicas,
                       drafter_devices=drafter_devs, attention_path=select_attention_path("cpu"),
                       discipline=Discipline(cfg, 2, enabled=False, guard_eager_flex=False), compute_loss=compute,
                       sample_anchors=anchors, start_step=0, total_steps=steps, first_batch=0,
                       compute_dtype=torch.float32)
    return pipe, optimizer, build_scheduler(optimizer, cfg)


def train(pipe, optimizer, scheduler, steps):
    """The coordinator side of train.py's loop, without the run directory."""
    out = []
    for step in range(steps):
        reports = pipe.collect(step)
        pl.optimizer_step(pipe.replicas, pipe.drafter_devices, optimizer, scheduler, 1.0)
        pipe.release(step)
        out.append(reports)
    return out


def pipeline_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("target-", "drafter-"))]


@pytest.fixture(autouse=True)
def no_threads_left_behind():
    yield
    assert pipeline_threads() == []


def test_threads_train_deterministically_and_shut_down_cleanly():
    runs = []
    for _ in range(2):
        pipe, opt, sched = make_pipeline(targets=(0, 1), drafters=(0, 1))
        for _, _, job in pl.warmup_jobs(pipe):  # warm-up leaves no gradient behind
            job()
        assert all(p.grad is None for r in pipe.replicas for p in r.parameters())
        pipe.start()
        assert sorted(pipeline_threads()) == ["drafter-0@cpu", "drafter-1@cpu", "target-0@cpu", "target-1@cpu"]
        reports = train(pipe, opt, sched, 6)
        assert pipe.stop(timeout=10) == [] and pipe.error is None
        # batch k = step * D + r goes to replica r, from target k % T, whatever the timing
        assert [[(r.replica, r.index) for r in step] for step in reports] == [[(0, 2 * s), (1, 2 * s + 1)] for s in range(6)]
        runs.append([r.loss for step in reports for r in step])
    assert runs[0] == runs[1]
    assert all(loss == loss for loss in runs[0])


def test_the_warmup_runs_each_replicas_first_batch_and_that_pass_is_its_first_step():
    """Three replicas, two targets, two buckets: every replica's warm-up on the bucket of
    its first batch is that batch, kept as step 1; the run is the one without a warm-up."""
    runs = {}
    for warm in (False, True):
        pipe, opt, sched = make_pipeline(targets=(0, 1), drafters=(0, 0, 0))
        if warm:
            for _, _, job in pl.warmup_jobs(pipe):
                job()
            assert sorted(pipe.handoff) == [0, 1, 2]
            assert [pipe.handoff[r].item.index for r in range(3)] == [0, 1, 2]
            assert all(p.grad is None for r in pipe.replicas for p in r.parameters())  # set aside until start()
        pipe.start()
        reports = train(pipe, opt, sched, 6)
        assert pipe.stop(timeout=10) == [] and pipe.error is None
        assert [[(r.replica, r.index) for r in step] for step in reports] == [[(r, 3 * s + r) for r in range(3)]
                                                                              for s in range(6)]
        made_by_threads = sum(pipe.target_tokens)
        later = sum(r.seq_tokens for step in reports[1:] for r in step)
        assert made_by_threads == (later if warm else later + sum(r.seq_tokens for r in reports[0]))
        runs[warm] = ([r.loss for step in reports for r in step], [p.detach().clone() for p in pipe.replicas[0].parameters()])
    assert runs[True][0] == runs[False][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[True][1], runs[False][1]))


def test_locked_first_steps_compile_each_thread_and_bucket_under_the_lock_then_run_free():
    pipe, opt, sched = make_pipeline(targets=(0, 1), drafters=(0, 1), compile={"serialized_warmup": False},
                                     data={"buckets": [256]})
    d = pipe.discipline
    d.warmup(pl.warmup_jobs(pipe), report=lambda progress: None)
    assert d.mode == "locked_first_steps"
    assert d._pending == {(name, 256) for name in ("target-0@cpu", "target-1@cpu", "drafter-0@cpu", "drafter-1@cpu")}
    pipe.start()
    train(pipe, opt, sched, 3)
    assert pipe.stop(timeout=10) == []
    assert d._pending == set() and d.frames_ok_after_warmup is not None  # every shape went through: locked


def test_unsafe_parallel_warmup_runs_every_drafter_first_call_at_once_after_the_targets():
    """The debug mode that reproduces the GPU deadlock: its drafter jobs must overlap."""
    pipe, opt, sched = make_pipeline(targets=(0,), drafters=(0, 0, 0), compile={"unsafe_parallel_warmup": True},
                                     data={"buckets": [256]})
    d = pipe.discipline
    assert d.mode == "unsafe_parallel"
    order: list[str] = []
    meet = threading.Barrier(3, timeout=10)  # jobs run one after another would break it

    def job(name, fn):
        def run():
            order.append(name)
            if name.startswith("drafter"):
                meet.wait()
            fn()
        return name, 256, run

    real = pl.warmup_jobs(pipe)
    assert [name for name, _, _ in real] == ["target-0@cpu", "drafter-0@cpu", "drafter-1@cpu", "drafter-2@cpu"]
    d.warmup([job(name, fn) for name, _, fn in real], report=lambda progress: None)
    assert order[0] == "target-0@cpu" and sorted(order[1:]) == ["drafter-0@cpu", "drafter-1@cpu", "drafter-2@cpu"]
    assert all(p.grad is None for r in pipe.replicas for p in r.parameters())
    pipe.start()
    train(pipe, opt, sched, 2)
    assert pipe.stop(timeout=10) == [] and pl.replicas_identical(pipe.replicas)


def test_unsafe_parallel_warmup_reraises_a_failed_first_call():
    pipe, _, _ = make_pipeline(drafters=(0, 0), compile={"unsafe_parallel_warmup": True}, data={"buckets": [256]})

    def boom():
        raise RuntimeError("first call failed")

    with pytest.raises(RuntimeError, match="first call failed"):
        pipe.discipline.warmup([("target-0@cpu", 256, lambda: None), ("drafter-0@cpu", 256, boom),
                                ("drafter-1@cpu", 256, lambda: None)], report=lambda progress: None)


def test_replicas_stay_bit_identical():
    pipe, opt, sched = make_pipeline(drafters=(0, 1))
    before = [p.detach().clone() for p in pl.trainable(pipe.replicas[0])]
    pipe.start()
    train(pipe, opt, sched, 5)
    assert pipe.stop(timeout=10) == []
    assert pl.replicas_identical(pipe.replicas)
    assert pipe.replicas[0] is not pipe.replicas[1]
    assert any(not torch.equal(a, p) for a, p in zip(before, pl.trainable(pipe.replicas[0])))
    sums = pl.replica_checksums(pipe.replicas)
    assert len(sums) == 2 and sums[0] == sums[1]
    weight = pl.trainable(pipe.replicas[1])[0]
    with torch.no_grad():  # one weight of replica 1 moved by one ulp: its checksum changes
        weight.view(-1)[3] = torch.nextafter(weight.view(-1)[3], torch.tensor(float("inf")))
    assert not pl.replicas_identical(pipe.replicas)
    changed = pl.replica_checksums(pipe.replicas)
    assert changed[0] == sums[0] and changed[1] != sums[1]


def test_gradients_are_averaged_onto_the_master_in_replica_order():
    replicas = [torch.nn.Linear(3, 2) for _ in range(3)]
    grads = [torch.randn(2, 3) for _ in replicas]
    for m, g in zip(replicas, grads):
        m.weight.grad = g.clone()
    replicas[2].bias.grad = torch.ones(2)  # a parameter only one replica used
    pl.reduce_gradients(replicas)
    assert torch.equal(replicas[0].weight.grad, ((grads[0] + grads[1]) + grads[2]) * (1 / 3))
    assert torch.equal(replicas[0].bias.grad, torch.ones(2) / 3)
    pl.broadcast_parameters(replicas)
    assert pl.replicas_identical(replicas) and all(p.grad is None for m in replicas for p in m.parameters())


def _raise_on(n: int, fn, exc: Exception, when: dict, replica_name: str = ""):
    """``fn``, except that its n-th call from a thread named ``replica_name``* raises ``exc``."""
    calls = {"n": 0}
    lock = threading.Lock()

    def wrapped(*args, **kwargs):
        if threading.current_thread().name.startswith(replica_name):
            with lock:
                calls["n"] += 1
                if calls["n"] == n:
                    when["raised"] = time.monotonic()
                    raise exc
        return fn(*args, **kwargs)

    return wrapped


@pytest.mark.parametrize("where", ["drafter", "target"])
def test_an_exception_in_any_thread_reaches_the_coordinator_within_seconds(where):
    when: dict = {}
    exc = ValueError(f"bad batch in the {where}")
    if where == "drafter":
        pipe, opt, sched = make_pipeline(compute=_raise_on(3, compute_loss, exc, when, "drafter-1"), steps=50)
    else:
        pipe, opt, sched = make_pipeline(anchors=_raise_on(4, sample_anchors, exc, when, "target-0"), steps=50)
    pipe.start()
    with pytest.raises(ValueError, match=f"bad batch in the {where}") as info:
        train(pipe, opt, sched, 50)
    assert time.monotonic() - when["raised"] < 10  # no hang: every wait looks at the stop event
    assert info.value._dflash_thread == ("drafter-1@cpu" if where == "drafter" else "target-0@cpu")
    assert "Traceback" in info.value._dflash_traceback
    assert pipe.stop(timeout=10) == []


def test_a_target_makes_its_next_batch_once_the_drafters_backward_is_launched():
    """queue_depth 1: while a drafter runs the forward of batch s, the target has made
    batches 0..s and no more (its slot comes back only when that backward is launched)."""
    made, seen = [], []

    def compute(drafter, batch, cfg, path):
        time.sleep(0.3)  # time enough for the target to make another batch, had it a slot
        seen.append(len(made))
        return compute_loss(drafter, batch, cfg, path)

    pipe, opt, sched = make_pipeline(targets=(0,), drafters=(0,), queue_depth=1, steps=4, compute=compute)
    make_item = pipe.make_item
    pipe.make_item = lambda t, k: (made.append(k), make_item(t, k))[1]  # counts the batches made, nothing else
    pipe.start()
    train(pipe, opt, sched, 4)
    assert pipe.stop(timeout=10) == [] and pipe.error is None
    assert seen == [1, 2, 3, 4] and made == [0, 1, 2, 3]


def test_stop_frees_a_target_blocked_on_a_full_queue():
    pipe, opt, sched = make_pipeline(targets=(0,), drafters=(0,), queue_depth=1, steps=50)
    pipe.start()
    pipe.collect(0)  # never released: the drafter waits, the target fills its queue and waits for a slot
    deadline = time.monotonic() + 30
    while pipe.queue_depths() != [1] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pipe.queue_depths() == [1]
    t0 = time.monotonic()
    assert pipe.stop(timeout=10) == [] and time.monotonic() - t0 < 5


@pytest.mark.slow
def test_raise_in_thread_fault_fails_the_run_with_its_signature(tmp_path):
    cfg = tiny_config(placement={"device": "cpu", "target": [0], "drafter": [0, 1]},
                      train={"steps": 1000, "log_every": 1, "checkpoint_every": 0},
                      fault={"kind": "raise_in_thread", "after_steps": 3, "message": "NCCL watchdog timeout on rank 3"})
    t = Trainer(cfg, tmp_path / "run")
    try:
        code = t.wait(180)
    finally:
        t.kill()
    assert code == contract.EXIT_CRASH, t.output[-3000:]
    status = read_status(t.run_dir)
    assert status["phase"] == contract.PHASE_FAILED
    assert status["error"] == "RuntimeError: NCCL watchdog timeout on rank N"
    assert status["detail"]["thread"] == "drafter-0@cpu"
    with open(os.path.join(t.run_dir, "fault_fired.json")) as f:
        fired = json.load(f)["time"]
    assert status["updated"] - fired < 10  # failed within seconds of the raise
    assert "error in thread drafter-0@cpu: RuntimeError: NCCL watchdog timeout on rank 3" in t.output


def test_flop_model_counts_matmul_weights_only():
    pipe, _, _ = make_pipeline(drafters=(0,))
    target, drafter = pipe.targets[0], pipe.replicas[0]
    flops = pl.flop_model(pipe.cfg, target, drafter)
    cfg = target.config
    layers = target.model.base_model.layers
    per_layer = sum(p.numel() for p in layers[0].parameters())
    # the layers up to the last captured one: no embedding lookup, no later layers, no lm_head
    assert flops.target_params == per_layer * (max(target.layer_ids) + 1) < sum(p.numel() for p in layers.parameters())
    assert flops.drafter_params == sum(p.numel() for p in drafter.trainable_parameters())
    assert flops.target(10) == 2 * flops.target_params * 10
    # and its causal attention over the bucket: (bucket + 1) / 2 keys per position, QK^T and PV
    layers_run = max(target.layer_ids) + 1
    assert flops.target_layers == layers_run and flops.attn_width == cfg.num_attention_heads * (
        getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)  # the target's heads
    assert flops.target(10, 64) == pytest.approx(2 * flops.target_params * 10
                                                 + 4 * layers_run * flops.attn_width * (64 + 1) / 2 * 10)
    # drafter: 6 x trainable params per query token, but the fusion only on the context
    # (no input gradient) and k/v on the context as well; the frozen lm_head's forward +
    # input gradient on the predicted slots (not a block's anchor); attention
    q, ctx = 64, 40
    fuse = drafter.fuse.weight.numel()
    kv = sum(l.attn.k_proj.weight.numel() + l.attn.v_proj.weight.numel() for l in drafter.layers)
    assert (flops.fuse_params, flops.kv_params) == (fuse, kv) and 0 < fuse + kv < flops.drafter_params
    attention = 12 * len(drafter.layers) * flops.attn_width * (100 + flops.block_size) * q
    predicted = q * (flops.block_size - 1) / flops.block_size
    assert flops.drafter(q, 100, ctx) == pytest.approx(
        6 * (flops.drafter_params - fuse) * q + 6 * kv * ctx + 4 * fuse * ctx
        + 4 * cfg.hidden_size * cfg.vocab_size * predicted + attention)


def test_replica_checksums_do_not_depend_on_the_slice_size(monkeypatch):
    pipe, _, _ = make_pipeline(drafters=(0, 1))
    whole = pl.replica_checksums(pipe.replicas)
    from trainer import replicas

    monkeypatch.setattr(replicas, "_CHECKSUM_SLICE", 7)  # many slices per weight, the last one short
    assert pl.replica_checksums(pipe.replicas) == whole


def test_mfu_is_against_the_nominal_peak_with_the_measured_rate_beside_it() -> None:
    flops = pl.FlopModel(drafter_params=10_000_000, target_params=500_000_000, hidden=1024, vocab=151_936,
                         drafter_layers=5, attn_width=2048, block_size=16)
    report = pl.Report(replica=0, step=1, index=0, bucket=2048, loss=2.0, stats={}, query_tokens=8192,
                       seq_tokens=32768, anchor_mean=1024.0, wait_s=0.0, fwd_s=0.1, bwd_s=0.2,
                       sequences=16, anchors=512)
    w = pl.Window(start=0.0)
    w.add([report], 0.0, 0.01, 0.5, 1.0, end=0.5)
    nominal, measured, name = pl.PEAK_FLOPS["H200"]
    f = pl.window_fields(w, 1, flops, nominal, 1, 1, 1, measured)["extra"]
    assert (f["samples_s"], f["anchors_s"]) == (32.0, 1024.0)  # 16 samples and 512 anchor blocks in 0.5 s
    achieved = f["tflops"] * 1e12
    assert f["mfu"] == pytest.approx(achieved / 989e12, rel=1e-3)
    assert f["mfu_measured"] == pytest.approx(achieved / 790e12, rel=1e-3)
    assert "nominal 989" in name
    assert "mfu_measured" not in pl.window_fields(w, 1, flops, *pl.PEAK_FLOPS["A100"][:1], 1, 1, 1)["extra"]


def test_stats_come_to_the_host_in_one_copy_with_the_values_of_one_copy_each():
    stats = {"tokens": torch.tensor(12.0), "slot_acc": torch.tensor([float("nan"), 0.5, 0.25]),
             "slot_count": torch.tensor([0.0, 4.0, 8.0]), "note": "kept as it is", "blocks": torch.tensor(3)}
    loss, plain = pl.to_host(torch.tensor(2.5), stats)
    assert loss == 2.5
    assert plain["tokens"] == 12.0 and plain["blocks"] == 3.0 and plain["note"] == "kept as it is"
    assert plain["slot_count"] == [0.0, 4.0, 8.0] and plain["slot_acc"][1:] == [0.5, 0.25]
    assert plain["slot_acc"][0] != plain["slot_acc"][0]  # NaN stays NaN
    assert [type(plain[k]) for k in ("tokens", "slot_acc")] == [float, list]
