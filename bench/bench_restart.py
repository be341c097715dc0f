"""An operator's `dflashctl restart` of a running run, with its ready standby woken
after the stop against a cold restart (no standby): request -> first step.

    python bench/bench_restart.py                 # CPU, tiny trainer, 2 restarts each way
    python bench/bench_restart.py --device cuda --preset qwen3-8b --restarts 2

For each mode a run is launched on the local host (real tmux, the real trainer, a
real SQLite store) and supervised in this process until its standby is ready (or,
cold, the playbook's ``restart.standby: false``) and it has a checkpoint; then the
supervisor lets go and ``dflashctl.runs.runhost.restart`` does what the `restart`
command does: a graceful stop (the trainer checkpoints), then the new process.
Printed per mode: the seconds from the restart request to the new process's first
step (the stop's checkpoint included, the same in both modes), and the new
process's own import time (status.json's startup_s).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_standby import arguments, status, wait_for  # noqa: E402  (this directory is on sys.path)

from dflashctl.config import load_inventory, load_playbook  # noqa: E402
from dflashctl.core import contract  # noqa: E402
from dflashctl.hosts.bundle import build_bundle  # noqa: E402
from dflashctl.hosts.tmux import SOCKET_ENV, Tmux  # noqa: E402
from dflashctl.launch import launch_run  # noqa: E402
from dflashctl.runs.runhost import restart, standby_session  # noqa: E402
from dflashctl.store import Store  # noqa: E402
from dflashctl.supervise.supervisor import Supervisor  # noqa: E402


def _supervised_until(store, inventory, root: Path, run_id: str, ready, interval: float) -> None:
    sup = Supervisor(store, inventory, interval=interval, playbooks_dir=str(root / "playbooks"))
    sup.attach(run_id)
    stop = threading.Event()
    thread = threading.Thread(target=sup.run, args=(stop,), daemon=True)
    thread.start()
    try:
        wait_for(ready, 900, "a checkpoint (and, with a standby, its imports)")
    finally:
        stop.set()
        thread.join(60)


def one_mode(root: Path, standby: bool, args) -> dict:
    inventory_path = root / "inventory.yaml"
    inventory_path.write_text(yaml.safe_dump({"hosts": {"local": {"transport": "local", "workdir": str(root / "work")}}}))
    inventory = load_inventory(str(inventory_path))
    trainer = {"model": {"preset": args.preset, "drafter_layers": 2, "block_size": 8},
               "data": {"buckets": [args.bucket], "batch_size": 1, "max_anchors": 16},
               "placement": {"device": args.device, "target": [0], "drafter": [0]},
               "train": {"steps": 1_000_000, "log_every": 1, "checkpoint_every": 4}}
    (root / "playbooks").mkdir()
    path = root / "playbooks" / "bench.yaml"
    path.write_text(yaml.safe_dump({"host": "local", "trainer": trainer, "poll_interval": args.interval,
                                   "restart": {"standby": standby}}))
    store = Store(str(root / "runs.db"))
    run_id = launch_run(load_playbook(str(path), inventory=inventory), inventory, store, bundle=build_bundle()).run_id
    run = store.get_run(run_id)
    seconds, imports = [], []
    try:
        for _ in range(args.restarts):
            def ready():
                s = status(run.run_dir)
                trained = s.get("phase") == "training" and s.get("step")
                checkpoint = any(Path(run.run_dir, contract.CHECKPOINT_DIR).glob("step-*"))
                if not standby:
                    return trained and checkpoint
                try:
                    waiting = json.loads(Path(run.run_dir, contract.STANDBY_FILE).read_text())
                except (OSError, ValueError):
                    return False
                return trained and checkpoint and waiting["pid"] != s.get("pid")

            _supervised_until(store, inventory, root, run_id, ready, args.interval)
            before = status(run.run_dir).get("pid")
            t0 = time.time()
            restart(run_id, store, inventory)
            started = wait_for(lambda: (s := status(run.run_dir)).get("pid") != before
                               and (s.get("detail") or {}).get("startup_s") and s, 900, "the new process's first step")
            seconds.append(round(time.time() - t0, 2))
            imports.append(started["detail"]["startup_s"]["import"])
    finally:
        tmux = Tmux(inventory.get("local"), inventory, os.environ[SOCKET_ENV])
        tmux.kill(run.tmux_session)
        tmux.kill(standby_session(run.tmux_session))
    return {"standby": standby, "request_to_first_step_s": seconds, "import_s": imports}


def main() -> None:
    p = arguments(__doc__)
    p.set_defaults(restarts=2)
    args = p.parse_args()
    os.environ.setdefault(SOCKET_ENV, f"bench-restart-{os.getpid()}")
    results = []
    for standby in (True, False):
        with tempfile.TemporaryDirectory(prefix="bench-restart-") as root:
            results.append(one_mode(Path(root), standby, args))
    if args.json:
        print(json.dumps(results))
        return
    print(f"{'mode':<10} {'request->first step (median)':>30} {'import in new process':>22}  each")
    for r in results:
        print(f"{'standby' if r['standby'] else 'cold':<10} {statistics.median(r['request_to_first_step_s']):>30.2f} "
              f"{statistics.median(r['import_s']):>22.2f}  {r['request_to_first_step_s']}")


if __name__ == "__main__":
    main()
