"""Restart downtime with and without the standby trainer: the whole path, on this machine.

    python -m bench.controller.standby                 # CPU, tiny trainer, 3 restarts each way
    python -m bench.controller.standby --device cuda --preset small --restarts 3

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

from pathlib import Path

from bench.common import (both_modes, crash_after_checkpoint, end_sessions, launch, local_inventory,
                          print_modes, restart_arguments, restart_trainer, run_status, supervising, wait_for)
from dflashctl.supervise.supervisor import Supervisor


def one_mode(root: Path, standby: bool, args) -> dict:
    inventory = local_inventory(root / "inventory.yaml", {"local": root / "work"})
    store, run, playbooks = launch(root, inventory, {
        "host": "local", "trainer": restart_trainer(args), "poll_interval": args.interval,
        "restart": {"backoff_initial": 0, "jitter": 0, "standby": standby,
                    "max_restarts": args.restarts + 1, "crash_loop_k": args.restarts + 1}})
    sup = Supervisor(store, inventory, interval=args.interval, playbooks_dir=playbooks)
    sup.attach(run.id)
    imports = []
    try:
        with supervising(sup):
            for i in range(args.restarts):
                crash_after_checkpoint(store, run.id, run.run_dir, i, standby)
                imports.append(wait_for(lambda: (run_status(run.run_dir).get("detail") or {}).get("startup_s"), 60,
                                        "the new process's start-up")["import"])
    finally:
        end_sessions(inventory, "local", run)
    rows = store.restarts(run.id)[:args.restarts]
    return {"standby": standby, "downtime_s": [round(r.downtime_s, 2) for r in rows],
            "time_to_first_step_s": [round(r.time_to_first_step_s, 2) for r in rows],
            "import_s": imports}


def main() -> None:
    args = restart_arguments(__doc__).parse_args()
    results = both_modes(one_mode, args, "standby")
    if results is None:
        return
    print_modes(results, [("downtime_s (median)", "downtime_s", 20), ("issued->first step", "time_to_first_step_s", 20),
                          ("import in new process", "import_s", 22)], each="downtime_s")


if __name__ == "__main__":
    main()
