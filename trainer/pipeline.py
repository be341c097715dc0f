"""The threaded pipeline: target threads -> bounded queues -> drafter replica threads.

::

    target thread t (one per target device)          drafter thread r (one per drafter device)
      takes a slot of (t, k % D) (queue_depth each)     step s: k = s*D + r, from queue[k % T][r]
      batch k = source.batch(k), k = t, t+T, ...        forward + backward on replica r; once the
      anchors (seeded by k), target features            backward is launched, the slot is free again
      put -> queue[t][k % D]                            report -> coordinator, wait for release(s)

    coordinator (the main thread, trainer/train.py):
      collect(s): the D reports -> sum the replicas' gradients onto the master copy
      (replica 0), in replica order -> clip, AdamW, schedule -> copy the master's
      parameters into every other replica -> release(s)

The coordinator's maths is in trainer/replicas.py, the metrics line's numbers in
trainer/metrics.py; this module holds the threads and what passes between them.

A slot is given back when the drafter's backward is launched, not when it takes the
batch: a target thread collates and launches its next batch while that drafter waits
for the GPU, never while it launches the start of its own step (both need the GIL;
bench/RESULTS.md measured the GPU idle in those launches).

Batch ``k`` always goes to the same replica at the same step and every queue is
filled in order, so the run is deterministic whatever the thread timing, and
resumable from ``batches_done = steps_done * D``.

Under torch.distributed (``world`` processes, trainer/distributed.py) each process
is one such pipeline and the global batch order is cut by rank: local batch ``j``
(step ``j // D``, replica ``j % D``) of rank ``q`` is global batch
``first_batch + (j // D) * D * world + q * D + j % D``, so a step consumes
``D * world`` consecutive global batches, exactly as one process with ``D * world``
replicas would, and ``batches_done = steps_done * D * world``. Replicas stay bit-identical: they
all receive a copy of the same master tensors after every optimiser step.

The compile warm-up (``warmup_jobs``) runs each replica's first batch when that batch
is of the bucket being compiled: its forward and backward are that step's, not a
throw-away pass. The replica's gradients and report are kept (``Handoff``), the target
threads skip those batches and the drafter threads report them at once, so the first
step costs only the optimiser and the rest of the replicas' work.

Failure handling: every thread body runs under ``_guard``; the first exception is
kept with its thread's name and sets the shared stop event. Every wait (queue get and
put, reports, release) has a timeout and looks at the stop event, so the
coordinator re-raises that exception within a fraction of a second, never hangs on a
dead thread. Threads are daemons and named (``target-0@cuda:0``, ``drafter-1@cuda:6``).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

# Also read from here (``pl.<name>`` in trainer.train): the replicas' maths and the metrics line's numbers.
from trainer.metrics import (
    PEAK_FLOPS,
    FlopModel,
    Window,
    flop_model,
    gpu_memory,
    peak_flops,
    target_stats,
    window_fields,
)
from trainer.replicas import (
    _sync,
    broadcast_parameters,
    build_models,
    optimizer_step,
    reduce_gradients,
    replica_checksums,
    replicas_identical,
    sync_all,
    trainable,
)

__all__ = [
    "DONE", "PEAK_FLOPS", "FlopModel", "Handoff", "Item", "Pipeline", "Report", "Stopped", "Window", "autocast_for",
    "batch_generator", "broadcast_parameters", "build_models", "flop_model", "gpu_memory", "optimizer_step",
    "peak_flops", "reduce_gradients", "replica_checksums", "replicas_identical", "sync_all", "target_stats",
    "thread_name", "to_host", "trainable", "warmup_jobs", "window_fields",
]

_POLL_S = 0.1


class _Done:
    """Sentinel: the target thread has produced its last batch."""


DONE = _Done()


class Stopped(Exception):
    """The stop event was set while waiting (shutdown, or another thread failed)."""


@dataclass
class Item:
    index: int  # global batch index k
    bucket: int
    input_ids: torch.Tensor  # [B, S] on the target device
    loss_mask: torch.Tensor
    anchors: torch.Tensor  # [B, N]
    valid: torch.Tensor
    features: torch.Tensor  # [B, S, K*H]
    seq_tokens: int  # non-pad tokens the target processed
    target_s: float
    n_anchors: int = 0  # valid anchor blocks
    anchor_mean: float = 0.0  # mean anchor position of the valid blocks (read on the host, before the copy)


@dataclass
class Report:
    replica: int
    step: int
    index: int
    bucket: int
    loss: float
    stats: dict
    query_tokens: int
    seq_tokens: int
    anchor_mean: float  # mean anchor position of valid blocks: the context each query sees
    wait_s: float
    fwd_s: float
    bwd_s: float
    sequences: int = 0  # samples in the batch
    anchors: int = 0  # valid anchor blocks (each block_size query slots)


@dataclass
class Handoff:
    """A replica's first step, computed by the compile warm-up (``warmup_jobs``)."""

    item: Item
    result: tuple  # drafter_step's (loss, stats, fwd_s, bwd_s)
    grads: list  # the replica's trainable gradients, set aside until the threads start
    started: float  # time.monotonic() when its drafter pass began


def thread_name(role: str, index: int, device: torch.device) -> str:
    """'drafter-1@cuda:6': names the thread and labels its compile warm-up jobs alike."""
    return f"{role}-{index}@{device}"


def batch_generator(seed: int, index: int) -> torch.Generator:
    """The anchor RNG of batch ``index``: a pure function of (seed, index), so resumes replay it."""
    return torch.Generator().manual_seed((seed * 1_000_003 + index) % (2**63))


def autocast_for(device: torch.device, dtype: torch.dtype):
    if device.type == "cuda" and dtype != torch.float32:
        return torch.autocast("cuda", dtype=dtype)
    return contextlib.nullcontext()


def to_host(loss: torch.Tensor, stats: dict) -> tuple[float, dict]:
    """The loss and the stats' tensors as Python numbers (lists for vectors), read from the
    device in one copy (one wait for the stream) instead of one per tensor."""
    names = [k for k, v in stats.items() if torch.is_tensor(v)]
    flat = torch.cat([loss.reshape(1).float()] + [stats[k].reshape(-1).float() for k in names]).tolist()
    plain, at = dict(stats), 1
    for k in names:
        n = stats[k].numel()
        plain[k] = flat[at:at + n] if stats[k].dim() else flat[at]
        at += n
    return flat[0], plain


class Pipeline:
    def __init__(self, *, cfg, source, targets: list, target_devices: list[torch.device], replicas: list,
                 drafter_devices: list[torch.device], attention_path, discipline, compute_loss: Callable,
                 sample_anchors: Callable, start_step: int, total_steps: int, first_batch: int,
                 compute_dtype: torch.dtype, rank: int = 0, world: int = 1):
        self.cfg, self.source = cfg, source
        self.targets, self.target_devices = targets, target_devices
        self.replicas, self.drafter_devices = replicas, drafter_devices
        self.attention_path, self.discipline = attention_path, discipline
        self.compute_loss, self.sample_anchors = compute_loss, sample_anchors
        self.start_step, self.total_steps = start_step, total_steps
        self.first_batch = first_batch  # global batch index of (start_step, replica 0)
        self.compute_dtype = compute_dtype
        self.T, self.D = len(targets), len(replicas)
        self.rank, self.world = rank, world
        depth = max(1, cfg.placement.queue_depth)
        self.queues = [[queue.Queue() for _ in range(self.D)] for _ in range(self.T)]
        # Batches target t may have made for replica r that the drafter has not launched the backward of.
        self.slots = [[threading.Semaphore(depth) for _ in range(self.D)] for _ in range(self.T)]
        self.reports: queue.Queue = queue.Queue()
        self.stop_event = threading.Event()
        self.error: Optional[BaseException] = None
        self.error_thread: Optional[str] = None
        self.error_traceback = ""
        self._release = threading.Condition()
        self._released_step = start_step - 1
        self.inject_raise: Optional[str] = None  # fault injection: the next drafter step raises this
        self.threads: list[threading.Thread] = []
        self.handoff: dict[int, Handoff] = {}  # replica -> its first step, done by the warm-up
        self._handed: frozenset[int] = frozenset()  # local batch numbers the threads skip
        self.target_tokens = [0] * self.T  # sequence tokens through each target (for tok/s, MFU)
        self.target_busy_s = [0.0] * self.T

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        for r, hand in self.handoff.items():  # the warm-up's first steps: their gradients back in place
            for p, g in zip(trainable(self.replicas[r]), hand.grads):
                p.grad = g
            hand.grads = []
        self._handed = frozenset(self.local_index(self.start_step, r) for r in self.handoff)
        for t, dev in enumerate(self.target_devices):
            self.threads.append(threading.Thread(target=self._guard, args=(self._target_loop, t),
                                                 name=thread_name("target", t, dev), daemon=True))
        for r, dev in enumerate(self.drafter_devices):
            self.threads.append(threading.Thread(target=self._guard, args=(self._drafter_loop, r),
                                                 name=thread_name("drafter", r, dev), daemon=True))
        for th in self.threads:
            th.start()

    def stop(self, timeout: float = 5.0) -> list[str]:
        """Set the stop event and join; returns the names of threads still alive after ``timeout``."""
        self.stop_event.set()
        with self._release:
            self._release.notify_all()
        deadline = time.monotonic() + timeout
        for th in self.threads:
            th.join(max(0.0, deadline - time.monotonic()))
        return [th.name for th in self.threads if th.is_alive()]

    def _guard(self, body: Callable, index: int) -> None:
        try:  # the compile settings are already in force here (Discipline.enter_thread, in main)
            body(index)
        except Stopped:
            pass
        except BaseException as e:  # relayed to the coordinator, never swallowed
            with self._release:
                if self.error is None:
                    self.error = e
                    self.error_thread = threading.current_thread().name
                    self.error_traceback = traceback.format_exc()
                    e._dflash_thread = self.error_thread  # read by train.run for the report
                    e._dflash_traceback = self.error_traceback
            self.stop_event.set()
            with self._release:
                self._release.notify_all()

    def check(self) -> None:
        """Re-raise a thread's exception in the caller (the coordinator)."""
        if self.error is not None:
            raise self.error

    # ------------------------------------------------------------------ waits with timeouts

    def _take_slot(self, slot: threading.Semaphore) -> None:
        while not slot.acquire(timeout=_POLL_S):
            if self.stop_event.is_set():
                raise Stopped
        if self.stop_event.is_set():
            raise Stopped

    def _get(self, q: queue.Queue) -> Any:
        while True:
            if self.stop_event.is_set():
                raise Stopped
            try:
                return q.get(timeout=_POLL_S)
            except queue.Empty:
                continue

    # ------------------------------------------------------------------ target threads

    def make_item(self, t: int, k: int) -> Item:
        """Batch ``k`` through target ``t``: read, pad, anchors, features."""
        t0 = time.monotonic()
        dev, cfg = self.target_devices[t], self.cfg
        batch = self.source.batch(k)
        anchors, valid = self.sample_anchors(batch["loss_mask"], cfg.data.max_anchors, cfg.model.block_size,
                                             batch_generator(cfg.data.seed, k))
        n_anchors = int(valid.sum())
        anchor_mean = float(anchors[valid].float().mean()) if n_anchors else 0.0
        input_ids = batch["input_ids"].to(dev, non_blocking=True)
        with torch.no_grad():
            features = self.targets[t].features(input_ids)
        if features.is_inference():  # inference tensors cannot be saved for the drafter's backward
            features = features.clone()
        _sync(dev)
        return Item(k, batch["bucket"], input_ids, batch["loss_mask"].to(dev), anchors.to(dev), valid.to(dev),
                    features, batch["seq_tokens"], time.monotonic() - t0, n_anchors, anchor_mean)

    def local_index(self, step: int, r: int) -> int:
        """This process's batch number ``j`` of (step, replica ``r``), counted from the start step."""
        return (step - self.start_step) * self.D + r

    def global_index(self, j: int) -> int:
        """Global batch index of local batch ``j`` (the rank's shard of the global order)."""
        step, r = divmod(j, self.D)
        return self.first_batch + step * self.D * self.world + self.rank * self.D + r

    def batch_index(self, step: int, r: int) -> int:
        return self.global_index(self.local_index(step, r))

    def route(self, j: int) -> tuple[int, int]:
        """(target thread, replica) of local batch ``j``: target ``t`` owns every T-th batch."""
        return j % self.T, j % self.D

    def _target_loop(self, t: int) -> None:
        dev = self.target_devices[t]
        stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        end = self.local_index(self.total_steps, 0)
        j = t
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            while j < end:
                if j in self._handed:  # computed by the warm-up: its replica reports it at once
                    j += self.T
                    continue
                k, r = self.global_index(j), self.route(j)[1]
                self._take_slot(self.slots[t][r])
                with self.discipline.step_guard(threading.current_thread().name, self.source.order.batch(k)[2]):
                    item = self.make_item(t, k)
                self.target_tokens[t] += item.seq_tokens
                self.target_busy_s[t] += item.target_s
                self.queues[t][r].put(item)
                j += self.T
        for q in self.queues[t]:
            q.put(DONE)

    # ------------------------------------------------------------------ drafter threads

    def drafter_step(self, r: int, item: Item, launched: Optional[Callable[[], None]] = None
                     ) -> tuple[float, dict, float, float]:
        """Forward and backward of batch ``item`` on replica ``r`` (training and warm-up alike);
        ``launched()`` runs once the backward's kernels are all launched, before the wait for them."""
        dev = self.drafter_devices[r]
        batch = {
            "features": item.features.to(dev, non_blocking=True),
            "input_ids": item.input_ids.to(dev, non_blocking=True),
            "loss_mask": item.loss_mask.to(dev, non_blocking=True),
            "anchors": item.anchors.to(dev, non_blocking=True),
            "valid": item.valid.to(dev, non_blocking=True),
        }
        t0 = time.monotonic()
        with autocast_for(dev, self.compute_dtype):
            loss, stats = self.compute_loss(self.replicas[r], batch, self.cfg, self.attention_path)
        _sync(dev)
        t1 = time.monotonic()
        loss.backward()
        if launched is not None:
            launched()
        loss_value, plain = to_host(loss.detach(), stats)
        return loss_value, plain, t1 - t0, time.monotonic() - t1

    def _drafter_loop(self, r: int) -> None:
        dev = self.drafter_devices[r]
        stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for step in range(self.start_step, self.total_steps):
                j = self.local_index(step, r)
                k = self.global_index(j)
                t0 = time.monotonic()
                t = self.route(j)[0]
                hand = self.handoff.pop(r, None) if j in self._handed else None
                item = hand.item if hand is not None else self._get(self.queues[t][r])
                if item is DONE:
                    return
                wait_s = time.monotonic() - t0
                if self.inject_raise is not None and r == 0:
                    raise RuntimeError(self.inject_raise)
                if hand is not None:
                    loss, stats, fwd_s, bwd_s = hand.result
                else:
                    with self.discipline.step_guard(threading.current_thread().name, item.bucket):
                        loss, stats, fwd_s, bwd_s = self.drafter_step(r, item, self.slots[t][r].release)
                self.reports.put(Report(r, step, k, item.bucket, loss, stats,
                                        int(stats.get("query_tokens", 0)), item.seq_tokens,
                                        item.anchor_mean, wait_s, fwd_s, bwd_s,
                                        int(item.anchors.shape[0]), item.n_anchors))
                del item, hand
                self._wait_release(step)

    def _wait_release(self, step: int) -> None:
        with self._release:
            while self._released_step < step:
                if self.stop_event.is_set():
                    raise Stopped
                self._release.wait(_POLL_S)

    # ------------------------------------------------------------------ coordinator side

    def collect(self, step: int, should_stop: Callable[[], bool] = lambda: False) -> Optional[list[Report]]:
        """The D reports of ``step`` in replica order; None when ``should_stop()`` turned true first."""
        got: dict[int, Report] = {}
        while len(got) < self.D:
            self.check()
            if should_stop():
                return None
            try:
                rep = self.reports.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            assert rep.step == step, f"replica {rep.replica} reported step {rep.step} during step {step}"
            got[rep.replica] = rep
        return [got[r] for r in range(self.D)]

    def release(self, step: int) -> None:
        with self._release:
            self._released_step = step
            self._release.notify_all()

    def queue_depths(self) -> list[int]:
        """Batches waiting for each drafter replica (over all its target queues)."""
        return [sum(self.queues[t][r].qsize() for t in range(self.T)) for r in range(self.D)]


def warmup_jobs(pipe: Pipeline) -> list[tuple[str, int, Callable[[], None]]]:
    """Compile warm-up: for every bucket in use, each target's forward, then each
    replica's forward AND backward, on a real batch of that bucket (real shapes,
    same grad mode, dtype and autocast as training). Jobs are labelled with the name
    of the thread that runs that shape later.

    A replica whose first batch (at the start step) is of the bucket runs on that
    batch, made by the target thread that owns it, and keeps the result as
    ``pipe.handoff[r]``: its first step. Every other warm-up pass drops its gradients."""
    jobs: list[tuple[str, int, Callable[[], None]]] = []
    made: dict[int, Item] = {}  # batch index -> item
    shape: dict[int, Item] = {}  # bucket -> an item of it (for the replicas without a first batch there)
    first = {r: pipe.batch_index(pipe.start_step, r) for r in range(pipe.D)}  # each replica's first batch
    for bucket in pipe.source.buckets_used():
        own = {r: k for r, k in first.items() if pipe.source.order.batch(k)[2] == bucket}
        fallback = pipe.source.first_index(bucket)
        for t, dev in enumerate(pipe.target_devices):
            # The first batches this target thread owns, or any batch of the bucket to compile its lane.
            ks = sorted({k for r, k in own.items() if pipe.route(pipe.local_index(pipe.start_step, r))[0] == t})

            def target_job(t=t, ks=tuple(ks or [fallback]), bucket=bucket):
                for k in ks:
                    made[k] = pipe.make_item(t, k)
                shape.setdefault(bucket, made[ks[0]])
            jobs.append((thread_name("target", t, dev), bucket, target_job))
        for r, dev in enumerate(pipe.drafter_devices):
            def drafter_job(r=r, bucket=bucket, k=own.get(r)):
                replica = pipe.replicas[r]
                started = time.monotonic()
                result = pipe.drafter_step(r, made[k] if k is not None else shape[bucket])
                if k is not None:
                    pipe.handoff[r] = Handoff(made[k], result, [p.grad for p in trainable(replica)], started)
                replica.zero_grad(set_to_none=True)
            jobs.append((thread_name("drafter", r, dev), bucket, drafter_job))
    return jobs
