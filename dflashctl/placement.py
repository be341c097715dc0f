"""How to split a host's GPUs between target and drafter, from what a run measured.

The rule: target GPUs produce hidden states, drafter GPUs consume them; the split
is right when the targets can make what the drafters can take. From a run's
metrics lines (the trainer's ``target_tok_s`` and ``target_busy`` per target
thread, ``seq_tok_s``, ``step_ms`` and ``time_ms.wait`` of the drafters):

    one target GPU, always busy:    cap_t = target_tok_s / target_busy
    one drafter GPU, never waiting: cap_d = (seq_tok_s / D) x step_ms / (step_ms - wait_ms)
    targets : drafters             = cap_d : cap_t   (of G GPUs: T = G x cap_d / (cap_t + cap_d))

both in sequence tokens per second. A short calibration run on the placement in
question gives the figures; ``dflashctl advise RUN`` reads them and says the split.

Pure: metrics lines in, an ``Advice`` out. Never here: I/O, or a run changed.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from dflashctl import contract


class PlacementError(ValueError):
    """The metrics do not say enough for advice (and why)."""


@dataclass(frozen=True)
class Advice:
    targets: int  # target GPUs of the total
    drafters: int
    total: int
    current: tuple[int, int]  # the measured run's (targets, drafters)
    target_capacity: float  # sequence tok/s one target GPU makes when always busy
    drafter_capacity: float  # sequence tok/s one drafter GPU takes when it never waits
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


def advise(lines: Sequence[contract.Metrics], total_gpus: int | None = None) -> Advice:
    """The split of ``total_gpus`` (default: the measured run's count) that balances
    the measured capacities; raises PlacementError when the lines cannot say."""
    caps_t, caps_d, shapes = [], [], []
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
    if not caps_t or not any(caps_t):
        raise PlacementError("no training metrics line carries the target and drafter figures "
                             "(target_tok_s, target_busy, seq_tok_s, step_ms): let the run train a few log intervals")
    T, D = max(set(shapes), key=shapes.count)
    cap_t, cap_d = statistics.median(caps_t), statistics.median(caps_d)
    total = int(total_gpus or (T + D))
    if total < 2:
        raise PlacementError(f"{total} GPU: target and drafter share it; a split needs at least 2")
    targets = min(total - 1, max(1, round(total * cap_d / (cap_t + cap_d))))
    made, taken = T * cap_t, D * cap_d
    bottleneck = "balanced" if abs(made - taken) <= 0.1 * max(made, taken) else (
        "target" if made < taken else "drafter")
    reason = (f"one target GPU makes {cap_t / 1000:.1f}K seq tok/s when always busy, one drafter GPU takes "
              f"{cap_d / 1000:.1f}K when it never waits; the measured {T}+{D} was "
              + {"balanced": "balanced", "target": "held back by its targets (drafters waited)",
                 "drafter": "held back by its drafters (targets idled)"}[bottleneck]
              + f"; of {total} GPUs, {targets} target + {total - targets} drafter balance them")
    return Advice(targets, total - targets, total, (T, D), round(cap_t, 1), round(cap_d, 1), bottleneck,
                  len(caps_t), reason)
