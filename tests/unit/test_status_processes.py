"""A host's processes and a GPU's clocks as the views read them back from the store
(dflashctl/status/processes.py): wrong types are unknown, the busiest first, a
process's parents in order, idle is no slowdown."""

from __future__ import annotations

from dflashctl.status.processes import Clocks, busiest, fmt_kib, lineage, processes_of


def test_stored_rows_are_read_back_and_wrong_types_are_unknown():
    rows = processes_of({"processes": [
        {"pid": 10, "ppid": 1, "user": "alice", "cpu_pct": 12, "rss_kib": 2048, "elapsed_s": 5, "cmd": "a", "top": True},
        {"pid": "11"}, {"pid": 12, "ppid": True, "user": 3, "cpu_pct": "x", "top": "yes"}, "junk"]})
    assert [p.pid for p in rows] == [10, 12]
    assert (rows[1].ppid, rows[1].user, rows[1].cpu_pct, rows[1].top) == (None, None, None, False)
    assert rows[0].figures() == "alice cpu 12% rss 2M up 5 s"
    assert processes_of(None) == [] and processes_of({"processes": "x"}) == []
    assert fmt_kib(12_900_000) == "12.3G" and fmt_kib(800_000) == "781M" and fmt_kib(None) == "?"


def test_the_busiest_first_and_a_processes_parents_in_order():
    rows = processes_of({"processes": [
        {"pid": 3, "ppid": 2, "cpu_pct": 50.0, "top": True}, {"pid": 2, "ppid": 1, "cpu_pct": 0.0},
        {"pid": 9, "ppid": 1, "cpu_pct": 300.0, "top": True}, {"pid": 8, "ppid": 8, "cpu_pct": 1.0}]})
    assert [p.pid for p in busiest(rows)] == [9, 3]
    assert [p.pid for p in lineage(rows, 3)] == [3, 2] and [p.pid for p in lineage(rows, 8)] == [8]


def test_clocks_idle_is_no_slowdown_and_a_row_without_clock_fields_has_none():
    clocks = Clocks.from_row({"clocks_sm_mhz": 1440.0, "extra": {
        "clocks.max.sm": 1980.0, "clocks_throttle_reasons.active": "0x0000000000000005"}})
    assert clocks.reasons == ["gpu idle", "sw power cap"] and clocks.slowdowns == ["sw power cap"]
    assert clocks.text() == "sm 1440/1980 MHz · sw power cap"
    assert Clocks.from_row({"clocks_sm_mhz": 1440.0}) is None and Clocks.from_row({"extra": "x"}) is None
