"""Where a host's GPUs should run the target and the drafter, from what a run measured.

Two ways to place them on G GPUs: a split (T GPUs run targets, G - T run drafters)
or shared (every GPU runs a target and a drafter). From a run's metrics lines (the
trainer's ``target_tok_s`` and ``target_busy`` per target thread, ``seq_tok_s``,
``step_ms`` and ``time_ms.wait`` of the drafters, ``gpus`` and ``gpu_mem``):

    one target GPU, always busy:    cap_t = target_tok_s / target_busy
    one drafter GPU, never waiting: cap_d = (seq_tok_s / D) x step_ms / (step_ms - wait_ms)
    split T + D of G:               min(T x cap_t, D x cap_d), best at T = G x cap_d / (cap_t + cap_d)
    shared, G GPUs:                 G x cap_t x cap_d / (cap_t + cap_d)   (each GPU does both in turn)

all in sequence tokens per second. Sharing never does worse than the best split in
this model (they are equal at an ideal, fractional T; a whole T loses some), and the
model held on 2 H200s at the reference size: from a 1+1 calibration it predicted
133.7K seq tok/s for both GPUs shared, and they made 133.8K (1.61x the 1+1's
82.9K, bench/RESULTS.md). So the rule: share, unless a target and a drafter do not
fit in one GPU's memory (the peaks the run reported against the GPU's size); then
split at the T that makes the most. A run that was itself shared gives its own
per-GPU rate for the shared figure, and capacities measured while sharing (lower
bounds) for the split.

Pure: metrics lines in, an ``Advice`` out. Never here: I/O, or a run changed.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

from dflashctl.core import contract


class PlacementError(ValueError):
    """The metrics do not say enough for advice (and why)."""


@dataclass(frozen=True)
class Advice:
    mode: str  # shared (every GPU runs a target and a drafter) | split
    targets: int  # GPUs that run a target (shared: all)
    drafters: int  # GPUs that run a drafter (shared: all)
    total: int
    placement: dict  # the trainer's placement for it: {"target": [...], "drafter": [...]}
    current: tuple[int, int]  # the measured run's (target threads, drafter replicas)
    current_shared: bool  # the measured run's targets and drafters shared their GPUs
    target_capacity: float  # sequence tok/s one target GPU makes when always busy
    drafter_capacity: float  # sequence tok/s one drafter GPU takes when it never waits
    split_tok_s: float  # the best split's sequence tok/s
    shared_tok_s: float  # sequence tok/s with every GPU shared
    fits_shared: Optional[bool]  # a target and a drafter fit one GPU's memory (None: not reported)
    bottleneck: str  # target | drafter | balanced (of the measured run)
    lines: int  # metrics lines the figures are the medians of
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _floats(value: Any) -> list[float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [float(value)]
    if isinstance(value, list):
        return [float(v) for v in value if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return []


def _devices(x: dict) -> tuple[set[str], set[str]]:
    gpus = x.get("gpus") if isinstance(x.get("gpus"), dict) else {}
    return tuple({d for d in gpus.get(role) or [] if isinstance(d, str)}  # type: ignore[return-value]
                 for role in ("target", "drafter"))


def _fits_shared(x: dict, targets: set[str], drafters: set[str]) -> Optional[bool]:
    """Whether the largest target GPU's peak plus the largest drafter GPU's peak fit in
    90 % of the smallest GPU (None: the line does not say)."""
    mem = x.get("gpu_mem") if isinstance(x.get("gpu_mem"), dict) else {}

    def figure(dev: str, key: str) -> Optional[float]:
        value = (mem.get(dev) or {}).get(key) if isinstance(mem.get(dev), dict) else None
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    peaks_t = [figure(d, "peak_gib") for d in targets]
    peaks_d = [figure(d, "peak_gib") for d in drafters]
    sizes = [figure(d, "total_gib") for d in targets | drafters]
    if not targets or not drafters or None in peaks_t + peaks_d + sizes:
        return None
    return max(peaks_t) + max(peaks_d) <= 0.9 * min(sizes)  # type: ignore[type-var, operator]


def best_split(total: int, cap_t: float, cap_d: float) -> tuple[int, float]:
    """(target GPUs, sequence tok/s) of the split of ``total`` GPUs that makes the most."""
    return max(((t, min(t * cap_t, (total - t) * cap_d)) for t in range(1, total)), key=lambda c: (c[1], -c[0]))


def advise(lines: Sequence[contract.Metrics], total_gpus: int | None = None) -> Advice:
    """The placement of ``total_gpus`` (default: the measured run's count) that makes the
    most; raises PlacementError when the lines cannot say."""
    caps_t, caps_d, shapes, per_gpu = [], [], [], []
    shared_run, used, fits_shared = False, 0, None  # as the newest usable line says
    on_cpu = False
    for m in lines:
        x = m.extra or {}
        made, busy = _floats(x.get("target_tok_s")), _floats(x.get("target_busy"))
        per_drafter = _floats(x.get("tok_s_per_drafter"))
        seq = _floats(x.get("seq_tok_s"))
        step = _floats(x.get("step_ms"))
        wait = _floats((x.get("time_ms") or {}).get("wait") if isinstance(x.get("time_ms"), dict) else None)
        if m.phase != contract.PHASE_TRAINING or not made or len(made) != len(busy) or not per_drafter or not seq \
                or not step or step[0] <= 0:
            continue
        T, D = len(made), len(per_drafter)
        caps_t.append(statistics.median(t / b for t, b in zip(made, busy) if b > 0) if any(busy) else 0.0)
        working = max(1e-9, step[0] - min(wait[0] if wait else 0.0, step[0] * 0.999))
        caps_d.append(seq[0] / D * step[0] / working)
        shapes.append((T, D))
        targets, drafters = _devices(x)
        on_cpu = bool(targets | drafters) and all(d == "cpu" for d in targets | drafters)
        shared_run = bool(targets) and targets == drafters
        # Each thread runs on one device: a line naming more devices than threads is not believed.
        used = min(len(targets | drafters), T + D) if targets else T + D
        per_gpu.append(seq[0] / max(1, used))
        fits_shared = True if shared_run else _fits_shared(x, targets, drafters)
    if not caps_t or not any(caps_t):
        raise PlacementError("no training metrics line carries the target and drafter figures "
                             "(target_tok_s, target_busy, seq_tok_s, step_ms): let the run train a few log intervals")
    if on_cpu:
        raise PlacementError("the run trained on CPU (its metrics name no GPU): its figures say nothing of how GPUs "
                             "would split; calibrate on the GPU host (`trainer.placement.device: cuda`), then advise")
    T, D = max(set(shapes), key=shapes.count)
    cap_t, cap_d = statistics.median(caps_t), statistics.median(caps_d)
    total = int(total_gpus or used)
    if total < 1:
        raise PlacementError(f"{total} GPUs: nothing to place")
    shared = (total * statistics.median(per_gpu) if shared_run
              else total * cap_t * cap_d / (cap_t + cap_d) if cap_t + cap_d > 0 else 0.0)
    t_split, split = best_split(total, cap_t, cap_d) if total >= 2 else (0, 0.0)
    share = total < 2 or (fits_shared is not False and shared >= split)
    made, taken = T * cap_t, D * cap_d
    bottleneck = "balanced" if abs(made - taken) <= 0.1 * max(made, taken) else (
        "target" if made < taken else "drafter")
    gpus = list(range(total))
    placement = ({"target": gpus, "drafter": gpus} if share
                 else {"target": gpus[:t_split], "drafter": gpus[t_split:]})
    measured = (f"the measured {T}+{D}{' (shared)' if shared_run else ''} was "
                + {"balanced": "balanced", "target": "held back by its targets (drafters waited)",
                   "drafter": "held back by its drafters (targets idled)"}[bottleneck])
    caps = (f"one target GPU makes {cap_t / 1000:.1f}K seq tok/s when always busy, one drafter GPU takes "
            f"{cap_d / 1000:.1f}K when it never waits" + (" (measured while sharing: lower bounds)" if shared_run else ""))
    basis = ("this run's rate per GPU" if shared_run
             else "each GPU doing both in turn")
    shared_text = f"shared: {shared / 1000:.1f}K ({basis})"
    split_text = f"best split {t_split}+{total - t_split}: {split / 1000:.1f}K" if total >= 2 else "no split of 1 GPU"
    memory = {True: "a target and a drafter fit one GPU", False: "a target and a drafter do not fit one GPU "
              "(the run's memory peaks)", None: "memory not reported: share only if a target and a drafter fit one GPU"}[
        fits_shared]
    choice = (f"share all {total} GPUs" if share else f"split {t_split} target + {total - t_split} drafter")
    reason = f"{caps}; {measured}. Of {total} GPUs, {shared_text}; {split_text}; {memory}: {choice}."
    return Advice("shared" if share else "split", total if share else t_split, total if share else total - t_split,
                  total, placement, (T, D), shared_run, round(cap_t, 1), round(cap_d, 1), round(split, 1),
                  round(shared, 1), fits_shared, bottleneck, len(caps_t), reason)
