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
import re
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from dflashctl.hosts.parsers import HostReading, read_host_stats
from dflashctl.hosts.probe import PROBE_SOURCE, HostProbe, parse_probe_host
from dflashctl.status.model import load_status
from dflashctl.store import Store
from dflashctl.supervise import supervisor_core as core
from dflashctl.tui.text import gpu_text
from tests import harness
from tests.harness.observations import make_policy, make_state, metrics, probe
from tests.harness.scenes import INTERVAL, NOW, PROD, add_host_readings, build, host_store, host_text, utc
from tests.harness.tui import app_for, loaded, run, screen_text

PROC = harness.FIXTURES / "proc"  # captured on the 2-core development VM


@pytest.fixture(autouse=True)
def _utc():
    utc()


def _captured(stat: str = "stat") -> tuple[HostReading, list[str]]:
    return read_host_stats((PROC / "loadavg").read_text(), (PROC / stat).read_text(),
                           (PROC / "meminfo").read_text(), 2)


# --------------------------------------------------------------------------- the parser


GIB = 1 << 30


def _cgroup(limit, usage, inactive="0"):
    return {"limit": limit, "usage": usage, "inactive": inactive}


def _cpu(quota, usage, uptime, period="100000"):
    return {"quota_us": quota, "period_us": period, "usage_us": usage, "uptime_s": uptime}


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


# --------------------------------------------------------------------------- stored with the poll's sample


def test_the_supervisor_stores_one_reading_per_poll_whatever_the_lines(tmp_path):
    reading = _captured()[0]
    obs = core.Probed(replace(probe(NOW, step=12), metrics_offset=300, host=reading),
                      lines=(metrics(NOW - 2, 10), metrics(NOW - 1, 11), metrics(NOW, 12)))
    _, writes, _ = core.step(make_state("running"), obs, NOW, make_policy())
    (samples,) = [w for w in writes if isinstance(w, core.Samples)]
    answer = HostProbe(NOW, "gpu1", None, None, None, None, [], [obs.result], host=reading)
    readings = core.host_readings("gpu1", answer, [("pb-run", obs.result)], NOW)  # as Supervisor._host_answer does
    store = Store(str(tmp_path / "runs.db"))
    run_id = store.create_run("pb", "gpu1", {}, NOW - 60).id
    store.add_samples(run_id, samples.lines, metrics_offset=samples.offset, observed=samples.observed)
    store.add_readings(readings.host, readings.observed, readings.gpu, readings.reading)
    assert [s.host_reading for s in store.samples(run_id)] == [None, None, None]
    assert store.readings("gpu1", 2, "host_reading") == [{"time": NOW, "gpu": None, "host_reading": asdict(reading)}]


def test_a_real_supervisor_stores_this_machines_cpu_and_memory_and_the_pane_draws_them(local_env):
    from tests.harness.local import wait_for

    run_id = local_env.start(local_env.playbook("hostline"))
    sup = local_env.supervisor()
    sup.attach(run_id)
    store = local_env.store
    try:
        wait_for(lambda: len(store.readings("local", 2, "host_reading")) == 2, 20, "two polls' host readings",
                 tick=sup.tick)
    finally:
        local_env.tmux.kill(run_id)
        sup.close()
    older, newer = store.readings("local", 2, "host_reading")
    assert newer["host_reading"]["cpus"] == len(os.sched_getaffinity(0))
    assert newer["host_reading"]["mem_total_kib"] == _memory_now()
    assert newer["host_reading"]["cpu_total"] >= older["host_reading"]["cpu_total"] and newer["time"] > older["time"]
    now = newer["time"]
    (host,) = [h for h in load_status(store, now).hosts if h.host == "local"]
    assert host.load is not None and host.load.cpus == newer["host_reading"]["cpus"]
    line = next(ln for ln in gpu_text([host], 160, now).plain.splitlines() if "host" in ln and " cpu " in ln)
    assert f"{len(os.sched_getaffinity(0))} CPUs" in line and "load " in line


def test_a_store_from_before_host_readings_upgrades_moving_its_readings_and_keeps_its_samples(tmp_path):
    import sqlite3

    path = str(tmp_path / "runs.db")
    store = Store(path)
    run_id = store.create_run("pb", "gpu1", {}, NOW - 60).id
    store.close()
    conn = sqlite3.connect(path)  # back to schema 11: readings on samples, no rollups
    conn.execute("DROP TABLE host_readings")
    conn.execute("DROP TABLE rollups")
    conn.execute("ALTER TABLE runs DROP COLUMN history_from")
    conn.execute("CREATE INDEX samples_host_reading ON samples (run_id, time) WHERE host_reading IS NOT NULL")
    conn.execute("DELETE FROM _sqlite_migrations WHERE name = '0012_host_readings_rollups'")
    conn.execute("PRAGMA user_version = 11")
    for i, step in enumerate((5, 6)):
        conn.execute("INSERT INTO samples (run_id, time, step, tok_s, observed, gpu, host_reading) "
                     "VALUES (?, ?, ?, 100.0, ?, ?, ?)", [run_id, NOW - 30 + 10 * i, step, NOW - 29 + 10 * i,
                                                          '[{"index": 0, "utilization_pct": 90}]', '{"cpus": 8}'])
    conn.commit()
    conn.close()
    store = Store(path)
    assert [(s.step, s.gpu, s.host_reading) for s in store.samples(run_id)] == [(5, None, None), (6, None, None)]
    assert [r["time"] for r in store.readings("gpu1", 5, "host_reading")] == [NOW - 29, NOW - 19]
    assert store.readings("gpu1", 1)[0]["gpu"] == [{"index": 0, "utilization_pct": 90}]
    (p,) = store.rollup_series(run_id, ["tok_s"], NOW - 60, NOW, 1)
    assert p["tok_s"] == 100.0 and p["samples"] == 2
    plan = store.conn.execute("EXPLAIN QUERY PLAN SELECT time FROM host_readings WHERE host = ? AND host_reading "
                              "IS NOT NULL ORDER BY time DESC LIMIT 2", ["gpu1"]).fetchall()
    assert "host_readings_host" in str(plan)  # a refresh finds the newest readings without a scan


# --------------------------------------------------------------------------- drawn in the GPU pane


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
    reading, _ = read_host_stats(*host_text(192, 44.31, 9_000_000, 7_000_000, 2_113_929_216, 1_390_411_776),
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
        reading, problems = read_host_stats(*host_text(192, 44.31, 9_000_000, 7_000_000, 2_113_929_216, 1_390_411_776),
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


def _gpu_ages(text) -> list[tuple[str | None, bool]]:
    """Each GPU row's age cell (None: blank) and whether it is drawn red."""
    out = []
    for line in text.plain.splitlines():
        if " util " not in line:
            continue
        m = re.search(r"W +(\d+[smhd]) ", line)
        at = text.plain.index(line) + (m.start(1) if m else 0)
        out.append((m.group(1) if m else None, any("red" in str(s.style) for s in text.spans if s.start <= at < s.end)))
    return out


def test_gpu_rows_leave_their_age_to_the_host_line_of_the_same_poll_and_say_it_where_it_differs_or_is_stale(
        tmp_path):
    # One poll read both: the host line's age says it once (a clock tick repaints one row, not eight).
    store = host_store(tmp_path / "same", observed_ago=5.0)
    add_host_readings(store, PROD)
    line, text = _host_line(store)
    assert line.rstrip().endswith(" 5s") and _gpu_ages(text) == [(None, False)] * 8
    # nvidia-smi did not answer the newest poll: the GPUs' own, older age on every row.
    store = host_store(tmp_path / "older", observed_ago=9.0)
    reading, _ = read_host_stats(*host_text(192, 44.31, 9_000_000, 7_000_000, 2_113_929_216, 1_390_411_776))
    store.add_readings("gpu1", NOW - 2.0, None, asdict(reading))
    line, text = _host_line(store)
    assert line.rstrip().endswith(" 2s") and _gpu_ages(text) == [("9s", False)] * 8
    # Past three polls: every row says its age, red, whatever the host line says.
    store = host_store(tmp_path / "stale", observed_ago=3 * INTERVAL + 5)
    add_host_readings(store, PROD)
    _, text = _host_line(store)
    assert _gpu_ages(text) == [("50s", True)] * 8


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
    from tests.harness.scenes import check_schema

    store = host_store(tmp_path, observed_ago=5.0)
    add_host_readings(store, PROD)
    payload = json.loads(json.dumps(load_status(store, NOW).to_dict()))
    check_schema(JSON_SCHEMA, payload)
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
