"""The host line of the GPU pane: each run host's CPU and memory, read by the probe
in its one round trip (/proc/loadavg, /proc/stat's cpu line, /proc/meminfo),
parsed by a pure parser that turns anything malformed into "unknown" (never a
wrong number), stored with the poll's sample and drawn under the host's header
with the reading's age, red past three polls like a GPU's.

Over real /proc captures of a Linux machine (tests/fixtures/proc), the real probe
script run here, real SQLite stores and the real console (pilot and SVG snapshot)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from dflashctl.hosts.parsers import HOST_TEXT_MAX_CHARS, HostReading, cpu_busy_pct, read_host_stats
from dflashctl.hosts.probe import PROBE_SOURCE, parse_probe_host
from dflashctl.status.model import load_status
from dflashctl.store import Store
from dflashctl.supervise import supervisor_core as core
from dflashctl.tui.text import gpu_text
from tests.test_supervisor import local_env  # noqa: F401 (the fixture: fake trainer runs in tmux on this host)
from tests.test_supervisor_core import make_policy, make_state, metrics, probe
from tests.test_tui import app_for, loaded, run, screen_text
from tests.test_tui_gpus import host_store
from tests.test_tui_scenes import INTERVAL, NOW, PROD, build, utc

PROC = Path(__file__).parent / "fixtures" / "proc"  # captured on the 2-core development VM


@pytest.fixture(autouse=True)
def _utc():
    utc()


def _captured(stat: str = "stat") -> tuple[HostReading, list[str]]:
    return read_host_stats((PROC / "loadavg").read_text(), (PROC / stat).read_text(),
                           (PROC / "meminfo").read_text(), 2)


def _kib(name: str) -> int:
    line = next(ln for ln in (PROC / "meminfo").read_text().splitlines() if ln.startswith(name + ":"))
    return int(line.split()[1])


# --------------------------------------------------------------------------- the parser


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


@pytest.mark.parametrize("what, loadavg, stat, meminfo, cpus, unknown", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_malformed_part_is_unknown_with_its_reason_and_the_others_are_read(what, loadavg, stat, meminfo, cpus,
                                                                            unknown):
    good = asdict(_captured()[0])
    reading, problems = read_host_stats(loadavg, stat, meminfo, cpus)
    got = asdict(reading)
    assert {k for k, v in got.items() if v is None} - {"mem_cgroup", "cpu_cgroup"} == unknown, what  # no cgroup: None
    assert {k: v for k, v in got.items() if k not in unknown} == {k: v for k, v in good.items() if k not in unknown}
    assert len(problems) == 1 and len(problems[0]) < 300, problems


def test_nothing_read_is_all_unknown_without_a_problem():
    reading, problems = read_host_stats(None, None, None, None)
    assert reading == HostReading() and problems == []
    assert len(HOSTILE[15][3]) > HOST_TEXT_MAX_CHARS  # the megabyte case is refused by size, before any regex


GIB = 1 << 30


def _cgroup(limit, usage, inactive="0"):
    return {"limit": limit, "usage": usage, "inactive": inactive}


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


def _cpu(quota, usage, uptime, period="100000"):
    return {"quota_us": quota, "period_us": period, "usage_us": usage, "uptime_s": uptime}


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


# --------------------------------------------------------------------------- the probe: in its one answer


def _run_probe(args) -> str:
    p = subprocess.run([sys.executable, "-I", "-S", "-c", PROBE_SOURCE, json.dumps(args)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_the_probe_reads_the_hosts_cpu_and_memory_in_its_one_answer(tmp_path):
    answer = parse_probe_host(_run_probe({"runs": [{"run_dir": str(tmp_path)}], "nvidia_smi": False}))
    host = answer.host
    assert host is not None and answer.runs[0].host == host
    assert host.cpus == len(os.sched_getaffinity(0))
    assert host.mem_total_kib == _memory_now() and 0 < host.mem_available_kib <= host.mem_total_kib
    assert host.load1 is not None and host.cpu_total > host.cpu_idle > 0
    assert not [e for e in answer.errors if e.startswith("host stats")]
    raw = json.loads(_run_probe([]))["host"]
    assert set(raw["meminfo"].split()) >= {"MemTotal:", "MemAvailable:"} and "\n" not in raw["stat"]
    # two meminfo lines, stat's first line and a cgroup's few numbers, not the whole files
    assert len(json.dumps(raw)) < 700


def _cgroup_tree(tmp_path, monkeypatch, self_cgroup: str, files: dict[str, str]):
    """A cgroup mount and /proc/self/cgroup as files under tmp_path, for the probe's own
    functions (imported here: the paths are the run host's, fixed in the probe)."""
    from dflashctl.hosts.remote import probe as remote

    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (tmp_path / "self").write_text(self_cgroup)
    monkeypatch.setattr(remote, "CGROUP_ROOT", str(root))
    monkeypatch.setattr(remote, "SELF_CGROUP", str(tmp_path / "self"))
    return remote


def test_the_probe_reads_the_tightest_cgroup_memory_limit_over_its_cgroup_and_those_above(tmp_path, monkeypatch):
    # cgroup v2 (an LXC container on Proxmox): the limit set on a parent binds, not the child's larger one
    remote = _cgroup_tree(tmp_path, monkeypatch, "0::/lxc/101/ns\n", {
        "lxc/memory.max": "max\n", "lxc/101/memory.max": f"{8 * GIB}\n", "lxc/101/memory.current": f"{6 * GIB}\n",
        "lxc/101/memory.stat": f"anon 1\ninactive_file {GIB}\nactive_file 5\n",
        "lxc/101/ns/memory.max": f"{16 * GIB}\n", "lxc/101/ns/memory.current": "1\n"})
    assert remote.cgroup_memory() == {"limit": str(8 * GIB), "usage": str(6 * GIB), "inactive": str(GIB)}
    raw = remote.host_stats()
    reading, problems = read_host_stats(raw["loadavg"], raw["stat"], raw["meminfo"], raw["cpus"], raw["cgroup_memory"])
    assert problems == [] and (reading.mem_total_kib, reading.mem_available_kib) == (8 << 20, 3 << 20)


@pytest.mark.parametrize("self_cgroup, files, expected", [
    # cgroup v1 (a hybrid host: the v2 line names a mount without memory files)
    ("4:memory:/docker/abc\n0::/\n", {"memory/docker/abc/memory.limit_in_bytes": "2147483648\n",
                                         "memory/docker/abc/memory.usage_in_bytes": "1073741824\n",
                                         "memory/docker/abc/memory.stat": "inactive_file 7\ntotal_inactive_file 9\n",
                                         "memory/memory.limit_in_bytes": "9223372036854771712\n"},
     {"limit": "2147483648", "usage": "1073741824", "inactive": "9"}),
    ("0::/\n", {"memory.current": "5\n"}, None),  # the root: no memory.max, no limit
    ("0::/a\n", {"a/memory.max": "max\n"}, None),  # a container without a limit
    ("0::/../../etc\n", {"memory.max": "1\n"}, None),  # a path that leaves the mount is not followed
    ("garbage", {}, None),
])
def test_the_probe_finds_cgroup_v1_limits_and_nothing_where_none_binds(tmp_path, monkeypatch, self_cgroup, files,
                                                                       expected):
    assert _cgroup_tree(tmp_path, monkeypatch, self_cgroup, files).cgroup_memory() == expected


def test_the_probe_reads_the_tightest_cgroup_cpu_quota_and_that_cgroups_cpu_time(tmp_path, monkeypatch):
    remote = _cgroup_tree(tmp_path, monkeypatch, "0::/docker/abc\n", {
        "docker/cpu.max": "400000 100000\n", "docker/abc/cpu.max": "150000 100000\n",
        "docker/abc/cpu.stat": "usage_usec 123456789\nuser_usec 1\nsystem_usec 2\n", "cpu.max": "max 100000\n"})
    got = remote.cgroup_cpu()
    assert {k: got[k] for k in ("quota_us", "period_us", "usage_us")} == {
        "quota_us": "150000", "period_us": "100000", "usage_us": "123456789"}
    assert float(got["uptime_s"]) > 0  # this machine's /proc/uptime
    raw = remote.host_stats()
    reading, problems = read_host_stats(raw["loadavg"], raw["stat"], raw["meminfo"], 8, raw["cgroup_memory"],
                                        raw["cgroup_cpu"])
    assert problems == [] and reading.cpu_cgroup == 1.5


@pytest.mark.parametrize("self_cgroup, files, expected", [
    # cgroup v1, cpu and cpuacct mounted apart: the quota from one, the time (ns) from the other
    ("3:cpuacct:/k8s/pod\n2:cpu:/k8s/pod\n0::/\n", {"cpu/k8s/pod/cpu.cfs_quota_us": "50000\n",
                                                     "cpu/k8s/pod/cpu.cfs_period_us": "100000\n",
                                                     "cpuacct/k8s/pod/cpuacct.usage": "7000000000\n",
                                                     "cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"},
     {"quota_us": "50000", "period_us": "100000", "usage_us": "7000000"}),
    ("0::/a\n", {"a/cpu.max": "max 100000\n", "a/cpu.stat": "usage_usec 5\n"}, None),  # no quota
    ("0::/../x\n", {"cpu.max": "1 100000\n"}, None),  # a path that leaves the mount
])
def test_the_probe_finds_cgroup_v1_cpu_quotas_and_nothing_where_none_is_set(tmp_path, monkeypatch, self_cgroup,
                                                                           files, expected):
    got = _cgroup_tree(tmp_path, monkeypatch, self_cgroup, files).cgroup_cpu()
    assert (got if got is None else {k: got[k] for k in ("quota_us", "period_us", "usage_us")}) == expected


def _memory_now() -> int:
    """What the host line should call this machine's memory: MemTotal, or the memory
    limit of a cgroup above this process where one is lower (CI may run in a container)."""
    from dflashctl.hosts.remote.probe import cgroup_memory

    limit = cgroup_memory()
    total = _kib_now("MemTotal")
    return min(total, int(limit["limit"]) // 1024) if limit else total


def _kib_now(name: str) -> int:
    line = next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith(name + ":"))
    return int(line.split()[1])


@pytest.mark.parametrize("host, error", [
    ("garbage", "probe answer: host is not an object ('garbage')"),
    ({"loadavg": "x", "cpus": 2}, "host stats: /proc/loadavg is not three load averages ('x')"),
])
def test_a_hostile_host_answer_is_an_error_line_and_never_a_reading(host, error):
    answer = json.loads(_run_probe([]))
    answer["host"] = host
    parsed = parse_probe_host(json.dumps(answer))
    assert error in parsed.errors
    assert parsed.host is None or parsed.host.load1 is None


# --------------------------------------------------------------------------- stored with the poll's sample


def test_the_supervisor_stores_one_reading_per_poll_with_its_samples(tmp_path):
    reading = _captured()[0]
    obs = core.Probed(replace(probe(NOW, step=12), metrics_offset=300, host=reading),
                      lines=(metrics(NOW - 2, 10), metrics(NOW - 1, 11), metrics(NOW, 12)))
    _, writes, _ = core.step(make_state("running"), obs, NOW, make_policy())
    (samples,) = [w for w in writes if isinstance(w, core.Samples)]
    assert samples.host == asdict(reading)
    store = Store(str(tmp_path / "runs.db"))
    run_id = store.create_run("pb", "gpu1", {}, NOW - 60).id
    store.add_samples(run_id, samples.lines, gpu=samples.gpu, metrics_offset=samples.offset, observed=samples.observed,
                      host_reading=samples.host)  # as Supervisor._write does
    assert [s.host_reading for s in store.samples(run_id)] == [None, None, asdict(reading)]
    (stored,) = store.host_samples(run_id, 2)
    assert stored.step == 12 and stored.host_reading == asdict(reading)


def test_a_real_supervisor_stores_this_machines_cpu_and_memory_and_the_pane_draws_them(local_env):
    from tests.test_supervisor import wait_for

    run_id = local_env.start(local_env.playbook("hostline"))
    sup = local_env.supervisor()
    sup.attach(run_id)
    store = local_env.store
    try:
        wait_for(lambda: len(store.host_samples(run_id, 2)) == 2, 20, "two polls' host readings", tick=sup.tick)
    finally:
        local_env.tmux.kill(run_id)
        sup.close()
    older, newer = store.host_samples(run_id, 2)
    assert newer.host_reading["cpus"] == len(os.sched_getaffinity(0))
    assert newer.host_reading["mem_total_kib"] == _memory_now()
    assert newer.host_reading["cpu_total"] >= older.host_reading["cpu_total"]
    read = [s.observed for s in store.samples(run_id) if s.host_reading is not None]
    assert len(set(read)) == len(read)  # one reading per poll (a poll's lines share its time), not one per line
    now = newer.observed
    (host,) = [h for h in load_status(store, now).hosts if h.host == "local"]
    assert host.load is not None and host.load.cpus == newer.host_reading["cpus"]
    line = next(ln for ln in gpu_text([host], 160, now).plain.splitlines() if "host" in ln and " cpu " in ln)
    assert f"{len(os.sched_getaffinity(0))} CPUs" in line and "load " in line


def test_a_store_from_before_host_readings_upgrades_and_keeps_its_samples(tmp_path):
    import sqlite3

    path = str(tmp_path / "runs.db")
    store = Store(path)
    run_id = store.create_run("pb", "gpu1", {}, NOW - 60).id
    store.close()
    conn = sqlite3.connect(path)  # back to schema 7: no samples.host_reading, no record of 0008
    conn.execute("DROP INDEX samples_host_reading")
    conn.execute("ALTER TABLE samples DROP COLUMN host_reading")
    conn.execute("DELETE FROM _sqlite_migrations WHERE name = '0008_sample_host_reading'")
    conn.execute("PRAGMA user_version = 7")
    conn.execute("INSERT INTO samples (run_id, time, step, tok_s) VALUES (?, ?, 5, 100.0)", [run_id, NOW - 30])
    conn.commit()
    conn.close()
    store = Store(path)
    store.add_samples(run_id, [{"time": NOW - 10, "step": 6}], host_reading={"cpus": 8})
    assert [(s.step, s.host_reading) for s in store.samples(run_id)] == [(5, None), (6, {"cpus": 8})]
    plan = store.conn.execute("EXPLAIN QUERY PLAN SELECT * FROM samples WHERE run_id = ? AND host_reading IS NOT NULL "
                              "ORDER BY time DESC LIMIT 2", [run_id]).fetchall()
    assert "samples_host_reading" in str(plan)  # a refresh finds the newest readings without a scan


# --------------------------------------------------------------------------- drawn in the GPU pane


def _host_text(cpus: int, load1: float, total: int, idle: int, mem_total_kib: int, mem_available_kib: int):
    """/proc text as a Linux host prints it."""
    user = total - idle
    return (f"{load1:.2f} {load1 * 0.9:.2f} {load1 * 0.8:.2f} 3/2113 88231\n",
            f"cpu  {user} 0 0 {idle} 0 0 0 0 0 0",
            f"MemTotal:       {mem_total_kib} kB\nMemAvailable:   {mem_available_kib} kB", cpus)


def add_host_readings(store: Store, run_id: str, *, interval: float = INTERVAL) -> None:
    """Two polls' readings of an 8-GPU host (192 CPUs, 2 TiB), ``interval`` apart, the
    newer one from the poll of the run's newest sample: 23 % busy between them,
    690 GiB of memory used. Parsed from /proc text, as the supervisor stores them;
    each on a copy of that sample (the run's progress is not changed)."""
    (last,) = store.recent_samples(run_id, 1)
    for back, total, idle in ((interval, 9_000_000_000, 7_000_000_000),
                              (0.0, 9_000_000_000 + 288_000, 7_000_000_000 + 221_760)):
        reading, problems = read_host_stats(*_host_text(192, 44.31, total, idle, 2_113_929_216, 1_390_411_776))
        assert problems == []
        copy = {k: v for k, v in asdict(last).items() if k not in ("id", "run_id", "gpu", "observed", "host_reading")}
        store.add_samples(run_id, [{**copy, "time": last.time - back}], observed=(last.observed or last.time) - back,
                          host_reading=asdict(reading))


def _host_line(store: Store, width: int = 160, compact: bool = False) -> tuple[str, object]:
    text = gpu_text(load_status(store, NOW).hosts, width, NOW, compact=compact)
    line = text.plain.splitlines()[1]
    return line, text


def test_the_pane_shows_the_hosts_cpu_busy_memory_and_load_with_the_readings_age(tmp_path):
    store = host_store(tmp_path, observed_ago=5.0)
    add_host_readings(store, PROD)
    line, _ = _host_line(store)
    assert "host" in line and "192 CPUs" in line and " 23% " in line
    assert " 0.7/2.0T " in line and "load 44.31/192" in line  # 690 GiB used of 2016 GiB
    assert line.rstrip().endswith(" 5s")
    compact, _ = _host_line(store, 80, compact=True)
    assert len(compact) <= 80 and " 23% " in compact and "load 44.31/192" in compact


def test_a_containers_memory_is_labelled_as_its_cgroups(tmp_path):
    store = host_store(tmp_path, observed_ago=5.0)
    (last,) = store.recent_samples(PROD, 1)
    reading, _ = read_host_stats(*_host_text(192, 44.31, 9_000_000, 7_000_000, 2_113_929_216, 1_390_411_776),
                                 _cgroup(str(64 * GIB), str(48 * GIB)))
    copy = {k: v for k, v in asdict(last).items() if k not in ("id", "run_id", "gpu", "observed", "host_reading")}
    store.add_samples(PROD, [copy], observed=last.observed or last.time, host_reading=asdict(reading))
    line, _ = _host_line(store)
    assert " cgrp " in line and " 48/64G " in line and " ram " not in line and "192 CPUs" in line
    (host,) = json.loads(json.dumps(load_status(store, NOW).to_dict()))["hosts"]
    assert host["load"]["mem_cgroup"] == 1 and host["load"]["mem_total_kib"] == 64 << 20


def test_a_containers_cpu_quota_is_shown_with_the_busy_share_of_it(tmp_path):
    store = host_store(tmp_path, observed_ago=5.0)
    (last,) = store.recent_samples(PROD, 1)
    copy = {k: v for k, v in asdict(last).items() if k not in ("id", "run_id", "gpu", "observed", "host_reading")}
    for back, used, uptime in ((INTERVAL, "500000000", 1000.0), (0.0, "506000000", 1000.0 + INTERVAL)):
        reading, problems = read_host_stats(*_host_text(192, 44.31, 9_000_000, 7_000_000, 2_113_929_216, 1_390_411_776),
                                            None, _cpu("400000", used, f"{uptime:.2f}"))
        assert problems == []
        store.add_samples(PROD, [{**copy, "time": last.time - back}], observed=(last.observed or last.time) - back,
                          host_reading=asdict(reading))
    line, _ = _host_line(store)
    busy = round(100 * 6.0 / (INTERVAL * 4))  # 6 s of CPU time over the poll, against 4 CPUs
    assert "4/192 CPUs" in line and f" {busy}% " in line


def test_a_host_reading_older_than_three_polls_is_red(tmp_path):
    for ago, red in ((4.0, False), (3 * INTERVAL + 5, True)):
        store = host_store(tmp_path / str(ago), observed_ago=ago)
        add_host_readings(store, PROD)
        line, text = _host_line(store)
        age = line.split()[-1]
        at = text.plain.index(line) + line.rindex(age)
        styles = [str(s.style) for s in text.spans if s.start <= at < s.end]
        assert any("red" in s for s in styles) == red, (age, styles)


def test_readings_far_apart_give_no_busy_share_and_the_load_stays(tmp_path):
    store = host_store(tmp_path, observed_ago=5.0)
    add_host_readings(store, PROD, interval=4 * INTERVAL)  # a gap of four polls: not this moment's
    line, _ = _host_line(store)
    assert " N/A " in line and "load 44.31/192" in line


def test_an_unknown_part_reads_na_never_a_number(tmp_path):
    store = host_store(tmp_path, observed_ago=5.0)
    reading, problems = read_host_stats("garbage", "cpu x", "MemTotal: 5 kB\nMemAvailable: 9 kB", 2)
    assert len(problems) == 3
    store.add_samples(PROD, [{"time": NOW - 4, "step": 5001}], observed=NOW - 4, host_reading=asdict(reading))
    line, _ = _host_line(store)
    assert line.count("N/A") == 3 and "2 CPUs" in line  # busy, memory, load
    assert not any(ch.isdigit() for ch in line.replace("2 CPUs", "").replace("4s", ""))


def test_no_reading_at_all_draws_no_host_line(tmp_path):
    store = host_store(tmp_path, observed_ago=5.0)  # samples of a supervisor from before host readings
    assert load_status(store, NOW).hosts[0].load is None
    assert " cpu " not in gpu_text(load_status(store, NOW).hosts, 160, NOW).plain


def test_status_json_has_each_hosts_cpu_and_memory(tmp_path):
    from dflashctl.status.model import JSON_SCHEMA
    from tests.test_status import _check

    store = host_store(tmp_path, observed_ago=5.0)
    add_host_readings(store, PROD)
    payload = json.loads(json.dumps(load_status(store, NOW).to_dict()))
    _check(JSON_SCHEMA, payload)
    load = payload["hosts"][0]["load"]
    assert (load["cpus"], load["load1"], round(load["busy_pct"]), load["time"]) == (192, 44.31, 23, NOW - 5.0)
    assert load["mem_total_kib"] - load["mem_available_kib"] == 2_113_929_216 - 1_390_411_776


def test_the_console_shows_the_host_line_at_each_size(tmp_path):
    store = build("healthy", tmp_path)
    add_host_readings(store, PROD)

    async def scenario():
        for size in ((80, 24), (120, 40), (201, 60)):
            app = app_for(store, tmp_path)
            async with app.run_test(size=size) as pilot:
                await loaded(pilot, app)
                shown = screen_text(app)
                assert " 23% " in shown and "load 44.31/192" in shown, (size, shown)

    run(scenario())


def test_the_gpu_pane_with_its_host_line_snapshot(snap_compare, tmp_path, monkeypatch):
    from dflashctl.tui.app import StatusApp

    monkeypatch.chdir(tmp_path)
    store = build("healthy", tmp_path)
    add_host_readings(store, PROD)
    app = StatusApp(store.path, interval=600, clock=lambda: NOW, playbooks_dir=str(tmp_path / "playbooks"),
                    probe_unsupervised=False)

    async def shown(pilot):
        await loaded(pilot, app)

    assert snap_compare(app, terminal_size=(120, 40), run_before=shown)
