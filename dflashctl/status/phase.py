"""A run's phase (starting, compiling, training, ...) and its time in it against a budget.

Derived from the newest samples and the current process's events; budgets from
the playbook (``thresholds``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from dflashctl.core.states import FINAL_STATES, LAUNCHING, RESTARTING
from dflashctl.core.units import NA, fmt_duration, short_duration
from dflashctl.status.samples import _sample_clock
from dflashctl.status.thresholds import Thresholds
from dflashctl.store import Event, Run, Sample

_STARTED = re.compile(r"\(pid [^,]*, phase (\w+)\)")
PROGRESSING = ("running", "stalled")  # states in which an ETA means something


@dataclass
class PhaseView:
    name: str | None  # starting, compiling, training, checkpointing, restarting, launching, or a final state
    since: float | None = None  # local clock
    budget_s: float | None = None
    elapsed_s: float | None = None  # until the newest data when that is not live (no ticking clock on a dead run)

    @property
    def over_budget(self) -> bool:
        return self.budget_s is not None and self.elapsed_s is not None and self.elapsed_s > self.budget_s

    def text(self, compact: bool = False) -> str:
        if self.name is None:
            return NA
        dur = short_duration if compact else fmt_duration
        if self.elapsed_s is None or self.name == "training":
            return self.name
        if self.budget_s is not None:
            return f"{self.name} {dur(self.elapsed_s)}{'/' if compact else ' / '}{dur(self.budget_s)}"
        return f"{self.name} {dur(self.elapsed_s)}"


def derive_phase(run: Run, samples: Sequence[Sample], state_events: Sequence[Event], restarts: Sequence[Any],
                 thresholds: Callable[[], Thresholds], as_of: float) -> PhaseView:
    """The run's phase, from its newest samples (their ``phase``) and the events of its
    current process (the start event names the phase status.json showed). Budgets
    (``thresholds()``) are read only for a phase that has one."""
    if run.state in FINAL_STATES:
        return PhaseView(run.state, run.ended)
    if run.state == RESTARTING:
        since = max([r.time for r in restarts] + [e.time for e in state_events if (e.detail or {}).get("to") == RESTARTING]
                    or [run.updated or run.created])
        return PhaseView("restarting", since, None, max(0.0, as_of - since))
    start_t, start_phase = None, None
    for e in reversed(state_events):
        if (e.detail or {}).get("to") == "running" or e.kind == "phase":
            start_t = e.time
            match = _STARTED.search(e.message or "")
            start_phase = (e.detail or {}).get("phase") or (match.group(1) if match else None)
            break
    current = [s for s in samples if start_t is None or _sample_clock(s) >= start_t - 1.0]
    if current:
        newest = current[-1].phase or "training"
        since = _sample_clock(current[-1])
        for s in reversed(current):
            if (s.phase or "training") != newest:
                break
            since = _sample_clock(s)
        name = newest
    elif start_t is not None:
        name, since = start_phase or "starting", start_t
    else:
        name, since = ("starting" if run.state == LAUNCHING else None), run.created
    budget = None
    if name == "starting":
        budget = thresholds().startup_budget_s
    elif name == "compiling":
        budget = thresholds().compile_budget_s
    elapsed = max(0.0, as_of - since) if since is not None and name is not None else None
    return PhaseView(name, since, budget, elapsed)
