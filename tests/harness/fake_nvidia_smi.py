"""Test stand-in for `nvidia-smi` on GPU-less test hosts: prints the real H200
captures in tests/fixtures/nvidia-smi according to its arguments.

The state (``idle`` or ``load``) comes from $DFLASHCTL_FAKE_SMI, else from the
file named by $FAKE_SMI_MODE_FILE (the host's ``fake-smi`` file), else ``idle``.

A query that matches a captured command prints that capture byte for byte. Other
``--query-gpu`` / ``--query-compute-apps`` field lists are answered from the same
captured values, formatted as nvidia-smi does (units and header per --format).
Fields that were never captured are refused like nvidia-smi refuses unknown ones.
Stdlib only: it runs with whatever python3 the test host has.
"""

from __future__ import annotations

import os
import sys

CAPTURES = os.environ.get("FAKE_SMI_CAPTURES") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "nvidia-smi"
)

GPU_FIELDS = (
    "index,uuid,name,memory.used,memory.total,utilization.gpu,"
    "temperature.gpu,power.draw,power.limit,clocks.sm"
)
NA_FIELDS = "index,ecc.errors.uncorrected.volatile.total,fan.speed,pstate,clocks_throttle_reasons.active"
SEED_FIELDS = "index,memory.used,utilization.gpu"
APP_FIELDS = "pid,process_name,used_memory,gpu_uuid"
CLOCK_NAMES = ("clocks.max.sm", "clocks.mem")  # read from the -q -x capture

# (query option, fields, format) -> capture file name ("{mode}" is idle or load).
EXACT = {
    ("--query-gpu", GPU_FIELDS, "csv,noheader,nounits"): "h200-{mode}-query.csv",
    ("--query-gpu", SEED_FIELDS, "csv,noheader"): "h200-{mode}-seed-query.csv",
    ("--query-gpu", SEED_FIELDS, "csv"): "h200-{mode}-seed-query-header.csv",
    ("--query-gpu", NA_FIELDS, "csv,noheader,nounits"): "h200-{mode}-na-fields.csv",
    ("--query-compute-apps", APP_FIELDS, "csv,noheader,nounits"): "h200-{mode}-apps.csv",
}
# Units nvidia-smi appends without `nounits`, and shows in the header.
UNITS = {
    "memory.used": "MiB",
    "memory.total": "MiB",
    "utilization.gpu": "%",
    "power.draw": "W",
    "power.limit": "W",
    "clocks.sm": "MHz",
    "clocks.max.sm": "MHz",
    "clocks.mem": "MHz",
    "fan.speed": "%",
    "used_memory": "MiB",
}
HEADER_NAMES = {"clocks.sm": "clocks.current.sm", "process_name": "process_name", "used_memory": "used_gpu_memory"}


def mode() -> str:
    value = os.environ.get("DFLASHCTL_FAKE_SMI")
    if not value and os.environ.get("FAKE_SMI_MODE_FILE"):
        try:
            with open(os.environ["FAKE_SMI_MODE_FILE"]) as f:
                value = f.read().strip()
        except OSError:
            value = None
    return value if value in ("idle", "load") else "idle"


def capture(name: str) -> str | None:
    path = os.path.join(CAPTURES, name.format(mode=mode()))
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()


def rows(fields: str, name: str) -> list[dict[str, str]]:
    text = capture(name)
    if text is None:  # no capture of these fields in this state: use the other state's
        text = capture(name.replace("{mode}", "load")) or ""
    names = fields.split(",")
    return [dict(zip(names, line.split(", "))) for line in text.splitlines() if line.strip()]


def table(option: str) -> list[dict[str, str]]:
    """Every captured value per GPU (or per process) for this kind of query."""
    if option == "--query-compute-apps":
        return rows(APP_FIELDS, "h200-{mode}-apps.csv")
    merged = rows(GPU_FIELDS, "h200-{mode}-query.csv")
    for row, extra in zip(merged, rows(NA_FIELDS, "h200-{mode}-na-fields.csv")):
        row.update({k: v for k, v in extra.items() if k not in row})
    for row, clocks in zip(merged, xml_clocks()):
        row.update({k: v for k, v in clocks.items() if k not in row})
    return merged


def xml_clocks() -> list[dict[str, str]]:
    """Per GPU of the ``-q -x`` capture: clocks.max.sm and clocks.mem, in MHz."""
    import re

    text = capture("h200-{mode}-q.xml") or ""
    out = []
    for gpu in text.split("<gpu id=")[1:]:
        found = {}
        for field, pattern in (("clocks.max.sm", r"<max_clocks>.*?<sm_clock>(\d+) MHz"),
                               ("clocks.mem", r"<clocks>.*?<mem_clock>(\d+) MHz")):
            m = re.search(pattern, gpu, re.S)
            if m:
                found[field] = m.group(1)
        out.append(found)
    return out


def query(option: str, fields: str, fmt: str) -> int:
    exact = EXACT.get((option, fields, fmt))
    text = capture(exact) if exact else None
    if text is not None:
        sys.stdout.write(text)
        return 0
    opts = set(fmt.split(","))
    if "csv" not in opts:
        print(f'"{fmt}" is not a valid format.', file=sys.stderr)
        return 2
    wanted = fields.split(",")
    data = table(option)
    known = set(GPU_FIELDS.split(",") + NA_FIELDS.split(",") + APP_FIELDS.split(",") + list(CLOCK_NAMES))
    for name in wanted:
        if name not in known:
            print(f'Field "{name}" is not a valid field to query.', file=sys.stderr)
            return 2
    if "noheader" not in opts:
        print(", ".join(_header(n) for n in wanted))
    for row in data:
        print(", ".join(_cell(n, row.get(n, "[N/A]"), "nounits" in opts) for n in wanted))
    return 0


def _header(name: str) -> str:
    unit = UNITS.get(name)
    return HEADER_NAMES.get(name, name) + (f" [{unit}]" if unit else "")


def _cell(name: str, value: str, nounits: bool) -> str:
    unit = UNITS.get(name)
    if nounits or not unit or value.startswith("["):
        return value
    return f"{value} %" if unit == "%" else f"{value} {unit}"


def option_value(args: list[str], option: str) -> str | None:
    for i, arg in enumerate(args):
        if arg.startswith(option + "="):
            return arg.split("=", 1)[1]
        if arg == option and i + 1 < len(args):
            return args[i + 1]
    return None


def main(args: list[str]) -> int:
    if not args:
        sys.stdout.write(capture("h200-{mode}-plain.txt") or "")
        return 0
    if set(args) in ({"-q", "-x"}, {"--query", "--xml-format"}):
        sys.stdout.write(capture("h200-{mode}-q.xml") or "")
        return 0
    if args in (["-L"], ["--list-gpus"]):
        for row in table("--query-gpu"):
            print(f"GPU {row['index']}: {row['name']} (UUID: {row['uuid']})")
        return 0
    for option in ("--query-gpu", "--query-compute-apps"):
        fields = option_value(args, option)
        if fields is not None:
            return query(option, fields, option_value(args, "--format") or "csv")
    print(f"fake nvidia-smi: no capture for arguments {args!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
