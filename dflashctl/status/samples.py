"""A run's samples read for its figures: their clock, the current process, smoothed rates.

tok/s and the step rate (the ETA's) are averaged over the newest ``SMOOTH_WINDOW_S``
of the current trainer process's samples.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

from dflashctl.store import Sample

SMOOTH_WINDOW_S = 300.0  # tok/s and the ETA are averaged over this much of the newest data


def _sample_clock(s: Sample) -> float:
    return s.observed if s.observed is not None else s.time


@dataclass(frozen=True)
class Smoothed:
    tok_s: float | None  # mean tok/s of the training samples in the window
    steps_per_s: float | None  # from the first and last step in the window
    window_s: float  # the data the figures span (at most SMOOTH_WINDOW_S)
    samples: int


def current_process(samples: Sequence[Sample]) -> list[Sample]:
    """The newest stretch of samples whose step never goes back (a restart resumes
    from an earlier checkpoint): the current trainer process's."""
    tail: list[Sample] = []
    for s in reversed(samples):
        if tail and s.step > tail[-1].step:
            break
        tail.append(s)
    return tail[::-1]


def smooth(samples: Sequence[Sample], window_s: float = SMOOTH_WINDOW_S) -> Smoothed:
    tail = current_process(samples)
    if not tail:
        return Smoothed(None, None, 0.0, 0)
    newest = tail[-1].time
    window = [s for s in tail if s.time >= newest - window_s]
    training = [s.tok_s for s in window if s.tok_s is not None and (s.phase or "training") == "training"]
    tok_s = statistics.fmean(training) if training else None
    span = window[-1].time - window[0].time
    rate = (window[-1].step - window[0].step) / span if len(window) >= 2 and span > 0 else None
    return Smoothed(tok_s, rate, span, len(window))
