"""The status console's costs: one refresh over a large store, and the CLI's start-up.

    .venv/bin/python -m bench.controller.status            # everything
    .venv/bin/python -m bench.controller.status --refresh  # only the refresh
    .venv/bin/python -m bench.controller.status --startup  # only the CLI start-up
    .venv/bin/python -m bench.controller.status --paint    # only the live screen's first paint and idle CPU

Refresh: a store with 8 hosts x 8 GPUs (one active run per host, every sample with
its 8 GPU readings) and 50 runs of recorded history (8 active + 42 finished, 2000
samples each: 100 000 samples, events and restarts), as a supervisor leaves it.
Measured: one ``StatusReader.load`` (what every refresh of the screen and
``status --once`` reads), cold (first) and warm (later refreshes: thresholds and
learned baselines kept), a run's detail view (its whole history as a chart), and
the screen's whole refresh in a headless Textual app (read + draw). Target: under
50 ms per refresh.

Start-up: wall-clock time of ``dflashctl --help``, ``dflashctl runs`` and
``dflashctl status --once`` (on the same store), best and median of several runs.
Targets: --help under 150 ms, runs / status --once under 250 ms.

Paint: first paint of ``dflashctl status`` in a pseudo-terminal, then the idle CPU of
the console process (``/proc/PID/stat`` utime + stime over ``--idle-seconds`` of
its refreshes every 2 s on the same store, nothing new in it), as % of one core.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import proc_cpu_s
from dflashctl.store import Store
from tests.harness.scenes import gpus, playbook, run_config

NOW = time.time()
HOSTS, GPUS, RUNS, SAMPLES = 8, 8, 50, 2000
# A run host's CPU and memory as the supervisor stores them (parsers.HostReading's fields).
HOST_READING = {"cpus": 192, "load1": 44.3, "load5": 40.1, "load15": 38.0, "cpu_total": 9_000_000_000,
                "cpu_idle": 7_000_000_000, "mem_total_kib": 2_113_929_216, "mem_available_kib": 1_390_411_776}


def build_store(root: Path) -> Store:
    from dflashctl.config import load_playbook
    from dflashctl.launch import thresholds_of

    store = Store(str(root / "runs.db"))
    source = playbook(root / "playbooks", "prod")
    # As launch records them: the playbook unchanged since, its thresholds in the run.
    recorded = thresholds_of(load_playbook(source))
    os.utime(source, (NOW - 10 * RUNS * 30000, NOW - 10 * RUNS * 30000))
    beat_hosts = {}
    active = []
    for i in range(RUNS):
        host = f"gpu{i % HOSTS + 1}"
        run_id = f"prod-{i:04d}-bench"
        is_active = i >= RUNS - HOSTS
        start = NOW - (RUNS - i) * 30000 - SAMPLES * 10
        store.create_run("prod", host, {**run_config(source), "thresholds": recorded}, start, run_id=run_id,
                         claim_gpus=False)
        store.transition(run_id, "running", "trainer started (pid 1, phase compiling)", start + 60)
        if is_active:
            start = NOW - SAMPLES * 10
        rows = [{"time": start + 10 * k, "step": 1000 + 5 * k, "tok_s": 12800.0 + (k % 7) * 50, "loss": 2.0,
                 "accept_len": 3.5, "eta_s": 1e5, "phase": "training", "mfu": 0.4} for k in range(SAMPLES)]
        with store.batch():
            for k, row in enumerate(rows):
                reading = gpus(GPUS, wobble=k) if is_active else (gpus(GPUS) if k % 50 == 0 else None)
                store.add_samples(run_id, [row], gpu=reading, observed=row["time"] + 1,
                                  host_reading=HOST_READING if is_active else None)
            for k in range(20):
                store.add_event(run_id, "probe", f"finding {k}", start + 100 * k, severity="info")
            store.add_restart(run_id, start + 500, "crash: CUDA out of memory", signature="cuda_oom")
        if is_active:
            active.append(run_id)
            beat_hosts[host] = {"last_ok": NOW - 2, "error": None, "down_since": None}
        else:
            store.transition(run_id, "done", "the trainer ended: done", start + SAMPLES * 10, exit_code=0,
                             exit_reason="done")
    store.heartbeat("bench", pid=1, host="elsewhere", started=NOW - 3600, interval=15.0, now=NOW - 2, runs=active,
                    hosts=beat_hosts)
    return store


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:7.1f} ms"


def bench_refresh(store: Store, playbooks: str, repeat: int = 20) -> None:
    from dflashctl.status.model import StatusReader

    reader = StatusReader(store, playbooks)
    t0 = time.perf_counter()
    view = reader.load(NOW)
    cold = time.perf_counter() - t0
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        view = reader.load(NOW)
        times.append(time.perf_counter() - t0)
    zoomed = {}
    for zoom in ("all", "1 h"):  # what the screen reads: the selected run's history charts too
        charted = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            reader.load(NOW, zoom=zoom)
            charted.append(time.perf_counter() - t0)
        zoomed[zoom] = statistics.median(charted)
    t0 = time.perf_counter()
    detail = reader.detail(view.runs[0].id, NOW)
    detail_s = time.perf_counter() - t0
    gpus_shown = sum(len(h.gpus) for h in view.hosts)
    print(f"store: {RUNS} runs ({HOSTS} active), {RUNS * SAMPLES} samples, {HOSTS} hosts x {GPUS} GPUs "
          f"({gpus_shown} GPU rows shown)")
    print(f"refresh (StatusReader.load), cold:   {_ms(cold)}")
    print(f"refresh (StatusReader.load), warm:   {_ms(statistics.median(times))} median, "
          f"{_ms(max(times))} max of {repeat}   target < 50 ms")
    for zoom, seconds in zoomed.items():
        print(f"refresh with the selected run's charts, zoom {zoom}: {_ms(seconds)} median of {repeat}")
    print(f"detail view (whole history, {len(detail.series)} points): {_ms(detail_s)}")
    bench_screen(store.path, playbooks)


def bench_screen(store_path: str, playbooks: str, repeat: int = 10) -> None:
    """The live screen at 200x60: a whole refresh (the worker's read, then the draw on
    the UI thread), and the draw alone (what the UI thread spends; Textual then
    renders only the widgets whose content changed)."""
    from dflashctl.tui.app import StatusApp

    async def scenario() -> tuple[list[float], list[float]]:
        app = StatusApp(store_path, interval=3600, clock=lambda: NOW, playbooks_dir=playbooks)
        cycles, draws = [], []
        async with app.run_test(size=(200, 60)) as pilot:
            while not app.loads:
                await pilot.pause(0.01)
            await pilot.pause(0.2)
            for _ in range(repeat):
                loads = app.loads
                t0 = time.perf_counter()
                app.action_reload()
                while app.loads == loads:
                    await asyncio.sleep(0.0005)
                cycles.append(time.perf_counter() - t0)
            for _ in range(repeat):
                t0 = time.perf_counter()
                app.draw()
                draws.append(time.perf_counter() - t0)
        return cycles, draws

    cycles, draws = asyncio.run(scenario())
    print(f"screen refresh (read in a worker + draw, 200x60): {_ms(statistics.median(cycles))} median, "
          f"{_ms(max(cycles))} max   target < 50 ms")
    print(f"  the draw on the UI thread:                    {_ms(statistics.median(draws))} median, "
          f"{_ms(max(draws))} max")


def bench_startup(store_path: str, repeat: int = 7) -> None:
    env = {**os.environ, "DFLASHCTL_STORE": store_path, "COLUMNS": "120"}
    commands = [("--help", 0.150), ("runs", 0.250), ("status --once", 0.250)]
    print(f"CLI start-up ({sys.executable} -m dflashctl ..., best / median of {repeat}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    for args, target in commands:
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "dflashctl", *args.split()], env=env, capture_output=True)
            times.append(time.perf_counter() - t0)
            assert done.returncode == 0, done.stderr.decode()[-500:]
        print(f"  dflashctl {args:<14} {_ms(min(times))} best, {_ms(statistics.median(times))} median"
              f"   target < {target * 1000:.0f} ms")
    base = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], env=env)
        base.append(time.perf_counter() - t0)
    print(f"  (python -c pass      {_ms(min(base))} best: the interpreter alone)")


def _first_paint(env: dict, needle: bytes, timeout: float = 60.0, interval: str = "600",
                 idle_s: float = 0.0) -> tuple[float, float | None]:
    """Seconds from starting ``dflashctl status`` in a pseudo-terminal (120x40) until
    its output holds ``needle`` (a run id: the first screen with the store's runs);
    with ``idle_s``, then the console's CPU over that many seconds of refreshes every
    ``interval`` (share of one core, 0..1); then ``q``."""
    import pty
    import select

    leader, follower = pty.openpty()
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "dflashctl", "status", "--interval", interval], stdin=follower,
                            stdout=follower, stderr=follower, env=env, close_fds=True)
    os.close(follower)
    seen, took, idle = b"", None, None
    try:
        while took is None and time.perf_counter() - t0 < timeout:
            if select.select([leader], [], [], 0.05)[0]:
                seen += os.read(leader, 65536)
                if needle in seen:
                    took = time.perf_counter() - t0
        if took is not None and idle_s > 0:
            settle = time.perf_counter() + 3.0  # the start's own work (imports, first layout) is not idle
            while time.perf_counter() < settle:
                if select.select([leader], [], [], 0.1)[0]:
                    os.read(leader, 65536)
            cpu0, wall0 = proc_cpu_s(proc.pid), time.perf_counter()
            while time.perf_counter() - wall0 < idle_s:  # read what it draws: a full terminal would block it
                if select.select([leader], [], [], 0.1)[0]:
                    os.read(leader, 65536)
            idle = (proc_cpu_s(proc.pid) - cpu0) / (time.perf_counter() - wall0)
        os.write(leader, b"q")
        deadline = time.monotonic() + 20
        while proc.poll() is None and time.monotonic() < deadline:  # read on: a full terminal blocks the app
            if select.select([leader], [], [], 0.1)[0]:
                try:
                    os.read(leader, 65536)
                except OSError:
                    break
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        os.close(leader)
    if took is None:
        raise SystemExit(f"no first paint within {timeout:g} s: {seen[-500:]!r}")
    return took, idle


def bench_paint(store: Store, repeat: int = 5, idle_s: float = 30.0, interval: str = "2") -> None:
    """First paint of the live screen, and the idle CPU of the console process: its
    CPU seconds over ``idle_s`` of refreshes every ``interval`` (the default
    refresh) with nothing new in the store, as a share of one core."""
    env = {**os.environ, "DFLASHCTL_STORE": store.path, "TERM": "xterm-256color", "COLUMNS": "120", "LINES": "40"}
    needle = store.list_runs(active_only=True)[0].id.encode()
    times = [_first_paint(env, needle)[0] for _ in range(repeat)]
    print(f"first paint of `dflashctl status` (pty 120x40, best / median of {repeat}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores): {_ms(min(times))} best, "
          f"{_ms(statistics.median(times))} median   target < 1000 ms on an idle machine")
    if idle_s > 0:
        _, idle = _first_paint(env, needle, interval=interval, idle_s=idle_s)
        print(f"idle CPU of the console process (pty 120x40, refresh every {interval} s, steady store, "
              f"{idle_s:g} s after a 3 s settle; load average {os.getloadavg()[0]:.1f}): "
              f"{idle * 100:.1f} % of one core")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--refresh", action="store_true", help="only the refresh")
    parser.add_argument("--startup", action="store_true", help="only the CLI start-up")
    parser.add_argument("--paint", action="store_true", help="only the live screen's first paint and idle CPU")
    parser.add_argument("--idle-seconds", type=float, default=30.0, metavar="S",
                        help="how long the idle CPU is measured (0: not measured; default 30)")
    args = parser.parse_args()
    both = not (args.refresh or args.startup or args.paint)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        store = build_store(root)
        print(f"(store built in {time.perf_counter() - t0:.1f} s: {store.path})")
        if args.refresh or both:
            bench_refresh(store, str(root / "playbooks"))
        if args.startup or both:
            bench_startup(store.path)
        if args.paint or both:
            bench_paint(store, idle_s=args.idle_seconds)


if __name__ == "__main__":
    main()
