"""The metrics line's numbers: tokens/s windows, FLOP counting and MFU, GPU memory.

The coordinator adds each step's reports to a ``Window`` and turns it into one
metrics line (``window_fields``): loss, accuracy, acceptance length, tokens/s, the
time split, and the model FLOP utilisation against the GPU's peak.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from trainer.pipeline import Pipeline, Report


# Dense bf16 matrix throughput per GPU model: (flop/s, what the figure is).
# Dense bf16 peak per GPU: (nominal, measured matmul rate or None, name). ``mfu`` divides by the
# nominal peak, the yardstick public trainers quote; ``mfu_measured`` by the rate a large bf16
# matmul reaches on that GPU (bench/RESULTS.md), where one was measured.
PEAK_FLOPS = {
    "H200": (989e12, 790e12, "H200 bf16 dense, nominal 989 TFLOP/s (measured matmul 790)"),
    "H100": (989e12, 790e12, "H100 bf16 dense, nominal 989 TFLOP/s (measured matmul as H200: 790)"),
    "A100": (312e12, None, "A100 bf16 dense, nominal 312 TFLOP/s"),
    "L40S": (362e12, None, "L40S bf16 dense, nominal 362 TFLOP/s"),
    "A10G": (70e12, None, "A10G bf16 dense, nominal 70 TFLOP/s"),
}


def peak_flops(device: torch.device) -> tuple[Optional[float], Optional[float], Optional[str]]:
    """(nominal peak, measured peak or None, its name) of ``device``'s GPU; Nones off CUDA."""
    if device.type != "cuda":
        return None, None, None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_FLOPS.items():
        if key in name:
            return value
    return None, None, f"unknown GPU '{name}'"


@dataclass
class FlopModel:
    """FLOPs of one step, as DFLASH.md counts them (plus the shared lm_head, which dominates)."""

    drafter_params: int  # every trainable weight
    target_params: int
    hidden: int
    vocab: int
    drafter_layers: int
    attn_width: int  # query heads x head dim of a drafter layer
    block_size: int
    fuse_params: int = 0  # of drafter_params: the fusion of the target's features (context tokens only)
    kv_params: int = 0  # of drafter_params: the layers' k/v projections (context and block tokens)
    target_layers: int = 0  # the target's layers a batch runs through (up to the last captured one)

    def drafter(self, query_tokens: int, mean_context: float, context_tokens: int = 0) -> float:
        """``context_tokens``: the positions of the target's features (batch x bucket)."""
        # Every weight but the fusion once per query token (forward, input and weight
        # gradients); k/v also once per context position; the fusion only there, with
        # no input gradient (the target's features are constants).
        dense = (6 * (self.drafter_params - self.fuse_params) * query_tokens
                 + 6 * self.kv_params * context_tokens + 4 * self.fuse_params * context_tokens)
        # Frozen lm_head: forward + gradient with respect to its input, no weight gradient,
        # for the slots the loss predicts (a block's anchor, slot 0, is not projected).
        lm_head = 4 * self.hidden * self.vocab * query_tokens * (self.block_size - 1) / self.block_size
        # QK^T and PV (2 x 2 flops per key and width), forward + backward (x3).
        attention = 12 * self.drafter_layers * self.attn_width * (mean_context + self.block_size) * query_tokens
        return dense + lm_head + attention

    def target(self, seq_tokens: int, bucket: int = 0) -> float:
        """Forward only: the weights, and causal attention over ``bucket`` positions
        (QK^T and PV, 2 x 2 flops per key and width; (bucket + 1) / 2 keys per position).
        The drafter's layers have the target's heads, so ``attn_width`` is the target's too."""
        attention = 2 * self.target_layers * self.attn_width * (bucket + 1) * seq_tokens if bucket else 0
        return 2 * self.target_params * seq_tokens + attention


@dataclass
class Window:
    """Accumulates the steps between two metrics lines."""

    start: float = field(default_factory=time.monotonic)
    end: float = 0.0  # time of the last step's release
    steps: int = 0
    reports: list = field(default_factory=list)
    allreduce_s: float = 0.0
    optim_s: float = 0.0
    step_s: float = 0.0
    grad_norm: float = 0.0

    def add(self, reports: list[Report], allreduce_s: float, optim_s: float, step_s: float, grad_norm: float,
            end: Optional[float] = None):
        self.end = time.monotonic() if end is None else end
        self.steps += 1
        self.reports.extend(reports)
        self.allreduce_s += allreduce_s
        self.optim_s += optim_s
        self.step_s += step_s
        self.grad_norm = grad_norm


def _mean(values) -> Optional[float]:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def window_fields(w: Window, n_replicas: int, flops: Optional[FlopModel], peak: Optional[float],
                  n_drafter_gpus: int, n_target_gpus: int, n_gpus: int, measured_peak: Optional[float] = None) -> dict:
    """Loss, acc, accept_len, tok/s and the time split of one window (keys of contract.Metrics + extras)."""
    elapsed = max(1e-9, w.end - w.start)
    reps = w.reports
    query = sum(r.query_tokens for r in reps)
    seq = sum(r.seq_tokens for r in reps)
    per_replica = [sum(r.query_tokens for r in reps if r.replica == i) / elapsed for i in range(n_replicas)]
    ms = lambda seconds: round(1000 * seconds / max(1, w.steps), 2)  # noqa: E731
    slot_correct = _sum_lists(r.stats.get("slot_correct") for r in reps)
    slot_count = _sum_lists(r.stats.get("slot_count") for r in reps)
    blocks = sum(r.stats.get("blocks", 0.0) for r in reps)
    accept_len = sum(r.stats.get("accept_len", 0.0) * r.stats.get("blocks", 0.0) for r in reps) / blocks if blocks else None
    out = {
        "loss": _mean(r.loss for r in reps),
        "acc": sum(slot_correct) / sum(slot_count) if slot_count and sum(slot_count) else None,
        "accept_len": accept_len,
        "tok_s": query / elapsed,
        "extra": {
            "tok_s_per_drafter": [round(x, 1) for x in per_replica],
            "seq_tok_s": round(seq / elapsed, 1),
            # The units public trainers quote: samples (sequences) and anchor blocks per second.
            "samples_s": round(sum(r.sequences for r in reps) / elapsed, 2),
            "anchors_s": round(sum(r.anchors for r in reps) / elapsed, 1),
            "step_ms": ms(w.step_s),
            "time_ms": {
                "wait": ms(sum(r.wait_s for r in reps) / n_replicas),
                "fwd": ms(sum(r.fwd_s for r in reps) / n_replicas),
                "bwd": ms(sum(r.bwd_s for r in reps) / n_replicas),
                "allreduce": ms(w.allreduce_s),
                "optim": ms(w.optim_s),
            },
            "grad_norm": w.grad_norm,
            "acc_per_slot": [round(c / n, 4) if n else None for c, n in zip(slot_correct, slot_count)],
            # Published acceptance lengths (tau) count the target's bonus token as well.
            "tau": None if accept_len is None else accept_len + 1,
        },
    }
    if flops is not None and peak:
        mean_ctx = _mean(r.anchor_mean for r in reps) or 0.0
        d_flops = flops.drafter(query, mean_ctx, seq)
        t_flops = sum(flops.target(r.seq_tokens, r.bucket) for r in reps)
        out["extra"]["mfu_drafter"] = round(d_flops / elapsed / (peak * n_drafter_gpus), 4)
        out["extra"]["mfu_target"] = round(t_flops / elapsed / (peak * n_target_gpus), 4)
        out["extra"]["mfu"] = round((d_flops + t_flops) / elapsed / (peak * n_gpus), 4)
        out["extra"]["tflops"] = round((d_flops + t_flops) / elapsed / 1e12, 1)
        if measured_peak:
            out["extra"]["mfu_measured"] = round((d_flops + t_flops) / elapsed / (measured_peak * n_gpus), 4)
    return out


def _sum_lists(lists) -> list[float]:
    total: list[float] = []
    for values in lists:
        if values is None:
            continue
        total = [a + b for a, b in zip(total, values)] if total else list(values)
    return total


def gpu_memory(devices: list[torch.device]) -> dict:
    out = {}
    for dev in sorted({d for d in devices if d.type == "cuda"}, key=str):
        out[str(dev)] = {
            "alloc_gib": round(torch.cuda.memory_allocated(dev) / 2**30, 2),
            "peak_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30, 2),
            "reserved_gib": round(torch.cuda.memory_reserved(dev) / 2**30, 2),
            "total_gib": round(torch.cuda.get_device_properties(dev).total_memory / 2**30, 2),
        }
    return out


def target_stats(pipe: Pipeline, elapsed: float) -> dict:
    """Per target thread since training started: sequence tokens/s, and the busy fraction
    (near 1: the targets are the bottleneck; the drafters' ``wait`` time says the same)."""
    elapsed = max(1e-9, elapsed)
    return {"target_tok_s": [round(n / elapsed, 1) for n in pipe.target_tokens],
            "target_busy": [round(b / elapsed, 3) for b in pipe.target_busy_s]}


def flop_model(cfg, target, drafter) -> FlopModel:
    tc = target.config
    heads = tc.num_attention_heads
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // heads
    layers_run = max(target.layer_ids) + 1  # the target stops after its last captured layer
    return FlopModel(
        drafter_params=sum(p.numel() for p in drafter.parameters() if p.requires_grad),
        # The layers the features run through; the embedding is a lookup, not a matmul.
        target_params=sum(p.numel() for p in target.model.base_model.layers[:layers_run].parameters()),
        hidden=tc.hidden_size, vocab=target.vocab_size, drafter_layers=len(drafter.layers),
        attn_width=heads * head_dim, block_size=cfg.model.block_size, target_layers=layers_run,
        fuse_params=drafter.fuse.weight.numel(),
        kv_params=sum(layer.attn.k_proj.weight.numel() + layer.attn.v_proj.weight.numel() for layer in drafter.layers),
    )
