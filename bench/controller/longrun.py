"""A five-day, eight-GPU run in the store and the console.

    .venv/bin/python -m bench.controller.longrun                 # 5 days, a poll every 4 s
    .venv/bin/python -m bench.controller.longrun --days 1        # a shorter run, same figures
    .venv/bin/python -m bench.controller.longrun --idle-seconds 0

The store: one run of ``--days`` days polled every ``--poll`` seconds (5 days at 4 s:
108,000 samples), each poll one metrics line and one reading of the host's 8 GPUs
(each with its trainer process) and of its CPU and memory, written through the
store's own write path as the supervisor writes them: one transaction per tick
(``add_samples``, ``add_readings``), the playbook's default retention applied every
minute of the run's clock (``apply_retention``).

The console (``StatusApp``) driven headless over that store (Textual's
``run_test``), at the run's end as its clock: first paint (the app started until
its first read is drawn), opening the run's detail view (Enter until its first load
is drawn), a refresh (the worker's read and the draw) on the main screen and in the
detail view, the console's idle CPU over ``--idle-seconds`` of refreshes every 2 s
(the default), twice: nothing new in the store (the clock fixed at the run's end),
then a live run (another process writes a poll every 4 s, as a supervisor, and the
console's clock runs), its peak RSS. htop's CPU in a pseudo-terminal of the
console's size over the same time when htop is installed. Goals: detail view
<= 1 s, refresh <= 50 ms, idle CPU no more than htop's; the store's size for the
run is printed with the retention's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import proc_cpu_s, vm_hwm_kib
from dflashctl.config import Retention
from dflashctl.core.units import fmt_bytes, fmt_duration
from dflashctl.store import Store
from dflashctl.supervise.supervisor import apply_retention
from dflashctl.supervise.supervisor_core import RunPolicy
from tests.harness.scenes import gpus, playbook, run_config

HOST = "gpu1"
STEPS_PER_S = 1.0
CONSOLE_SIZE = (200, 60)  # the headless console's terminal, and htop's beside it


def _gpu_reading(i: int) -> list[dict]:
    """The 8 GPUs of one poll, each with its trainer's process (as ``host_gpu_rows`` stores them)."""
    rows = gpus(8, util=90.0 + i % 10, used=90112.0 + 64 * (i % 7), wobble=i)
    for g in rows:
        g.update(uuid=f"GPU-8a7820b2-30e1-7367-326a-a5d3dfe3b0f{g['index']}", clocks_sm_mhz=1980.0, extra={})
        g["apps"] = [{"pid": 4343, "name": "/opt/torch/.venv/bin/python3", "used_memory_mib": g["memory_used_mib"],
                      "role": "trainer", "run_id": None}]
    return rows


def _host_reading(i: int, poll: float) -> dict:
    return {"cpus": 192, "load1": 40.0 + i % 9, "load5": 40.0, "load15": 38.0, "cpu_total": int(192 * 100 * poll * i),
            "cpu_idle": int(150 * 100 * poll * i), "mem_total_kib": 2_113_929_216,
            "mem_available_kib": 1_390_411_776 - 1024 * (i % 97), "cpu_cgroup": None, "mem_cgroup": None}


def build(root: Path, days: float, poll: float) -> tuple[Store, str, float, float]:
    """The store of one run of ``days`` days polled every ``poll`` s; (store, run id,
    its end time, seconds the writes took)."""
    store = Store(str(root / "runs.db"))
    source = playbook(root / "playbooks", "prod")
    polls = int(days * 86400 / poll)
    start = time.time() - polls * poll
    run_id = store.create_run("prod", HOST, run_config(source, steps=int(polls * poll * STEPS_PER_S * 1.2)),
                              start - 120).id
    store.transition(run_id, "running", "trainer started (pid 4343, phase training)", start - 60)
    run = store.get_run(run_id)
    policy = RunPolicy.defaults("prod")
    pruned, t0 = float("-inf"), time.perf_counter()
    for i in range(polls):
        t = start + i * poll
        pruned = tick(store, run, policy, i, t, poll, pruned)
        if i % 20000 == 0 and i:
            print(f"  {i:,} polls written ({time.perf_counter() - t0:.0f} s)", flush=True)
    beat(store, run_id, start, poll, start + polls * poll)
    return store, run_id, start + polls * poll, time.perf_counter() - t0


def tick(store: Store, run, policy: RunPolicy, i: int, t: float, poll: float, pruned: float) -> float:
    """Poll ``i`` of the run at ``t``, as Supervisor._store_tick writes it: its metrics
    line and the host's reading in one transaction, the retention once a minute of the
    run's clock. The time of the last pruning."""
    line = {"time": t, "step": int(i * poll * STEPS_PER_S), "tok_s": 12800.0 + 150 * ((i * 7) % 5 - 2),
            "loss": 2.4 - 1e-6 * i, "acc": 0.61, "accept_len": 3.1 + 1e-6 * i, "eta_s": 86400.0,
            "phase": "training", "mfu": 0.41, "extra": {"lr": 3e-4, "grad_norm": 0.8 + (i % 13) / 100}}
    with store.batch():
        store.add_samples(run.id, [line], metrics_offset=200 * (i + 1), observed=t + 0.5)
        store.add_readings(HOST, t + 0.5, _gpu_reading(i), _host_reading(i, poll))
        if t - pruned >= 60.0:
            pruned = t
            apply_retention(store, [(run, policy)])
    return pruned


def beat(store: Store, run_id: str, start: float, poll: float, now: float) -> None:
    store.heartbeat("bench:1", pid=os.getpid(), host="bench", started=start, interval=poll, now=now,
                    runs=[run_id], hosts={HOST: {"last_ok": now, "error": None, "down_since": None}})


def feed(path: str, run_id: str, poll: float, seconds: float) -> None:
    """A supervisor's writes to a live run for ``seconds``: a poll every ``poll`` s at
    the wall clock (run in its own process: its CPU is not the console's)."""
    store = Store(path)
    run, policy = store.get_run(run_id), RunPolicy.defaults("prod")
    # Poll numbers past every one the build wrote: steps and metrics offsets only grow.
    i = store.conn.execute("SELECT count(*) FROM samples").fetchone()[0] + 1_000_000
    start, pruned = time.time(), float("-inf")
    while time.time() - start < seconds:
        t = time.time()
        pruned = tick(store, run, policy, i, t, poll, pruned)
        beat(store, run_id, start, poll, t)
        i += 1
        time.sleep(max(0.0, poll - (time.time() - t)))
    store.close()


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def bench_console(store: Store, run_id: str, now: float, playbooks: str, idle_s: float, repeat: int = 10) -> dict:
    from dflashctl.tui.app import StatusApp
    from dflashctl.tui.screens import DetailScreen

    figures: dict = {}

    async def until(pilot, predicate, timeout: float = 120.0) -> None:
        deadline = time.perf_counter() + timeout
        while not predicate():
            if time.perf_counter() > deadline:
                raise SystemExit("the console did not get there within 120 s")
            await pilot.pause(0.001)

    async def reloads(pilot, app, screen) -> list[float]:
        times = []
        for _ in range(repeat):
            loads = screen.loads
            t0 = time.perf_counter()
            screen.reload() if screen is not app else app.action_reload()
            await until(pilot, lambda: screen.loads > loads)
            times.append(time.perf_counter() - t0)
        return times

    async def idle(seconds: float) -> float:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await asyncio.sleep(seconds)  # the app refreshes itself every 2 s meanwhile
        return (time.process_time() - cpu0) / (time.perf_counter() - wall0)

    clock = {"live": False}

    async def scenario() -> None:
        t0 = time.perf_counter()
        app = StatusApp(store.path, interval=2.0, clock=lambda: time.time() if clock["live"] else now,
                        playbooks_dir=playbooks,
                        probe_unsupervised=False)
        async with app.run_test(size=CONSOLE_SIZE) as pilot:
            await until(pilot, lambda: app.loads)
            await pilot.pause()
            figures["first_paint_s"] = time.perf_counter() - t0
            figures["refresh_s"] = await reloads(pilot, app, app)
            if idle_s > 0:
                figures["idle_cpu"] = await idle(idle_s)
                # A live run: another process writes a poll every 4 s, the console's clock runs.
                clock["live"] = True
                feeder = subprocess.Popen([sys.executable, "-m", "bench.controller.longrun", "--feed", store.path,
                                           run_id, str(idle_s + 10)], cwd=Path(__file__).resolve().parents[2])
                try:
                    await asyncio.sleep(6)  # its first polls in, the chart's new span drawn
                    figures["live_cpu"] = await idle(idle_s)
                finally:
                    feeder.terminate()
                    feeder.wait()
                clock["live"] = False
            t0 = time.perf_counter()
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, DetailScreen) and app.screen.loads)
            await pilot.pause()
            figures["detail_s"] = time.perf_counter() - t0
            figures["detail_refresh_s"] = await reloads(pilot, app, app.screen)
        figures["rss_kib"] = vm_hwm_kib()

    asyncio.run(scenario())
    return figures


def htop_cpu(seconds: float, size: tuple[int, int] = CONSOLE_SIZE) -> float | None:
    """htop's CPU in a pseudo-terminal of the console's ``size`` (its default delay)
    over ``seconds``, as a share of one core (None: htop is not installed)."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    if seconds <= 0 or shutil.which("htop") is None:
        return None
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", size[1], size[0], 0, 0))
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": str(size[0]), "LINES": str(size[1])}
    proc = subprocess.Popen(["htop"], stdin=follower, stdout=follower, stderr=follower, env=env, close_fds=True)
    os.close(follower)
    try:
        settle = time.perf_counter() + 3.0
        while time.perf_counter() < settle:
            if select.select([leader], [], [], 0.1)[0]:
                os.read(leader, 65536)
        cpu0, wall0 = proc_cpu_s(proc.pid), time.perf_counter()
        while time.perf_counter() - wall0 < seconds:
            if select.select([leader], [], [], 0.1)[0]:
                os.read(leader, 65536)
        return (proc_cpu_s(proc.pid) - cpu0) / (time.perf_counter() - wall0)
    finally:
        proc.kill()
        proc.wait()
        os.close(leader)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--days", type=float, default=5.0, help="the run's length (default 5)")
    parser.add_argument("--poll", type=float, default=4.0, help="seconds between polls (default 4)")
    parser.add_argument("--idle-seconds", type=float, default=30.0, metavar="S",
                        help="how long the idle CPU is measured, the console's and htop's (0: not measured)")
    parser.add_argument("--feed", nargs=3, metavar=("STORE", "RUN", "SECONDS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.feed:
        return feed(args.feed[0], args.feed[1], args.poll, float(args.feed[2]))
    keep = Retention()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        print(f"building: a {args.days:g}-day run on {HOST}, a poll every {args.poll:g} s, 8 GPUs "
              f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)", flush=True)
        store, run_id, now, took = build(root, args.days, args.poll)
        polls = int(args.days * 86400 / args.poll)
        tables = store.table_bytes()
        print(f"written: {polls:,} samples, {polls:,} host readings of 8 GPUs, through the write path, in "
              f"{took:.0f} s ({took / polls * 1000:.2f} ms per tick)")
        print(f"store: {fmt_bytes(store.file_bytes())} on disk with retention full {fmt_duration(keep.full)}, "
              f"fine {fmt_duration(keep.fine)} (samples kept {store.conn.execute('SELECT count(*) FROM samples').fetchone()[0]:,}, "
              f"readings kept {store.conn.execute('SELECT count(*) FROM host_readings').fetchone()[0]:,}, "
              f"rollup rows {store.conn.execute('SELECT count(*) FROM rollups').fetchone()[0]:,})")
        print("  by table: " + ", ".join(f"{t} {fmt_bytes(n)}" for t, n in sorted(tables.items(), key=lambda kv: -kv[1])
                                           if n >= 65536))
        print(f"  the run's share (runs, console): {fmt_bytes(store.run_bytes([run_id], tables)[run_id])}")
        store.close()
        figures = bench_console(Store(str(root / "runs.db")), run_id, now, str(root / "playbooks"), args.idle_seconds)
        refresh, detail_refresh = figures["refresh_s"], figures["detail_refresh_s"]
        print(f"console (headless, {CONSOLE_SIZE[0]}x{CONSOLE_SIZE[1]}, load average {os.getloadavg()[0]:.1f}):")
        print(f"  first paint:            {_ms(figures['first_paint_s'])}")
        print(f"  detail view opened:     {_ms(figures['detail_s'])}   goal <= 1000 ms")
        print(f"  refresh, main screen:   {_ms(statistics.median(refresh))} median, {_ms(max(refresh))} max   "
              "goal <= 50 ms")
        print(f"  refresh, detail view:   {_ms(statistics.median(detail_refresh))} median, "
              f"{_ms(max(detail_refresh))} max")
        print(f"  peak RSS:               {figures['rss_kib'] / 1024:.0f} MiB")
        if "idle_cpu" in figures:
            print(f"  idle CPU (refresh every 2 s, {args.idle_seconds:g} s), nothing new in the store: "
                  f"{figures['idle_cpu'] * 100:.2f} % of one core")
            print(f"  idle CPU, a live run (a poll every 4 s from another process, the clock running): "
                  f"{figures['live_cpu'] * 100:.2f} % of one core")
            htop = htop_cpu(args.idle_seconds)
            print(f"  htop ({CONSOLE_SIZE[0]}x{CONSOLE_SIZE[1]}), same machine, next {args.idle_seconds:g} s: "
                  + (f"{htop * 100:.2f} % of one core" if htop is not None else "not installed: not measured"))


if __name__ == "__main__":
    main()
