"""A host's processes and its GPUs' clocks as the views show them: what an operator
opened htop and nvitop for. From the host's stored reading (``HostReading.processes``:
the GPU processes, the runs' trainers and standbys with their parents, the busiest)
and each GPU row's ``extra`` (clocks, throttle reasons). Stored values are checked
again here (a field of the wrong type is unknown, never an error).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflashctl.core.units import fmt_duration
from dflashctl.hosts.parsers import throttle_reasons


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def fmt_kib(kib: float | None) -> str:
    """Resident memory as htop shows it: 812M, 12.3G."""
    if kib is None:
        return "?"
    mib = kib / 1024
    return f"{mib / 1024:.1f}G" if mib >= 1024 else f"{mib:.0f}M"


@dataclass
class ProcessView:
    pid: int
    ppid: int | None = None
    user: str | None = None
    cpu_pct: float | None = None  # over the probe's short sample
    rss_kib: float | None = None
    elapsed_s: float | None = None
    cmd: str | None = None
    sm_pct: float | None = None  # nvidia-smi pmon's share of the GPU's SMs
    top: bool = False  # one of the host's busiest

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> "ProcessView | None":
        pid = _int(row.get("pid"))
        if pid is None:
            return None
        return cls(pid, _int(row.get("ppid")), _text(row.get("user")), _num(row.get("cpu_pct")),
                   _num(row.get("rss_kib")), _num(row.get("elapsed_s")), _text(row.get("cmd")),
                   _num(row.get("sm_pct")), row.get("top") is True)

    def figures(self) -> str:
        """``alice sm 97% cpu 101% rss 12.3G up 2.1 d``: who, how much, since when."""
        parts = [self.user or "?"]
        if self.sm_pct is not None:
            parts.append(f"sm {self.sm_pct:.0f}%")
        parts.append("cpu ?" if self.cpu_pct is None else f"cpu {self.cpu_pct:.0f}%")
        parts.append(f"rss {fmt_kib(self.rss_kib)}")
        if self.elapsed_s is not None:
            parts.append(f"up {fmt_duration(self.elapsed_s)}")
        return " ".join(parts)


def processes_of(host_reading: Any) -> list[ProcessView]:
    """The processes a stored host reading holds ([] for none, or an older probe)."""
    rows = host_reading.get("processes") if isinstance(host_reading, dict) else None
    views = [ProcessView.from_row(r) for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []
    return [v for v in views if v is not None]


def busiest(processes: list[ProcessView], n: int = 3) -> list[ProcessView]:
    """The host's busiest processes, most CPU first."""
    return sorted((p for p in processes if p.top and p.cpu_pct is not None), key=lambda p: -(p.cpu_pct or 0))[:n]


def lineage(processes: list[ProcessView], pid: int) -> list[ProcessView]:
    """``pid`` and its parents the reading holds, the process first (trainer, run.sh,
    the tmux server...): how it was started."""
    by_pid = {p.pid: p for p in processes}
    chain: list[ProcessView] = []
    here = by_pid.get(pid)
    while here is not None and here not in chain:
        chain.append(here)
        here = by_pid.get(here.ppid) if here.ppid else None
    return chain


@dataclass
class Clocks:
    """A GPU's clocks and why it is held below its maximum."""

    sm_mhz: float | None = None
    max_sm_mhz: float | None = None
    mem_mhz: float | None = None
    reasons: list[str] | None = None  # throttle reasons in words (None: not read)

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> "Clocks | None":
        extra = row.get("extra") if isinstance(row.get("extra"), dict) else {}
        mask = extra.get("clocks_throttle_reasons.active")
        clocks = cls(_num(row.get("clocks_sm_mhz")), _num(extra.get("clocks.max.sm")), _num(extra.get("clocks.mem")),
                     throttle_reasons(mask))
        return None if clocks == cls(clocks.sm_mhz) else clocks

    @property
    def slowdowns(self) -> list[str]:
        """The reasons that slow a busy GPU (idle is none)."""
        return [r for r in self.reasons or [] if r != "gpu idle"]

    def text(self) -> str:
        """``sm 1440/1980 MHz · sw power cap``."""
        sm = "?" if self.sm_mhz is None else f"{self.sm_mhz:.0f}"
        out = f"sm {sm}/{self.max_sm_mhz:.0f} MHz" if self.max_sm_mhz else f"sm {sm} MHz"
        return out + "".join(f" · {r}" for r in self.slowdowns)
