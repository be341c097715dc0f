"""The supervisor's memory when a run host floods every kind of answer.

    .venv/bin/python -m bench.controller.flood [--rounds 6] [--flood-mib 1536]

Two child processes, each a supervisor (``Supervisor``, observing: act=False,
claim=False) watching one run on a local host, doing the same rounds; each round is
one supervisor tick (the probe) and every other read of a host the controller does:
`logs -n 50`, the metrics tail (`advise`), the evaluation report (`eval`), `check`'s
facts, the compile-cache look and a copy-back transfer into the store's receiver.

    idle    the host answers as a healthy one does
    flood   half the rounds, the run's files are huge (sparse: a 1.5 GB trainer.log
            line, metrics.jsonl, eval.json, status.json); the other half, the host's
            container wrapper answers every command with 1.5 GB, on stdout and on
            stderr in turn, before running it

Prints each child's peak RSS (VmHWM) and the flood's against the idle one (target:
at most 1.5x), and what each read of the flood ended with.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO, cpu_model, print_markdown, vm_hwm_kib

EVAL_ATTEMPT = "20270101-000000-abcdef"  # an eval attempt's id (its files are named by it)
EVAL_REPORT = f"eval-{EVAL_ATTEMPT}.json"
TARGET_RATIO = 1.5


def _flood_wrapper(directory: Path, size: int) -> str:
    """A container wrapper that answers with ``size`` bytes first: on stdout, then on
    stderr at the next call, and so on; then runs the command."""
    counter = directory / "calls"
    script = directory / "flood-wrapper"
    script.write_text(f"""#!/bin/sh
n=$(cat {counter} 2>/dev/null || echo 0); echo $((n + 1)) > {counter}
if [ $((n % 2)) -eq 0 ]; then head -c {size} /dev/zero; else head -c {size} /dev/zero >&2; fi
exec "$@"
""")
    script.chmod(0o755)
    return str(script)


def _run_files(run_dir: Path, huge: int) -> None:
    """The run's files: a healthy run's, or (``huge`` > 0) each a sparse line that long."""
    from dflashctl.core import contract

    run_dir.mkdir(parents=True, exist_ok=True)
    for name in (contract.LOG_FILE, contract.METRICS_FILE, EVAL_REPORT, contract.STATUS_FILE):
        with open(run_dir / name, "wb") as f:
            f.truncate(0)
            if huge:
                f.truncate(huge)
    if huge:
        return
    now = time.time()
    (run_dir / contract.METRICS_FILE).write_text("".join(
        contract.Metrics(time=now - 50 + i, step=i, total_steps=1000, tok_s=1000.0).to_line() + "\n"
        for i in range(1, 51)))
    (run_dir / contract.LOG_FILE).write_text("".join(f"step {i} loss 1.0\n" for i in range(1, 201)))
    (run_dir / EVAL_REPORT).write_text(json.dumps({"prompts": 2, "tau": 3.0, "per_prompt": [{"tau": 3.0}] * 2}))


def _reads(sup, store, inventory, run, work: Path) -> dict[str, str]:
    """One round: a supervisor tick, then every other read of the host. What each ended with."""
    from dflashctl.core.errors import first_line
    from dflashctl.hosts.facts import gather_facts
    from dflashctl.hosts.transport import connect
    from dflashctl.hosts.transport.limits import COPY_BACK
    from dflashctl.runs import compile_cache, evaluate, logs
    from trainer import compile_cache as trainer_cache

    transport = connect("h1", inventory)
    said: dict[str, str] = {}
    report = sup.tick()
    said["probe"] = str(report.hosts.get("h1"))[:120]

    def attempt(name, fn):
        try:
            value = fn()
            said[name] = f"ok ({len(value) if hasattr(value, '__len__') else value!r:.60})"
        except Exception as e:  # noqa: BLE001 - what each read ended with is the figure
            said[name] = first_line(e)[:160]

    attempt("logs -n 50", lambda: "".join(logs.logs(run.id, store, inventory, n=50)))
    attempt("metrics tail", lambda: logs.metrics_tail(run.id, store, inventory, n=50))
    attempt("eval report", lambda: evaluate._read_eval(transport, run, EVAL_ATTEMPT))
    attempt("check facts", lambda: gather_facts(transport, timeout=60).hostname)
    attempt("cache look", lambda: compile_cache.look(transport, run.run_dir).manifest)
    data = os.urandom(1 << 20)
    fields = {name: "bench" for name in trainer_cache.FIELDS}
    key = trainer_cache.key_of(fields)
    manifest = {"key": key, "fields": fields, "file": f"{key}.bin", "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest()}
    artifact = work / "artifact.bin"
    artifact.write_bytes(data)
    cache = compile_cache.LocalCache(str(work / "cache"))
    receiver = cache.receiver(manifest, {"domain": cache.domain_of(transport).id})

    def copy_back():
        try:
            transport.run(["cat", str(artifact)], timeout=60, stdout_sink=receiver.write, limit=COPY_BACK)
            return receiver.commit().bytes
        finally:
            receiver.abort()

    attempt("copy-back", copy_back)
    return said


def child(mode: str, rounds: int, flood: int) -> dict:
    from dflashctl.config import Host, Inventory
    from dflashctl.store import Store
    from dflashctl.supervise.supervisor import Supervisor

    work = Path(tempfile.mkdtemp(prefix=f"bench-flood-{mode}-"))
    os.environ["DFLASHCTL_HOME"] = str(work / "home")
    run_dir = work / "run"
    _run_files(run_dir, 0)
    store = Store(str(work / "runs.db"))
    run = store.create_run("bench", "h1", {}, time.time(), run_id="bench-flood", run_dir=str(run_dir),
                           tmux_session="bench-flood-none")
    wrapper = _flood_wrapper(work, flood)
    outcomes, idle_after_first = [], None
    for i in range(rounds):
        # Each half of the rounds against its own host (inventory), as two supervisors would see it.
        files_half = i < rounds // 2
        if mode == "flood" and files_half:
            _run_files(run_dir, flood)
        elif mode == "flood":
            _run_files(run_dir, 0)
        host = Host(name="h1", transport="local",
                    wrapper=[wrapper] if mode == "flood" and not files_half else [])
        inventory = Inventory(hosts={"h1": host}, source=f"bench-{mode}")
        sup = Supervisor(store, inventory, act=False, claim=False, interval=1.0, probe_timeout=60)
        sup.attach(run.id)
        outcomes.append(_reads(sup, store, inventory, store.get_run(run.id), work))
        if i == 0:
            idle_after_first = vm_hwm_kib()
    return {"mode": mode, "hwm_kib": vm_hwm_kib(), "after_first_kib": idle_after_first, "outcomes": outcomes}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--flood-mib", type=int, default=1536)
    p.add_argument("--child", choices=["idle", "flood"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.rounds, args.flood_mib << 20)))
        return 0
    results = {}
    for mode in ("idle", "flood"):
        t0 = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "bench.controller.flood", "--child", mode, "--rounds",
                               str(args.rounds), "--flood-mib", str(args.flood_mib)], cwd=REPO, capture_output=True,
                              text=True, timeout=1800)
        if done.returncode:
            raise SystemExit(f"the {mode} child failed:\n{done.stderr[-3000:]}")
        results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        results[mode]["seconds"] = time.monotonic() - t0
    idle, flood = results["idle"]["hwm_kib"], results["flood"]["hwm_kib"]
    ratio = flood / idle
    print(f"{platform.node()}: {cpu_model()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    print("what each read of the flood ended with (a round of huge files, then a round of the flooding wrapper):")
    half = args.rounds // 2
    for which, outcome in (("files", results["flood"]["outcomes"][0]), ("wrapper", results["flood"]["outcomes"][half]),
                           ("wrapper", results["flood"]["outcomes"][half + 1])):
        for name, text in outcome.items():
            print(f"  {which:<8} {name:<13} {text}")
    print_markdown([
        ("supervisor peak RSS, healthy host (idle)", f"{idle / 1024:.0f} MiB"),
        (f"supervisor peak RSS, host flooding every answer ({args.flood_mib} MiB each)", f"{flood / 1024:.0f} MiB"),
        ("flood / idle", f"{ratio:.2f}x (target <= {TARGET_RATIO}x)"),
        ("rounds per child, seconds (idle, flood)",
         f"{args.rounds}: {results['idle']['seconds']:.1f} s, {results['flood']['seconds']:.1f} s"),
    ], value_header="figure")
    return 0 if ratio <= TARGET_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
