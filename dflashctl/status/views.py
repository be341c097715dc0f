"""The whole views of one read: StatusView (every run, hosts, notices) and DetailView (one run).

What the console's screens, ``status --once`` and ``status --json`` are made from.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from dflashctl.core.units import fmt_clock, short_duration
from dflashctl.status.charts import ChartView
from dflashctl.status.events import EventView
from dflashctl.status.gpus import GpuView, HostView
from dflashctl.status.runs import Notice, RunView
from dflashctl.status.schema import SCHEMA
from dflashctl.status.thresholds import Thresholds


@dataclass
class StatusView:
    now: float
    store: str
    runs: list[RunView]
    selected: str | None
    events: list[EventView]  # of the selected run, oldest first
    hosts: list[HostView]
    notices: list[Notice] = field(default_factory=list)
    supervisors: int = 0  # supervisors ticking now
    blocked: int = 0  # supervisors alive but unable to write: the store's write lock is held by another
    busy_s: float = 0.0  # the longest of those silences
    errors: list[EventView] = field(default_factory=list)  # the newest error events of every run, oldest first
    chart: ChartView | None = None  # the selected run's history at the screen's zoom

    @property
    def gpus(self) -> list[GpuView]:
        return [g for h in self.hosts for g in h.gpus]

    def summary(self, short: bool = False) -> str:
        if not self.runs:
            return "no runs yet: dflashctl launch demo"
        active = sum(r.active for r in self.runs)
        busy = f", {self.blocked} alive, store busy {short_duration(self.busy_s)}" if self.blocked else ""
        if short:
            return f"{len(self.runs)} runs, {active} active, {self.supervisors} sup{busy} · {fmt_clock(self.now)}"
        return (f"{len(self.runs)} run(s), {active} active · {self.supervisors} supervisor(s) ticking{busy}"
                f" · read {fmt_clock(self.now)}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "now": self.now,
            "store": self.store,
            "selected": self.selected,
            "supervisors": self.supervisors,
            "runs": [r.to_dict() for r in self.runs],
            "events": [asdict(e) for e in self.events],
            "hosts": [{k: v for k, v in asdict(h).items() if k != "gpus"} for h in self.hosts],
            "gpus": [asdict(g) for g in self.gpus],
            "notices": [asdict(n) for n in self.notices],
        }


@dataclass
class EnvSummary:
    snapshot_time: float | None = None
    packages: int | None = None
    torch: str | None = None
    findings: list[EventView] = field(default_factory=list)  # drift / conflict events of the run

    def lines(self) -> list[str]:
        if self.snapshot_time is None:
            head = "no environment snapshot of the host recorded before this run (dflashctl env-audit)"
        else:
            head = (f"snapshot {fmt_clock(self.snapshot_time)}: {self.packages} packages"
                    + (f", torch {self.torch}" if self.torch else ""))
        return [head] + ([f"{e.severity}: {e.message}" for e in self.findings] or ["no drift or conflict recorded"])


@dataclass
class DetailView:
    run: RunView
    events: list[EventView]
    series: list[dict[str, Any]]  # Store.sample_series
    thresholds: Thresholds
    env: EnvSummary
    restarts: list[dict[str, Any]]
    run_dir: str | None = None
    exit_code: int | None = None
    chart: ChartView | None = None  # the history at the screen's zoom
    store_bytes: int | None = None  # the run's share of the store (Store.run_bytes)
    file_bytes: int | None = None  # the whole store's file
    history_from: float | None = None  # every sample kept from here on; before, rollups (None: all kept)

    def to_dict(self) -> dict[str, Any]:
        return {"run": self.run.to_dict(), "events": [asdict(e) for e in self.events], "series": self.series,
                "thresholds": asdict(self.thresholds), "env": asdict(self.env), "restarts": self.restarts,
                "run_dir": self.run_dir, "exit_code": self.exit_code, "store_bytes": self.store_bytes,
                "file_bytes": self.file_bytes, "history_from": self.history_from}
