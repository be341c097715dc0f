"""The threaded trainer soaked: one run for a fixed wall time, resumed after each failure.

A long run is days of steps; a race that shows once per few thousand steps is a crash
every few minutes at full speed, and a 50-step drill never sees it. This runs
``python -m trainer`` on one run directory until ``--minutes`` have passed: each time
the process ends before that, its first error line is recorded and it is started again
with ``--resume auto`` (from its last checkpoint). At the end it is stopped with SIGTERM.

    python -m bench.trainer.soak --preset small --drafters 2 --buckets 1024 --minutes 8
    python -m bench.trainer.soak --preset qwen3-0.6b --drafters 3 --buckets 512,1024 --minutes 8
    python -m bench.trainer.soak ... --repo /path/to/other/checkout   # another version of the trainer

Prints a JSON line per process (steps it ran, how it ended, its first error line, the
recompiles it counted after the warm-up) and a summary: steps in all, failures, failures
per 10,000 steps by first error line, recompiles. Exit 0 when no process failed.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

from bench.common import REPO, add_share_argument, apply_share, write_shard

ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception|Exit|Hit|Interrupt))(?::\s?(.*))?$")


def config(args) -> dict:
    buckets = [int(b) for b in args.buckets.split(",")]
    return apply_share({
        "model": {"preset": args.preset, "drafter_layers": args.drafter_layers, "block_size": 16},
        "data": {"buckets": buckets, "batch_size": args.batch_size, "max_anchors": args.anchors},
        "train": {"steps": 100_000_000, "log_every": args.log_every, "checkpoint_every": args.checkpoint_every},
        "placement": {"device": args.device, "target": [0], "drafter": [0] * args.drafters, "queue_depth": 4},
        "compile": {"enabled": "on" if args.device == "cuda" else "off", "cache_dir": args.cache_dir},
    }, args)


def first_error(log_path: str) -> str | None:
    """The first exception line of the process's log (the error that ended it), if any."""
    try:
        with open(log_path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for i, line in enumerate(lines):
        if line.startswith("Traceback"):
            for later in lines[i + 1:]:
                if not later.startswith((" ", "\t")) and ERROR_LINE.match(later.strip()):
                    return later.strip()[:300]
    for line in lines:
        if "Detected recompile" in line or "FailOnRecompileLimitHit" in line:
            return line.strip()[:300]
    return None


def read_metrics(path: str, since: float) -> list[dict]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    m = json.loads(line)
                except ValueError:
                    continue
                if m.get("time", 0) >= since:
                    out.append(m)
    except OSError:
        pass
    return out


def one_process(i: int, args, cfg_path: str, run_dir: str, deadline: float) -> dict:
    log_path = os.path.join(args.work_dir, f"process-{i}.log")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = args.repo + os.pathsep + env.get("PYTHONPATH", "")
    start = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "trainer", "--config", cfg_path, "--run-dir", run_dir,
                                 "--resume", "auto"], cwd=args.repo, stdout=log, stderr=subprocess.STDOUT, env=env)
        stopped = False
        while proc.poll() is None:
            if time.monotonic() >= deadline and not stopped:
                proc.send_signal(signal.SIGTERM)  # the trainer checkpoints and ends
                stopped, stop_at = True, time.monotonic()
            if stopped and time.monotonic() - stop_at > 90:
                proc.kill()
            time.sleep(0.5)
    metrics = read_metrics(os.path.join(run_dir, "metrics.jsonl"), start)
    steps = [m["step"] for m in metrics if isinstance(m.get("step"), int)]
    recompiles = [(m.get("dynamo") or {}).get("recompiles") for m in metrics]
    recompiles = [r for r in recompiles if isinstance(r, int)]
    clean = stopped and proc.returncode in (0, 4)  # done, or stopped by the soak's SIGTERM (EXIT_STOPPED)
    return {"process": i, "exit_code": proc.returncode, "stopped_by_soak": stopped, "failed": not clean,
            "first_step": min(steps) if steps else None, "last_step": max(steps) if steps else None,
            "steps": (max(steps) - min(steps) + args.log_every) if steps else 0,
            "recompiles": max(recompiles) if recompiles else None,
            "first_error": None if clean else first_error(log_path),
            "wall_s": round(time.time() - start, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--drafters", type=int, default=2, help="drafter threads on GPU 0 (default 2)")
    p.add_argument("--drafter-layers", type=int, default=3)
    p.add_argument("--buckets", default="1024", help="comma list of length buckets (default 1024)")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--anchors", type=int, default=128)
    p.add_argument("--samples", type=int, default=256, help="samples in the synthetic shard (default 256)")
    p.add_argument("--minutes", type=float, default=8.0, help="wall time of the soak (default 8)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--checkpoint-every", type=int, default=1000)
    p.add_argument("--device", default="cuda")
    add_share_argument(p)
    p.add_argument("--repo", default=REPO, help="the checkout whose trainer runs (default this one)")
    p.add_argument("--work-dir", help="run directory, logs and compile cache (default a new temporary one)")
    p.add_argument("--max-processes", type=int, default=50, help="give up after this many starts (a crash loop)")
    args = p.parse_args(argv)
    args.repo = os.path.abspath(args.repo)
    args.work_dir = args.work_dir or tempfile.mkdtemp(prefix="bench-soak-")
    os.makedirs(args.work_dir, exist_ok=True)
    args.cache_dir = os.path.join(args.work_dir, "compile-cache")
    cfg = config(args)
    cfg["data"]["shards"] = write_shard(os.path.join(args.work_dir, "shards"), cfg, samples=args.samples, spread=True,
                                        name="soak.jsonl")
    cfg_path = os.path.join(args.work_dir, "config.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    run_dir = os.path.join(args.work_dir, "run")
    print(json.dumps({"bench": "soak", "repo": args.repo, "minutes": args.minutes, "config": cfg}), flush=True)
    deadline = time.monotonic() + args.minutes * 60
    results = []
    while time.monotonic() < deadline and len(results) < args.max_processes:
        r = one_process(len(results), args, cfg_path, run_dir, deadline)
        results.append(r)
        print(json.dumps(r), flush=True)
    failed = [r for r in results if r["failed"]]
    steps = sum(r["steps"] for r in results)
    by_error = collections.Counter((r["first_error"] or f"exit {r['exit_code']} (no error line)") for r in failed)
    summary = {"summary": True, "repo": args.repo, "preset": args.preset, "drafters": args.drafters,
               "buckets": cfg["data"]["buckets"], "processes": len(results), "steps": steps,
               "failures": len(failed),
               "failures_per_10k_steps": {e: round(n * 10_000 / max(steps, 1), 2) for e, n in by_error.items()},
               "recompiles": sum(r["recompiles"] or 0 for r in results),
               "minutes": args.minutes}
    print(json.dumps(summary), flush=True)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
