"""An operator's `dflashctl restart` of a running run, with its ready standby woken
after the stop against a cold restart (no standby): request -> first step.

    python -m bench.controller.restart                 # CPU, tiny trainer, 2 restarts each way
    python -m bench.controller.restart --device cuda --preset qwen3-8b --restarts 2

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
import time
from pathlib import Path

from bench.common import (both_modes, end_sessions, launch, local_inventory, print_modes, restart_arguments,
                          restart_trainer, run_status, supervising, wait_for)
from dflashctl.core import contract
from dflashctl.runs.runhost import restart
from dflashctl.supervise.supervisor import Supervisor


def one_mode(root: Path, standby: bool, args) -> dict:
    inventory = local_inventory(root / "inventory.yaml", {"local": root / "work"})
    store, run, playbooks = launch(root, inventory, {"host": "local", "trainer": restart_trainer(args),
                                                     "poll_interval": args.interval, "restart": {"standby": standby}})
    run_id = run.id
    seconds, imports = [], []
    try:
        for _ in range(args.restarts):
            def ready():
                s = run_status(run.run_dir)
                trained = s.get("phase") == "training" and s.get("step")
                checkpoint = any(Path(run.run_dir, contract.CHECKPOINT_DIR).glob("step-*"))
                if not standby:
                    return trained and checkpoint
                try:
                    waiting = json.loads(Path(run.run_dir, contract.STANDBY_FILE).read_text())
                except (OSError, ValueError):
                    return False
                return trained and checkpoint and waiting["pid"] != s.get("pid")

            sup = Supervisor(store, inventory, interval=args.interval, playbooks_dir=playbooks)
            sup.attach(run_id)
            with supervising(sup):
                wait_for(ready, 900, "a checkpoint (and, with a standby, its imports)")
            before = run_status(run.run_dir).get("pid")
            t0 = time.time()
            restart(run_id, store, inventory)
            started = wait_for(lambda: (s := run_status(run.run_dir)).get("pid") != before
                               and (s.get("detail") or {}).get("startup_s") and s, 900, "the new process's first step")
            seconds.append(round(time.time() - t0, 2))
            imports.append(started["detail"]["startup_s"]["import"])
    finally:
        end_sessions(inventory, "local", run)
    return {"standby": standby, "request_to_first_step_s": seconds, "import_s": imports}


def main() -> None:
    p = restart_arguments(__doc__)
    p.set_defaults(restarts=2)
    args = p.parse_args()
    results = both_modes(one_mode, args, "restart")
    if results is None:
        return
    print_modes(results, [("request->first step (median)", "request_to_first_step_s", 30),
                          ("import in new process", "import_s", 22)], each="request_to_first_step_s")


if __name__ == "__main__":
    main()
