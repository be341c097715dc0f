"""Optimiser and learning-rate schedule of the drafter.

AdamW over the master copy of the trainable parameters (fp32 always: on GPU the
forward and backward run under bf16 autocast, so the fp32 parameters ARE the master
weights and no second copy is needed), fused on CUDA, cosine decay after a linear
warm-up, gradient clipping by global norm.
"""

from __future__ import annotations

import math

import torch


def lr_factor(step: int, total: int, warmup_frac: float, min_lr_frac: float) -> float:
    """Multiplier of the peak lr at ``step`` (0-based): linear warm-up, then cosine to min_lr_frac."""
    warmup = max(1, round(warmup_frac * total)) if warmup_frac > 0 else 0
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr_frac + (1 - min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(params, cfg, device: torch.device) -> torch.optim.AdamW:
    o = cfg.optim
    params = [p for p in params if p.requires_grad]
    fused = device.type == "cuda" and all(p.is_cuda and p.dtype == torch.float32 for p in params)
    return torch.optim.AdamW(
        params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay, eps=1e-8,
        **({"fused": True} if fused else {}),
    )


def build_scheduler(optimizer, cfg) -> torch.optim.lr_scheduler.LambdaLR:
    o, total = cfg.optim, cfg.train.steps
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total, o.warmup_frac, o.min_lr_frac)
    )


def clip_grads(params, max_norm: float) -> float:
    """Clip by global norm; returns the norm before clipping (inf/nan passes through for the caller to see)."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return 0.0
    if max_norm and max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    return float(torch.linalg.vector_norm(torch.stack([p.grad.detach().float().norm() for p in params])))
