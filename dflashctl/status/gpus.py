"""GPU and host line views: each GPU's readings and processes, a host's CPU and memory.

From the newest poll that read them (``Store.readings``); a field a host's answer did not give is
None (unknown), and a reading older than three polls is stale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from dflashctl.core.units import NA, fmt_duration
from dflashctl.hosts.parsers import HostReading, cpu_busy_pct
from dflashctl.status.processes import Clocks, ProcessView, processes_of
from dflashctl.status.styles import _ago


@dataclass
class AppView:
    """A compute process on a GPU: whose it is (the run's trainer or standby, or
    ``foreign``: no process of a run)."""

    pid: int | None
    name: str | None
    used_memory_mib: float | None
    role: str | None = None  # trainer | standby | None (foreign)
    run_id: str | None = None  # the run whose process it is (None: foreign, or read by an older supervisor)
    process: ProcessView | None = None  # its user, SM and CPU share, RSS, elapsed, command (the host's reading)

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> "AppView":
        pid = row.get("pid") if isinstance(row.get("pid"), int) else None
        name = row.get("name") if isinstance(row.get("name"), str) else None
        role = row.get("role") if row.get("role") in ("trainer", "standby") else None
        run_id = row.get("run_id") if isinstance(row.get("run_id"), str) else None
        return cls(pid, name, _float(row.get("used_memory_mib")), role, run_id)

    @property
    def foreign(self) -> bool:
        return self.role is None


def reading_age(time: float | None, now: float) -> float | None:
    return None if time is None else max(0.0, now - time)


def reading_stale(time: float | None, stale_after_s: float | None, now: float) -> bool:
    age = reading_age(time, now)
    return age is not None and stale_after_s is not None and age > stale_after_s


@dataclass
class HostLoad:
    """A host's CPU and memory, from the newest poll that read them (the same poll
    as its GPU readings). A field the host's answer did not give is None: unknown."""

    time: float  # of the reading (local clock)
    cpus: int | None = None
    load1: float | None = None
    busy_pct: float | None = None  # all CPUs, between the two newest readings (None: only one, or far apart)
    mem_total_kib: int | None = None
    mem_available_kib: int | None = None
    stale_after_s: float | None = None  # three polls of the run whose supervisor read it
    mem_cgroup: int | None = None  # 1: the memory is a container's cgroup limit, not the machine's
    cpu_cgroup: float | None = None  # a container's CPU quota (CPUs) when the busy share is of it
    processes: list[ProcessView] = field(default_factory=list)  # the GPU and run processes, the busiest

    @classmethod
    def from_readings(cls, newer: dict[str, Any], older: dict[str, Any] | None, stale_after_s: float) -> "HostLoad":
        """The newest reading (``Store.readings``: time, host_reading); the CPU's busy
        share from the one before it when the two are at most three polls apart (over
        longer it is not this moment's)."""
        now_reading = stored_host_reading(newer.get("host_reading"))
        busy = None
        if older is not None and 0 < newer["time"] - older["time"] <= stale_after_s:
            busy = cpu_busy_pct(stored_host_reading(older.get("host_reading")), now_reading)
        return cls(newer["time"], now_reading.cpus, now_reading.load1, busy, now_reading.mem_total_kib,
                   now_reading.mem_available_kib, stale_after_s, now_reading.mem_cgroup, now_reading.cpu_cgroup,
                   processes_of(newer.get("host_reading")))

    def age_s(self, now: float) -> float | None:
        return reading_age(self.time, now)

    def stale(self, now: float) -> bool:
        """Older than three polls, as a GPU reading."""
        return reading_stale(self.time, self.stale_after_s, now)

    @property
    def cpu_fraction(self) -> float | None:
        """How busy the CPUs are, 0..1: the busy share when known, else load per CPU."""
        if self.busy_pct is not None:
            return self.busy_pct / 100
        if self.load1 is None or not self.cpus:
            return None
        return self.load1 / self.cpus

    def busy_text(self) -> str:
        return NA if self.busy_pct is None else f"{self.busy_pct:.0f}%"

    def load_text(self) -> str:
        """'2.41/2' (the 1-minute load average over the CPUs it may use)."""
        if self.load1 is None:
            return NA
        return f"{self.load1:.2f}/{self.cpus}" if self.cpus else f"{self.load1:.2f}"

    @property
    def memory_fraction(self) -> float | None:
        if self.mem_total_kib is None or self.mem_available_kib is None:
            return None
        return 1 - self.mem_available_kib / self.mem_total_kib

    def memory_text(self) -> str:
        """'5.2/24G', '0.7/2.0T': used of total, in 8 cells."""
        if self.memory_fraction is None:
            return NA
        total = self.mem_total_kib / (1024 * 1024)  # type: ignore[operator]
        used = total * self.memory_fraction
        unit, scale = ("T", 1024.0) if total >= 1000 else ("G", 1.0)
        return "/".join(f"{v / scale:.1f}" if v / scale < 10 else f"{v / scale:.0f}" for v in (used, total)) + unit


_HOST_INTS = ("cpus", "cpu_total", "cpu_idle", "mem_total_kib", "mem_available_kib", "mem_cgroup")


def stored_host_reading(value: Any) -> HostReading:
    """A reading's ``host_reading`` -> ``HostReading``; a field that is not a
    number (or not a whole one where it must be) is None, unknown."""
    value = value if isinstance(value, dict) else {}
    reading = HostReading()
    for name in (f.name for f in fields(HostReading)):
        v = _float(value.get(name))
        if v is not None and name in _HOST_INTS:
            v = int(v) if v.is_integer() and v >= 0 else None
        setattr(reading, name, v)
    if (reading.mem_total_kib is not None and reading.mem_available_kib is not None
            and not 0 <= reading.mem_available_kib <= reading.mem_total_kib) or reading.mem_total_kib == 0:
        reading.mem_total_kib = reading.mem_available_kib = None
    return reading


@dataclass
class GpuView:
    """One GPU of a host, from the newest poll that read it."""

    host: str
    index: int | None
    name: str | None = None
    role: str | None = None  # target, drafter, target+drafter; None: held by no run
    run_id: str | None = None  # the active run holding it
    time: float | None = None  # of the reading (local clock)
    utilization_pct: float | None = None
    memory_used_mib: float | None = None
    memory_total_mib: float | None = None
    temperature_c: float | None = None
    power_draw_w: float | None = None
    power_limit_w: float | None = None
    utilization_history: list[float] = field(default_factory=list)
    memory_history: list[float] = field(default_factory=list)  # used fraction 0..1
    apps: list[AppView] = field(default_factory=list)  # its compute processes (nvidia-smi --query-compute-apps)
    apps_read: bool = False  # the reading listed compute processes (an older supervisor's did not)
    stale_after_s: float | None = None  # three polls of the run whose supervisor read it
    clocks: Clocks | None = None  # SM and memory clocks, throttle reasons (None: not read)

    IDLE_PCT = 5.0  # at most this busy, no process and no run holding it: idle (drawn dim)

    @property
    def idle(self) -> bool:
        return self.run_id is None and not self.apps and (self.utilization_pct or 0.0) <= self.IDLE_PCT

    def age_s(self, now: float) -> float | None:
        return reading_age(self.time, now)

    def stale(self, now: float) -> bool:
        """Older than three polls: the readings are not today's, whatever the host says."""
        return reading_stale(self.time, self.stale_after_s, now)

    @property
    def memory_fraction(self) -> float | None:
        if self.memory_used_mib is None or not self.memory_total_mib:
            return None
        return self.memory_used_mib / self.memory_total_mib

    def memory_text(self) -> str:
        if self.memory_used_mib is None:
            return NA
        used = self.memory_used_mib / 1024
        return f"{used:.0f}/{self.memory_total_mib / 1024:.0f}G" if self.memory_total_mib else f"{used:.0f}G"

    def power_text(self) -> str:
        if self.power_draw_w is None:
            return NA
        return f"{self.power_draw_w:.0f}/{self.power_limit_w:.0f}W" if self.power_limit_w else f"{self.power_draw_w:.0f}W"


@dataclass
class HostView:
    """A host with active runs, or one a supervisor polls: how fresh its readings are, and its GPUs."""

    host: str
    runs: list[str]
    last_answer: float | None = None
    down_since: float | None = None
    error: str | None = None
    supervised: bool = False
    gpus: list[GpuView] = field(default_factory=list)
    load: HostLoad | None = None  # its CPU and memory (None: no supervisor has read them)

    def join_processes(self) -> None:
        """Each GPU process with its row of the host's reading (same pid)."""
        by_pid = {p.pid: p for p in (self.load.processes if self.load else [])}
        for g in self.gpus:
            for a in g.apps:
                a.process = by_pid.get(a.pid) if a.pid is not None else None

    def status_text(self, now: float) -> str:
        if not self.supervised:
            return "no supervisor polls it"
        if self.down_since is not None:
            return f"unreachable since {fmt_duration(now - self.down_since)}" + (f": {self.error}" if self.error else "")
        return "no answer yet" if self.last_answer is None else f"answered {_ago(now, self.last_answer)}"


def gpu_readings(value: Any) -> list[dict[str, Any]]:
    """A reading's ``gpu`` -> a list of reading dicts. The supervisor stores
    ``parsers.GpuReading`` objects as dicts (a list, or ``{"gpus": [...]}``);
    anything else reads as no readings."""
    if isinstance(value, dict):
        value = value.get("gpus", list(value.values()) if all(isinstance(v, dict) for v in value.values()) else [])
    if not isinstance(value, list):
        return []
    return [g for g in value if isinstance(g, dict)]


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)
