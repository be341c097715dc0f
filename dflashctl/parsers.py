"""Pure parsers for what the probe brings back: nvidia-smi CSV, metrics lines, pane text.

Every function here is a function of text. A missing reading (``[N/A]``, an empty
file, a field nvidia-smi does not support on this GPU) is ``None``, never an
exception: one odd GPU must not hide the others.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from dflashctl import contract

# --------------------------------------------------------------------------- nvidia-smi

# The probe's queries. Changing them changes what the parsers expect by default.
GPU_QUERY_FIELDS = (
    "index",
    "uuid",
    "name",
    "memory.used",
    "memory.total",
    "utilization.gpu",
    "temperature.gpu",
    "power.draw",
    "power.limit",
    "clocks.sm",
)
COMPUTE_APPS_FIELDS = ("pid", "process_name", "used_memory", "gpu_uuid")

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


def smi_value(cell: str) -> str | None:
    """The cell's text, or None for nvidia-smi's ways of saying 'no reading'
    (``[N/A]``, ``N/A``, ``[Not Supported]``, ``[Unknown Error]``, ...)."""
    cell = cell.strip()
    if not cell or cell == "N/A" or (cell.startswith("[") and cell.endswith("]")):
        return None
    return cell


def smi_number(cell: str) -> float | None:
    """A numeric cell with or without its unit; None when missing or not a number."""
    text = smi_value(cell)
    if text is None:
        return None
    m = _NUMBER.match(text)
    return float(m.group(1)) if m else None


def _split(line: str) -> list[str]:
    # nvidia-smi never quotes: cells are separated by ", ".
    return [c.strip() for c in line.split(",")]


def _field_name(header_cell: str) -> str:
    return _HEADER_UNIT.sub("", header_cell.strip())


def _rows(text: str, fields: tuple[str, ...] | list[str]) -> tuple[list[str], list[list[str]]]:
    """Split CSV text into (field names, rows). A header line, when present,
    names the fields (and wins over ``fields``). Lines with no comma at all are
    nvidia-smi's error messages, not rows, when more than one field is expected."""
    names = list(fields)
    rows = []
    for n, line in enumerate(l for l in text.splitlines() if l.strip()):
        cells = _split(line)
        if n == 0 and _looks_like_header(cells):
            names = [_field_name(c) for c in cells]
            continue
        if len(cells) == 1 and len(names) > 1:
            continue
        rows.append(_fit(cells, names))
    return names, rows


def _looks_like_header(cells: list[str]) -> bool:
    # Field names are lower-case dotted identifiers; a data row always has a
    # number, an upper-case name or a bracketed "[N/A]" somewhere.
    return all(_FIELD_NAME.match(_field_name(c)) for c in cells)


def _fit(cells: list[str], names: list[str]) -> list[str]:
    """Make a row as long as the field list. Surplus cells come from a comma
    inside a name: glue them back into that field; missing cells are empty."""
    surplus = len(cells) - len(names)
    if surplus > 0:
        at = next((i for i, n in enumerate(names) if n in ("name", "process_name")), len(names) - 1)
        cells = cells[:at] + [", ".join(cells[at : at + surplus + 1])] + cells[at + surplus + 1 :]
    return cells + [""] * (len(names) - len(cells))


def parse_gpu_query(text: str, fields: tuple[str, ...] | list[str] = GPU_QUERY_FIELDS) -> list[GpuReading]:
    """``nvidia-smi --query-gpu=... --format=csv[,noheader][,nounits]`` -> one reading per GPU.

    ``fields`` are the queried names in order (ignored when the text has a header).
    Fields without a ``GpuReading`` attribute land in ``extra`` (numbers as float,
    anything else as text, missing as None).
    """
    names, rows = _rows(text, fields)
    readings = []
    for cells in rows:
        reading = GpuReading()
        for name, cell in zip(names, cells):
            attr = _GPU_ATTRS.get(name)
            if attr is None:
                number = smi_number(cell)
                reading.extra[name] = number if number is not None else smi_value(cell)
            elif attr in _TEXT_ATTRS:
                setattr(reading, attr, smi_value(cell))
            elif attr == "index":
                number = smi_number(cell)
                reading.index = int(number) if number is not None else None
            else:
                setattr(reading, attr, smi_number(cell))
        readings.append(reading)
    return readings


def parse_compute_apps(text: str, fields: tuple[str, ...] | list[str] = COMPUTE_APPS_FIELDS) -> list[ComputeApp]:
    """``nvidia-smi --query-compute-apps=pid,process_name,used_memory,gpu_uuid`` -> rows.
    Empty text (no process on any GPU) is an empty list."""
    names, rows = _rows(text, fields)
    apps = []
    for cells in rows:
        values = {_APP_ATTRS.get(n): c for n, c in zip(names, cells)}
        pid = smi_number(values.get("pid", ""))
        apps.append(
            ComputeApp(
                pid=int(pid) if pid is not None else None,
                process_name=smi_value(values.get("process_name", "")),
                used_memory_mib=smi_number(values.get("used_memory_mib", "")),
                gpu_uuid=smi_value(values.get("gpu_uuid", "")),
            )
        )
    return apps


# --------------------------------------------------------------------------- metrics


def parse_metrics_chunk(text: str) -> tuple[list[contract.Metrics], int]:
    """Complete metrics.jsonl lines -> (parsed metrics, number of malformed lines).
    Blank lines are neither."""
    parsed: list[contract.Metrics] = []
    malformed = 0
    for line in text.splitlines():
        if not line.strip():
            continue
        m = contract.parse_metrics_line(line)
        if m is None:
            malformed += 1
        else:
            parsed.append(m)
    return parsed, malformed


# --------------------------------------------------------------------------- pane / log text

_TRACEBACK = re.compile(r"Traceback \(most recent call last\):")
_CHAINED = re.compile(
    r"During handling of the above exception, another exception occurred:"
    r"|The above exception was the direct cause of the following exception:"
)
_MAX_MESSAGE_LINES = 30


@dataclass
class Traceback:
    """The last Python traceback in some output."""

    text: str  # from the "Traceback" line to the end of the exception message
    exception: str  # the exception line, e.g. "torch.OutOfMemoryError: CUDA out of memory. ..."
    lines_after: int  # non-blank lines printed after it (0: it is the last thing printed)


def tail_lines(text: str | None, n: int) -> str:
    """The last ``n`` lines, trailing blank lines (a pane's empty rows) dropped first."""
    if not text or n <= 0:
        return ""
    lines = text.rstrip().splitlines()
    return "\n".join(lines[-n:])


def last_traceback(text: str | None) -> Traceback | None:
    """The last traceback in ``text``, or None. Line prefixes that a launcher adds
    (``[rank0]: ``) are removed; chained exceptions give the final one."""
    if not text:
        return None
    lines = text.splitlines()
    start = None
    for i in range(len(lines) - 1, -1, -1):
        if _TRACEBACK.search(lines[i]):
            start = i
            break
    if start is None:
        return None
    prefix = lines[start][: _TRACEBACK.search(lines[start]).start()]
    body = [l[len(prefix) :] if prefix and l.startswith(prefix) else l for l in lines[start:]]
    # Frames are indented; the first non-indented line after the header is the exception.
    exc_at = next((j for j in range(1, len(body)) if body[j].strip() and not body[j][0].isspace()), None)
    if exc_at is None:  # cut off before the exception line (output still arriving)
        return Traceback(text="\n".join(body).rstrip(), exception="", lines_after=0)
    end = exc_at + 1
    while end < len(body) and body[end].strip() and end - exc_at < _MAX_MESSAGE_LINES:
        end += 1
    after = sum(1 for l in body[end:] if l.strip())
    return Traceback(text="\n".join(body[:end]), exception=body[exc_at].strip(), lines_after=after)


def last_error_start(text: str | None) -> int | None:
    """Offset of the line where the last error report begins: the first
    traceback of the last chain ("During handling of the above exception ..."),
    so the original cause is included. None when there is no traceback."""
    if not text:
        return None
    starts = [m.start() for m in _TRACEBACK.finditer(text)]
    if not starts:
        return None
    i = len(starts) - 1
    while i > 0 and _CHAINED.search(text, starts[i - 1], starts[i]):
        i -= 1
    return text.rfind("\n", 0, starts[i]) + 1
