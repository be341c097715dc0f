"""Benchmark the bundled trainer on one GPU: tok/s, MFU, and start-to-first-step with a
cold and then a warm compile cache (or any sequence of start kinds, ``--runs``).

    python -m bench.trainer.reference                       # qwen3-0.6b-shaped target, H200-sized defaults
    python -m bench.trainer.reference --preset qwen3-1.7b --batch-size 8
    python -m bench.trainer.reference --config my.json      # any trainer config (placement, model, ...)
    python -m bench.trainer.reference --cpu-smoke           # tiny, on CPU: checks the bench itself works
    python -m bench.trainer.reference --runs cold,warm,artifact,resume

Each run is a real ``python -m trainer`` process on full-length sequences written to a
shard file (every sequence fills the bucket, so every anchor slot is used). Kinds of
start (``--runs``, in order; default ``cold,warm``):

- ``cold``: a fresh compile cache directory (wiped first) and a new run directory;
- ``warm``: the same cache directory again, a new run directory;
- ``artifact``: a fresh, empty cache directory, and a new run directory holding the
  ``compile_cache/`` artifact the newest earlier run saved: a new host whose cache
  was wiped, given the artifact a controller holds;
- ``resume``: the previous run's directory and cache, resumed from its last
  checkpoint (``--resume auto``) for ``--steps`` more steps: a restart with
  everything warm.

Prints one JSON line per run (with the trainer's own start-up breakdown,
``startup_s``, and its ``compile_cache`` outcome) and a summary line; exit 0 when
every run finished.

Defaults (DFLASH.md reference recipe, shrunk to one GPU): target preset qwen3-0.6b
with random weights, 5-layer drafter, block 16, B=16 sequences of 2048 tokens, 512
anchors each, bf16 compute with fp32 master weights, compiled flex_attention.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

from bench.common import add_shape_arguments, finish, reference_config, run_once, write_shard


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(p)
    p.add_argument("--runs", default="cold,warm",
                   help="comma list of cold/warm/artifact/resume starts, in order (default cold,warm)")
    p.add_argument("--synthetic", action="store_true",
                   help="train on the trainer's synthetic task (a learnable cycle of tokens) instead of shards "
                        "of random tokens: for comparing how two settings learn, not for speed")
    p.add_argument("--cache-dir", help="compile cache to use (default: a fresh temporary directory)")
    p.add_argument("--work-dir", help="where run directories and logs go (default: a temporary directory, removed)")
    args = p.parse_args(argv)

    cfg = reference_config(args)
    work = args.work_dir or tempfile.mkdtemp(prefix="bench-trainer-")
    cache_dir = args.cache_dir or os.path.join(work, "compile-cache")
    batch = cfg["data"].get("batch_size", 1)
    os.makedirs(work, exist_ok=True)
    if not args.synthetic:
        cfg["data"]["shards"] = write_shard(os.path.join(work, "shards"), cfg, samples=max(32, 4 * batch))
    print(json.dumps({"bench": "trainer", "config": cfg, "work_dir": work, "cache_dir": cache_dir}), flush=True)
    results = []
    kinds = [k.strip() for k in args.runs.split(",") if k.strip()]
    unknown = sorted(set(kinds) - {"cold", "warm", "artifact", "resume"})
    if unknown:
        p.error(f"--runs: unknown kind(s) {unknown}; use cold, warm, artifact, resume")
    for i, kind in enumerate(kinds):
        run_cfg, cache, options = cfg, cache_dir, {}
        if kind == "cold" and os.path.isdir(cache_dir) and not args.cache_dir:
            shutil.rmtree(cache_dir)
        if kind == "artifact":
            saved = [r for r in results if os.path.exists(os.path.join(r["run_dir"], "compile_cache", "compile_cache.json"))]
            if not saved:
                p.error("--runs: an 'artifact' start needs an earlier run that saved compile_cache/")
            cache = os.path.join(work, f"compile-cache-artifact{i}")  # this host's cache: wiped
            shutil.rmtree(cache, ignore_errors=True)
            options["artifact_from"] = saved[-1]["run_dir"]
        if kind == "resume":
            if not results:
                p.error("--runs: a 'resume' start needs an earlier run")
            prev = results[-1]
            run_cfg = json.loads(json.dumps(cfg))
            run_cfg["train"]["steps"] = (prev["last_step"] or 0) + cfg["train"]["steps"]
            cache = prev["cache_dir"]
            options.update(run_dir=prev["run_dir"], resume=True)
        result = run_once(f"{i}-{kind}", run_cfg, work, cache, args.timeout, **options)
        result.update(kind=kind, cache_dir=cache)
        results.append(result)
        print(json.dumps(result), flush=True)
        table = os.path.join(result["run_dir"], "profile.txt")
        if os.path.exists(table) and kind != "resume":
            with open(table) as f:
                print(f.read(), flush=True)
    ok = all(r["exit_code"] == 0 for r in results)
    summary = {"summary": True, "ok": ok}
    for r in results:
        summary[r["run"]] = {k: r[k] for k in ("start_to_first_step_s", "warmup_s", "tok_s", "mfu", "mfu_drafter",
                                               "step_ms", "compile_cache", "recompiles", "startup_s")}
    return finish(summary, work, keep=bool(args.work_dir), ok=ok)


if __name__ == "__main__":
    sys.exit(main())
