"""Restart downtime with and without the standby trainer: the whole path, on this machine.

    python bench/bench_standby.py                 # CPU, tiny trainer, 3 restarts each way
    python bench/bench_standby.py --device cuda --preset small --restarts 3

For each mode (``standby`` on, then off) a run is launched on the local host (real
tmux, the real trainer, a real SQLite store) and supervised in this process; after
each checkpoint-and-step the trainer is SIGKILLed and the supervisor restarts it.
Printed per mode, from the run's restarts rows (the supervisor's own accounting):
``downtime_s`` (failure -> first step of the new process), ``time_to_first_step_s``
(restart issued -> first step) and, from the new process's status, its import
time. The standby's own imports run beside the training process and are not counted
by anything here; that is the point.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dflashctl.config import load_inventory, load_playbook  # noqa: E402
from dflashctl.core import contract  # noqa: E402
from dflashctl.hosts.bundle import build_bundle  # noqa: E402
from dflashctl.hosts.tmux import SOCKET_ENV, Tmux  # noqa: E402
from dflashctl.launch import launch_run  # noqa: E402
from dflashctl.runs.runhost import standby_session  # noqa: E402
from dflashctl.store import Store  # noqa: E402
from dflashctl.supervise.supervisor import Supervisor  # noqa: E402


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise SystemExit(f"timed out after {timeout:g}s waiting for {what}")


def status(run_dir: str) -> dict:
    try:
        return json.loads(Path(run_dir, contract.STATUS_FILE).read_text())
    except (OSError, ValueError):
        return {}


def arguments(doc: str) -> argparse.ArgumentParser:
    """The options of a restart bench (this one and bench_restart_wrapper.py)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--bucket", type=int, default=128)
    p.add_argument("--restarts", type=int, default=3)
    p.add_argument("--interval", type=float, default=0.5, help="supervisor poll interval (detection delay)")
    p.add_argument("--json", action="store_true")
    return p


def trainer_config(args) -> dict:
    """A run that checkpoints every 4 steps and logs every step, for ``arguments``."""
    return {"model": {"preset": args.preset, "drafter_layers": 2, "block_size": 8},
            "data": {"buckets": [args.bucket], "batch_size": 1, "max_anchors": 16},
            "placement": {"device": args.device, "target": [0], "drafter": [0]},
            "train": {"steps": 1_000_000, "log_every": 1, "checkpoint_every": 4}}


def one_mode(root: Path, standby: bool, args) -> dict:
    inventory_path = root / "inventory.yaml"
    inventory_path.write_text(yaml.safe_dump({"hosts": {"local": {"transport": "local", "workdir": str(root / "work")}}}))
    inventory = load_inventory(str(inventory_path))
    trainer = trainer_config(args)
    (root / "playbooks").mkdir()
    path = root / "playbooks" / "bench.yaml"
    path.write_text(yaml.safe_dump({"host": "local", "trainer": trainer, "poll_interval": args.interval,
                                   "restart": {"backoff_initial": 0, "jitter": 0, "standby": standby,
                                               "max_restarts": args.restarts + 1, "crash_loop_k": args.restarts + 1}}))
    store = Store(str(root / "runs.db"))
    run_id = launch_run(load_playbook(str(path), inventory=inventory), inventory, store, bundle=build_bundle()).run_id
    run = store.get_run(run_id)
    sup = Supervisor(store, inventory, interval=args.interval, playbooks_dir=str(root / "playbooks"))
    sup.attach(run_id)
    import threading

    stop = threading.Event()
    thread = threading.Thread(target=sup.run, args=(stop,), daemon=True)
    thread.start()
    imports = []
    try:
        for i in range(args.restarts):
            wait_for(lambda: store.get_run(run_id).state == "running" and status(run.run_dir).get("phase") == "training"
                     and (status(run.run_dir).get("step") or 0) % 4 >= 1, 600, "a trained step past a checkpoint")
            if standby:
                wait_for(lambda: Path(run.run_dir, contract.STANDBY_FILE).exists()
                         and json.loads(Path(run.run_dir, contract.STANDBY_FILE).read_text())["pid"] != status(run.run_dir)["pid"],
                         600, "the standby's imports")
                time.sleep(1.0)
            os.kill(status(run.run_dir)["pid"], signal.SIGKILL)
            wait_for(lambda: len(store.restarts(run_id)) > i and store.restarts(run_id)[i].time_to_first_step_s is not None,
                     600, f"restart {i + 1}'s first step")
            imports.append(wait_for(lambda: (status(run.run_dir).get("detail") or {}).get("startup_s"), 60,
                                    "the new process's start-up")["import"])
    finally:
        stop.set()
        thread.join(60)
        tmux = Tmux(inventory.get("local"), inventory, os.environ[SOCKET_ENV])
        tmux.kill(run.tmux_session)
        tmux.kill(standby_session(run.tmux_session))
    rows = store.restarts(run_id)[:args.restarts]
    return {"standby": standby, "downtime_s": [round(r.downtime_s, 2) for r in rows],
            "time_to_first_step_s": [round(r.time_to_first_step_s, 2) for r in rows],
            "import_s": imports}


def main() -> None:
    args = arguments(__doc__).parse_args()
    os.environ.setdefault(SOCKET_ENV, f"bench-standby-{os.getpid()}")
    results = []
    for standby in (True, False):
        with tempfile.TemporaryDirectory(prefix="bench-standby-") as root:
            results.append(one_mode(Path(root), standby, args))
    if args.json:
        print(json.dumps(results))
        return
    print(f"{'mode':<10} {'downtime_s (median)':>20} {'issued->first step':>20} {'import in new process':>22}  each")
    for r in results:
        print(f"{'standby' if r['standby'] else 'cold':<10} {statistics.median(r['downtime_s']):>20.2f} "
              f"{statistics.median(r['time_to_first_step_s']):>20.2f} {statistics.median(r['import_s']):>22.2f}  "
              f"{r['downtime_s']}")


if __name__ == "__main__":
    main()
