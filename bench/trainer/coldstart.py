"""The threaded cold start on one GPU: 1 target thread and 3 drafter threads sharing
GPU 0, each start with a FRESH compile cache, then one start on the warm cache. The
2-layer drafter has a full and a sliding-window layer, so flex_attention is compiled
for both mask variants, forward and backward.

    python -m bench.trainer.coldstart                     # 3 cold starts + 1 warm, 50 steps each
    python -m bench.trainer.coldstart --unsafe --timeout 180
        # the same with the compile discipline switched off (compile.unsafe_parallel_warmup):
        # on a cold cache the drafter threads compile flex_attention forward+backward at once;
        # a start that reaches no training step before --timeout is reported as a hang, with
        # every thread's stack (SIGUSR1 -> faulthandler) from the trainer log.
    python -m bench.trainer.coldstart --preset qwen3-0.6b --layer-types sliding,full,sliding \
        --block 8 --buckets 512,1024 --cold 5 --warm 0 --steps 6
        # the drill's reference shapes: a qwen3-0.6b target, 3 drafter layers, two buckets

Prints one JSON line per start (time to first step, steps, dynamo counters, attention
path) and a summary line: starts, finished, failed (the trainer exited with an error),
hangs (no step before --timeout) and stopped_at_limit (steps, but still running at
--timeout). Exit 0 when every start behaved as expected (safe mode:
all finished; --unsafe: reported, whatever happened).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from bench.common import add_share_argument, apply_share, cold_then_warm, finish, run_once, write_shard


def config(args) -> dict:
    return apply_share({
        "model": {"preset": args.preset, "drafter_layers": len(args.layer_types), "block_size": args.block,
                  "layer_types": args.layer_types, "sliding_window": args.window},
        "data": {"buckets": args.buckets, "max_anchors": args.anchors, "batch_size": 2},
        "train": {"steps": args.steps, "log_every": 1, "checkpoint_every": 0},
        "placement": {"device": "cuda", "target": [0], "drafter": [0, 0, 0], "queue_depth": 4},
        "compile": {"enabled": "on", "unsafe_parallel_warmup": bool(args.unsafe),
                    **({"mask_builder": args.mask_builder} if args.mask_builder else {}),
                    **({"warmup_processes": args.warmup_processes} if args.warmup_processes is not None else {})},
    }, args)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small", help="target preset (default small)")
    p.add_argument("--buckets", type=lambda v: [int(b) for b in v.split(",")], default=[1024],
                   help="sequence buckets, a comma list (default 1024; each is its own compiled shape)")
    p.add_argument("--block", type=int, default=16, help="the drafter's block size (default 16)")
    p.add_argument("--anchors", type=int, default=64)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--layer-types", type=lambda v: v.split(","), default=["full", "sliding"],
                   help="drafter layers, comma list of full/sliding (default full,sliding: both mask variants)")
    p.add_argument("--mask-builder", choices=["direct", "compiled", "eager"],
                   help="how BlockMasks are built (default: the trainer's default)")
    p.add_argument("--window", type=int, default=512, help="sliding window (default 512)")
    p.add_argument("--cold", type=int, default=3, help="starts with a fresh compile cache (default 3)")
    p.add_argument("--warm", type=int, default=1, help="starts on the last cold start's cache (default 1)")
    add_share_argument(p)
    p.add_argument("--warmup-processes", type=int,
                   help="compile.warmup_processes: warm-up helpers on a cold cache (default: the trainer's, one per 8 CPUs)")
    p.add_argument("--unsafe", action="store_true", help="switch the compile discipline off (debug flag)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per start before it counts as a hang")
    p.add_argument("--work-dir", help="keep run directories and logs here")
    args = p.parse_args(argv)

    cfg = config(args)
    work = args.work_dir or tempfile.mkdtemp(prefix="bench-coldstart-")
    cfg["data"]["shards"] = write_shard(os.path.join(work, "shards"), cfg, samples=64,
                                        spread=len(args.buckets) > 1)  # each bucket gets batches
    print(json.dumps({"bench": "coldstart", "unsafe": args.unsafe, "config": cfg}), flush=True)
    results = []
    for kind, i, cache in cold_then_warm(work, args.cold, args.warm):
        r = run_once(f"{kind}{i}", cfg, work, cache, args.timeout)
        r["kind"] = kind
        r["hang"] = r["exit_code"] == "timeout" and not r["steps"]
        if r.get("dynamo") is None:
            r.pop("dynamo", None)
        results.append(r)
        print(json.dumps(r), flush=True)
    finished = [r for r in results if r["exit_code"] == 0 and r["steps"] >= 1]
    summary = {
        "summary": True,
        "unsafe": args.unsafe,
        "starts": len(results),
        "finished": len(finished),
        "failed": sum(r["exit_code"] not in (0, "timeout") for r in results),  # the trainer exited with an error
        "hangs": sum(r["hang"] for r in results),
        # trained, but still running at --timeout: slow, not hung
        "stopped_at_limit": sum(r["exit_code"] == "timeout" and not r["hang"] for r in results),
        "first_step_s": {r["run"]: r["start_to_first_step_s"] for r in results},
    }
    return finish(summary, work, keep=bool(args.work_dir), ok=args.unsafe or len(finished) == len(results))


if __name__ == "__main__":
    sys.exit(main())
