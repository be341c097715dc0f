"""The probe script run for real by the local python: a real run directory, a real
tmux server on a private socket, real processes (sleeping, stopped, zombie) and a
stand-in `nvidia-smi` on PATH that prints the H200 captures."""

from __future__ import annotations

import getpass
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflashctl.core import contract
from dflashctl.hosts.probe import (
    ProbeArgs,
    ProbeError,
    ProbeResult,
    estimate_skew,
    parse_probe_host,
    parse_probe_output,
    probe_command,
)
from tests import harness

SMI = harness.FIXTURES / "nvidia-smi"
LOAD_UUID = "GPU-8a7820b2-30e1-7367-326a-a5d3dfe3b0fd"


# --------------------------------------------------------------------------- fixtures


def _tmux(socket: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["tmux", "-L", socket, *args], capture_output=True, text=True, check=check, timeout=10)


def _wait(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _proc_state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()[0]


@pytest.fixture(scope="module")
def tmux_socket():
    """A tmux server of our own (never the user's), killed by its pid at the end."""
    socket = f"dflash-test-{os.getpid()}"
    _tmux(socket, "new-session", "-d", "-s", "keepalive", "sleep 600")
    server_pid = int(_tmux(socket, "display-message", "-p", "-t", "=keepalive:", "#{pid}").stdout)
    yield socket
    os.kill(server_pid, signal.SIGTERM)
    _wait(lambda: _proc_state(server_pid) in (None, "Z"), what="the tmux server to exit")


@pytest.fixture
def fake_smi(tmp_path):
    """A `nvidia-smi` that cats the load captures and logs each call; MODE file
    switches it to failing or hanging."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    calls, mode = tmp_path / "smi-calls", tmp_path / "smi-mode"
    script = bindir / "nvidia-smi"
    script.write_text(
        f"""#!/bin/sh
echo "$*" >> {calls}
case "$(cat {mode} 2>/dev/null)" in
  fail) echo "Failed to initialize NVML: Driver/library version mismatch" >&2; exit 18 ;;
  hang) exec sleep 60 ;;
esac
case "$*" in
  *--query-compute-apps=pid,process_name,used_memory,gpu_uuid*) cat {SMI / "h200-load-apps.csv"} ;;
  *--query-gpu=index,clocks.max.sm,clocks.mem,clocks_throttle_reasons.active*)
    # The load capture's values: max SM and memory clocks from its -q -x, the mask from its na-fields query.
    echo "0, 1980, 3201, $(cut -d, -f5 {SMI / "h200-load-na-fields.csv"} | tr -d ' ')" ;;
  *--query-gpu=*) cat {SMI / "h200-load-query.csv"} ;;
  *) exit 2 ;;
esac
"""
    )
    script.chmod(0o755)
    return {"path": str(bindir), "calls": calls, "mode": mode}


@pytest.fixture
def procs():
    """Processes started by a test, killed and reaped by pid afterwards."""
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


NO_SMI_PATH: list[str] = []  # a PATH holding tmux and nothing else (set by the fixture below)


@pytest.fixture(scope="module", autouse=True)
def _no_smi_path(tmp_path_factory):
    """Even on a GPU machine, the probe must not find a real nvidia-smi unless a test says so."""
    bindir = tmp_path_factory.mktemp("bin-tmux-only")
    (bindir / "tmux").symlink_to(shutil.which("tmux"))
    NO_SMI_PATH.append(str(bindir))
    yield
    NO_SMI_PATH.clear()


def probe_output(argv: list[str], path: str | None = None) -> str:
    """Run a probe command; ``path``: a directory put first on PATH (else no nvidia-smi)."""
    env = dict(os.environ)
    env["PATH"] = f"{path}:{env['PATH']}" if path else NO_SMI_PATH[0]
    p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""
    return p.stdout


def probe(args, path: str | None = None) -> str:
    return probe_output(probe_command(sys.executable, args), path)


def probe_one(args: ProbeArgs, path: str | None = None) -> ProbeResult:
    results = parse_probe_output(probe([args], path))
    assert not isinstance(results, ProbeError), results
    assert len(results) == 1
    return results[0]


def write_run(run_dir: Path, *, pid: int | None, phase: str = contract.PHASE_TRAINING, steps=(1, 2, 3)) -> list[str]:
    run_dir.mkdir(parents=True, exist_ok=True)
    contract.write_status(str(run_dir), contract.Status(phase=phase, pid=pid, started=time.time() - 60, step=steps[-1]))
    lines = [contract.Metrics(time=1000.0 + s, step=s, total_steps=100, tok_s=12800.0).to_line() for s in steps]
    (run_dir / contract.METRICS_FILE).write_text("".join(l + "\n" for l in lines))
    (run_dir / contract.LOG_FILE).write_text("".join(f"log line {i}\n" for i in range(500)))
    return lines


# --------------------------------------------------------------------------- tests


def test_live_run(tmp_path, tmux_socket, fake_smi, procs) -> None:
    trainer = subprocess.Popen(["sleep", "600"])
    procs.append(trainer)
    run_dir = tmp_path / "run"
    lines = write_run(run_dir, pid=trainer.pid)
    with open(run_dir / contract.METRICS_FILE, "a") as f:
        f.write('{"time": 1004, "step": 4')  # being written: not complete yet
    session = "demo-20261129-101500-ab12"
    _tmux(tmux_socket, "new-session", "-d", "-s", session, "-x", "120", "-y", "20",
          "printf 'step 1 ok\\nstep 2 ok\\n'; exec sleep 600")  # fmt: skip
    _wait(lambda: "step 2 ok" in _tmux(tmux_socket, "capture-pane", "-p", "-t", f"={session}:").stdout, what="pane output")

    sent = time.time()
    r = probe_one(ProbeArgs(run_dir=str(run_dir), session=session, socket=tmux_socket, pane_lines=50), fake_smi["path"])
    received = time.time()

    assert r.errors == []
    assert r.session_alive is True and r.pane_dead is False
    assert r.pane_tail.splitlines()[-2:] == ["step 1 ok", "step 2 ok"]
    assert r.status.phase == contract.PHASE_TRAINING and r.status.pid == trainer.pid
    assert r.process.pid == trainer.pid and r.process.alive and r.process.state in ("S", "R")
    assert "sleep 600" in r.process.cmdline
    assert r.metrics_chunk == "".join(l + "\n" for l in lines)
    assert r.metrics_offset == len(r.metrics_chunk.encode()) and not r.metrics_reset
    assert r.metrics_inode == os.stat(run_dir / contract.METRICS_FILE).st_ino
    assert r.log_tail.splitlines() == [f"log line {i}" for i in range(450, 500)]
    assert r.exit_code is None
    assert [(g.index, g.uuid, g.memory_used_mib, g.utilization_pct) for g in r.gpus] == [(0, LOAD_UUID, 1011.0, 100.0)]
    assert [(a.pid, a.process_name, a.used_memory_mib) for a in r.compute_apps] == [(416, "python3", 1002.0)]
    assert r.gpus[0].extra == {"clocks.max.sm": 1980.0, "clocks.mem": 3201.0,
                               "clocks_throttle_reasons.active": "0x0000000000000004"}
    rows = {p["pid"]: p for p in r.host.processes}
    mine = rows[trainer.pid]  # the run's trainer: who, how much, since when, what
    assert mine["user"] == getpass.getuser() and mine["cmd"] == "sleep 600" and mine["ppid"] == os.getpid()
    assert mine["rss_kib"] > 0 and 0 <= mine["elapsed_s"] < 600 and mine["cpu_pct"] is not None
    assert os.getpid() in rows  # its parent: how it was started
    assert sum(p["top"] for p in r.host.processes) >= 1  # and the host's top CPU consumers
    assert sent - 1 <= r.host_time <= received + 1  # same machine: one clock
    assert abs(estimate_skew(r.host_time, sent, received)) < received - sent + 1


def test_metrics_offsets_follow_appends_truncation_and_rotation(tmp_path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    path = run_dir / contract.METRICS_FILE
    line = lambda s: contract.Metrics(time=float(s), step=s, total_steps=9).to_line() + "\n"  # noqa: E731
    path.write_text(line(1) + line(2) + line(3)[:10])
    args = ProbeArgs(run_dir=str(run_dir), nvidia_smi=False)

    r1 = probe_one(args)
    assert r1.metrics_chunk == line(1) + line(2)
    args = r1.next_args(args)

    with open(path, "a") as f:
        f.write(line(3)[10:] + line(4))
    r2 = probe_one(args)
    assert r2.metrics_chunk == line(3) + line(4) and not r2.metrics_reset
    args = r2.next_args(args)
    assert probe_one(args).metrics_chunk == ""  # nothing new

    path.write_text(line(7))  # truncated and rewritten: shorter than the offset
    r3 = probe_one(args)
    assert r3.metrics_reset and r3.metrics_chunk == line(7) and r3.metrics_offset == len(line(7))
    args = r3.next_args(args)

    rotated = run_dir / "new.jsonl"  # replaced by another, longer file: another inode
    rotated.write_text(line(8) * 5)
    os.replace(rotated, path)
    r4 = probe_one(args)
    assert r4.metrics_reset and r4.metrics_chunk == line(8) * 5

    small = probe_one(ProbeArgs(run_dir=str(run_dir), nvidia_smi=False, metrics_max_bytes=len(line(8)) * 2 + 3))
    assert small.metrics_chunk == line(8) * 2 and small.metrics_more  # only whole lines, the rest next time


def test_dead_run_exit_code_and_exact_session_names(tmp_path, tmux_socket) -> None:
    run_dir = tmp_path / "run"
    write_run(run_dir, pid=2**22 + 12345, phase=contract.PHASE_FAILED)  # a pid no process has
    (run_dir / contract.EXIT_CODE_FILE).write_text("137\n")
    _tmux(tmux_socket, "new-session", "-d", "-s", "prod-run-1", "sleep 600")  # "prod-run" is only its prefix

    r = probe_one(ProbeArgs(run_dir=str(run_dir), session="prod-run", socket=tmux_socket, nvidia_smi=False))
    assert r.session_alive is False and r.pane_tail is None
    assert r.exit_code == 137
    assert r.process.alive is False and r.process.state is None
    assert r.status.phase == contract.PHASE_FAILED and r.gpus is None
    assert r.errors == []
    assert r.tmux_server_gone is False  # the session is gone, its server lives on

    no_server = probe_one(ProbeArgs(run_dir=str(run_dir), session="x", socket=f"{tmux_socket}-none", nvidia_smi=False))
    assert no_server.session_alive is False and no_server.tmux_server_gone is True


def test_the_free_disk_and_the_kernels_oom_kills_come_with_every_answer(tmp_path) -> None:
    run_dir = tmp_path / "run"
    write_run(run_dir, pid=None)
    r = probe_one(ProbeArgs(run_dir=str(run_dir), nvidia_smi=False))
    usage = shutil.disk_usage(run_dir)
    assert 0 < r.disk_total == usage.total and abs(r.disk_free - usage.free) < 1 << 30
    with open("/proc/vmstat") as f:  # Linux 4.13+: the host's count, readable by anyone
        counted = next((int(line.split()[1]) for line in f if line.startswith("oom_kill ")), None)
    assert r.oom_kills is not None and r.oom_kills.host == counted
    assert r.oom_kills.since(r.oom_kills) == 0


def test_stopped_and_zombie_processes(tmp_path, procs) -> None:
    stopped = subprocess.Popen(["sleep", "600"])
    zombie = subprocess.Popen(["true"])  # exits at once; not reaped until the fixture ends
    procs.extend([stopped, zombie])
    os.kill(stopped.pid, signal.SIGSTOP)
    _wait(lambda: _proc_state(stopped.pid) == "T", what="SIGSTOP")
    _wait(lambda: _proc_state(zombie.pid) == "Z", what="the zombie")

    write_run(tmp_path / "a", pid=stopped.pid)
    r = probe_one(ProbeArgs(run_dir=str(tmp_path / "a"), nvidia_smi=False))
    assert r.process.state == "T" and r.process.alive

    (tmp_path / "b").mkdir()  # no status.json yet: the launcher's pid hint is used
    r = probe_one(ProbeArgs(run_dir=str(tmp_path / "b"), pid_hint=zombie.pid, nvidia_smi=False))
    assert r.status is None and r.process.pid == zombie.pid
    assert r.process.state == "Z" and r.process.alive is False


def test_several_runs_one_round_trip_one_nvidia_smi(tmp_path, fake_smi) -> None:
    for name in ("a", "b", "c"):
        write_run(tmp_path / name, pid=None, steps=(1, 2) if name != "b" else (5,))
    args = [ProbeArgs(run_dir=str(tmp_path / n)) for n in ("a", "b", "c")]
    host = parse_probe_host(probe(args, fake_smi["path"]))
    assert [Path(r.run_dir).name for r in host.runs] == ["a", "b", "c"]
    assert [r.status.step for r in host.runs] == [2, 5, 2]
    assert all(r.gpus == host.gpus and len(r.gpus) == 1 for r in host.runs)
    calls = fake_smi["calls"].read_text().splitlines()
    assert "--query-gpu=index,uuid" in calls[0] and "--query-compute-apps=" in calls[1]  # once for the host
    assert len(calls) == 4 and "clocks_throttle_reasons" in calls[2] and "pmon" in calls[3]  # and its extras
    assert host.python == "%d.%d.%d" % sys.version_info[:3]

    gpus_only = parse_probe_host(probe_output(probe_command(sys.executable, [], nvidia_smi=True), fake_smi["path"]))
    assert gpus_only.runs == [] and gpus_only.gpus == host.gpus and len(gpus_only.compute_apps) == 1

    missing = parse_probe_output(probe([ProbeArgs(run_dir=str(tmp_path / "nowhere"))]))[0]
    assert missing.status is None and missing.metrics_chunk == "" and missing.log_tail is None
    assert missing.gpus is None and missing.errors == ["nvidia-smi: RuntimeError: nvidia-smi not found on PATH"]


def test_failing_and_hanging_nvidia_smi_are_errors_not_failures(tmp_path, fake_smi) -> None:
    write_run(tmp_path / "run", pid=None)
    fake_smi["mode"].write_text("fail")
    r = probe_one(ProbeArgs(run_dir=str(tmp_path / "run")), fake_smi["path"])
    assert r.gpus is None and r.status.step == 3
    assert r.errors == ["nvidia-smi: RuntimeError: exit 18: Failed to initialize NVML: Driver/library version mismatch"]

    fake_smi["mode"].write_text("hang")
    r = probe_one(ProbeArgs(run_dir=str(tmp_path / "run"), step_timeout=0.5), fake_smi["path"])
    assert r.gpus is None and r.status.step == 3 and r.metrics_chunk.count("\n") == 3
    assert len(r.errors) == 1 and "nvidia-smi" in r.errors[0] and "timed out" in r.errors[0]


def test_a_hung_read_costs_one_step_not_the_probe(tmp_path) -> None:
    run_dir = tmp_path / "run"
    write_run(run_dir, pid=None)
    (run_dir / contract.STATUS_FILE).unlink()
    os.mkfifo(run_dir / contract.STATUS_FILE)  # open() blocks forever: no writer, like a dead NFS mount
    r = probe_one(ProbeArgs(run_dir=str(run_dir), nvidia_smi=False, step_timeout=0.3))
    assert r.errors == ["status.json: timed out after 0.3s"]
    assert r.status is None and r.metrics_chunk.count("\n") == 3 and r.log_tail


def test_a_garbage_status_json_still_reports_how_the_run_ended(tmp_path, procs) -> None:
    """status.json nested far too deep (or binary): the run's other readings stand."""
    trainer = subprocess.Popen(["sleep", "600"])
    procs.append(trainer)
    run_dir = tmp_path / "run"
    write_run(run_dir, pid=trainer.pid)
    (run_dir / contract.EXIT_CODE_FILE).write_text("1\n")
    (run_dir / contract.STATUS_FILE).write_text('{"phase": "training", "detail": ' + '{"a": ' * 5000 + "1" + "}" * 5001)
    r = probe_one(ProbeArgs(run_dir=str(run_dir), nvidia_smi=False, pid_hint=trainer.pid))
    assert r.errors == ["status.json: ValueError: nested deeper than 32 levels: not parsed"]
    assert r.status is None and r.exit_code == 1 and r.metrics_chunk.count("\n") == 3
    assert r.process.pid == trainer.pid and r.process.alive  # from the launcher's pid hint

    (run_dir / contract.STATUS_FILE).write_bytes(b"\x00\xff" * 100)
    r = probe_one(ProbeArgs(run_dir=str(run_dir), nvidia_smi=False))
    assert len(r.errors) == 1 and r.errors[0].startswith("status.json: ValueError: not JSON")
    assert r.exit_code == 1 and r.process is None


def test_probe_through_jump_and_container_wrapper(ssh_env) -> None:
    """One round trip over the real route: ssh to a jump host, on to the target,
    into `pct exec 200 --`; '~' in the run dir expands on the run host."""
    from dflashctl.hosts import transport

    host = ssh_env.inventory.get("target")
    run_dir = ssh_env.workdir("target") / "runs" / "probe-test"
    write_run(run_dir, pid=None)
    remote_dir = f"{host.workdir}/runs/probe-test"
    args = [ProbeArgs(run_dir=remote_dir, session="probe-test", step_timeout=10)]
    result = transport.connect("target", ssh_env.inventory).run(probe_command(host.python, args), timeout=60)
    answer = parse_probe_host(result.stdout)
    assert not isinstance(answer, ProbeError), answer
    assert answer.hostname == "ct200" and answer.errors == []
    [r] = answer.runs
    assert r.run_dir == remote_dir and r.session_alive is False and r.errors == []
    assert r.status.step == 3 and r.metrics_chunk.count("\n") == 3
    assert len(r.gpus) == 1 and r.gpus[0].name == "NVIDIA H200" and r.compute_apps is not None


def test_the_standbys_pid_is_read_from_standby_json(tmp_path) -> None:
    """The GPU pane names the standby's GPU process, and a supervisor that re-attaches
    keeps a standby that waits: the probe reads the pid the standby wrote
    (trainer/standby.py writes standby.json so) while that process lives."""
    write_run(tmp_path / "a", pid=None)
    assert probe_one(ProbeArgs(run_dir=str(tmp_path / "a"))).standby_pid is None  # no standby waits
    ready = {"pid": os.getpid(), "token": "ab12cd34", "ready": time.time(), "import_s": 4.2}
    contract.atomic_write_text(str(tmp_path / "a" / contract.STANDBY_FILE), json.dumps(ready) + "\n")
    assert probe_one(ProbeArgs(run_dir=str(tmp_path / "a"))).standby_pid == os.getpid()
    assert probe_one(ProbeArgs(run_dir=str(tmp_path / "a"), nvidia_smi=False)).standby_pid == os.getpid()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid no process has now
    contract.atomic_write_text(str(tmp_path / "a" / contract.STANDBY_FILE), json.dumps({**ready, "pid": gone.pid}))
    assert probe_one(ProbeArgs(run_dir=str(tmp_path / "a"))).standby_pid is None  # it left: none waits
    (tmp_path / "a" / contract.STANDBY_FILE).write_text('{"token": "x"}')
    r = probe_one(ProbeArgs(run_dir=str(tmp_path / "a")))
    assert r.standby_pid is None and any("standby.json" in e and "no pid" in e for e in r.errors), r.errors


def test_a_busy_process_is_among_the_hosts_top_cpu_consumers(tmp_path, procs) -> None:
    """What eats the host's CPU, as htop would show it: measured over the probe's
    own short sample, not the process's lifetime."""
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time() + 60\nwhile time.time() < t: pass"])
    procs.append(busy)
    time.sleep(0.5)
    from dflashctl.hosts.probe import PROBE_SOURCE

    # The 40 busiest: on a machine others load too, this one may not be in the top 5.
    host = parse_probe_host(probe_output([sys.executable, "-I", "-S", "-c", PROBE_SOURCE,
                                          json.dumps({"runs": [], "processes": 40})]))
    row = next((p for p in host.host.processes if p["pid"] == busy.pid), None)
    assert row is not None and row["top"], [(p["pid"], p["cpu_pct"]) for p in host.host.processes]
    assert row["cpu_pct"] > 5 and "while time.time()" in row["cmd"]

