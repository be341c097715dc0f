"""Regeneration throughput, and eval's speed-up on a drafter whose data its target wrote.

    python -m bench.trainer.regenerate --device cuda --preset qwen3-0.6b                  # part 1: tokens/s
    python -m bench.trainer.regenerate --device cuda --preset qwen3-0.6b --e2e --steps 2000
    python -m bench.trainer.regenerate                                                     # CPU, tiny preset

Part 1 (always): the target of ``--preset`` (random, seeded weights: no download)
writes ``--new-tokens`` tokens for each of ``--prompts`` random prompts of
``--prompt-len`` tokens with trainer/data/regenerate.py's batched decoding, once per
batch size of ``--batch-sizes``: new tokens per second (the first batch, which pays
for lazy initialisation, is not timed), and peak GPU memory.

Part 2 (``--e2e``): the real recipe end to end, in a temporary run directory:
``data.regenerate`` (the synthetic task's prompts, the target writes the
responses), ``--steps`` of training with ``data.holdout``, then ``python -m trainer
eval`` on the held-out prompts: measured tau, τ est (accept_len + 1), the speed-up
over greedy decoding and whether the output equals greedy decoding. A random
target's own text may be hard to learn; ``--preset tiny-cycle`` is the demo's
target, whose text a small drafter learns in seconds.

Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

import torch

from trainer.config import ModelConfig
from trainer.data.regenerate import decode_batch
from trainer.target import build_target, default_dtype


def throughput(args) -> None:
    cfg = ModelConfig(preset=args.preset, dtype=args.dtype)
    target = build_target(cfg, args.device, default_dtype(cfg, args.device))
    rng = random.Random(0)
    prompts = [[rng.randrange(1, target.vocab_size - 1) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        decode_batch(target.model, prompts[:batch], 8, 0.0, set(), target.device)  # warm-up, not timed
        if target.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        began, tokens = time.perf_counter(), 0
        timed = prompts[:batch * args.batches] if args.batches else prompts
        for b in range(0, len(timed), batch):
            tokens += sum(map(len, decode_batch(target.model, timed[b:b + batch], args.new_tokens, args.temperature,
                                                set(), target.device)))
        if target.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - began
        print(json.dumps({"part": "regenerate", "preset": args.preset, "device": str(target.device),
                          "dtype": str(target.dtype).replace("torch.", ""), "batch_size": batch,
                          "prompts": len(timed), "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                          "temperature": args.temperature, "seconds": round(seconds, 3),
                          "tok_s": round(tokens / seconds, 1),
                          "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
                          if target.device.type == "cuda" else None}), flush=True)


def end_to_end(args) -> None:
    from trainer import config as config_mod
    from trainer.eval import run_eval
    from trainer.train import run

    device = args.device
    raw = {
        "model": {"preset": args.preset, "drafter_layers": args.drafter_layers, "block_size": args.block_size},
        "data": {"buckets": [args.bucket], "batch_size": args.batch, "max_anchors": args.max_anchors,
                 "synthetic_samples": args.samples, "holdout": args.holdout,
                 "regenerate": {"max_new_tokens": args.new_tokens, "batch_size": max(map(int, args.batch_sizes.split(",")))}},
        "train": {"steps": args.steps, "log_every": max(1, args.steps // 20), "checkpoint_every": args.steps},
        "placement": {"device": "cuda" if device.startswith("cuda") else "cpu", "target": [0], "drafter": [0]},
    }
    with tempfile.TemporaryDirectory(prefix="bench-regenerate-") as root:
        began = time.perf_counter()
        code = run(config_mod.from_dict(raw), os.path.join(root, "run"), install_signals=False)
        trained = time.perf_counter() - began
        if code != 0:
            print(json.dumps({"part": "e2e", "error": f"training exited {code}"}))
            return
        with open(os.path.join(root, "run", "regenerated", "manifest.json")) as f:
            manifest = json.load(f)
        report = run_eval(os.path.join(root, "run"), prompts=args.eval_prompts, max_new_tokens=args.new_tokens,
                          device=device, reference=False)
    training = report.get("training") or {}
    print(json.dumps({"part": "e2e", "preset": args.preset, "device": report["device"], "dtype": report["dtype"],
                      "regenerated_samples": manifest["samples"], "regenerate_s": round(manifest["seconds"], 2),
                      "regenerate_tok_s": round(manifest["new_tokens_this_run"] / manifest["seconds"], 1),
                      "train_s_total": round(trained, 1), "steps": args.steps, "prompts": report["prompts"],
                      "data": report["data"], "tau": report["tau"], "tau_est": training.get("tau_estimate"),
                      "speedup": report["speed"]["speedup"], "speculative_tok_s": report["speed"]["speculative_tok_s"],
                      "greedy_tok_s": report["speed"]["greedy_tok_s"], "greedy_identical": report["greedy_identical"],
                      "accept_len_hist": report["accept_len_hist"]}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--preset", default="tiny", help="target preset (tiny, tiny-cycle, qwen3-0.6b, ...)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--batch-sizes", default="1,16,64", help="comma-separated")
    p.add_argument("--batches", type=int, default=0,
                   help="part 1: time at most this many batches per batch size (default: all the prompts)")
    p.add_argument("--threads", type=int, help="CPU intra-op threads")
    p.add_argument("--e2e", action="store_true", help="part 2: regenerate, train, eval on the held-out prompts")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--samples", type=int, default=512, help="e2e: prompts regenerated")
    p.add_argument("--holdout", type=int, default=32)
    p.add_argument("--eval-prompts", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--drafter-layers", type=int, default=2)
    p.add_argument("--bucket", type=int, default=512)
    p.add_argument("--batch", type=int, default=4, help="e2e: sequences per drafter step")
    p.add_argument("--max-anchors", type=int, default=64)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    throughput(args)
    if args.e2e:
        end_to_end(args)


if __name__ == "__main__":
    main()
