"""Crash to first step through a jump host and a `pct exec` wrapper vs the local host, in one run.

    python bench/bench_restart_wrapper.py                  # tiny CPU trainer, 3 restarts per host
    python bench/bench_restart_wrapper.py --restarts 5 --json

Real OpenSSH servers on loopback (tests/harness: `target` is reached through the
jump host `jump` and runs every command inside the test `pct exec 200 --`), real
tmux, the real trainer, a real SQLite store and the supervisor in this process.
For each host (`local`, then `target`) a run is launched with the standby on; after
each checkpoint-and-step, once the standby has done its imports, the trainer is
SIGKILLed and the supervisor restarts it (the standby renamed and woken). Printed
per host: kill -> first step of the new process (the bench's own clock: the kill,
then the first stored sample after it), the restart row's ``downtime_s`` and
``time_to_first_step_s``, and the host commands the restart itself ran (count and
seconds, from the transport); then the ratio target / local of the medians (the
target: <= 1.5).

Also one tmux lifecycle call on each host's kept-open connection against the same
call through a fresh connection in a new Python process (what a forwarding
``tmux_bin`` executable cost per call).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dflashctl import contract, transport  # noqa: E402
from dflashctl.bundle import build_bundle  # noqa: E402
from dflashctl.config import load_playbook  # noqa: E402
from dflashctl.launch import launch_run  # noqa: E402
from dflashctl.runhost import standby_session  # noqa: E402
from dflashctl.store import Store  # noqa: E402
from dflashctl.supervisor import Supervisor  # noqa: E402
from dflashctl.tmux import SOCKET_ENV, UTF8_ENV, Tmux  # noqa: E402
from bench_standby import arguments, status, trainer_config, wait_for  # noqa: E402  (this folder)

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


def one_host(env, root: Path, host: str, args, calls: CallLog) -> dict:
    trainer = trainer_config(args)
    playbooks = root / f"playbooks-{host}"
    playbooks.mkdir()
    path = playbooks / "bench.yaml"
    path.write_text(yaml.safe_dump({"host": host, "trainer": trainer, "poll_interval": args.interval,
                                   "compile_cache": None,
                                   "restart": {"backoff_initial": 0, "jitter": 0, "standby": True,
                                               "max_restarts": args.restarts + 1, "crash_loop_k": args.restarts + 1}}))
    store = Store(str(root / f"runs-{host}.db"))
    inventory = env.inventory
    run_id = launch_run(load_playbook(str(path), inventory=inventory), inventory, store, bundle=build_bundle()).run_id
    run = store.get_run(run_id)
    sup = Supervisor(store, inventory, interval=args.interval, playbooks_dir=str(playbooks))
    sup.attach(run_id)
    restart_fn_calls: list[tuple[int, float]] = []

    def restart_fn(rid, serialized, st, inv):  # the supervisor's own restart, its host commands counted
        from dflashctl.runhost import restart_run

        calls.thread, before = threading.get_ident(), len(calls.calls.get(host, []))
        started = time.monotonic()
        try:
            restart_run(rid, serialized, st, inv, clock=sup.clock)
        finally:
            calls.thread = None
            restart_fn_calls.append((len(calls.calls.get(host, [])) - before, time.monotonic() - started))

    sup.restart_fn = restart_fn
    stop = threading.Event()
    thread = threading.Thread(target=sup.run, args=(stop,), daemon=True, name="bench-supervisor")
    thread.start()
    kill_to_step = []
    try:
        for i in range(args.restarts):
            wait_for(lambda: store.get_run(run_id).state == "running" and status(run.run_dir).get("phase") == "training"
                     and (status(run.run_dir).get("step") or 0) % 4 >= 1, 600, "a trained step past a checkpoint")
            wait_for(lambda: Path(run.run_dir, contract.STANDBY_FILE).exists()
                     and json.loads(Path(run.run_dir, contract.STANDBY_FILE).read_text())["pid"]
                     != status(run.run_dir)["pid"], 600, "the standby's imports")
            time.sleep(1.0)
            killed_at = time.time()
            os.kill(status(run.run_dir)["pid"], signal.SIGKILL)  # every test host is this machine
            row = wait_for(lambda: len(store.restarts(run_id)) > i and store.restarts(run_id)[i].time_to_first_step_s
                           is not None and store.restarts(run_id)[i], 600, f"restart {i + 1}'s first step")
            first = min(s.time for s in store.samples(run_id) if s.time > row.time)
            kill_to_step.append(round(first - killed_at, 2))
    finally:
        stop.set()
        thread.join(60)
        tmux = Tmux(inventory.get(host), inventory)
        tmux.kill(run.tmux_session)
        tmux.kill(standby_session(run.tmux_session))
    rows = store.restarts(run_id)[: args.restarts]
    woken = [e for e in store.events(run_id, kind="process") if (e.detail or {}).get("standby")]
    return {"host": host, "route": transport.connect(host, inventory).describe_route(),
            "standby_woken": len(woken),
            "kill_to_first_step_s": kill_to_step,
            "downtime_s": [round(r.downtime_s, 2) for r in rows],
            "time_to_first_step_s": [round(r.time_to_first_step_s, 2) for r in rows],
            "restart_commands": [n for n, _ in restart_fn_calls],
            "restart_call_s": [round(s, 2) for _, s in restart_fn_calls]}


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
        "import sys; from dflashctl.config import load_inventory; from dflashctl.transport import connect; "
        "t = connect(sys.argv[2], load_inventory(sys.argv[1])); "
        "sys.exit(t.run(['tmux', '-L', sys.argv[3], 'has-session', '-t', '=bench-none'], env=%r, check=False).exit_code)"
        % UTF8_ENV)
    fresh = []
    for _ in range(3):
        started = time.monotonic()
        subprocess.run([sys.executable, "-c", fresh_code, env.inventory_path, host, tmux.socket], check=False,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        fresh.append(time.monotonic() - started)
    return {"host": host, "kept_open_s": round(statistics.median(kept), 3), "fresh_process_s": round(statistics.median(fresh), 3)}


def main() -> None:
    args = arguments(__doc__).parse_args()
    os.environ.setdefault(SOCKET_ENV, f"bench-restart-{os.getpid()}")
    from tests.harness import SshEnv

    calls = CallLog()
    with tempfile.TemporaryDirectory(prefix="bench-restart-wrapper-") as root:
        with SshEnv(os.path.join(root, "ssh")) as env:
            try:
                results = [one_host(env, Path(root), host, args, calls) for host in HOSTS]
                lifecycle = [lifecycle_call(env, host) for host in HOSTS]
            finally:
                for host in HOSTS:
                    Tmux(env.inventory.get(host), env.inventory).kill_server()
                transport.default_pool.close()
    local, wrapped = (statistics.median(r["kill_to_first_step_s"]) for r in results)
    ratio = wrapped / local if local > 0 else float("inf")
    if args.json:
        print(json.dumps({"hosts": results, "lifecycle_call": lifecycle, "ratio": round(ratio, 2)}))
        return
    print(f"{'host':<8} {'route':<34} {'kill->first step':>17} {'downtime_s':>11} {'issued->step':>13} "
          f"{'restart cmds':>13} {'restart call':>13} {'standby':>8}  each kill->first step")
    for r in results:
        print(f"{r['host']:<8} {r['route']:<34} {statistics.median(r['kill_to_first_step_s']):>17.2f} "
              f"{statistics.median(r['downtime_s']):>11.2f} {statistics.median(r['time_to_first_step_s']):>13.2f} "
              f"{statistics.median(r['restart_commands']):>13.0f} {statistics.median(r['restart_call_s']):>12.2f}s"
              f" {r['standby_woken']:>4}/{args.restarts:<3}  {r['kill_to_first_step_s']}")
    print(f"ratio target / local (median kill -> first step): {ratio:.2f}x (target <= 1.5x)")
    for c in lifecycle:
        print(f"one tmux call on {c['host']}: {c['kept_open_s'] * 1000:.0f} ms on the kept-open connection, "
              f"{c['fresh_process_s'] * 1000:.0f} ms through a fresh connection in a new process")


if __name__ == "__main__":
    main()
