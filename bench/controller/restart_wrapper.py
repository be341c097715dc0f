"""Crash to first step through a jump host and a `pct exec` wrapper vs the local host, in one run.

    python -m bench.controller.restart_wrapper                  # tiny CPU trainer, 5 restarts per host
    python -m bench.controller.restart_wrapper --restarts 7 --json

Real OpenSSH servers on loopback (tests/harness: `target` is reached through the
jump host `jump` and runs every command inside the test `pct exec 200 --`), real
tmux, the real trainer, a real SQLite store and the supervisor in this process.
A run is launched on each host (`local` and `target`) with the standby on; both
train at once, and in turn (local, target, local, ...), after a checkpoint-and-step
and once the standby has done its imports, each trainer is SIGKILLed and the
supervisor restarts it (the standby renamed and woken): both hosts' figures are taken
under the same load. Printed
per host: kill -> first step of the new process (the bench's own clock: the kill,
then the first stored sample after it), the restart row's ``downtime_s`` and
``time_to_first_step_s``, and the host commands the restart itself ran (each one
round trip: counted and timed by the transport; on one host the whole restart is
one); then the ratio target / local of the medians (the target: <= 1.3), and the
machine's load average before and after.

Also one tmux lifecycle call on each host's kept-open connection against the same
call through a fresh connection in a new Python process (what a forwarding
``tmux_bin`` executable cost per call).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import (REPO, crash_after_checkpoint, end_sessions, launch, restart_arguments, restart_trainer,
                          ssh_hosts, supervising)
from dflashctl.hosts import transport
from dflashctl.hosts.tmux import SOCKET_ENV, UTF8_ENV, Tmux
from dflashctl.supervise.supervisor import Supervisor

HOSTS = ("local", "target")


class CallLog:
    """Every host command's duration, per host, while ``on`` (the restart's own
    commands: the supervisor's probes run on another thread and are left out)."""

    def __init__(self):
        self.calls: dict[str, list[float]] = {}
        self.thread: int | None = None
        self._run = transport.Transport.run
        log = self

        def run(t, argv, **kw):
            started = time.monotonic()
            try:
                return log._run(t, argv, **kw)
            finally:
                if threading.get_ident() == log.thread:
                    log.calls.setdefault(t.name, []).append(time.monotonic() - started)

        transport.Transport.run = run  # measuring only: the call itself is the real one


class HostRun:
    """A run on one host, launched and supervised in this process (standby on)."""

    def __init__(self, env, root: Path, host: str, args, calls: CallLog):
        self.host, self.args, self.calls, self.inventory = host, args, calls, env.inventory
        self.store, self.run, playbooks = launch(root, self.inventory, {
            "host": host, "trainer": restart_trainer(args), "poll_interval": args.interval, "compile_cache": None,
            "restart": {"backoff_initial": 0, "jitter": 0, "standby": True, "max_restarts": args.restarts + 1,
                        "crash_loop_k": args.restarts + 1}}, tag=f"-{host}")
        self.run_id = self.run.id
        self.sup = Supervisor(self.store, self.inventory, interval=args.interval, playbooks_dir=playbooks)
        self.sup.attach(self.run_id)
        self.sup.restart_fn = self._restart
        self.restart_calls: list[tuple[int, float]] = []
        self.kill_to_step: list[float] = []
        self.looping = contextlib.ExitStack()
        self.looping.enter_context(supervising(self.sup, name=f"bench-{host}"))

    def _restart(self, run_id, serialized, store, inventory, **how) -> None:
        """The supervisor's own restart (its marker and stack dump included), its host commands counted."""
        from dflashctl.runs.runhost import restart_run

        self.calls.thread, before = threading.get_ident(), len(self.calls.calls.get(self.host, []))
        started = time.monotonic()
        try:
            restart_run(run_id, serialized, store, inventory, **how)
        finally:
            self.calls.thread = None
            self.restart_calls.append((len(self.calls.calls.get(self.host, [])) - before, time.monotonic() - started))

    def kill_once(self, i: int) -> None:
        """After a checkpoint and a step, with the standby ready: SIGKILL, then the first step after."""
        killed_at, row = crash_after_checkpoint(self.store, self.run_id, self.run.run_dir, i, standby=True)
        first = min(s.time for s in self.store.samples(self.run_id) if s.time > row.time)
        self.kill_to_step.append(round(first - killed_at, 2))

    def close(self) -> None:
        self.looping.close()
        end_sessions(self.inventory, self.host, self.run)

    def result(self) -> dict:
        rows = self.store.restarts(self.run_id)[: self.args.restarts]
        woken = [e for e in self.store.events(self.run_id, kind="process") if (e.detail or {}).get("standby")]
        return {"host": self.host, "route": transport.connect(self.host, self.inventory).describe_route(),
                "standby_woken": len(woken), "kill_to_first_step_s": self.kill_to_step,
                "downtime_s": [round(r.downtime_s, 2) for r in rows],
                "time_to_first_step_s": [round(r.time_to_first_step_s, 2) for r in rows],
                "restart_commands": [n for n, _ in self.restart_calls],
                "restart_call_s": [round(s, 2) for _, s in self.restart_calls]}


def lifecycle_call(env, host: str, calls: int = 10) -> dict:
    """One tmux call (has-session) on the kept-open connection, and through a fresh
    connection in a new Python process."""
    tmux = Tmux(env.inventory.get(host), env.inventory)
    tmux.has_session("bench-none")  # the connection is open from here on
    kept = []
    for _ in range(calls):
        started = time.monotonic()
        tmux.has_session("bench-none")
        kept.append(time.monotonic() - started)
    fresh_code = (
        "import sys; from dflashctl.config import load_inventory; from dflashctl.hosts.transport import connect; "
        "t = connect(sys.argv[2], load_inventory(sys.argv[1])); "
        "sys.exit(t.run(['tmux', '-L', sys.argv[3], 'has-session', '-t', '=bench-none'], env=%r, check=False).exit_code)"
        % UTF8_ENV)
    fresh = []
    for _ in range(3):
        started = time.monotonic()
        subprocess.run([sys.executable, "-c", fresh_code, env.inventory_path, host, tmux.socket], check=False,
                       cwd=REPO)
        fresh.append(time.monotonic() - started)
    return {"host": host, "kept_open_s": round(statistics.median(kept), 3), "fresh_process_s": round(statistics.median(fresh), 3)}


def main() -> None:
    parser = restart_arguments(__doc__)
    parser.set_defaults(restarts=5)
    args = parser.parse_args()
    load_before = os.getloadavg()
    os.environ.setdefault(SOCKET_ENV, f"bench-restart-{os.getpid()}")
    calls = CallLog()
    with tempfile.TemporaryDirectory(prefix="bench-restart-wrapper-") as root:
        with ssh_hosts(os.path.join(root, "ssh")) as env:
            runs = []
            try:
                runs = [HostRun(env, Path(root), host, args, calls) for host in HOSTS]
                # Both runs train at once and their crashes alternate, so both hosts' figures
                # are taken under the same load (this machine is shared).
                for i in range(args.restarts):
                    for r in runs:
                        r.kill_once(i)
                for r in runs:
                    r.close()
                results = [r.result() for r in runs]
                lifecycle = [lifecycle_call(env, host) for host in HOSTS]
            finally:
                for host in HOSTS:
                    Tmux(env.inventory.get(host), env.inventory).kill_server()
                transport.default_pool.close()
    local, wrapped = (statistics.median(r["kill_to_first_step_s"]) for r in results)
    ratio = wrapped / local if local > 0 else float("inf")
    load = {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()],
            "cpus": os.cpu_count()}
    if args.json:
        print(json.dumps({"hosts": results, "lifecycle_call": lifecycle, "ratio": round(ratio, 2), "load": load}))
        return
    print(f"{'host':<8} {'route':<34} {'kill->first step':>17} {'downtime_s':>11} {'issued->step':>13} "
          f"{'round trips':>13} {'restart call':>13} {'standby':>8}  each kill->first step")
    for r in results:
        print(f"{r['host']:<8} {r['route']:<34} {statistics.median(r['kill_to_first_step_s']):>17.2f} "
              f"{statistics.median(r['downtime_s']):>11.2f} {statistics.median(r['time_to_first_step_s']):>13.2f} "
              f"{statistics.median(r['restart_commands']):>13.0f} {statistics.median(r['restart_call_s']):>12.2f}s"
              f" {r['standby_woken']:>4}/{args.restarts:<3}  {r['kill_to_first_step_s']}")
    print(f"ratio target / local (median kill -> first step, {args.restarts} interleaved each): {ratio:.2f}x "
          f"(target <= 1.3x)")
    print(f"round trips per restart: " + ", ".join(f"{r['host']} {r['restart_commands']}" for r in results))
    print(f"load average (1, 5, 15 min) before {load['before']}, after {load['after']} on {load['cpus']} CPUs")
    for c in lifecycle:
        print(f"one tmux call on {c['host']}: {c['kept_open_s'] * 1000:.0f} ms on the kept-open connection, "
              f"{c['fresh_process_s'] * 1000:.0f} ms through a fresh connection in a new process")


if __name__ == "__main__":
    main()
