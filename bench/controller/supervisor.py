"""Supervisor benchmark on loopback sshd hosts (tests/harness), real tmux and SQLite.

    .venv/bin/python -m bench.controller.supervisor [--hosts 16] [--ticks 20] [--trials 20] [--interval 1.0]

1. Per-tick cost: one supervisor tick (probe every host in one round trip each,
   concurrently, parse, store, detect, decide) for 1 host and for N hosts, each
   reached through the same jump host and running one trainer-like process
   (tests/harness/fake_trainer.py, started by the launcher's run.sh in tmux)
   that logs a metrics line every 0.5 s. Target: N hosts < 2x one host. Also the
   CPU a tick costs this process, and the CPU the hosts' side (sshd sessions and
   the probe) costs: on this machine every "host" shares the same cores.
2. Crash detection latency: a trainer-like process in a tmux session on `target`
   (jump -> `pct exec` container) is SIGKILLed at a random moment, ``--trials``
   times; latency = the time the supervisor (looping every ``--interval``) stored
   the crash event minus the time of the kill. The supervisor restarts the process
   between trials (the launcher's real restart). Median and max.

Prints the figures and a block for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import signal
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import cpu_model, cpu_ms, print_markdown, ssh_hosts, supervising

SOCKET = f"dflash-bench-{os.getpid()}"


def _playbook(directory: Path, name: str, host: str, **settings) -> str:
    import yaml

    raw = {
        "host": host,
        "trainer": {"train": {"steps": 10**9, "log_every": 1, "checkpoint_every": 5},
                    "placement": {"device": "cpu", "target": [0], "drafter": [0]}},
        "compile_cache": None,
        **settings,
    }
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def _status_pid(run_dir: str) -> int | None:
    from dflashctl.core import contract

    try:
        status = contract.parse_status(Path(run_dir, contract.STATUS_FILE).read_text())
    except FileNotFoundError:
        return None
    return status.pid if status else None


def tick_cost(env, store, playbook: str, hosts: list[str], ticks: int) -> dict:
    """Median tick seconds, this process's CPU per tick, the hosts' CPU per tick."""
    from dflashctl.config import load_playbook
    from dflashctl.supervise.supervisor import Supervisor
    from tests.harness.fake_trainer import start_fake_run

    pb = load_playbook(playbook, inventory=env.inventory)
    with ThreadPoolExecutor(8) as pool:
        runs = list(pool.map(lambda h: start_fake_run(store, env.inventory, h, pb.trainer.to_dict(), playbook=pb.name,
                                                      playbook_source=pb.source, socket=SOCKET, step_s=0.5), hosts))
    sup = Supervisor(store, env.inventory, interval=1.0, claim=False)
    for run_id in runs:
        sup.attach(run_id)
    for _ in range(3):  # connections opened, runs seen running
        sup.tick()
        time.sleep(0.3)
    seconds, cpu, host_cpu = [], [], []
    for _ in range(ticks):
        pids = list(env.sshd_pids.values())
        host_before, before = cpu_ms(pids), time.process_time()
        report = sup.tick()
        cpu.append(time.process_time() - before)
        host_cpu.append((cpu_ms(pids) - host_before) / 1000)
        seconds.append(report.seconds)
        failed = {h: v for h, v in report.hosts.items() if not isinstance(v, float)}
        assert not failed, failed
        time.sleep(0.5)
    sup.close()
    samples = sum(len(store.samples(r)) for r in runs)
    return {"hosts": len(hosts), "tick_s": statistics.median(seconds), "tick_max_s": max(seconds),
            "cpu_s": statistics.median(cpu), "host_cpu_s": statistics.median(host_cpu), "samples": samples,
            "runs": runs}


def detection_latency(env, store, playbook: str, host: str, trials: int, interval: float) -> dict:
    """Seconds from SIGKILL to the stored crash event, over ``trials`` kills."""
    from dflashctl.config import load_playbook
    from dflashctl.supervise.supervisor import Supervisor
    from tests.harness.fake_trainer import start_fake_run

    pb = load_playbook(playbook, inventory=env.inventory)
    run_id = start_fake_run(store, env.inventory, host, pb.trainer.to_dict(), playbook=pb.name,
                            playbook_source=pb.source, socket=SOCKET, step_s=0.1)
    run_dir = store.get_run(run_id).run_dir
    sup = Supervisor(store, env.inventory, interval=interval)
    sup.attach(run_id)
    rng = random.Random(1)
    latencies = []
    with supervising(sup, name="bench-supervisor"):
        for trial in range(trials):
            # Wait for the (re)started process to be running and seen training.
            deadline = time.monotonic() + 120
            while True:
                run = store.get_run(run_id)
                pid = _status_pid(run_dir)
                fresh = [s for s in store.samples(run_id, limit=1)
                         if not store.restarts(run_id) or s.time > store.restarts(run_id)[-1].time]
                if run.state == "running" and pid and fresh:
                    break
                assert run.state not in ("failed", "done", "stopped"), run.state
                assert time.monotonic() < deadline, f"trial {trial}: the run did not come back ({run.state})"
                time.sleep(0.05)
            time.sleep(rng.uniform(0, interval))  # a random moment relative to the ticks
            crashes = len(store.events(run_id, kind="crash"))
            killed = time.time()
            os.kill(pid, signal.SIGKILL)
            while len(store.events(run_id, kind="crash")) == crashes:
                assert time.monotonic() < deadline + 60, f"trial {trial}: no crash event"
                time.sleep(0.01)
            latencies.append(store.events(run_id, kind="crash")[-1].time - killed)
            print(f"  trial {trial + 1:2d}: crash recorded {latencies[-1]:.3f} s after SIGKILL", flush=True)
    rows = store.restarts(run_id)
    return {"latency": latencies, "restarts": len(rows),
            "detect_delay_s": [r.detect_delay_s for r in rows if r.detect_delay_s is not None],
            "ttfs": [r.time_to_first_step_s for r in rows if r.time_to_first_step_s is not None],
            "run": run_id}


def end_tmux_servers(env, hosts: list[str]) -> None:
    """The trainer-like processes live in tmux servers on the hosts: end them by pid."""
    from dflashctl.hosts.tmux import Tmux

    def one(host):
        pid = Tmux(env.inventory.get(host), env.inventory, SOCKET).server_pid()
        if pid:  # the test hosts are this machine
            os.kill(pid, signal.SIGTERM)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, hosts))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=16, help="hosts for the many-host tick (default 16)")
    parser.add_argument("--ticks", type=int, default=20, help="ticks measured per figure (default 20)")
    parser.add_argument("--trials", type=int, default=20, help="crash detection trials (default 20)")
    parser.add_argument("--interval", type=float, default=1.0, help="poll interval for the detection trials (default 1 s)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-supervisor-") as root:
        os.environ["DFLASHCTL_HOME"] = os.path.join(root, "home")
        os.environ["DFLASHCTL_TMUX_SOCKET"] = SOCKET
        from dflashctl.store import Store

        with ssh_hosts(os.path.join(root, "ssh")) as env:
            nodes = env.add_hosts(args.hosts, jump="jump")
            store = Store(os.path.join(root, "runs.db"))
            playbooks = Path(root, "playbooks")
            try:
                tick_pb = _playbook(playbooks, "tick", nodes[0], poll_interval=1.0)
                print(f"per-tick cost ({args.ticks} ticks each, hosts through one jump):", flush=True)
                one = tick_cost(env, store, tick_pb, nodes[:1], args.ticks)
                many = tick_cost(env, store, tick_pb, nodes[1:] + nodes[:1], args.ticks)
                ratio = many["tick_s"] / one["tick_s"]
                for r in (one, many):
                    print(f"  {r['hosts']:2d} host(s): tick {r['tick_s'] * 1000:.0f} ms median ({r['tick_max_s'] * 1000:.0f} max); "
                          f"this process {r['cpu_s'] * 1000:.0f} ms CPU; host side {r['host_cpu_s'] * 1000:.0f} ms CPU")
                print(f"  {args.hosts} hosts / 1 host: {ratio:.2f}x (target < 2x: {'ok' if ratio < 2 else 'MISSED'})")
                floor = many["host_cpu_s"] / os.cpu_count()
                print(f"  CPU floor of {args.hosts} probes sharing {os.cpu_count()} cores: {floor * 1000:.0f} ms; "
                      f"one host after another would take about {args.hosts * one['tick_s'] * 1000:.0f} ms", flush=True)

                crash_pb = _playbook(playbooks, "crash", "target", poll_interval=args.interval,
                                     restart={"max_restarts": 1000, "crash_loop_k": 1000, "backoff_initial": 0,
                                              "jitter": 0})
                print(f"crash detection latency on target (jump -> pct exec), interval {args.interval:g} s:", flush=True)
                det = detection_latency(env, store, crash_pb, "target", args.trials, args.interval)
            finally:
                end_tmux_servers(env, ["target", *nodes])
    lat = det["latency"]
    print(f"  median {statistics.median(lat):.3f} s, max {max(lat):.3f} s over {len(lat)} kills "
          f"(interval {args.interval:g} s); the supervisor's own detect_delay_s: median "
          f"{statistics.median(det['detect_delay_s']):.3f} s; restarted process's first step: median "
          f"{statistics.median(det['ttfs']):.2f} s after the restart")
    print()
    print("--- for bench/RESULTS.md ---")
    print(f"Date: {time.strftime('%a %b %d %H:%M %Z %Y')}. Hardware: `nproc` {os.cpu_count()}, `lscpu` model "
          f"\"{cpu_model()}\", Python {platform.python_version()}.")
    print_markdown([
        ("tick, 1 host via jump", f"{one['tick_s'] * 1000:.0f} ms median ({one['tick_max_s'] * 1000:.0f} max)"),
        (f"tick, {args.hosts} hosts via jump", f"{many['tick_s'] * 1000:.0f} ms median ({many['tick_max_s'] * 1000:.0f} "
         f"max); {ratio:.2f}x (target < 2x: {'ok' if ratio < 2 else 'MISSED'})"),
        (f"CPU per tick, this process: 1 / {args.hosts} hosts", f"{one['cpu_s'] * 1000:.0f} ms / "
         f"{many['cpu_s'] * 1000:.0f} ms"),
        (f"CPU per tick, host side (sshd + probe): 1 / {args.hosts} hosts", f"{one['host_cpu_s'] * 1000:.0f} ms / "
         f"{many['host_cpu_s'] * 1000:.0f} ms (floor on {os.cpu_count()} cores: {floor * 1000:.0f} ms)"),
        (f"{args.hosts} hosts polled one after another (estimate: {args.hosts} x the 1-host tick)",
         f"{args.hosts * one['tick_s'] * 1000:.0f} ms"),
        (f"crash detection latency, SIGKILL -> crash stored ({len(lat)} trials, interval {args.interval:g} s)",
         f"median {statistics.median(lat):.3f} s, max {max(lat):.3f} s"),
        ("restart issued -> first step of the restarted (trainer-like) process",
         f"median {statistics.median(det['ttfs']):.2f} s"),
    ], "figure")
    return 0 if ratio < 2 else 1


if __name__ == "__main__":
    sys.exit(main())
