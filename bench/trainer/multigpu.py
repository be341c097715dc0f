"""Multi-GPU runs of the threaded trainer on one host: for each topology T+D (T
target GPUs, then D drafter GPUs), cold starts in fresh compile caches and a warm
start; throughput of the whole pipeline and per drafter GPU, queue depths, replica
checksums, and scaling per drafter GPU against the first topology.

    python -m bench.trainer.multigpu --topology 1+1 --topology 2+2      # 2 or 4 GPUs
    python -m bench.trainer.multigpu --topology 5+3 --cold 3 --steps 200  # the seed topology, 8 GPUs
    python -m bench.trainer.multigpu --cpu-smoke                        # the bench itself, on CPU

Reading the queues: a drafter queue that stays full means the drafters are the
bottleneck (add drafter GPUs); one that stays near empty while drafters wait means
the targets are (add target GPUs). Prints one JSON line per start and a summary;
exit 0 when every start finished with equal replica checksums.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from bench.common import add_shape_arguments, cold_then_warm, finish, reference_config, run_once, write_shard


def topology(text: str) -> tuple[int, int]:
    try:
        targets, drafters = (int(x) for x in text.split("+"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"topology {text!r}: expected T+D, e.g. 5+3") from None
    if targets < 1 or drafters < 1:
        raise argparse.ArgumentTypeError(f"topology {text!r}: needs at least one target and one drafter GPU")
    return targets, drafters


def placement(targets: int, drafters: int, cpu: bool) -> dict:
    if cpu:  # every role on the CPU: the bench's own logic, not a measurement
        return {"device": "cpu", "target": [0] * targets, "drafter": [0] * drafters}
    return {"device": "cuda", "target": list(range(targets)), "drafter": list(range(targets, targets + drafters)),
            "queue_depth": 2}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(p)
    p.add_argument("--topology", type=topology, action="append",
                   help="T+D target and drafter GPUs (repeatable; default 1+1 and 2+2)")
    p.add_argument("--cold", type=int, default=3, help="cold starts per topology (default 3)")
    p.add_argument("--warm", type=int, default=1, help="warm starts per topology (default 1)")
    p.add_argument("--work-dir", help="keep run directories and logs here")
    args = p.parse_args(argv)
    topologies = args.topology or [(1, 1), (2, 2)]
    if args.warm and not args.cold:
        p.error("--warm needs at least one --cold start: a warm start reuses the last cold start's cache")
    if args.cpu_smoke:
        args.cold, args.warm, args.steps = min(args.cold, 1), min(args.warm, 1), args.steps or 4

    work = args.work_dir or tempfile.mkdtemp(prefix="bench-multigpu-")
    results, ok = [], True
    for targets, drafters in topologies:
        cfg = reference_config(args)
        cfg["placement"] = placement(targets, drafters, args.cpu_smoke)
        name = f"{targets}+{drafters}"
        cfg["data"]["shards"] = write_shard(os.path.join(work, f"shards-{name}"), cfg,
                                            samples=max(32, 4 * cfg["data"].get("batch_size", 1) * drafters))
        print(json.dumps({"bench": "multigpu", "topology": name, "config": cfg}), flush=True)
        for kind, i, cache in cold_then_warm(work, args.cold, args.warm, tag=f"{name}-"):
            r = run_once(f"{name}-{kind}{i}", cfg, work, cache, args.timeout)
            sums = r.get("replica_checksums") or []
            r.update(topology=name, kind=kind, drafter_gpus=drafters,
                     replicas_identical=len(set(sums)) == 1 if drafters > 1 else None)
            ok &= r["exit_code"] == 0 and r["replicas_identical"] is not False
            results.append(r)
            print(json.dumps(r), flush=True)

    summary = {"summary": True, "ok": ok, "topologies": {}}
    base = None
    for name in dict.fromkeys(r["topology"] for r in results):
        runs = [r for r in results if r["topology"] == name and r["tok_s"]]
        if not runs:
            continue
        best = max(runs, key=lambda r: r["tok_s"])
        per_gpu = best["tok_s"] / best["drafter_gpus"]
        base = base or per_gpu
        summary["topologies"][name] = {
            "first_step_s": {r["run"]: r["start_to_first_step_s"] for r in results if r["topology"] == name},
            "tok_s": round(best["tok_s"]), "tok_s_per_drafter": best["tok_s_per_drafter"],
            "queue_depth": best["queue_depth"], "scaling_per_drafter_gpu": round(per_gpu / base, 3),
        }
    return finish(summary, work, keep=bool(args.work_dir), ok=ok)


if __name__ == "__main__":
    sys.exit(main())
