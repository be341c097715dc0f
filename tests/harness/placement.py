"""Metrics lines as a run's trainer writes them, for the placement advice's tests."""

from __future__ import annotations

from dflashctl.core import contract

T0 = 1_800_000_000.0


def line(step: int, *, target_tok_s, target_busy, seq_tok_s, step_ms, wait_ms, drafters, phase="training",
         gpus=None, peaks=None, total_gib=141.0):
    extra = {"target_tok_s": target_tok_s, "target_busy": target_busy, "tok_s_per_drafter": [1.0] * drafters,
             "seq_tok_s": seq_tok_s, "step_ms": step_ms, "time_ms": {"wait": wait_ms}}
    if gpus:
        extra["gpus"] = gpus
    if peaks:
        extra["gpu_mem"] = {dev: {"peak_gib": peak, "total_gib": total_gib} for dev, peak in peaks.items()}
    return contract.Metrics(time=T0 + step, step=step, total_steps=1000, tok_s=1.0, phase=phase, extra=extra)
