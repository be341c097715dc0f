"""The host line's parser over real /proc captures of a Linux machine
(tests/fixtures/proc): CPU, memory and load, a container's cgroup limits, and
anything malformed read as "unknown" with its reason, never a wrong number. (The
probe's readings, the store and the pane: tests/integration/test_tui_hostline.py.)"""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest

from dflashctl.hosts.parsers import HOST_TEXT_MAX_CHARS, HostReading, cpu_busy_pct, read_host_stats
from tests import harness

PROC = harness.FIXTURES / "proc"  # captured on the 2-core development VM


def _captured(stat: str = "stat") -> tuple[HostReading, list[str]]:
    return read_host_stats((PROC / "loadavg").read_text(), (PROC / stat).read_text(),
                           (PROC / "meminfo").read_text(), 2)


def _kib(name: str) -> int:
    line = next(ln for ln in (PROC / "meminfo").read_text().splitlines() if ln.startswith(name + ":"))
    return int(line.split()[1])


GIB = 1 << 30


def _cgroup(limit, usage, inactive="0"):
    return {"limit": limit, "usage": usage, "inactive": inactive}


def _cpu(quota, usage, uptime, period="100000"):
    return {"quota_us": quota, "period_us": period, "usage_us": usage, "uptime_s": uptime}


LOADAVG = (PROC / "loadavg").read_text()


STAT = (PROC / "stat").read_text()


MEMINFO = (PROC / "meminfo").read_text()


# (what is hostile, loadavg, stat, meminfo, cpus, the fields it must leave unknown)
HOSTILE = [
    ("loadavg cut short", "0.52 0.5", STAT, MEMINFO, 2, {"load1", "load5", "load15"}),
    ("loadavg not numbers", "nan nan nan 1/2 3", STAT, MEMINFO, 2, {"load1", "load5", "load15"}),
    ("loadavg negative", "-1.00 0.50 0.20 1/2 3", STAT, MEMINFO, 2, {"load1", "load5", "load15"}),
    ("loadavg a thousand digits", "9" * 1000 + ".00 0.5 0.5 1/2 3", STAT, MEMINFO, 2, {"load1", "load5", "load15"}),
    ("loadavg of binary", "\x00\xff\x1b[2J", STAT, MEMINFO, 2, {"load1", "load5", "load15"}),
    ("stat without its cpu line", LOADAVG, STAT.split("\n", 1)[1], MEMINFO, 2, {"cpu_total", "cpu_idle"}),
    ("stat cpu line of letters", LOADAVG, "cpu  12 x 3 4 5\n", MEMINFO, 2, {"cpu_total", "cpu_idle"}),
    ("stat cpu line of three fields", LOADAVG, "cpu  1 2 3\n", MEMINFO, 2, {"cpu_total", "cpu_idle"}),
    ("stat with a 40-digit counter", LOADAVG, "cpu  " + "9" * 40 + " 0 0 1 0\n", MEMINFO, 2, {"cpu_total", "cpu_idle"}),
    ("stat counters past int64", LOADAVG, "cpu  " + " ".join(["9" * 19] * 8) + "\n", MEMINFO, 2,
     {"cpu_total", "cpu_idle"}),
    ("meminfo available above total", LOADAVG, STAT, "MemTotal: 100 kB\nMemAvailable: 200 kB\n", 2,
     {"mem_total_kib", "mem_available_kib"}),
    ("meminfo in MB, not kB", LOADAVG, STAT, "MemTotal: 100 MB\nMemAvailable: 50 MB\n", 2,
     {"mem_total_kib", "mem_available_kib"}),
    ("meminfo MemTotal twice", LOADAVG, STAT, "MemTotal: 100 kB\nMemAvailable: 50 kB\nMemTotal: 900 kB\n", 2,
     {"mem_total_kib", "mem_available_kib"}),
    ("meminfo without MemAvailable (kernel < 3.14)", LOADAVG, STAT, "MemTotal: 100 kB\nMemFree: 50 kB\n", 2,
     {"mem_total_kib", "mem_available_kib"}),
    ("meminfo of zero total", LOADAVG, STAT, "MemTotal: 0 kB\nMemAvailable: 0 kB\n", 2,
     {"mem_total_kib", "mem_available_kib"}),
    ("meminfo of a megabyte", LOADAVG, STAT, MEMINFO * 1000, 2, {"mem_total_kib", "mem_available_kib"}),
    ("meminfo not text", LOADAVG, STAT, ["MemTotal: 1 kB"], 2, {"mem_total_kib", "mem_available_kib"}),
    ("cpus zero", LOADAVG, STAT, MEMINFO, 0, {"cpus"}),
    ("cpus a bool", LOADAVG, STAT, MEMINFO, True, {"cpus"}),
    ("cpus as text", LOADAVG, STAT, MEMINFO, "2", {"cpus"}),
    ("cpus a 5000-digit int", LOADAVG, STAT, MEMINFO, 10**5000, {"cpus"}),
    ("cpus a float", LOADAVG, STAT, MEMINFO, 2.5, {"cpus"}),
]


def test_real_proc_files_parse_to_what_they_say():
    reading, problems = _captured()
    assert problems == []
    loads = [float(v) for v in (PROC / "loadavg").read_text().split()[:3]]
    assert [reading.load1, reading.load5, reading.load15] == loads
    cpu = [int(v) for v in (PROC / "stat").read_text().splitlines()[0].split()[1:]]
    assert reading.cpu_total == sum(cpu[:8]) and reading.cpu_idle == cpu[3] + cpu[4]
    assert (reading.mem_total_kib, reading.mem_available_kib) == (_kib("MemTotal"), _kib("MemAvailable"))
    assert reading.cpus == 2


def test_busy_share_between_two_real_readings_and_none_when_it_cannot_be_known():
    older, newer = _captured()[0], _captured("stat.2s-later")[0]
    busy = cpu_busy_pct(older, newer)
    d_total, d_idle = newer.cpu_total - older.cpu_total, newer.cpu_idle - older.cpu_idle
    assert d_total > 0 and busy == pytest.approx(100 * (d_total - d_idle) / d_total) and 0 <= busy <= 100
    assert cpu_busy_pct(older, older) is None  # no time passed
    assert cpu_busy_pct(newer, older) is None  # counters went back: a reboot between the readings
    assert cpu_busy_pct(older, replace(newer, cpu_idle=None)) is None
    assert cpu_busy_pct(older, replace(newer, cpu_idle=newer.cpu_idle + d_total + 1)) is None  # idle > elapsed


@pytest.mark.parametrize("what, loadavg, stat, meminfo, cpus, unknown", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_malformed_part_is_unknown_with_its_reason_and_the_others_are_read(what, loadavg, stat, meminfo, cpus,
                                                                            unknown):
    good = asdict(_captured()[0])
    reading, problems = read_host_stats(loadavg, stat, meminfo, cpus)
    got = asdict(reading)
    # No cgroup, no process rows (the probe adds those apart): None.
    assert {k for k, v in got.items() if v is None} - {"mem_cgroup", "cpu_cgroup", "processes"} == unknown, what
    assert {k: v for k, v in got.items() if k not in unknown} == {k: v for k, v in good.items() if k not in unknown}
    assert len(problems) == 1 and len(problems[0]) < 300, problems


def test_nothing_read_is_all_unknown_without_a_problem():
    reading, problems = read_host_stats(None, None, None, None)
    assert reading == HostReading() and problems == []
    assert len(HOSTILE[15][3]) > HOST_TEXT_MAX_CHARS  # the megabyte case is refused by size, before any regex


def test_a_containers_cgroup_limit_below_the_machines_memory_is_the_memory_shown():
    """In an LXC container without lxcfs, /proc/meminfo tells the machine's memory:
    the cgroup's limit is what the run can have, and what is left under it is the
    limit less its use plus the inactive page cache reclaim frees first."""
    machine = _captured()[0]  # the development VM: 24 GiB
    cg = _cgroup(str(8 * GIB), str(6 * GIB), str(GIB))
    reading, problems = read_host_stats((PROC / "loadavg").read_text(), (PROC / "stat").read_text(),
                                        (PROC / "meminfo").read_text(), 2, cg)
    assert problems == []
    assert (reading.mem_total_kib, reading.mem_available_kib, reading.mem_cgroup) == (8 << 20, 3 << 20, 1)
    assert (reading.load1, reading.cpu_total) == (machine.load1, machine.cpu_total)  # the rest as read
    # The machine's MemAvailable when that is less; a limit at or above the machine's memory
    # (cgroup v1's "unlimited" is 9223372036854771712) does not bind: the machine's figures.
    tight, _ = read_host_stats(None, None, "MemTotal: 33554432 kB\nMemAvailable: 1048576 kB\n", 2, cg)
    assert (tight.mem_total_kib, tight.mem_available_kib, tight.mem_cgroup) == (8 << 20, 1 << 20, 1)
    for limit in (str(machine.mem_total_kib * 1024), "9223372036854771712"):
        loose, problems = read_host_stats(None, None, (PROC / "meminfo").read_text(), 2, _cgroup(limit, str(GIB)))
        assert problems == [] and loose.mem_cgroup is None
        assert (loose.mem_total_kib, loose.mem_available_kib) == (machine.mem_total_kib, machine.mem_available_kib)
    # Usage above the limit (the kernel is reclaiming) leaves nothing, never a negative figure.
    over, _ = read_host_stats(None, None, None, None, _cgroup(str(GIB), str(2 * GIB)))
    assert (over.mem_total_kib, over.mem_available_kib) == (1 << 20, 0)


@pytest.mark.parametrize("cgroup_memory, problem", [
    ("8G", "cgroup memory is not an object (str)"),
    (_cgroup("8G", "1"), "cgroup memory: limit is not a byte count ('8G')"),
    (_cgroup(str(GIB), 10**5000), "cgroup memory: usage is not a byte count (a int)"),
    (_cgroup(str(GIB), "-1"), "cgroup memory: usage is not a byte count ('-1')"),
    (_cgroup("0", "0"), "cgroup memory: a limit of 0 bytes is not a reading"),
])
def test_a_malformed_cgroup_reading_leaves_the_machines_memory_with_its_reason(cgroup_memory, problem):
    reading, problems = read_host_stats(None, None, (PROC / "meminfo").read_text(), 2, cgroup_memory)
    assert problems == [problem]
    assert (reading.mem_total_kib, reading.mem_available_kib, reading.mem_cgroup) == (
        _kib("MemTotal"), _kib("MemAvailable"), None)


def test_a_containers_cpu_quota_below_its_cpus_makes_the_busy_share_the_quotas():
    """Docker's --cpus or a cgroup's cpu.max: between two readings 10 s apart, a
    container with a quota of 2 CPUs that used 9 s of CPU time was 45 % busy, whatever
    the machine's /proc/stat says."""
    text = [(PROC / f).read_text() for f in ("loadavg", "stat", "meminfo")]
    older, p1 = read_host_stats(*text, 8, None, _cpu("200000", "500000000", "1000.00"))
    newer, p2 = read_host_stats(*text, 8, None, _cpu("200000", "509000000", "1010.00"))
    assert p1 == p2 == [] and older.cpu_cgroup == newer.cpu_cgroup == 2.0
    assert cpu_busy_pct(older, newer) == pytest.approx(45.0)
    # A quota of at least the CPUs the probe may use does not bind: the machine's counters.
    machine = _captured()[0]
    loose, problems = read_host_stats(*text, 8, None, _cpu("800000", "1", "1000.00"))
    assert problems == [] and loose.cpu_cgroup is None
    assert (loose.cpu_total, loose.cpu_idle) == (machine.cpu_total, machine.cpu_idle)
    # Counters of two kinds (a quota set between two polls) give no busy share.
    assert cpu_busy_pct(loose, newer) is None and cpu_busy_pct(newer, loose) is None


@pytest.mark.parametrize("cgroup_cpu, problem", [
    ([1], "cgroup cpu is not an object (list)"),
    (_cpu("2e5", "1", "1.0"), "cgroup cpu: quota_us is not a number of microseconds ('2e5')"),
    (_cpu("200000", None, "1.0"), "cgroup cpu: usage_us is not a number of microseconds (a NoneType)"),
    (_cpu("200000", "1", "-3"), "cgroup cpu: uptime_s is not seconds ('-3')"),
    (_cpu("200000", "1", "1.0", period="0"), "cgroup cpu: a quota of 200000 per 0 us is not a reading"),
])
def test_a_malformed_cgroup_cpu_reading_leaves_the_machines_counters_with_its_reason(cgroup_cpu, problem):
    machine = _captured()[0]
    reading, problems = read_host_stats((PROC / "loadavg").read_text(), (PROC / "stat").read_text(),
                                        (PROC / "meminfo").read_text(), 8, None, cgroup_cpu)
    assert problems == [problem]
    assert (reading.cpu_total, reading.cpu_idle, reading.cpu_cgroup) == (machine.cpu_total, machine.cpu_idle, None)
