"""Per-process and clock readings (dflashctl/hosts/parsers.py) on the real H200
captures where one exists: the throttle mask against what the same host's
`nvidia-smi -q -x` says, clocks merged into each GPU's reading by index, pmon's
SM shares, and the probe's process rows refused field by field when hostile."""

from __future__ import annotations

import re

from dflashctl.hosts import parsers
from tests.harness import FIXTURES

SMI = FIXTURES / "nvidia-smi"
NA_FIELDS = ("index", "ecc.errors.uncorrected.volatile.total", "fan.speed", "pstate", "clocks_throttle_reasons.active")


def test_the_captured_throttle_mask_says_what_the_hosts_xml_says():
    (row,) = parsers.parse_gpu_query((SMI / "h200-load-na-fields.csv").read_text(), NA_FIELDS)
    reasons = parsers.throttle_reasons(row.extra["clocks_throttle_reasons.active"])
    xml = (SMI / "h200-load-q.xml").read_text()
    active = re.findall(r"<clocks_event_reason_(\w+)>Active<", xml)
    assert reasons == ["sw power cap"] and active == ["sw_power_cap"]
    assert parsers.throttle_reasons("0x0000000000000000") == []
    assert parsers.throttle_reasons("0x0000000000000041") == ["gpu idle", "hw thermal slowdown"]
    assert parsers.throttle_reasons("0x8000") == ["0x8000"]  # a bit without a name: its value
    for bad in ("[N/A]", "4", None, 4, "0x" + "f" * 40):
        assert parsers.throttle_reasons(bad) is None


def test_clocks_are_merged_into_each_gpus_reading_by_index():
    gpus = parsers.parse_gpu_query((SMI / "h200-load-query.csv").read_text())
    clocks = parsers.parse_gpu_query((SMI / "h200-load-na-fields.csv").read_text(), NA_FIELDS)
    parsers.merge_clocks(gpus, clocks)
    assert gpus[0].clocks_sm_mhz == 1440.0 and gpus[0].extra["clocks_throttle_reasons.active"] == "0x0000000000000004"
    assert gpus[0].extra["fan.speed"] is None  # [N/A]


def test_pmon_rows_give_each_processes_sm_share():
    # nvidia-smi pmon -c 1 -s u as its manual prints it (no capture of it yet).
    text = ("# gpu         pid   type     sm    mem    enc    dec    jpg    ofa    command \n"
            "# Idx           #    C/G      %      %      %      %      %      %    name \n"
            "    0        416     C     99     40      -      -      -      -    python3        \n"
            "    1          -     -      -      -      -      -      -      -    -              \n"
            "    2       4343     C      -      -      -      -      -      -    python3        \n"
            "    3       4344     C    250      1      -      -      -      -    python3        \n"
            "garbage\n")
    parsed = parsers.read_pmon(text)
    assert parsed.rows == [(0, 416, 99.0), (2, 4343, None)]
    assert [r.line for r in parsed.rejected] == [6, 7]


def test_captured_pmon_and_clocks_of_an_h200_under_load_and_idle():
    load = parsers.read_pmon((SMI / "h200-pmon-load.txt").read_text())
    assert load.rows == [(0, 477, 97.0)] and not load.rejected
    idle = parsers.read_pmon((SMI / "h200-pmon-idle.txt").read_text())
    assert idle.rows == [] and not idle.rejected  # a GPU with no process: its row of '-' is no process
    busy, quiet = (parsers.read_clocks((SMI / f"h200-clocks-{k}.csv").read_text()).rows for k in ("load", "idle"))
    assert [g.extra["clocks_throttle_reasons.active"] for g in busy + quiet] == ["0x0000000000000004",
                                                                                "0x0000000000000000"]
    assert busy[0].extra["clocks.max.sm"] == 1980.0 and busy[0].extra["clocks.mem"] == 3201.0


def test_hostile_process_rows_are_refused_field_by_field():
    rows, problems = parsers.read_processes({"rows": [
        {"pid": 7, "ppid": 1, "user": "alice", "cpu_pct": 12.5, "rss_kib": 2048, "elapsed_s": 60.0, "cmd": "x" * 9000},
        {"pid": "7"}, "not a row", {"pid": True},
        {"pid": 8, "ppid": -1, "user": 5, "cpu_pct": float("nan"), "rss_kib": 1.5, "elapsed_s": -3, "cmd": None},
    ], "top": [8, "x"]})
    assert [r.pid for r in rows] == [7, 8] and len(problems) == 3
    assert rows[0].user == "alice" and len(rows[0].cmd) == parsers.PROC_CMD_CHARS and not rows[0].top
    assert (rows[1].ppid, rows[1].user, rows[1].cpu_pct, rows[1].rss_kib, rows[1].elapsed_s) == (None,) * 5
    assert rows[1].top
    assert parsers.read_processes("junk") == ([], ["procs is not an object with rows"])
    assert parsers.read_processes(None) == ([], [])
    many, said = parsers.read_processes({"rows": [{"pid": p} for p in range(1, 200)]})
    assert len(many) == parsers.PROC_MAX_ROWS and "first 64 kept" in said[0]
