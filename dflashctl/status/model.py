"""View models of the status console: pure data read from the store, never drawing.

``StatusReader(store).load(now, ...)`` (or ``load_status``) returns a
``StatusView``: every run worth showing (active runs first, then the most recent
ones), each with

- its freshness (``dflashctl.status.freshness``): supervised or not, data age, host
  unreachable; a run whose data is not live never shows an ETA, and one nobody
  watches comes with the command that fixes it (``notices``);
- its phase (starting, compiling, training, checkpointing, restarting, ...) with
  the time spent in it against the playbook's budget ("compiling 12 m / 30 m");
- progress, tok/s averaged over ``SMOOTH_WINDOW_S`` and as a share of the
  baseline, an ETA from the step rate over the same window, loss, acceptance
  tau (the estimate, accept_len + 1, and the measured one of the newest eval), restarts, the event that matters last;
- for a run on several hosts, each host's process as the supervisor last saw it
  (``RunHostView``), with how old that is;

the GPUs of every host with an active run (one row per GPU: role, the run that
holds it, readings and a short history), and the selected run's recent events.
``StatusReader.detail`` reads one run in full (every event, the whole history as
a chart series, thresholds, the environment audit). ``select_columns`` picks the
run columns that fit a width, for the screen and for ``status --once``.

Everything here comes from the store (the supervisor writes it) and the run's
playbook file (its thresholds); nothing touches a host. A missing reading is a
value (``None``, shown as ``N/A``), never an exception. This module never imports
UI code (Textual): ``status --once`` / ``--json`` use it without a screen.
"""

from __future__ import annotations

import math
import os
import re
import socket
import sqlite3
import statistics
import threading
import urllib.parse
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Iterable, Sequence

from dflashctl.core.contract import describe_exit, tau_estimate, tau_gap
from dflashctl.core.states import ACTIVE_STATES, FINAL_STATES, LAUNCHING, RESTARTING
from dflashctl.core.units import NA, fmt_clock, fmt_duration, fmt_tok_s, short_duration, short_rate
from dflashctl.hosts.parsers import HostReading, cpu_busy_pct
from dflashctl.runs.recorded import playbook_now, thresholds_of
from dflashctl.status.columns import Col, choose
from dflashctl.status.freshness import Freshness, freshness
from dflashctl.store import Event, Run, Sample, Store

SCHEMA = "dflashctl.status/1"  # the --json document's name and version (JSON_SCHEMA below)
HISTORY = 60  # newest samples per active run read on each refresh (smoothing, sparkline)
FINISHED_HISTORY = 12  # of a finished run
SMOOTH_WINDOW_S = 300.0  # tok/s and the ETA are averaged over this much of the newest data
GPU_HISTORY = 16  # GPU readings per GPU in its history
EVENTS = 40  # recent events of the selected run
ERRORS = 20  # newest error events of every run read on each refresh (the console's banner and bell)
DETAIL_EVENTS = 500  # events in a run's detail view
RECENT_RUNS = 20  # finished runs shown besides the active ones
SERIES_POINTS = 240  # buckets of a run's whole history in its charts
BASELINE_TTL_S = 60.0  # a learned baseline is read again after this long

# Styles are data (rich style names); the drawing code decides how to apply them.
STATE_STYLE = {
    "running": "green", "stalled": "bold yellow", "restarting": "yellow", "lost": "yellow", "failed": "bold red",
    "launching": "cyan", "done": "blue", "stopped": "dim", "unsupervised": "bold white on red",
    "unreachable": "bold red", "stale": "yellow", "store busy": "bold yellow",
}
SEVERITY_STYLE = {"info": "", "warning": "yellow", "error": "red", "critical": "bold red"}
PHASE_STYLE = {"compiling": "magenta", "starting": "cyan", "regenerating": "cyan", "checkpointing": "blue", "training": "green",
               "restarting": "yellow"}

_BARS = "▁▂▃▄▅▆▇█"


# --------------------------------------------------------------------------- small formatters


def spark(values: Sequence[float | None], width: int = 12, low: float | None = 0.0,
          high: float | None = None) -> str:
    """A one-line text sparkline of the last ``width`` values ('' without values).

    Scaled from ``low`` (0 by default, so 12.0 and 12.7 Ktok/s draw as nearly equal
    bars, not as empty and full ones) to ``high`` (the largest value by default);
    ``low=None`` scales from the smallest value (shows small changes, exaggerates
    noise)."""
    values = [v for v in values if v is not None and math.isfinite(v)][-width:]
    if not values:
        return ""
    low = min(values) if low is None else min(low, min(values))
    high = max(values) if high is None else max(high, max(values))
    if high - low <= 1e-12 * max(abs(high), 1.0):
        return _BARS[len(_BARS) // 2] * len(values)
    return "".join(_BARS[round((v - low) / (high - low) * (len(_BARS) - 1))] for v in values)


def bar(fraction: float | None, width: int) -> str:
    """A horizontal bar of ``width`` cells filled to ``fraction`` (eighths of a cell)."""
    if fraction is None or not math.isfinite(fraction) or width <= 0:
        return "·" * max(width, 0)
    eighths = round(max(0.0, min(1.0, fraction)) * width * 8)
    full, part = divmod(eighths, 8)
    return ("█" * full + (" ▏▎▍▌▋▊▉"[part] if part else "")).ljust(width, "░")[:width]


def _num(value: Any, fmt: str, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return NA
    return format(value, fmt) + unit


def _ago(now: float, t: float | None) -> str:
    return NA if t is None else f"{fmt_duration(max(0.0, now - t))} ago"


# --------------------------------------------------------------------------- thresholds (the playbook's)


@dataclass(frozen=True)
class Thresholds:
    """What the run's playbook holds it to (as its file says now)."""

    source: str | None
    error: str | None  # why the playbook could not be read (the defaults are shown)
    baseline_tok_s: float | None  # the playbook's; None: learned from earlier healthy runs
    regression_fraction: float
    regression_windows: int
    max_eta_s: float | None
    stall_window_s: float
    compile_budget_s: float
    startup_budget_s: float
    poll_interval_s: float
    max_restarts: int
    restart_window_s: float
    crash_loop_k: int

    def lines(self) -> list[tuple[str, str]]:
        """(name, value) pairs for the detail view."""
        return [
            ("baseline", fmt_tok_s(self.baseline_tok_s) if self.baseline_tok_s else "learned from earlier healthy runs"),
            ("regression", f"below {self.regression_fraction:.0%} of baseline for {self.regression_windows} windows"),
            ("max ETA", fmt_duration(self.max_eta_s) if self.max_eta_s else "none"),
            ("stall window", fmt_duration(self.stall_window_s)),
            ("compile budget", fmt_duration(self.compile_budget_s)),
            ("startup budget", fmt_duration(self.startup_budget_s)),
            ("poll interval", fmt_duration(self.poll_interval_s)),
            ("restarts", f"at most {self.max_restarts} in {fmt_duration(self.restart_window_s)}; "
                         f"stop after {self.crash_loop_k} without progress"),
            ("playbook", self.source or NA),
        ] + ([("warning", self.error)] if self.error else [])


def _thresholds_of(run: Run, playbooks_dir: str | None) -> Thresholds:
    """The run's playbook thresholds: as recorded at launch while the playbook file
    has not changed since, else read from the file (it was launched from, else by
    name) as it says now."""
    source = (run.config or {}).get("playbook_source")
    recorded = (run.config or {}).get("thresholds")
    if isinstance(recorded, dict) and source and os.path.isfile(source) and os.path.getmtime(source) <= run.created:
        try:
            return Thresholds(source, None, **recorded)
        except TypeError:
            pass  # recorded by another version: read the file
    pb, error = playbook_now(run, None, playbooks_dir)  # pydantic: only when the file must be read
    if pb is not None:
        return Thresholds(pb.source, None, **thresholds_of(pb))
    return Thresholds(source, f"playbook {run.playbook} cannot be read ({error}): default thresholds shown",
                      **thresholds_of(None))


# --------------------------------------------------------------------------- phase


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


def _sample_clock(s: Sample) -> float:
    return s.observed if s.observed is not None else s.time


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


# --------------------------------------------------------------------------- smoothing


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


# --------------------------------------------------------------------------- views


@dataclass
class EventView:
    time: float
    run_id: str | None
    kind: str
    severity: str
    message: str
    classification: str = ""
    id: int = 0
    detail: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_event(cls, e: Event) -> "EventView":
        return cls(e.time, e.run_id, e.kind, e.severity, e.message, classify(e), e.id,
                   e.detail if isinstance(e.detail, dict) else {})

    @property
    def first_error(self) -> str | None:
        """The trainer's own first error line behind the event, as it printed it (the
        line its crash signature matched, else the exception of its traceback, else
        the error its status.json named), never the signature's numberless pattern."""
        d = self.detail
        finding = d.get("finding") if isinstance(d.get("finding"), dict) else {}
        for value in (d.get("matched_line"), d.get("exception"), finding.get("matched_line"),
                      finding.get("exception")):
            if isinstance(value, str) and value.strip():
                return value.strip()
        signature, message = d.get("status_error"), d.get("status_message")
        if isinstance(message, str) and message.strip():  # status.json's: "Type: N" -> "Type: " + its real words
            kind = signature.split(":", 1)[0] if isinstance(signature, str) and ":" in signature else None
            return f"{kind}: {message.strip()}" if kind else message.strip()
        return signature if isinstance(signature, str) and signature.strip() else None

    def cells(self) -> tuple[str, ...]:
        return (fmt_clock(self.time), self.severity, self.classification or self.kind, self.message)


def classify(e: Event) -> str:
    """An event's class for the timeline: its kind, made precise by its detail
    (a state change's target, a crash signature)."""
    detail = e.detail if isinstance(e.detail, dict) else {}
    if e.kind == "state" and detail.get("to"):
        return f"state→{detail['to']}"
    signature = detail.get("signature")
    if signature is None and isinstance(detail.get("finding"), dict):
        signature = detail["finding"].get("signature")
    return f"{e.kind}:{signature}" if signature else e.kind


@dataclass
class AppView:
    """A compute process on a GPU: whose it is (the run's trainer or standby, or
    ``foreign``: no process of a run)."""

    pid: int | None
    name: str | None
    used_memory_mib: float | None
    role: str | None = None  # trainer | standby | None (foreign)

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> "AppView":
        pid = row.get("pid") if isinstance(row.get("pid"), int) else None
        name = row.get("name") if isinstance(row.get("name"), str) else None
        role = row.get("role") if row.get("role") in ("trainer", "standby") else None
        return cls(pid, name, _float(row.get("used_memory_mib")), role)

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
    """A host's CPU and memory, from the newest sample that read them (the same poll
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

    @classmethod
    def from_samples(cls, newer: Sample, older: Sample | None, stale_after_s: float) -> "HostLoad":
        """The newest reading; the CPU's busy share from the one before it when the
        two are at most three polls apart (over longer it is not this moment's)."""
        now_reading = stored_host_reading(newer.host_reading)
        busy = None
        if older is not None and 0 < _sample_clock(newer) - _sample_clock(older) <= stale_after_s:
            busy = cpu_busy_pct(stored_host_reading(older.host_reading), now_reading)
        return cls(_sample_clock(newer), now_reading.cpus, now_reading.load1, busy, now_reading.mem_total_kib,
                   now_reading.mem_available_kib, stale_after_s, now_reading.mem_cgroup, now_reading.cpu_cgroup)

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
    """A sample's ``host_reading`` column -> ``HostReading``; a field that is not a
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
    """One GPU of a host, from the newest sample that read it."""

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
    """A host with active runs: how fresh its readings are, and its GPUs."""

    host: str
    runs: list[str]
    last_answer: float | None = None
    down_since: float | None = None
    error: str | None = None
    supervised: bool = False
    gpus: list[GpuView] = field(default_factory=list)
    load: HostLoad | None = None  # its CPU and memory (None: no supervisor has read them)

    def status_text(self, now: float) -> str:
        if not self.supervised:
            return "no supervisor polls it"
        if self.down_since is not None:
            return f"unreachable since {fmt_duration(now - self.down_since)}" + (f": {self.error}" if self.error else "")
        return "no answer yet" if self.last_answer is None else f"answered {_ago(now, self.last_answer)}"


@dataclass
class RunHostView:
    """One host (rank) of a multi-host run: its process as the supervisor last saw it
    (``Store.update_run_hosts``), and how old that is. ``stale``: older than the
    run's freshness window (``Freshness.stale_after_s``), the rule a run's own data
    is held to; a finished run's rows are shown with their age, never as stale."""

    rank: int
    host: str
    phase: str | None = None  # the process's status.json phase
    step: int | None = None
    alive: bool | None = None  # the process exists (None: not read)
    exit_code: int | None = None  # what run.sh wrote: the process ended
    exit_reason: str | None = None  # the exit code in words (contract.describe_exit)
    error: str | None = None  # what the probe could not read, or why the host did not answer
    seen: float | None = None  # when the supervisor last got an answer from it (local clock)
    age_s: float | None = None  # now - seen; None: never seen
    stale: bool = False

    @classmethod
    def from_row(cls, row: dict[str, Any], now: float, stale_after_s: float | None) -> "RunHostView":
        seen, code = row.get("seen"), row.get("exit_code")
        age = None if seen is None else max(0.0, now - seen)
        return cls(row["rank"], row["host"], row.get("phase"), row.get("step"), row.get("alive"), code,
                   None if code is None else describe_exit(code), row.get("error"), seen, age,
                   age is not None and stale_after_s is not None and age > stale_after_s)

    def state_text(self) -> str:
        """What the process is doing: its phase, or that it ended or is gone."""
        if self.exit_code is not None:
            return f"ended: {self.exit_reason}"
        if self.alive is False:
            return "not alive"
        return self.phase or NA

    def seen_text(self) -> str:
        if self.age_s is None:
            return "no answer yet"
        return ("stale: " if self.stale else "") + f"seen {short_duration(self.age_s)} ago"


@dataclass
class DirectProbe:
    """What the status console saw itself of a run nobody supervises (one probe round
    trip, in a worker): nothing of it is stored."""

    time: float
    session_alive: bool | None = None
    trainer_alive: bool | None = None
    trainer_state: str | None = None  # /proc state letter: T is stopped
    phase: str | None = None
    step: int | None = None
    exit_code: int | None = None
    error: str | None = None

    @classmethod
    def from_probe(cls, time: float, result: Any) -> "DirectProbe":
        """From a ``probe.ProbeResult``."""
        status, process = result.status, result.process
        return cls(time, result.session_alive, process.alive if process else None, process.state if process else None,
                   status.phase if status else None, status.step if status else None, result.exit_code)

    def text(self, now: float) -> str:
        head = f"probed by status {fmt_duration(max(0.0, now - self.time))} ago: "
        if self.error:
            return head + f"no answer ({self.error})"
        if self.exit_code is not None:
            alive = f"the trainer ended (exit code {self.exit_code})"
        elif self.trainer_alive:
            alive = "the trainer is alive" + (" but stopped (SIGSTOP)" if self.trainer_state == "T" else "")
        elif self.session_alive:
            alive = "its tmux session is alive"
        else:
            alive = "no trainer and no session"
        return head + alive + (f", {self.phase}" if self.phase else "") + (f" at step {self.step:,}" if self.step else "")


@dataclass
class Notice:
    """Something the operator must act on, with the command that does it."""

    severity: str  # warning | error
    text: str
    fix: str | None = None
    run_id: str | None = None


@dataclass
class RunView:
    id: str
    playbook: str
    host: str
    state: str  # as stored
    created: float
    freshness: Freshness
    phase: PhaseView
    total_steps: int | None = None
    step: int | None = None
    tok_s: float | None = None  # mean over the window (training samples)
    tok_s_last: float | None = None  # the newest sample's
    window_s: float = 0.0  # what tok/s and the ETA are averaged over
    tok_s_history: list[float] = field(default_factory=list)  # the current process's newest samples
    loss_history: list[float] = field(default_factory=list)
    accept_history: list[float] = field(default_factory=list)
    baseline_tok_s: float | None = None
    baseline_pct: float | None = None
    eta_s: float | None = None  # None when the data is not live
    mfu: float | None = None  # the trainer's estimate against the GPU's nominal peak, 0..1 (GPU runs only)
    mfu_measured: float | None = None  # the same against the rate a large matmul reaches there
    samples_s: float | None = None  # the newest line's samples (sequences) per second
    loss: float | None = None
    acc: float | None = None
    accept_len: float | None = None  # the trainer's expected run of correct drafter slots (tau_est - 1)
    tau: float | None = None  # measured tau (accepted + 1 per target forward), the newest eval's
    tau_eval: dict[str, Any] | None = None  # that eval: step, speedup, prompts, complete
    sample_time: float | None = None  # newest sample, trainer's clock
    restarts: int = 0
    last_event: EventView | None = None
    exit_reason: str | None = None
    gpus: list[int] = field(default_factory=list)
    roles: dict[int, str] = field(default_factory=dict)
    hosts: list[RunHostView] = field(default_factory=list)  # a multi-host run's, by rank ([]: one host)
    probe: DirectProbe | None = None  # what the console saw itself of it, while nobody supervises it
    attention: str | None = None  # failed, crash loop, stalled, regressed: what sorts it first (``ATTENTION``)

    @property
    def probed(self) -> DirectProbe | None:
        """The console's own probe, where it says more than the store: an active run
        nobody supervises, probed without an error."""
        p = self.probe
        return p if p is not None and not p.error and self.active and not self.freshness.supervised else None

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    @property
    def display_state(self) -> str:
        """The state as the operator should read it: an active run nobody watches is
        ``unsupervised``, one whose host does not answer ``unreachable`` (or
        ``stale`` while its supervisor has not yet said so)."""
        f = self.freshness
        if not self.active:
            return self.state
        if not f.supervised:
            return "unsupervised"
        if f.store_busy:
            return "store busy"
        if f.host_down_since is not None:
            return "unreachable"
        if not f.live and f.host_last_answer is not None:
            return "stale"
        return self.state

    @property
    def tau_est(self) -> float | None:
        """The training-time tau, accept_len + 1 (dflashctl.core.contract.tau_estimate)."""
        return tau_estimate(self.accept_len)

    @property
    def tau_note(self) -> str | None:
        """Why the measured tau is well below the estimate, when it is (contract.tau_gap)."""
        return tau_gap(self.tau_est, self.tau)

    @property
    def progress_pct(self) -> float | None:
        if self.step is None or not self.total_steps:
            return None
        return 100.0 * self.step / self.total_steps

    def step_text(self) -> str:
        if self.step is None:
            return NA
        return f"{self.step:,}/{self.total_steps:,}" if self.total_steps else f"{self.step:,}"

    def progress_text(self) -> str:
        pct = self.progress_pct
        return NA if pct is None else (f"{pct:.0f}%" if pct >= 10 or pct == 0 else f"{pct:.1f}%")

    def eta_text(self, compact: bool = False) -> str:
        if not self.active:
            return "-"
        if not self.freshness.live and self.state != RESTARTING:
            return "stale" if self.step is not None else NA
        return NA if self.eta_s is None else (short_duration if compact else fmt_duration)(self.eta_s)

    def tok_s_text(self, compact: bool = True) -> str:
        return (short_rate if compact else fmt_tok_s)(self.tok_s if self.tok_s is not None else self.tok_s_last) \
            if (self.tok_s is not None or self.tok_s_last is not None) else NA

    def last_event_text(self) -> str:
        if self.last_event is None:
            return NA
        return f"{fmt_clock(self.last_event.time)} {self.last_event.message}"

    def age_text(self) -> str:
        age = self.freshness.data_age_s
        return NA if age is None else short_duration(age)

    def cell(self, key: str) -> str:
        """Display text of one run column (``COLUMNS``)."""
        if key == "run":
            return self.id
        if key == "state":
            # A run that crashed and was restarted carries its count ("running ↻2") where
            # it fits the column (and is underlined, ``style``): it never looks like one
            # that never crashed, whichever columns fit.
            shown = self.attention if self.attention in ("crash loop", "regressed") \
                and self.display_state in PROGRESSING + (RESTARTING,) else self.display_state
            mark = f" ↻{self.restarts}" if self.restarts and shown != RESTARTING else ""
            return shown + mark if len(shown + mark) <= COLUMN["state"].width else shown
        probed = self.probed
        if key == "phase":
            if probed is not None and (probed.phase or probed.exit_code is not None):
                return f"{probed.phase or f'exit {probed.exit_code}'} (probed)"
            return self.phase.text(compact=True) if self.active else "-"
        if key == "progress":
            return self.progress_text()
        if key == "eta":
            return self.eta_text(compact=True)
        if key == "tok_s":
            return self.tok_s_text()
        if key == "baseline":
            return NA if self.baseline_pct is None else f"{self.baseline_pct:.0f}%"
        if key == "step":
            if probed is not None and probed.step is not None:
                return f"{probed.step:,} (probed)"
            return self.step_text()
        if key == "host":
            return self.host
        if key == "age":
            return self.age_text()
        if key == "history":
            return spark(self.tok_s_history, 12, high=self.baseline_tok_s) or NA
        if key == "loss":
            return _num(self.loss, ".3f")
        if key == "accept":
            return _num(self.tau_est, ".2f")
        if key == "tau":
            return _num(self.tau, ".2f")
        if key == "mfu":
            return NA if self.mfu is None else f"{100 * self.mfu:.0f}%"
        if key == "restarts":
            return str(self.restarts)
        if key == "last_event":
            return self.last_event_text()
        raise KeyError(key)

    def style(self, key: str) -> str:
        """Style of one cell ('' for none)."""
        if key == "state":
            if self.attention in ("crash loop", "regressed") and self.display_state in PROGRESSING + (RESTARTING,):
                return "bold red"
            return STATE_STYLE.get(self.display_state, "") + (" underline" if self.restarts else "")
        if key in ("phase", "step") and self.probed is not None:
            return "cyan"
        if key == "phase" and self.active:
            return "bold red" if self.phase.over_budget else PHASE_STYLE.get(self.phase.name or "", "")
        if key in ("eta", "tok_s", "age", "progress", "step") and self.active and not self.freshness.live:
            return "dim"
        if key == "baseline" and self.baseline_pct is not None and self.baseline_pct < 60:
            return "bold red"
        if key == "last_event" and self.last_event is not None:
            return SEVERITY_STYLE.get(self.last_event.severity, "")
        if key == "tau" and self.tau_note:
            return "yellow"
        if key == "restarts" and self.restarts:
            return "bold red" if self.attention == "crash loop" else "bold yellow"
        return ""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["freshness"] = self.freshness.to_dict()
        d["phase"] = {**asdict(self.phase), "over_budget": self.phase.over_budget}
        d.update(active=self.active, display_state=self.display_state, progress_pct=self.progress_pct,
                 tau_est=self.tau_est, tau_note=self.tau_note)
        d["roles"] = {str(k): v for k, v in self.roles.items()}
        return d


# --------------------------------------------------------------------------- run columns


LAST_EVENT_MAX = 60  # the widest the last-event column grows (its full text is in the detail view)
COLUMNS = (
    Col("run", "run", 25, 0),
    Col("state", "state", 12, 0),
    Col("phase", "phase", 17, 1),
    Col("progress", "done", 5, 1, "right"),
    Col("eta", "ETA", 6, 1, "right"),
    Col("tok_s", "tok/s", 6, 2, "right"),
    Col("baseline", "%base", 5, 2, "right"),
    Col("step", "step", 15, 3, "right"),
    Col("host", "host", 10, 4),
    Col("age", "age", 5, 3, "right"),
    Col("history", "tok/s history", 13, 6),
    Col("loss", "loss", 6, 5, "right"),
    Col("accept", "τ est", 5, 5, "right"),
    Col("tau", "τ", 5, 5, "right"),
    Col("restarts", "rst", 3, 5, "right"),
    Col("mfu", "MFU", 4, 7, "right"),
    Col("last_event", "last event", 24, 8, grow=LAST_EVENT_MAX - 24),
)
COLUMN = {c.key: c for c in COLUMNS}
COMPACT_RUN_WIDTH = 18


def select_columns(width: int, gap: int = 2, run_width: int = 25) -> list[Col]:
    """The run columns that fit ``width`` cells (each column costs its width plus
    ``gap``), most important first, shown in ``COLUMNS`` order; the last-event
    column takes what is left, up to ``LAST_EVENT_MAX``. Cells are never folded:
    a column that does not fit is left out (``columns.choose``)."""
    columns = [Col("run", "run", run_width, 0)] + [c for c in COLUMNS if c.key != "run"]
    return choose(columns, width - gap, gap)


# --------------------------------------------------------------------------- status and detail


SORTS = ("default", "state", "host", "progress", "tok/s", "ETA", "created")


def sort_runs(runs: list[RunView], key: str) -> list[RunView]:
    """Runs in the order of a sort key (``SORTS``); ``default``: needs-attention first,
    then active, then newest."""
    if key == "state":
        return sorted(runs, key=lambda r: (r.display_state, -r.created))
    if key == "host":
        return sorted(runs, key=lambda r: (r.host, -r.created))
    if key == "progress":
        return sorted(runs, key=lambda r: -(r.progress_pct or -1))
    if key == "tok/s":
        return sorted(runs, key=lambda r: -(r.tok_s or r.tok_s_last or -1))
    if key == "ETA":
        return sorted(runs, key=lambda r: (r.eta_s is None, r.eta_s or 0))
    if key == "created":
        return sorted(runs, key=lambda r: -r.created)
    return sorted(runs, key=lambda r: (attention_rank(r), not r.active, -r.created))


# What needs the operator first: a run's ``attention`` (failed, crash loop, stalled,
# regressed), then an active run's display state; everything else after, active first.
ATTENTION = {"failed": 0, "crash loop": 0, "unsupervised": 1, "stalled": 1, "unreachable": 2, "regressed": 2,
             "lost": 3, "stale": 3, "store busy": 3, "restarting": 4}
FAILED_RECENT_S = 24 * 3600.0  # a failed run sorts first this long after it ended
CRASH_LOOP_RESTARTS = 2  # counted restarts in the playbook's restart window without step progress


def attention_rank(r: RunView) -> int:
    ranks = [ATTENTION[r.attention]] if r.attention in ATTENTION else []
    if r.active:
        ranks.append(ATTENTION.get(r.display_state, 8))
    return min(ranks, default=9)


def attention_of(run: Run, display_state: str, restarts: Sequence[Any], regression: Event | None, now: float,
                 window_s: float) -> str | None:
    """Why a run needs the operator before the others (None: it does not): it failed
    (within ``FAILED_RECENT_S``), it is crash-looping (``CRASH_LOOP_RESTARTS`` counted
    restarts within ``window_s`` with no step gained between them), it is stalled,
    or its newest regression finding has not been cleared."""
    if run.state == "failed":
        return "failed" if now - (run.ended or run.updated or run.created) <= FAILED_RECENT_S else None
    if run.state not in ACTIVE_STATES:
        return None
    recent = [r for r in restarts if r.counts and now - r.time <= window_s]
    steps = {r.step_before for r in recent}
    if len(recent) >= CRASH_LOOP_RESTARTS and len(steps) == 1:
        return "crash loop"
    if display_state == "stalled":
        return "stalled"
    if regression is not None and regression.severity != "info":
        return "regressed"
    return None


def matching(items: Sequence[Any], text: str, words_of: Callable[[Any], str]) -> list[Any]:
    """The items whose ``words_of(item)`` contains every word of ``text`` (any case);
    all of them for an empty ``text``. The one filter of the console (runs, events,
    log lines)."""
    words = text.lower().split()
    if not words:
        return list(items)
    return [item for item in items if all(w in words_of(item).lower() for w in words)]


def filter_runs(runs: list[RunView], text: str) -> list[RunView]:
    """Runs whose id, playbook, host, state or phase contains every word of ``text``."""
    return matching(runs, text, lambda r: " ".join([r.id, r.playbook, r.host, r.display_state, r.phase.name or ""]))


def filter_events(events: Sequence[EventView], text: str) -> list[EventView]:
    """Events whose time, severity, class or message contains every word of ``text``."""
    return matching(events, text, lambda e: " ".join(e.cells()))


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


# --------------------------------------------------------------------------- history charts

# The charts' zooms, cycled by a key: the newest hour, the newest six hours, the whole run.
ZOOMS = ("1 h", "6 h", "all")
ZOOM_SPAN_S: dict[str, float | None] = {"1 h": 3600.0, "6 h": 6 * 3600.0, "all": None}


def next_zoom(zoom: str) -> str:
    """The zoom after ``zoom`` (1 h -> 6 h -> all -> 1 h); an unknown one gives 'all'."""
    return ZOOMS[(ZOOMS.index(zoom) + 1) % len(ZOOMS)] if zoom in ZOOMS else "all"


@dataclass(frozen=True)
class Mark:
    """Something a chart marks at its time: a restart or the start of a stall."""

    time: float
    kind: str  # "restart" | "stall"
    text: str = ""


def chart_window(first: float, newest: float, now: float, active: bool, zoom: str) -> tuple[float, float]:
    """The time span (t0, t1) a run's charts show at ``zoom``: up to ``now`` for an
    active run (a silence at the end is drawn as one), up to its newest sample for a
    finished one; from the run's first sample ('all') or the zoom's span before t1,
    never before the first sample."""
    t1 = max(now, newest) if active else newest
    span = ZOOM_SPAN_S.get(zoom)
    t0 = first if span is None else max(first, t1 - span)
    return t0, max(t1, t0)


def marks_of(restarts: Iterable[Any], state_events: Iterable[Event], t0: float, t1: float) -> list[Mark]:
    """The restarts (``Store.restarts``) and stalls (state events to ``stalled``) between
    ``t0`` and ``t1``, oldest first."""
    marks = [Mark(r.time, "restart", r.reason or "") for r in restarts]
    marks += [Mark(e.time, "stall", e.message or "") for e in state_events
              if (e.detail or {}).get("to") == "stalled"]
    return sorted((m for m in marks if t0 <= m.time <= t1), key=lambda m: m.time)


@dataclass
class ChartView:
    """A run's history as its charts draw it at one zoom: buckets of its samples
    (``Store.sample_series``) between ``t0`` and ``t1`` and the marks in that span."""

    zoom: str
    t0: float
    t1: float
    series: list[dict[str, Any]]
    marks: list[Mark] = field(default_factory=list)
    first: float | None = None  # the run's first sample (what 'all' starts at)

    def points(self, key: str) -> list[tuple[float, float]]:
        """(time, value) of one column of the series ('tok_s', 'loss', 'tau_est' = accept_len + 1)."""
        out = []
        for p in self.series:
            v = tau_estimate(p.get("accept_len")) if key == "tau_est" else p.get(key)
            if v is not None and math.isfinite(v) and self.t0 <= p["time"] <= self.t1:
                out.append((p["time"], float(v)))
        return out

    def title(self) -> str:
        """The zoom, for the charts' titles: 'zoom all: 2 h', 'zoom 1 h of 2 h', and
        'zoom 6 h: all 2 h' (a run shorter than the zoom)."""
        first = self.t0 if self.first is None else min(self.first, self.t0)
        whole = fmt_duration(self.t1 - first)
        if self.zoom == "all":
            return f"zoom all: {whole}"
        if self.t0 <= first:
            return f"zoom {self.zoom}: all {whole}"
        return f"zoom {self.zoom} of {whole}"


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

    def to_dict(self) -> dict[str, Any]:
        return {"run": self.run.to_dict(), "events": [asdict(e) for e in self.events], "series": self.series,
                "thresholds": asdict(self.thresholds), "env": asdict(self.env), "restarts": self.restarts,
                "run_dir": self.run_dir, "exit_code": self.exit_code}


def _total_steps(run: Run) -> int | None:
    try:
        return int(run.config["trainer"]["train"]["steps"])
    except (KeyError, TypeError, ValueError):
        return None


def roles_of(run: Run) -> dict[int, str]:
    """Physical GPU index -> its role in the run (target, drafter, target+drafter)."""
    try:
        placement = run.config["trainer"]["placement"]
    except (KeyError, TypeError):
        return {}
    if not isinstance(placement, dict) or placement.get("device") == "cpu":
        return {}
    roles: dict[int, str] = {}
    for role in ("target", "drafter"):
        for g in placement.get(role) or []:
            try:
                g = int(g)
            except (TypeError, ValueError):
                continue
            roles[g] = f"{roles[g]}+{role}" if g in roles else role
    return roles


def gpu_readings(value: Any) -> list[dict[str, Any]]:
    """A sample's ``gpu`` column -> a list of reading dicts. The supervisor stores
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


def _process_gone(pid: Any) -> bool:
    """Whether process ``pid`` of this machine has ended (a zombie has)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # alive, another user's
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return stat[stat.rindex(")") + 2:].split()[0] in ("Z", "X")
    except (OSError, ValueError, IndexError):
        return False


def store_write_busy(path: str) -> bool:
    """Whether another connection holds the store's write lock now (tried without
    waiting, nothing written; a file that is not there is not busy, and is not made)."""
    try:
        conn = sqlite3.connect(f"file:{urllib.parse.quote(os.path.abspath(path))}?mode=rw", uri=True, timeout=0)
    except sqlite3.Error:
        return False
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.rollback()
        return False
    except sqlite3.OperationalError as e:
        return "locked" in str(e) or "busy" in str(e)
    finally:
        conn.close()


def heartbeats_now(store: Store, now: float | None = None) -> list[dict]:
    """The supervisors' heartbeats; one of a supervisor of this machine whose process
    has ended (killed: it could not say so) reads as stopped at its last tick, so its
    runs show as unsupervised at once, not only after its heartbeat grows old. One
    whose process is alive is marked ``alive``; if it is late (``now`` given), and
    the store's write lock is held by another, ``store_busy`` too: it is blocked, not
    gone."""
    here = socket.gethostname()
    out = []
    busy: bool | None = None
    for b in store.supervisors():
        if b.get("stopped") or b.get("host") != here:
            out.append(b)
        elif _process_gone(b.get("pid")):
            out.append({**b, "stopped": b.get("last_tick")})
        else:
            b = {**b, "alive": True}
            late = now is not None and now - (b.get("last_tick") or 0) > 3 * max(1.0, b.get("interval") or 1)
            if late:
                busy = store_write_busy(store.path) if busy is None else busy
                b["store_busy"] = busy
            out.append(b)
    return out


def select_runs(store: Store, run: str | None = None, recent: int = RECENT_RUNS) -> list[Run]:
    """One run (by id or prefix), or the active runs and then the most recent others."""
    if run is not None:
        return [store.get_run(run)]
    active = store.list_runs(active_only=True)
    seen = {r.id for r in active}
    return active + [r for r in store.list_runs(limit=recent) if r.id not in seen]


class StatusReader:
    """Reads status and detail views from a store, keeping what changes slowly
    (playbook thresholds, learned baselines) between refreshes. Used from one
    worker thread at a time (the store gives each thread its own connection)."""

    def __init__(self, store: Store, playbooks_dir: str | None = None):
        self.store = store
        self.playbooks_dir = playbooks_dir
        self._thresholds: dict[tuple, Thresholds] = {}
        self._baselines: dict[str, tuple[float, float | None]] = {}
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- slow-changing inputs

    def thresholds(self, run: Run) -> Thresholds:
        source = (run.config or {}).get("playbook_source") or run.playbook
        try:
            mtime = os.stat(source).st_mtime
        except (OSError, TypeError, ValueError):
            mtime = None
        key = (run.playbook, source, mtime)
        with self._lock:
            cached = self._thresholds.get(key)
        if cached is None:
            cached = _thresholds_of(run, self.playbooks_dir)
            with self._lock:
                self._thresholds[key] = cached
        return cached

    def baseline(self, run: Run, now: float) -> float | None:
        own = self.thresholds(run).baseline_tok_s
        if own:
            return own
        with self._lock:
            cached = self._baselines.get(run.playbook)
        if cached is None or now - cached[0] > BASELINE_TTL_S:
            cached = (now, self.store.baseline_tok_s(run.playbook, exclude_run=run.id))
            with self._lock:
                self._baselines[run.playbook] = cached
        return cached[1]

    # ----------------------------------------------------------------- one run

    def run_view(self, run: Run, heartbeats: list[dict], now: float, history: int = HISTORY) -> RunView:
        store = self.store
        # A finished run needs its newest figures and a short history only.
        samples = store.recent_samples(run.id, history if run.active else min(history, FINISHED_HISTORY))
        newest = samples[-1] if samples else None
        fresh = freshness(run, heartbeats, newest, now)
        state_events = store.events(run.id, kind="state")
        restarts = store.restarts(run.id)
        # A finished run's last word is how it ended; what was written after (a
        # supervisor looking at it once more) must not hide the cause.
        if run.active:
            last = store.events(run.id, limit=1)
            last_event = EventView.from_event(last[-1]) if last else None
        else:
            last_event = EventView.from_event(state_events[-1]) if state_events else None
        # The clock of a run whose data is not live stops at its newest data.
        as_of = now if fresh.live or not run.active else max(
            [t for t in (fresh.data_time, fresh.host_last_answer, fresh.last_tick) if t] or [run.updated or run.created])
        phase = derive_phase(run, samples, state_events, restarts, lambda: self.thresholds(run), as_of)
        smoothed = smooth(samples)
        total = _total_steps(run)
        view = RunView(
            id=run.id, playbook=run.playbook, host=run.host, state=run.state, created=run.created,
            freshness=fresh, phase=phase, total_steps=total,
            restarts=sum(1 for r in restarts if r.counts), last_event=last_event, exit_reason=run.exit_reason,
            gpus=run.gpus, roles=roles_of(run),
            hosts=[RunHostView.from_row(h, now, fresh.stale_after_s) for h in run.hosts],
        )
        regression = store.events(run.id, kind="regression", limit=1) if run.active else []
        view.attention = attention_of(run, view.display_state, restarts, regression[-1] if regression else None, now,
                                      self.thresholds(run).restart_window_s if restarts else 0.0)
        process = current_process(samples)
        view.tok_s_history = [s.tok_s for s in process if s.tok_s is not None]
        view.loss_history = [s.loss for s in process if s.loss is not None]
        view.accept_history = [s.accept_len for s in process if s.accept_len is not None]
        view.tau, view.tau_eval = measured_tau(store.evals(run.id))
        if newest is not None:
            view.step, view.tok_s_last, view.loss = newest.step, newest.tok_s, newest.loss
            view.acc, view.accept_len, view.mfu, view.sample_time = newest.acc, newest.accept_len, newest.mfu, newest.time
            view.samples_s, view.mfu_measured = newest.samples_s, newest.mfu_measured
            view.tok_s, view.window_s = smoothed.tok_s, smoothed.window_s
        if run.active and view.tok_s is not None and phase.name == "training":
            view.baseline_tok_s = self.baseline(run, now)
            if view.baseline_tok_s:
                view.baseline_pct = 100.0 * view.tok_s / view.baseline_tok_s
        if run.active and fresh.live and newest is not None and run.state in PROGRESSING \
                and phase.name in ("training", "checkpointing"):
            if smoothed.steps_per_s and total:
                view.eta_s = max(0.0, total - newest.step) / smoothed.steps_per_s
            elif newest.eta_s is not None:
                view.eta_s = newest.eta_s
        return view

    # ----------------------------------------------------------------- GPUs

    def hosts(self, runs: list[Run], heartbeats: list[dict], now: float) -> list[HostView]:
        by_host: dict[str, list[Run]] = {}
        for r in runs:
            by_host.setdefault(r.host, []).append(r)
        views = []
        for host, host_runs in by_host.items():
            beat = next((b for b in heartbeats if host in (b.get("hosts") or {})), None)
            info = ((beat or {}).get("hosts") or {}).get(host) or {}
            ticking = [b for b in heartbeats if set(b.get("runs") or []) & {r.id for r in host_runs}
                       and not b.get("stopped") and now - (b.get("last_tick") or 0) <= 3 * max(1.0, b.get("interval") or 1)]
            hv = HostView(host, [r.id for r in host_runs], info.get("last_ok"), info.get("down_since"),
                          info.get("error"), bool(ticking))
            readings = [(r, self.store.gpu_samples(r.id, GPU_HISTORY)) for r in host_runs]
            readings = [(r, s) for r, s in readings if s]
            holders = {}
            for r in host_runs:
                roles = roles_of(r)
                for g in r.gpus:
                    holders.setdefault(g, (r.id, roles.get(g)))
            if readings:
                run, samples = max(readings, key=lambda rs: _sample_clock(rs[1][-1]))
                history: dict[Any, list[dict]] = {}
                for s in samples:
                    for g in gpu_readings(s.gpu):
                        history.setdefault(g.get("index"), []).append(g)
                stale_after = 3 * self.thresholds(run).poll_interval_s
                for g in gpu_readings(samples[-1].gpu):
                    index = g.get("index") if isinstance(g.get("index"), int) else None
                    holder, role = holders.get(index, (None, None))
                    past = history.get(g.get("index"), [])
                    apps = g.get("apps") if isinstance(g.get("apps"), list) else None
                    hv.gpus.append(GpuView(
                        host, index, g.get("name") if isinstance(g.get("name"), str) else None, role, holder,
                        _sample_clock(samples[-1]), _float(g.get("utilization_pct")), _float(g.get("memory_used_mib")),
                        _float(g.get("memory_total_mib")), _float(g.get("temperature_c")),
                        _float(g.get("power_draw_w")), _float(g.get("power_limit_w")),
                        [v for v in (_float(p.get("utilization_pct")) for p in past) if v is not None],
                        [u / t for u, t in ((_float(p.get("memory_used_mib")), _float(p.get("memory_total_mib")))
                                            for p in past) if u is not None and t],
                        [AppView.from_row(a) for a in apps or [] if isinstance(a, dict)], apps is not None,
                        stale_after))
            else:
                for index, (holder, role) in sorted(holders.items()):
                    hv.gpus.append(GpuView(host, index, role=role, run_id=holder))
            hv.load = self.host_load(host_runs)
            views.append(hv)
        return views

    def host_load(self, host_runs: list[Run]) -> HostLoad | None:
        """The host's newest CPU and memory reading, of whichever of its runs was read last."""
        readings = [(r, s) for r, s in ((r, self.store.host_samples(r.id, 2)) for r in host_runs) if s]
        if not readings:
            return None
        run, samples = max(readings, key=lambda rs: _sample_clock(rs[1][-1]))
        return HostLoad.from_samples(samples[-1], samples[-2] if len(samples) > 1 else None,
                                     3 * self.thresholds(run).poll_interval_s)

    # ----------------------------------------------------------------- everything

    def load(self, now: float, run: str | None = None, selected: str | None = None, *,
             history: int = HISTORY, events: int = EVENTS, zoom: str | None = None) -> StatusView:
        """Everything the status screen shows, read from the store at ``now``; with
        ``zoom`` (``ZOOMS``) the selected run's history charts too."""
        store = self.store
        rows = select_runs(store, run)
        heartbeats = heartbeats_now(store, now)
        runs = sort_runs([self.run_view(r, heartbeats, now, history) for r in rows], "default")
        if selected not in {r.id for r in runs}:
            selected = runs[0].id if runs else None
        shown = [r for r in rows if r.active]
        hosts = self.hosts(shown, heartbeats, now)
        recent = [EventView.from_event(e) for e in store.events(selected, limit=events)] if selected else []
        ticking = sum(1 for b in heartbeats if not b.get("stopped")
                      and now - (b.get("last_tick") or 0) <= 3 * max(1.0, b.get("interval") or 1))
        blocked = [now - (b.get("last_tick") or now) for b in heartbeats if b.get("store_busy")]
        errors = [EventView.from_event(e) for e in store.events(min_severity="error", limit=ERRORS)]
        chart = None
        if zoom is not None and selected is not None:
            chart = self.chart(next(r for r in rows if r.id == selected), now, zoom)
        return StatusView(now, store.path, runs, selected, recent, hosts, notices_of(runs, now), ticking,
                          len(blocked), max(blocked, default=0.0), errors, chart)

    def chart(self, run: Run, now: float, zoom: str = "all",
              whole: list[dict[str, Any]] | None = None) -> ChartView | None:
        """The run's history at ``zoom``: its samples in ``SERIES_POINTS`` buckets over the
        zoom's span (``whole``: the whole run's, already read), its restarts and stalls
        in that span. None without samples."""
        series = whole if whole is not None else self.store.sample_series(run.id, SERIES_POINTS)
        if not series:
            return None
        first = series[0].get("start", series[0]["time"])  # a bucket's time is its newest sample's
        t0, t1 = chart_window(first, series[-1]["time"], now, run.active, zoom)
        if t0 > first:  # zoomed in: the span's own buckets, as fine as the whole run's
            series = self.store.sample_series(run.id, SERIES_POINTS, since=t0)
        marks = marks_of(self.store.restarts(run.id), self.store.events(run.id, kind="state"), t0, t1)
        return ChartView(zoom, t0, t1, series, marks, first)

    def detail(self, run_ref: str, now: float, zoom: str = "all") -> DetailView:
        """One run in full: every event (the newest ``DETAIL_EVENTS``), its whole history
        as a chart series (and its charts at ``zoom``), its thresholds, the environment
        audit, its restarts."""
        store = self.store
        run = store.get_run(run_ref)
        view = self.run_view(run, heartbeats_now(store, now), now)
        events = [EventView.from_event(e) for e in store.events(run.id, limit=DETAIL_EVENTS)]
        snapshot = store.env_snapshot_at(run.host, run.created + 60.0)
        env = EnvSummary(findings=[e for e in events if e.kind in ("drift", "conflict", "preflight", "env-audit")])
        if snapshot is not None:
            data = snapshot.get("data")
            env.snapshot_time = snapshot.get("time")
            env.packages = len(data) if isinstance(data, (dict, list)) else None
            if isinstance(data, dict):
                torch = data.get("torch")
                env.torch = torch if isinstance(torch, str) else None
        series = store.sample_series(run.id, SERIES_POINTS)
        return DetailView(view, events, series, self.thresholds(run), env,
                          [r.to_dict() for r in store.restarts(run.id)], run.run_dir, run.exit_code,
                          self.chart(run, now, zoom, whole=series))


def notices_of(runs: Iterable[RunView], now: float) -> list[Notice]:
    """What needs the operator, most urgent first: runs nobody watches (with the
    command that watches them), unreachable hosts, phases over budget."""
    out: list[Notice] = []
    down: set[str] = set()
    for r in runs:
        if not r.active:
            continue
        f = r.freshness
        if not f.supervised:
            out.append(Notice("error", f"{r.id} {f.note}", f.fix, r.id))
        elif f.host_down_since is not None and r.host not in down:
            down.add(r.host)
            out.append(Notice("error", f.note, None, r.id))
        elif not f.live and f.note:
            out.append(Notice("warning", f"{r.id}: {f.note}", None, r.id))
        if r.phase.over_budget:
            out.append(Notice("warning", f"{r.id}: {r.phase.text()} (over budget)", f"dflashctl logs {r.id}", r.id))
    for r in runs:
        if r.tau_note:
            out.append(Notice("warning", f"{r.id}: {r.tau_note}", f"dflashctl eval {r.id}", r.id))
    return out


def measured_tau(evals: list[dict[str, Any]]) -> tuple[float | None, dict[str, Any] | None]:
    """The newest evaluation with a measured tau (``Store.evals``, oldest first): its
    tau and a summary of it (step, speed-up, prompts measured, complete), or (None, None)."""
    for row in reversed(evals):
        if row.get("error") is None and row.get("tau") is not None:
            report = row.get("report") or {}
            return row["tau"], {"time": row["time"], "step": row["step"], "speedup": row.get("speedup"),
                                "prompts": report.get("prompts"), "complete": report.get("complete", True)}
    return None, None


def load_status(store: Store, now: float, run: str | None = None, selected: str | None = None, *,
                history: int = HISTORY, events: int = EVENTS, playbooks_dir: str | None = None) -> StatusView:
    """``StatusReader(store).load(...)`` for one read."""
    return StatusReader(store, playbooks_dir).load(now, run, selected, history=history, events=events)


# --------------------------------------------------------------------------- the --json document

_NUM = {"type": ["number", "null"]}
_STR = {"type": ["string", "null"]}
JSON_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": SCHEMA,
    "description": "dflashctl status --json: every run, its freshness and phase, the GPUs of hosts with active runs. "
                   "Times are unix seconds on the operator's clock unless named otherwise.",
    "type": "object",
    "required": ["schema", "now", "store", "selected", "supervisors", "runs", "events", "hosts", "gpus", "notices"],
    "properties": {
        "schema": {"const": SCHEMA},
        "now": {"type": "number"},
        "store": {"type": "string", "description": "the run store file"},
        "selected": _STR,
        "supervisors": {"type": "integer", "description": "supervisors ticking now"},
        "runs": {"type": "array", "items": {
            "type": "object",
            "required": ["id", "playbook", "host", "state", "display_state", "active", "freshness", "phase", "step",
                         "total_steps", "progress_pct", "tok_s", "baseline_pct", "eta_s", "loss", "accept_len",
                         "tau_est", "tau",
                         "restarts", "last_event", "hosts"],
            "properties": {
                "id": {"type": "string"}, "playbook": {"type": "string"}, "host": {"type": "string"},
                "state": {"type": "string", "description": "as stored: launching, running, stalled, restarting, "
                                                           "lost, stopped, done, failed"},
                "display_state": {"type": "string", "description": "state, or unsupervised / unreachable / stale "
                                                                   "when what is stored is not live"},
                "active": {"type": "boolean"},
                "freshness": {"type": "object", "required": ["supervised", "live", "note", "fix", "data_age_s"],
                              "description": "dflashctl.status.freshness.Freshness: supervised, live, unsupervised_since, "
                                             "host_down_since, data_age_s, note, fix (the command that fixes it), "
                                             "stale_after_s (an answer older than this is not live)"},
                "phase": {"type": "object", "required": ["name", "since", "budget_s", "elapsed_s", "over_budget"]},
                "step": {"type": ["integer", "null"]}, "total_steps": {"type": ["integer", "null"]},
                "progress_pct": _NUM,
                "tok_s": {**_NUM, "description": "mean over window_s of the newest training samples"},
                "tok_s_last": _NUM, "window_s": {"type": "number"}, "baseline_tok_s": _NUM, "baseline_pct": _NUM,
                "eta_s": {**_NUM, "description": "from the step rate over window_s; null when the data is not live"},
                "loss": _NUM, "acc": _NUM,
                "accept_len": {**_NUM, "description": "the trainer's expected run of correct drafter slots at the "
                                                      "training anchors (tau_est - 1)"},
                "tau_est": {**_NUM, "description": "τ est: the training-time tau, accept_len + 1"},
                "tau": {**_NUM, "description": "τ: measured tau (accepted draft tokens + 1 per target forward) "
                                               "of the newest dflashctl eval"},
                "tau_eval": {"type": ["object", "null"], "description": "that eval: time, step, speedup, prompts, "
                                                                        "complete (false: stopped early)"},
                "tau_note": {**_STR, "description": "why tau is more than contract.TAU_GAP_MARGIN below tau_est"},
                "mfu": {**_NUM, "description": "model FLOPs utilisation against the GPU's nominal dense peak"},
                "mfu_measured": {**_NUM, "description": "the same against the rate a large matmul measured there"},
                "samples_s": {**_NUM, "description": "the newest line's samples (sequences) per second"},
                "restarts": {"type": "integer"}, "exit_reason": _STR,
                "attention": {**_STR, "description": "why it sorts first: failed (within a day), crash loop, "
                                                     "stalled, regressed; null: nothing needs the operator"},
                "last_event": {"type": ["object", "null"]}, "tok_s_history": {"type": "array"},
                "gpus": {"type": "array"}, "roles": {"type": "object"},
                "hosts": {"type": "array", "description": "a run on several hosts: one per host, by rank, as the "
                                                          "supervisor last saw its process; [] for a run on one host",
                          "items": {"type": "object", "required": [
                              "rank", "host", "phase", "step", "alive", "exit_code", "exit_reason", "error", "seen",
                              "age_s", "stale"], "properties": {
                              "rank": {"type": "integer"}, "host": {"type": "string"}, "phase": _STR,
                              "step": {"type": ["integer", "null"]}, "alive": {"type": ["boolean", "null"]},
                              "exit_code": {"type": ["integer", "null"], "description": "the process ended"},
                              "exit_reason": {**_STR, "description": "the exit code in words"},
                              "error": {**_STR, "description": "what the probe could not read, or why the host "
                                                               "did not answer"},
                              "seen": {**_NUM, "description": "when its host last answered for this run"},
                              "age_s": {**_NUM, "description": "now - seen; null: never answered"},
                              "stale": {"type": "boolean", "description": "age_s over freshness.stale_after_s "
                                                                          "(an active run only)"}}}},
            }}},
        "events": {"type": "array", "description": "the selected run's recent events, oldest first"},
        "hosts": {"type": "array", "items": {"type": "object", "required": ["host", "runs", "last_answer",
                                                                             "down_since", "error", "supervised"],
                                             "properties": {"load": {
                                                 "type": ["object", "null"],
                                                 "description": "the host's CPU and memory from the newest poll that "
                                                                "read them (null: none did): time, cpus, load1, "
                                                                "busy_pct, mem_total_kib, mem_available_kib, "
                                                                "stale_after_s, mem_cgroup (1: the memory is a "
                                                                "container's cgroup limit and what is left under "
                                                                "it), cpu_cgroup (its CPU quota in CPUs, when "
                                                                "busy_pct is the share of it used); an unknown "
                                                                "field is null"}}}},
        "gpus": {"type": "array", "items": {"type": "object", "required": [
            "host", "index", "name", "role", "run_id", "utilization_pct", "memory_used_mib", "memory_total_mib",
            "temperature_c", "power_draw_w", "utilization_history"]}},
        "notices": {"type": "array", "items": {"type": "object", "required": ["severity", "text", "fix", "run_id"]}},
    },
}
