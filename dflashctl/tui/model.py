"""View models of the status screen: pure data read from the store, never drawing.

``load_status(store, now, ...)`` returns a ``StatusView``: every run worth showing
(active runs first, then the most recent ones) with its latest sample, throughput
history, restarts and last event; the selected run's recent events; and the GPU
readings of the latest samples. The supervisor writes all of it; nothing here
touches a host. A missing reading is a value (``None``, shown as ``N/A``), never
an exception.

Used by the Textual app (``dflashctl.tui.app``) and by ``status --once`` /
``--json``; this module never imports UI code.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from dflashctl.detectors import fmt_clock, fmt_duration, fmt_tok_s
from dflashctl.store import ACTIVE_STATES, FINAL_STATES, Event, Run, Store

HISTORY = 60  # samples of tok/s history per run
EVENTS = 20  # recent events of the selected run
RECENT_RUNS = 20  # finished runs shown besides the active ones
NA = "N/A"

# Column headers of the run table, in the order of RunView.cells().
RUN_COLUMNS = ("run", "state", "host", "step", "tok/s", "history", "MFU", "loss", "accept", "ETA", "restarts",
               "last event")
GPU_COLUMNS = ("host", "run", "GPU", "name", "util", "memory", "temp", "power")
EVENT_COLUMNS = ("time", "severity", "kind", "message")

# Styles are data (rich style names); the drawing code decides how to apply them.
STATE_STYLE = {"running": "green", "stalled": "yellow", "restarting": "yellow", "lost": "yellow",
               "failed": "red", "launching": "cyan", "done": "blue", "stopped": "dim"}
SEVERITY_STYLE = {"info": "", "warning": "yellow", "error": "red", "critical": "bold red"}

_BARS = "▁▂▃▄▅▆▇█"


def spark(values: list[float], width: int = 12) -> str:
    """A one-line text sparkline of the last ``width`` values ('' without values)."""
    values = [v for v in values if v is not None and math.isfinite(v)][-width:]
    if not values:
        return ""
    low, high = min(values), max(values)
    if high - low <= 1e-12 * max(abs(high), 1.0):
        return _BARS[len(_BARS) // 2] * len(values)
    return "".join(_BARS[round((v - low) / (high - low) * (len(_BARS) - 1))] for v in values)


def _num(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return NA
    return format(value, fmt)


# --------------------------------------------------------------------------- views


@dataclass
class EventView:
    time: float
    run_id: str | None
    kind: str
    severity: str
    message: str

    @classmethod
    def from_event(cls, e: Event) -> "EventView":
        return cls(e.time, e.run_id, e.kind, e.severity, e.message)

    def cells(self) -> tuple[str, ...]:
        return (fmt_clock(self.time), self.severity, self.kind, self.message)


@dataclass
class GpuView:
    """One GPU reading from a run's latest sample that has readings."""

    host: str
    run_id: str
    time: float
    index: int | None = None
    name: str | None = None
    utilization_pct: float | None = None
    memory_used_mib: float | None = None
    memory_total_mib: float | None = None
    temperature_c: float | None = None
    power_draw_w: float | None = None

    def cells(self) -> tuple[str, ...]:
        if self.memory_used_mib is None:
            memory = NA
        elif self.memory_total_mib:
            memory = f"{self.memory_used_mib / 1024:.1f}/{self.memory_total_mib / 1024:.0f} GiB"
        else:
            memory = f"{self.memory_used_mib / 1024:.1f} GiB"
        return (
            self.host,
            self.run_id,
            NA if self.index is None else str(self.index),
            self.name or NA,
            _num(self.utilization_pct, ".0f") + (" %" if self.utilization_pct is not None else ""),
            memory,
            _num(self.temperature_c, ".0f") + (" C" if self.temperature_c is not None else ""),
            _num(self.power_draw_w, ".0f") + (" W" if self.power_draw_w is not None else ""),
        )


@dataclass
class RunView:
    id: str
    playbook: str
    host: str
    state: str
    created: float
    total_steps: int | None = None
    step: int | None = None
    phase: str | None = None
    tok_s: float | None = None
    tok_s_history: list[float] = field(default_factory=list)
    mfu: float | None = None  # the trainer's estimate, 0..1 (GPU runs only)
    loss: float | None = None
    acc: float | None = None
    accept_len: float | None = None
    eta_s: float | None = None
    sample_time: float | None = None
    restarts: int = 0
    last_event: EventView | None = None
    exit_reason: str | None = None

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    def step_text(self) -> str:
        if self.step is None:
            return NA
        if not self.total_steps:
            return f"{self.step:,}"
        return f"{self.step:,}/{self.total_steps:,} ({100.0 * self.step / self.total_steps:.1f}%)"

    def eta_text(self) -> str:
        if self.state in FINAL_STATES:
            return "-"
        return NA if self.eta_s is None else fmt_duration(self.eta_s)

    def last_event_text(self) -> str:
        if self.last_event is None:
            return NA
        return f"{fmt_clock(self.last_event.time)} {self.last_event.message}"

    def cells(self) -> tuple[str, ...]:
        """Display text per column of RUN_COLUMNS."""
        return (
            self.id,
            self.state,
            self.host,
            self.step_text(),
            NA if self.tok_s is None else fmt_tok_s(self.tok_s),
            spark(self.tok_s_history) or NA,
            NA if self.mfu is None else f"{100 * self.mfu:.0f} %",
            _num(self.loss, ".4f"),
            _num(self.accept_len, ".2f"),
            self.eta_text(),
            str(self.restarts),
            self.last_event_text(),
        )


@dataclass
class StatusView:
    now: float
    store: str
    runs: list[RunView]
    selected: str | None
    events: list[EventView]  # of the selected run, oldest first
    gpus: list[GpuView]

    @property
    def selected_run(self) -> RunView | None:
        return next((r for r in self.runs if r.id == self.selected), None)

    def summary(self) -> str:
        active = sum(r.active for r in self.runs)
        return (f"{len(self.runs)} run(s), {active} active · store {self.store} · read {fmt_clock(self.now)}"
                if self.runs else f"no runs yet (store {self.store}): dflashctl launch demo")

    def to_dict(self) -> dict[str, Any]:
        return {
            "now": self.now,
            "store": self.store,
            "selected": self.selected,
            "runs": [{**asdict(r), "active": r.active} for r in self.runs],
            "events": [asdict(e) for e in self.events],
            "gpus": [asdict(g) for g in self.gpus],
        }


# --------------------------------------------------------------------------- loading


def _total_steps(run: Run) -> int | None:
    try:
        return int(run.config["trainer"]["train"]["steps"])
    except (KeyError, TypeError, ValueError):
        return None


def gpu_readings(value: Any) -> list[dict[str, Any]]:
    """A sample's ``gpu`` column -> a list of reading dicts. The supervisor stores
    ``parsers.GpuReading`` objects as dicts (a list, or ``{"gpus": [...]}``);
    anything else reads as no readings."""
    if isinstance(value, dict):
        value = value.get("gpus", list(value.values()) if all(isinstance(v, dict) for v in value.values()) else [])
    if not isinstance(value, list):
        return []
    return [g for g in value if isinstance(g, dict)]


def _gpu_views(run: Run, samples) -> list[GpuView]:
    latest = next((s for s in reversed(samples) if gpu_readings(s.gpu)), None)
    if latest is None:
        return []
    names = set(GpuView.__dataclass_fields__) - {"host", "run_id", "time"}
    return [GpuView(run.host, run.id, latest.time, **{k: g.get(k) for k in names}) for g in gpu_readings(latest.gpu)]


def _run_view(store: Store, run: Run, history: int) -> tuple[RunView, list]:
    samples = store.samples(run.id, limit=history)
    last = samples[-1] if samples else None
    events = store.events(run.id, limit=1)
    view = RunView(
        id=run.id,
        playbook=run.playbook,
        host=run.host,
        state=run.state,
        created=run.created,
        total_steps=_total_steps(run),
        tok_s_history=[s.tok_s for s in samples if s.tok_s is not None],
        restarts=len(store.restarts(run.id)),
        last_event=EventView.from_event(events[-1]) if events else None,
        exit_reason=run.exit_reason,
    )
    if last is not None:
        view.step, view.phase, view.tok_s, view.loss = last.step, last.phase, last.tok_s, last.loss
        view.acc, view.accept_len, view.eta_s, view.sample_time = last.acc, last.accept_len, last.eta_s, last.time
        view.mfu = last.mfu
    return view, samples


def select_runs(store: Store, run: str | None = None, recent: int = RECENT_RUNS) -> list[Run]:
    """One run (by id or prefix), or the active runs and then the most recent others."""
    if run is not None:
        return [store.get_run(run)]
    active = store.list_runs(active_only=True)
    seen = {r.id for r in active}
    return active + [r for r in store.list_runs(limit=recent) if r.id not in seen]


def load_status(
    store: Store,
    now: float,
    run: str | None = None,
    selected: str | None = None,
    *,
    history: int = HISTORY,
    events: int = EVENTS,
) -> StatusView:
    """Everything the status screen shows, read from the store at ``now``."""
    loaded = [(r, *_run_view(store, r, history)) for r in select_runs(store, run)]
    runs = [view for _, view, _ in loaded]
    if selected not in {r.id for r in runs}:
        selected = runs[0].id if runs else None
    gpus = [g for r, _, samples in loaded if r.state in ACTIVE_STATES or r.id == selected
            for g in _gpu_views(r, samples)]
    recent = [EventView.from_event(e) for e in store.events(selected, limit=events)] if selected else []
    return StatusView(now, store.path, runs, selected, recent, gpus)
