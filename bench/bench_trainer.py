"""Benchmark the bundled trainer on one GPU: tok/s, MFU, and start-to-first-step with a
cold and then a warm compile cache (or any sequence of start kinds, ``--runs``).

    python bench/bench_trainer.py                       # qwen3-0.6b-shaped target, H200-sized defaults
    python bench/bench_trainer.py --preset qwen3-1.7b --batch-size 8
    python bench/bench_trainer.py --config my.json      # any trainer config (placement, model, ...)
    python bench/bench_trainer.py --cpu-smoke           # tiny, on CPU: checks the bench itself works
    python bench/bench_trainer.py --runs cold,warm,artifact,resume

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
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = {"tiny": 512, "small": 4096}  # presets with a small vocabulary; the qwen3-* presets have 151936


def queue_depth(run_dir: str) -> int:
    """How many batches the target may run ahead of the drafters (the run's placement.queue_depth)."""
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            return int(json.load(f)["placement"]["queue_depth"])
    except (OSError, ValueError, KeyError, TypeError):
        return 2


def reference_config(args) -> dict:
    if args.cpu_smoke:
        cfg = {
            "model": {"preset": "tiny", "drafter_layers": 2, "block_size": 8},
            "data": {"buckets": [256], "max_anchors": 16, "batch_size": 2},
            "placement": {"device": "cpu", "target": [0], "drafter": [0]},
        }
    elif args.config:
        with open(args.config) as f:
            cfg = json.load(f)
        cfg = cfg.get("trainer", cfg)
    else:
        cfg = {
            "model": {"preset": args.preset, "drafter_layers": args.drafter_layers, "block_size": 16},
            "data": {"buckets": [args.bucket], "max_anchors": args.anchors, "batch_size": args.batch_size},
            "placement": {"device": "cuda", "target": [0], "drafter": [0], "queue_depth": 2},
            "compile": {"enabled": "on"},
        }
        if args.layer_types:
            cfg["model"]["layer_types"] = args.layer_types.split(",")
    if args.mask_builder:
        cfg.setdefault("compile", {})["mask_builder"] = args.mask_builder
    cfg.setdefault("train", {})
    cfg["train"].update({"steps": args.steps or (6 if args.cpu_smoke else 20), "log_every": getattr(args, "log_every", 1),
                         "checkpoint_every": 0})
    if getattr(args, "residual", None):
        cfg.setdefault("model", {})["residual"] = args.residual
    if args.eager_layers:
        cfg.setdefault("compile", {})["drafter_layers"] = False
    if getattr(args, "target_compile", None):
        cfg.setdefault("compile", {})["target"] = args.target_compile == "on"
    if getattr(args, "flex_kernel", None):
        cfg.setdefault("compile", {})["flex_kernel"] = args.flex_kernel
    if args.loss_chunk:
        cfg["train"]["loss_chunk"] = args.loss_chunk
    if getattr(args, "loss_kernel", None):
        cfg["train"]["loss_kernel"] = args.loss_kernel
    for role in ("target", "drafter"):
        if getattr(args, f"{role}_gpus", None):
            cfg.setdefault("placement", {})[role] = [int(g) for g in getattr(args, f"{role}_gpus").split(",")]
    if args.profile:
        cfg["train"].update({"profile_steps": args.profile, "profile_after": 5})
    return cfg


def write_shard(directory: str, cfg: dict, samples: int) -> str:
    """Full-length samples (prompt 64 tokens, the rest response) with random token ids."""
    seq_len = max(cfg["data"]["buckets"])
    vocab = VOCAB.get(cfg["model"].get("preset"), 151936) - 1  # the last id is the drafter's MASK
    rng = random.Random(0)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "bench.jsonl"), "w") as f:
        for _ in range(samples):
            ids = [rng.randrange(1, vocab) for _ in range(seq_len)]
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * 64 + [1] * (seq_len - 64)}) + "\n")
    return directory


def run_once(name: str, cfg: dict, work: str, cache_dir: str, timeout: float, *, run_dir: str | None = None,
             resume: bool = False, artifact_from: str | None = None) -> dict:
    """One trainer process. ``run_dir`` (default ``work/name``) is resumed when
    ``resume``; ``artifact_from`` names an earlier run directory whose compile_cache/
    is copied into this one before the start."""
    run_dir = run_dir or os.path.join(work, name)
    if artifact_from:
        shutil.rmtree(os.path.join(run_dir, "compile_cache"), ignore_errors=True)
        shutil.copytree(os.path.join(artifact_from, "compile_cache"), os.path.join(run_dir, "compile_cache"))
    cfg = json.loads(json.dumps(cfg))
    cfg.setdefault("compile", {})["cache_dir"] = cache_dir
    config_path = os.path.join(work, f"{name}.json")
    with open(config_path, "w") as f:
        json.dump(cfg, f)
    log_path = os.path.join(work, f"{name}.log")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    start = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "trainer", "--config", config_path, "--run-dir", run_dir,
                                 "--resume", "auto" if resume else "never"], cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT, env=env)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # every thread's stack into the log (faulthandler)
            time.sleep(3)
            proc.kill()
            code = "timeout"
    metrics = []
    if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            metrics = [json.loads(line) for line in f if line.strip()]
    metrics = [m for m in metrics if m["time"] >= start]  # a resumed run's directory holds the earlier lines too
    status = {}
    if os.path.exists(os.path.join(run_dir, "status.json")):
        with open(os.path.join(run_dir, "status.json")) as f:
            status = json.load(f)
    # After the first steps' allocator and cache effects, and before the last ones: the target
    # runs up to queue_depth batches ahead, so in a run's last steps it has finished and the
    # drafter has the GPU to itself (a 6-step run's steps 4-6 ran ~20 % faster than steady).
    every = max(1, int(cfg.get("train", {}).get("log_every", 1)))
    tail = -(-(max(queue_depth(run_dir), 1) + 1) // every)  # in metrics lines of ``every`` steps
    steady = metrics[len(metrics) // 2:len(metrics) - tail]
    throughput_steady = bool(steady)
    steady = steady or metrics[len(metrics) // 2:] or metrics

    def med(key):
        values = [m[key] for m in steady if m.get(key) is not None]
        return statistics.median(values) if values else None

    def med_each(key):  # per element of a list-valued field (one per drafter replica or queue)
        if not steady or not all(m.get(key) for m in steady):
            return None
        return [statistics.median(v) for v in zip(*(m[key] for m in steady))]

    result = {
        "run": name,
        "exit_code": code,
        "wall_s": round(time.time() - start, 1),
        "start_to_first_step_s": round(metrics[0]["time"] - start, 1) if metrics else None,
        "warmup_s": (metrics[-1].get("warmup_s") if metrics else None),
        "steps": len(metrics),
        "throughput_steady": throughput_steady,  # false: too few steps, the figures below include the tail
        "tok_s": med("tok_s"),
        "seq_tok_s": med("seq_tok_s"),
        "samples_s": med("samples_s"),
        "anchors_s": med("anchors_s"),
        "step_ms": med("step_ms"),
        "mfu": med("mfu"),
        "mfu_measured": med("mfu_measured"),
        "mfu_drafter": med("mfu_drafter"),
        "tflops": med("tflops"),
        "mfu_peak": metrics[-1].get("mfu_peak") if metrics else None,
        "loss": metrics[-1]["loss"] if metrics else None,
        # The last tenth of the run's metrics lines: what a training-quality comparison reads.
        "loss_last_tenth": _mean_of(metrics[-max(1, len(metrics) // 10):], "loss"),
        "acc_last_tenth": _mean_of(metrics[-max(1, len(metrics) // 10):], "acc"),
        "attention_path": metrics[-1].get("attention_path") if metrics else None,
        "dynamo": metrics[-1].get("dynamo") if metrics else None,
        "time_ms": metrics[-1].get("time_ms") if metrics else None,
        "gpu_mem": metrics[-1].get("gpu_mem") if metrics else None,
        "tok_s_per_drafter": med_each("tok_s_per_drafter"),
        "queue_depth": med_each("queue_depth"),
        "replica_checksums": metrics[-1].get("replica_checksums") if metrics else None,
        "first_step_ms": metrics[0].get("step_ms") if metrics else None,
        "recompiles": (metrics[-1].get("dynamo") or {}).get("recompiles") if metrics else None,
        "compile_cache": metrics[-1].get("compile_cache") if metrics else None,
        "compile_cache_detail": metrics[-1].get("compile_cache_detail") if metrics else None,
        "startup_s": metrics[-1].get("startup_s") if metrics else None,
        "last_step": metrics[-1]["step"] if metrics else None,
        "run_dir": run_dir,
        "status": status.get("phase"),
        "error": status.get("error"),
    }
    if code != 0:
        with open(log_path) as f:
            result["log_tail"] = f.read()[-(12000 if code == "timeout" else 2000):]
    return result


def _mean_of(lines: list[dict], key: str):
    values = [m[key] for m in lines if m.get(key) is not None]
    return round(statistics.fmean(values), 5) if values else None


def cold_then_warm(work: str, cold: int, warm: int, tag: str = ""):
    """(kind, i, cache dir) for ``cold`` starts, each in a fresh compile cache, then
    ``warm`` starts on the last cold start's cache."""
    cache = None
    for kind, i in [("cold", i) for i in range(cold)] + [("warm", i) for i in range(warm)]:
        if kind == "cold":
            cache = os.path.join(work, f"cache-{tag}{i}")
            shutil.rmtree(cache, ignore_errors=True)
        yield kind, i, cache


def add_shape_arguments(p: argparse.ArgumentParser) -> None:
    """The options that shape the trainer config (reference_config); shared with bench_multigpu."""
    p.add_argument("--config", help="trainer config JSON (or a dict with a 'trainer' key); overrides the reference shape")
    p.add_argument("--preset", default="qwen3-0.6b", help="target preset with random weights (default qwen3-0.6b)")
    p.add_argument("--drafter-layers", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step (default 16)")
    p.add_argument("--anchors", type=int, default=512, help="anchors per sequence (default 512)")
    p.add_argument("--bucket", type=int, default=2048, help="sequence length (default 2048)")
    p.add_argument("--layer-types", help="drafter layers as a comma list of full/sliding (default: all full)")
    p.add_argument("--mask-builder", choices=["direct", "compiled", "eager"],
                   help="how BlockMasks are built (default: the trainer's default)")
    p.add_argument("--eager-layers", action="store_true",
                   help="compile only flex_attention and the loss, not whole drafter layers (compile.drafter_layers: false)")
    p.add_argument("--loss-chunk", type=int, help="query positions per loss chunk (default: the trainer's)")
    p.add_argument("--target-gpus", metavar="LIST", help="GPU indices of the target threads, e.g. 0 or 0,1 "
                   "(default 0; the same list as --drafter-gpus shares those GPUs)")
    p.add_argument("--drafter-gpus", metavar="LIST", help="GPU indices of the drafter replicas (default 0)")
    p.add_argument("--loss-kernel", choices=["auto", "triton", "inductor"],
                   help="each compiled loss chunk's kernel (default: the trainer's, auto)")
    p.add_argument("--target-compile", choices=["on", "off"],
                   help="compile the target's decoder layers (compile.target; default: the trainer's default)")
    p.add_argument("--log-every", type=int, default=1,
                   help="steps per metrics line (default 1; the trainer's own default is 10): a line's "
                        "bookkeeping runs in the coordinator while the drafters launch their next step")
    p.add_argument("--residual", choices=["float32", "compute"],
                   help="the drafter's residual stream dtype (model.residual; default: the trainer's)")
    p.add_argument("--flex-kernel", choices=["auto", "default", "flash"],
                   help="flex_attention's kernel configuration (compile.flex_kernel; default: the trainer's, auto)")
    p.add_argument("--steps", type=int, help="steps per run (default 20; 6 with --cpu-smoke)")
    p.add_argument("--timeout", type=float, default=1500, help="seconds per run before it is killed")
    p.add_argument("--cpu-smoke", action="store_true", help="a tiny CPU run of the whole bench")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="profile N steps after 5 (train.profile_steps); prints each run's profile.txt")


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
    print(json.dumps(summary), flush=True)
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
