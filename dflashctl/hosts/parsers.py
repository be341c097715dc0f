"""Pure parsers for what the probe brings back: nvidia-smi CSV, host readings, metrics lines.

Every function here is a function of text, and that text comes from a host the
controller does not control: it is untrusted. A missing reading (``[N/A]``, an
empty file, a field nvidia-smi does not support on this GPU) is ``None``, never an
exception: one odd GPU must not hide the others. A malformed row or line (wrong
field count, a number that is not one or is out of range, memory used above
total, a metrics line breaking the contract) is refused and reported as a
``Rejected`` value by the ``read_*`` functions, never repaired by guessing and
never raised; the ``parse_*`` functions return only what was accepted. Nothing
here may raise on any input text, call float()/int() on an unbounded string, or
recurse over what it reads.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, TypeVar

from dflashctl.core import contract

# What the host-side probe asks nvidia-smi for is what these parsers read by default:
# one definition, the probe's (a stdlib script, imported here as a module). The clock
# fields are asked apart from the GPU rows (a driver without one leaves those whole).
from dflashctl.hosts.remote.probe import CLOCK_FIELDS, COMPUTE_APPS_FIELDS, GPU_QUERY_FIELDS  # noqa: F401

T = TypeVar("T")

# --------------------------------------------------------------------------- rejections


@dataclass
class Rejected:
    """A line of some output that was not accepted, and why."""

    line: int  # 1-based, counted in the text given to the parser (blank lines included)
    reason: str  # e.g. "step is not an integer ('x')"
    text: str  # the line's first characters, for the operator

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}"


@dataclass
class Parsed(Generic[T]):
    """What a parser accepted, and what it rejected with the reasons."""

    rows: list[T] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)


_SHOWN_CHARS = 200  # of a rejected line


def _rejected(number: int, reason: str, line: str) -> Rejected:
    return Rejected(number, reason, line[:_SHOWN_CHARS])


# --------------------------------------------------------------------------- nvidia-smi

# nvidia-smi field name (as queried, or as printed in the header) -> GpuReading attribute.
_GPU_ATTRS = {
    "index": "index",
    "uuid": "uuid",
    "name": "name",
    "memory.used": "memory_used_mib",
    "memory.total": "memory_total_mib",
    "utilization.gpu": "utilization_pct",
    "temperature.gpu": "temperature_c",
    "power.draw": "power_draw_w",
    "power.draw.instant": "power_draw_w",
    "power.limit": "power_limit_w",
    "clocks.sm": "clocks_sm_mhz",
    "clocks.current.sm": "clocks_sm_mhz",  # the header's name for the clocks.sm query
}
_TEXT_ATTRS = {"uuid", "name"}
_APP_ATTRS = {
    "pid": "pid",
    "process_name": "process_name",
    "name": "process_name",
    "used_memory": "used_memory_mib",
    "used_gpu_memory": "used_memory_mib",
    "gpu_uuid": "gpu_uuid",
}

# attribute -> (lowest, highest, whole number): a reading outside is not a reading of a GPU.
_MAX_MIB = 2**30  # 1 PiB
_GPU_NUMBERS = {
    "index": (0, 65535, True),
    "memory_used_mib": (0, _MAX_MIB, False),
    "memory_total_mib": (0, _MAX_MIB, False),
    "utilization_pct": (0, 100, False),
    "temperature_c": (-100, 300, False),
    "power_draw_w": (0, 100_000, False),
    "power_limit_w": (0, 100_000, False),
    "clocks_sm_mhz": (0, 100_000, False),
}
_APP_NUMBERS = {
    "pid": (0, 2**31 - 1, True),
    "used_memory_mib": (0, _MAX_MIB, False),
}

MAX_CELL_CHARS = 4096  # a longer cell (a process path is the longest real one) rejects its row
MAX_ID_CHARS = 256  # GPU names and UUIDs
_MAX_NUMBER_CHARS = 40  # "693.45 W" is 8; longer never reaches float()

# A number, optionally followed by its unit ("1011 MiB", "100 %", "693.45 W", "1980 MHz").
_NUMBER = re.compile(r"^(-?\d+(?:\.\d+)?)(?:\s*[A-Za-z%]+)?$")
_HEADER_UNIT = re.compile(r"\s*\[[^\]]*\]\s*$")
_FIELD_NAME = re.compile(r"^[a-z][a-z0-9_.]*$")


@dataclass
class GpuReading:
    """One GPU row of ``nvidia-smi --query-gpu``. Units: MiB, %, degrees C, W, MHz."""

    index: int | None = None
    uuid: str | None = None
    name: str | None = None
    memory_used_mib: float | None = None
    memory_total_mib: float | None = None
    utilization_pct: float | None = None
    temperature_c: float | None = None
    power_draw_w: float | None = None
    power_limit_w: float | None = None
    clocks_sm_mhz: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # queried fields without an attribute


@dataclass
class ComputeApp:
    """One row of ``nvidia-smi --query-compute-apps``."""

    pid: int | None = None
    process_name: str | None = None
    used_memory_mib: float | None = None
    gpu_uuid: str | None = None


class _BadCell(ValueError):
    """A cell that cannot be what its field says; its row is rejected."""


def smi_value(cell: str) -> str | None:
    """The cell's text, or None for nvidia-smi's ways of saying 'no reading'
    (``[N/A]``, ``N/A``, ``[Not Supported]``, ``[Unknown Error]``, ...)."""
    cell = cell.strip()
    if not cell or cell == "N/A" or (cell.startswith("[") and cell.endswith("]")):
        return None
    return cell


def smi_number(cell: str) -> float | None:
    """A numeric cell with or without its unit; None when missing or not a number
    (a cell too long to be a reading included: it never reaches float())."""
    text = smi_value(cell)
    if text is None or len(text) > _MAX_NUMBER_CHARS:
        return None
    m = _NUMBER.match(text)
    return float(m.group(1)) if m else None


def _number_cell(name: str, cell: str, low: float, high: float, whole: bool) -> float | int | None:
    """A numeric field's cell: None when nvidia-smi has no reading; ``_BadCell``
    when it holds anything but a number in [low, high]."""
    if smi_value(cell) is None:
        return None
    number = smi_number(cell)
    if number is None:
        raise _BadCell(f"{name} is not a number ({_show(cell)})")
    if not low <= number <= high or (whole and not number.is_integer()):
        kind = "a whole number" if whole else "a number"
        raise _BadCell(f"{name} is not {kind} in {low}..{high} ({_show(cell)})")
    return int(number) if whole else number


def _text_cell(name: str, cell: str, max_chars: int) -> str | None:
    text = smi_value(cell)
    if text is not None and len(text) > max_chars:
        raise _BadCell(f"{name} is {len(text)} characters long, over the {max_chars} limit")
    return text


def _show(cell: str) -> str:
    return repr(cell[:40] + ("..." if len(cell) > 40 else ""))


def _split(line: str) -> list[str]:
    # nvidia-smi never quotes: cells are separated by ", ".
    return [c.strip() for c in line.split(",")]


def _field_name(header_cell: str) -> str:
    return _HEADER_UNIT.sub("", header_cell.strip())


def _looks_like_header(cells: list[str]) -> bool:
    # Field names are lower-case dotted identifiers; a data row always has a
    # number, an upper-case name or a bracketed "[N/A]" somewhere.
    return all(_FIELD_NAME.match(_field_name(c)) for c in cells)


def _rows(
    text: str, fields: tuple[str, ...] | list[str], glue_into: tuple[str, ...] = ()
) -> tuple[list[str], list[tuple[int, str, list[str]]], list[Rejected]]:
    """Split CSV text into (field names, rows as (line number, line, cells), rejected lines).

    A header line, when present, names the fields (and wins over ``fields``). A
    row must have exactly one cell per field: a short row is cut off, a long one
    misaligned; either is rejected, never padded or glued. The one exception is
    ``glue_into``: fields whose values may contain ", " (a process name); the
    first of them present takes the surplus cells. Lines with no comma at all are nvidia-smi's error
    messages, not rows, when more than one field is expected."""
    names = list(fields)
    rows: list[tuple[int, str, list[str]]] = []
    rejected: list[Rejected] = []
    first = True
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        cells = _split(line)
        if first:
            first = False
            if _looks_like_header(cells):
                names = [_field_name(c) for c in cells]
                continue
        if len(cells) == 1 and len(names) > 1:
            rejected.append(_rejected(number, "not a CSV row (a message from nvidia-smi?)", line))
            continue
        surplus = len(cells) - len(names)
        glue = next((n for n in glue_into if n in names), None)
        if surplus > 0 and glue is not None:
            at = names.index(glue)
            cells = cells[:at] + [", ".join(cells[at : at + surplus + 1])] + cells[at + surplus + 1 :]
        if len(cells) != len(names):
            rejected.append(_rejected(number, f"{len(cells)} fields, expected {len(names)}", line))
            continue
        longest = max(range(len(cells)), key=lambda i: len(cells[i]))
        if len(cells[longest]) > MAX_CELL_CHARS:
            reason = f"{names[longest]} is {len(cells[longest])} characters long, over the {MAX_CELL_CHARS} limit"
            rejected.append(_rejected(number, reason, line))
            continue
        rows.append((number, line, cells))
    return names, rows, rejected


def _read_table(
    text: str,
    fields: tuple[str, ...] | list[str],
    make_row: Callable[[list[str], list[str]], T],
    glue_into: tuple[str, ...] = (),
) -> Parsed[T]:
    """``_rows`` then ``make_row`` on each row; a ``_BadCell`` refuses that row alone."""
    names, rows, rejected = _rows(text, fields, glue_into)
    parsed = Parsed[T](rejected=rejected)
    for number, line, cells in rows:
        try:
            parsed.rows.append(make_row(names, cells))
        except _BadCell as e:
            rejected.append(_rejected(number, str(e), line))
    rejected.sort(key=lambda r: r.line)
    return parsed


def _gpu_row(names: list[str], cells: list[str]) -> GpuReading:
    """One row's cells -> GpuReading; ``_BadCell`` when a field is not what it says
    or memory used exceeds memory total."""
    reading = GpuReading()
    for name, cell in zip(names, cells):
        attr = _GPU_ATTRS.get(name)
        if attr is None:
            number = smi_number(cell)
            reading.extra[name] = number if number is not None else smi_value(cell)
        elif attr in _TEXT_ATTRS:
            setattr(reading, attr, _text_cell(name, cell, MAX_ID_CHARS))
        else:
            setattr(reading, attr, _number_cell(name, cell, *_GPU_NUMBERS[attr]))
    used, total = reading.memory_used_mib, reading.memory_total_mib
    if used is not None and total is not None and used > total:
        raise _BadCell(f"memory.used {used:g} MiB exceeds memory.total {total:g} MiB")
    return reading


def read_gpu_query(text: str, fields: tuple[str, ...] | list[str] = GPU_QUERY_FIELDS) -> Parsed[GpuReading]:
    """``nvidia-smi --query-gpu=... --format=csv[,noheader][,nounits]`` -> one reading
    per well-formed GPU row, and every other row with the reason it was refused.

    ``fields`` are the queried names in order (ignored when the text has a header).
    A row is refused when its field count differs from the query's, when a
    numeric field holds anything but an in-range number (``[N/A]`` and the like
    are None, not refusals), when a name or UUID is implausibly long, or when
    memory used exceeds memory total. Fields without a ``GpuReading`` attribute
    land in ``extra`` (numbers as float, anything else as text, missing as None).
    Never raises on any text.
    """
    return _read_table(text, fields, _gpu_row)


def parse_gpu_query(text: str, fields: tuple[str, ...] | list[str] = GPU_QUERY_FIELDS) -> list[GpuReading]:
    """The well-formed GPU rows of ``read_gpu_query`` (refused rows left out)."""
    return read_gpu_query(text, fields).rows


def _app_row(names: list[str], cells: list[str]) -> ComputeApp:
    values = {_APP_ATTRS.get(n, n): (n, c) for n, c in zip(names, cells)}

    def cell(attr: str) -> tuple[str, str]:
        return values.get(attr, (attr, ""))

    pid = _number_cell(*cell("pid"), *_APP_NUMBERS["pid"])
    return ComputeApp(
        pid=int(pid) if pid is not None else None,
        process_name=_text_cell(*cell("process_name"), MAX_CELL_CHARS),
        used_memory_mib=_number_cell(*cell("used_memory_mib"), *_APP_NUMBERS["used_memory_mib"]),
        gpu_uuid=_text_cell(*cell("gpu_uuid"), MAX_ID_CHARS),
    )


def read_compute_apps(text: str, fields: tuple[str, ...] | list[str] = COMPUTE_APPS_FIELDS) -> Parsed[ComputeApp]:
    """``nvidia-smi --query-compute-apps=pid,process_name,used_memory,gpu_uuid`` ->
    the well-formed rows, and every other row with the reason it was refused.
    Empty text (no process on any GPU) is no rows. A comma inside a process name
    stays in that name; any other field count mismatch, a pid that is not a
    whole number, or memory that is not an in-range number refuses the row.
    Never raises on any text."""
    return _read_table(text, fields, _app_row, glue_into=("process_name", "name"))


def parse_compute_apps(text: str, fields: tuple[str, ...] | list[str] = COMPUTE_APPS_FIELDS) -> list[ComputeApp]:
    """The well-formed rows of ``read_compute_apps`` (refused rows left out)."""
    return read_compute_apps(text, fields).rows


# --------------------------------------------------------------------------- clocks, throttling, SM share

# nvmlClocksThrottleReasons bits, as nvidia-smi -q words them.
THROTTLE_REASONS = (
    (0x1, "gpu idle"),
    (0x2, "applications clocks setting"),
    (0x4, "sw power cap"),
    (0x8, "hw slowdown"),
    (0x10, "sync boost"),
    (0x20, "sw thermal slowdown"),
    (0x40, "hw thermal slowdown"),
    (0x80, "hw power brake slowdown"),
    (0x100, "display clocks setting"),
)
_MASK = re.compile(r"^0x[0-9a-fA-F]{1,16}$")


def throttle_reasons(mask: Any) -> list[str] | None:
    """``clocks_throttle_reasons.active`` (``0x0000000000000004``) -> its reasons in
    words (``['sw power cap']``; ``[]``: none); None when it is not such a mask. A
    bit without a name is said as its value."""
    if not isinstance(mask, str) or not _MASK.match(mask.strip()):
        return None
    bits = int(mask.strip(), 16)
    named = [name for bit, name in THROTTLE_REASONS if bits & bit]
    rest = bits & ~sum(bit for bit, _ in THROTTLE_REASONS)
    return named + ([f"0x{rest:x}"] if rest else [])


def read_clocks(text: str) -> Parsed[GpuReading]:
    """``nvidia-smi --query-gpu=index,clocks.max.sm,clocks.mem,clocks_throttle_reasons.active``
    -> per GPU its index and those fields (in ``extra``); rows as ``read_gpu_query``."""
    return read_gpu_query(text, CLOCK_FIELDS)


def merge_clocks(gpus: list[GpuReading], clocks: list[GpuReading]) -> None:
    """Each GPU's clock fields (``read_clocks``) into its reading's ``extra``, by index."""
    by_index = {c.index: c for c in clocks if c.index is not None}
    for g in gpus:
        found = by_index.get(g.index)
        if found is not None:
            g.extra.update(found.extra)


def read_pmon(text: str) -> Parsed[tuple[int, int, float | None]]:
    """``nvidia-smi pmon -c 1 -s u`` -> (GPU index, pid, SM %) per process row; ``#``
    lines are its header, ``-`` an SM share it did not sample (None). A row whose GPU
    or pid is not a whole number, or whose SM share is outside 0..100, is refused."""
    parsed: Parsed[tuple[int, int, float | None]] = Parsed()
    for number, line in enumerate((text or "").splitlines(), 1):
        cells = line.split()
        if not cells or line.lstrip().startswith("#"):
            continue
        if len(cells) < 4 or not cells[0].isdigit() or not cells[1].isdigit():
            if len(cells) >= 2 and cells[1] == "-":  # a GPU without a process
                continue
            parsed.rejected.append(_rejected(number, "not a pmon row (gpu pid type sm ...)", line))
            continue
        sm = None if cells[3] == "-" else smi_number(cells[3])
        if cells[3] != "-" and (sm is None or not 0 <= sm <= 100):
            parsed.rejected.append(_rejected(number, f"sm is not a share ({cells[3][:20]!r})", line))
            continue
        parsed.rows.append((int(cells[0]), int(cells[1]), sm))
    return parsed


# --------------------------------------------------------------------------- a host's processes

PROC_MAX_ROWS = 64
PROC_CMD_CHARS = 512


@dataclass
class ProcessRow:
    """One process of a host as the probe read it (/proc): its parent, user, CPU share
    over the probe's short sample, resident memory, time since it started, command
    line, and the SM share nvidia-smi pmon gave it (None: not a GPU process or not
    sampled)."""

    pid: int
    ppid: int | None = None
    user: str | None = None
    cpu_pct: float | None = None
    rss_kib: int | None = None
    elapsed_s: float | None = None
    cmd: str | None = None
    sm_pct: float | None = None
    top: bool = False  # one of the host's top CPU consumers


def read_processes(raw: Any) -> tuple[list[ProcessRow], list[str]]:
    """The probe's ``procs`` (``{"rows": [...], "top": [pids]}``) -> rows, and what was
    refused: a row that is not an object or whose pid is not a whole number is left
    out; a field of the wrong type or out of range is None; text is cut and kept
    printable by the caller. Never raises."""
    if raw is None:
        return [], []
    if not isinstance(raw, dict) or not isinstance(raw.get("rows"), list):
        return [], ["procs is not an object with rows"]
    top = {p for p in raw.get("top") or [] if isinstance(p, int)} if isinstance(raw.get("top"), list) else set()
    rows, problems = [], []

    def number(value: Any, low: float, high: float, whole: bool = False) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (whole and not isinstance(value, int)):
            return None
        return value if low <= value <= high and math.isfinite(value) else None

    for i, row in enumerate(raw["rows"][:PROC_MAX_ROWS]):
        pid = row.get("pid") if isinstance(row, dict) else None
        if number(pid, 1, 2**31 - 1, whole=True) is None:
            problems.append(f"procs row {i}: no pid")
            continue
        text = {k: row.get(k)[:PROC_CMD_CHARS] if isinstance(row.get(k), str) else None for k in ("user", "cmd")}
        rows.append(ProcessRow(pid, number(row.get("ppid"), 0, 2**31 - 1, whole=True), text["user"],
                               number(row.get("cpu_pct"), 0, 100_000), number(row.get("rss_kib"), 0, 2**50, whole=True),
                               number(row.get("elapsed_s"), 0, 10**10), text["cmd"], top=pid in top))
    if len(raw["rows"]) > PROC_MAX_ROWS:
        problems.append(f"procs: {len(raw['rows'])} rows, the first {PROC_MAX_ROWS} kept")
    return rows, problems


# --------------------------------------------------------------------------- host CPU and memory

# What the probe reads of the host itself (dflashctl/hosts/remote/probe.py ``host_stats``).
HOST_TEXT_MAX_CHARS = 16384  # of each file's text; more is not the file it claims to be
MAX_CPUS = 65536
_MAX_LOAD = 1e6  # a load average above a million runnable tasks is not a reading
_MAX_JIFFIES = 2**63 - 1
_MAX_KIB = 2**50  # 1 EiB
_LOADAVG = re.compile(r"^(\d{1,7}\.\d{1,3}) (\d{1,7}\.\d{1,3}) (\d{1,7}\.\d{1,3})(?: |\n|$)")
_STAT_CPU = re.compile(r"^cpu((?: +\d{1,20}){4,10}) *$")
_MEMINFO = re.compile(r"^(MemTotal|MemAvailable): +(\d{1,16}) kB *$")


@dataclass
class HostReading:
    """A host's CPU and memory at one poll: ``/proc/loadavg``, the ``cpu`` line of
    ``/proc/stat`` (jiffies since boot, all CPUs together), ``/proc/meminfo`` and the
    CPUs the probe may run on. A field that could not be read is None: unknown.

    In a container whose cgroup sets a memory limit below the machine's memory,
    /proc/meminfo (without lxcfs) still tells the machine's: the memory is then the
    cgroup's limit, and what is left under it is the limit less its usage plus the
    inactive page cache that reclaim frees first, or the machine's MemAvailable when
    that is less. Where a cgroup's CPU quota is less than the CPUs the probe may use,
    the CPU counters are that cgroup's: its CPU time used, against its quota's share
    of the host's uptime, in /proc/stat's units (1/100 s), so the busy share between
    two readings is the share of the quota used."""

    cpus: int | None = None
    load1: float | None = None
    load5: float | None = None
    load15: float | None = None
    cpu_total: int | None = None  # jiffies: user nice system idle iowait irq softirq steal (guest is in user)
    cpu_idle: int | None = None  # jiffies: idle + iowait
    mem_total_kib: int | None = None
    mem_available_kib: int | None = None  # MemAvailable: what can be had without swapping
    mem_cgroup: int | None = None  # 1: the two above are a cgroup's limit and what is left under it (a container)
    cpu_cgroup: float | None = None  # a cgroup's CPU quota, in CPUs, when cpu_total/cpu_idle are its time against it
    processes: list[dict[str, Any]] | None = None  # ProcessRow's fields: GPU and run processes, top CPU consumers


def _host_text(name: str, text: Any, problems: list[str]) -> str | None:
    if text is None:
        return None
    if not isinstance(text, str):
        problems.append(f"{name} is not text ({type(text).__name__})")
        return None
    if len(text) > HOST_TEXT_MAX_CHARS:
        problems.append(f"{name} is {len(text)} characters long, over the {HOST_TEXT_MAX_CHARS} limit: not read")
        return None
    return text


def _loadavg(text: str, reading: HostReading, problems: list[str]) -> None:
    m = _LOADAVG.match(text)
    loads = [float(v) for v in m.groups()] if m else []
    if not m or any(v > _MAX_LOAD for v in loads):
        problems.append(f"/proc/loadavg is not three load averages ({_show(text)})")
        return
    reading.load1, reading.load5, reading.load15 = loads


def _stat(text: str, reading: HostReading, problems: list[str]) -> None:
    """The aggregate ``cpu`` line (the first line of /proc/stat on Linux)."""
    line = next((ln for ln in text.splitlines() if ln.startswith("cpu ")), None)
    m = _STAT_CPU.match(line) if line is not None else None
    if m is None:
        problems.append(f"/proc/stat has no well-formed cpu line ({_show(line if line is not None else text)})")
        return
    values = [int(v) for v in m.group(1).split()]
    total, idle = sum(values[:8]), values[3] + (values[4] if len(values) > 4 else 0)
    if total > _MAX_JIFFIES:
        problems.append(f"/proc/stat: cpu time {total} is out of range")
        return
    reading.cpu_total, reading.cpu_idle = total, idle


def _meminfo(text: str, reading: HostReading, problems: list[str]) -> None:
    found: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("Mem"):
            m = _MEMINFO.match(line)
            if m is not None:
                if m.group(1) in found:
                    problems.append(f"/proc/meminfo: {m.group(1)} twice: memory unknown")
                    return
                found[m.group(1)] = int(m.group(2))
    total, available = found.get("MemTotal"), found.get("MemAvailable")
    if total is None or available is None:
        missing = " and ".join(k for k in ("MemTotal", "MemAvailable") if k not in found)
        problems.append(f"/proc/meminfo has no {missing} line in kB")
        return
    if not 0 < total <= _MAX_KIB or available > total:
        problems.append(f"/proc/meminfo: MemAvailable {available} kB of MemTotal {total} kB is not a reading")
        return
    reading.mem_total_kib, reading.mem_available_kib = total, available


_CGROUP_NUMBER = re.compile(r"^\d{1,20}$")


def _shown(value: Any) -> str:
    """A value from a host answer, for an error line: text cut short, else only its type
    (never str() of what may be a huge int)."""
    return _show(value) if isinstance(value, str) else f"a {type(value).__name__}"


def _cgroup_numbers(raw: Any, what: str, keys: tuple[str, ...], unit: str, problems: list[str],
                    optional: tuple[str, ...] = ()) -> dict[str, int] | None:
    """The whole numbers ``keys`` of a probe's cgroup object (texts of digits; an absent
    ``optional`` one reads 0), or None with the first reason it is not a reading."""
    if not isinstance(raw, dict):
        problems.append(f"{what} is not an object ({type(raw).__name__})")
        return None
    numbers: dict[str, int] = {}
    for key in keys:
        text = raw.get(key)
        if text is None and key in optional:
            numbers[key] = 0
        elif isinstance(text, str) and _CGROUP_NUMBER.match(text):
            numbers[key] = int(text)
        else:
            problems.append(f"{what}: {key} is not {unit} ({_shown(text)})")
            return None
    return numbers


def _cgroup_memory(raw: Any, reading: HostReading, problems: list[str]) -> None:
    """The probe's ``cgroup_memory`` (texts of a cgroup's limit, usage and inactive
    page cache, in bytes) over the /proc/meminfo figures, where its limit binds."""
    numbers = _cgroup_numbers(raw, "cgroup memory", ("limit", "usage", "inactive"), "a byte count", problems,
                              optional=("inactive",))
    if numbers is None:
        return
    limit_kib = numbers["limit"] // 1024
    if limit_kib > _MAX_KIB or (reading.mem_total_kib is not None and limit_kib >= reading.mem_total_kib):
        return  # the limit does not bind ("unlimited" in cgroup v1 is a huge number): the machine's figures
    if limit_kib == 0:
        problems.append(f"cgroup memory: a limit of {numbers['limit']} bytes is not a reading")
        return
    left_kib = max(0, min(limit_kib, (numbers["limit"] - numbers["usage"] + numbers["inactive"]) // 1024))
    if reading.mem_available_kib is not None:
        left_kib = min(left_kib, reading.mem_available_kib)
    reading.mem_total_kib, reading.mem_available_kib, reading.mem_cgroup = limit_kib, left_kib, 1


_UPTIME = re.compile(r"^\d{1,12}(\.\d{1,3})?$")


def _cgroup_cpu(raw: Any, reading: HostReading, problems: list[str]) -> None:
    """The probe's ``cgroup_cpu`` (texts: quota and period in microseconds, the CPU time
    the cgroup used in microseconds, the host's uptime in seconds) over /proc/stat's
    counters, where the quota is less than the CPUs the probe may use."""
    numbers = _cgroup_numbers(raw, "cgroup cpu", ("quota_us", "period_us", "usage_us"), "a number of microseconds",
                              problems)
    if numbers is None:
        return
    uptime = raw.get("uptime_s")
    if not isinstance(uptime, str) or not _UPTIME.match(uptime):
        problems.append(f"cgroup cpu: uptime_s is not seconds ({_shown(uptime)})")
        return
    if numbers["period_us"] == 0 or numbers["quota_us"] == 0:
        problems.append(f"cgroup cpu: a quota of {numbers['quota_us']} per {numbers['period_us']} us is not a reading")
        return
    quota = numbers["quota_us"] / numbers["period_us"]  # CPUs
    if quota > MAX_CPUS or (reading.cpus is not None and quota >= reading.cpus):
        return  # the quota does not bind: the machine's counters
    total = int(float(uptime) * 100 * quota)
    reading.cpu_total, reading.cpu_idle = total, max(0, total - numbers["usage_us"] // 10_000)
    reading.cpu_cgroup = round(quota, 3)


def read_host_stats(loadavg: Any, stat: Any, meminfo: Any, cpus: Any,
                    cgroup_memory: Any = None, cgroup_cpu: Any = None) -> tuple[HostReading, list[str]]:
    """The probe's host texts -> a ``HostReading`` and what was wrong with them.

    Each part stands alone: a garbage /proc/stat leaves the load and memory read.
    A part that is not what it should be (not text, longer than
    ``HOST_TEXT_MAX_CHARS``, a number out of range, memory available above total,
    a field twice) is None, unknown, with its reason in the list: never a guessed
    number. ``cpus`` is an int in 1..``MAX_CPUS``. ``cgroup_memory`` (a container's
    limit, usage and inactive cache) replaces the memory where its limit binds, and
    ``cgroup_cpu`` (its quota, CPU time and the uptime) the CPU counters where its
    quota binds; a malformed one leaves the /proc figures. Never raises on any input."""
    reading, problems = HostReading(), []
    if cpus is not None:
        if type(cpus) is int and 1 <= cpus <= MAX_CPUS:  # type(): a bool is not a CPU count
            reading.cpus = cpus
        else:
            shown = "out of range" if type(cpus) is int else f"a {type(cpus).__name__}"  # never repr() a huge int
            problems.append(f"cpus is not a whole number in 1..{MAX_CPUS} ({shown})")
    for name, text, read in (("/proc/loadavg", loadavg, _loadavg), ("/proc/stat", stat, _stat),
                             ("/proc/meminfo", meminfo, _meminfo)):
        text = _host_text(name, text, problems)
        if text is not None:
            read(text, reading, problems)
    if cgroup_memory is not None:
        _cgroup_memory(cgroup_memory, reading, problems)
    if cgroup_cpu is not None:
        _cgroup_cpu(cgroup_cpu, reading, problems)
    return reading, problems


def cpu_busy_pct(older: HostReading, newer: HostReading) -> float | None:
    """How busy the host's CPUs were between two readings, 0..100 (all CPUs
    together, or a cgroup's quota: ``HostReading``); None when either lacks its
    counters, they are not of the same kind, no time passed between them or the
    counters went back (a reboot between the readings)."""
    if None in (older.cpu_total, older.cpu_idle, newer.cpu_total, newer.cpu_idle):
        return None
    if older.cpu_cgroup != newer.cpu_cgroup:
        return None  # counters of different kinds: a cgroup's quota set or changed between the two
    total = newer.cpu_total - older.cpu_total  # type: ignore[operator]
    idle = newer.cpu_idle - older.cpu_idle  # type: ignore[operator]
    if total <= 0 or not 0 <= idle <= total:
        return None
    return 100.0 * (total - idle) / total


# --------------------------------------------------------------------------- metrics


def read_metrics_chunk(text: str) -> Parsed[contract.Metrics]:
    """Complete metrics.jsonl lines -> the good lines as ``Metrics`` and the bad ones
    as ``Rejected`` (1-based line number in ``text``, the reason from
    ``contract.read_metrics_line``). Blank lines are neither. Never raises."""
    parsed = Parsed[contract.Metrics]()
    for number, line in enumerate(text.split("\n"), 1):
        if len(line) <= contract.MAX_LINE_CHARS and not line.strip():
            continue
        try:
            parsed.rows.append(contract.read_metrics_line(line))
        except contract.ContractError as e:
            parsed.rejected.append(_rejected(number, e.reason, line))
    return parsed


def parse_metrics_chunk(text: str) -> tuple[list[contract.Metrics], int]:
    """Complete metrics.jsonl lines -> (parsed metrics, number of malformed lines).
    Blank lines are neither. ``read_metrics_chunk`` also says which lines and why."""
    chunk = read_metrics_chunk(text)
    return chunk.rows, len(chunk.rejected)
