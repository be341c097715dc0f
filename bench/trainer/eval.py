"""Speculative decoding speed: trainer.speculative's block drafting and verification
against plain greedy decoding of the same target, on the same hardware.

    python -m bench.trainer.eval                                  # CPU, tiny preset
    python -m bench.trainer.eval --device cuda --preset qwen3-0.6b --block-size 16 --drafter-layers 5

The target is a preset with random weights (no download). A random target's
continuation is something no drafter has learned, so besides the ``measured`` row
(the drafter of ``--checkpoint``, or an untrained one: acceptance near zero, the
cost of drafting without its benefit) the bench forces the acceptance: for each K
of ``--accept``, the drafter still runs its full forward (its cost is timed), then
its proposal is replaced by the target's own greedy continuation for slots 1..K and
a wrong token at slot K + 1, so every step accepts K tokens (tau = K + 1) unless
the block verification and one-token greedy disagree on a near tie (bf16): the
achieved tau is printed beside each row.

Prints a table (and one JSON line with --json): tokens/s of greedy and of each
speculative row, the speed-up, the achieved tau, target forwards per token, and
how many prompts' outputs equal greedy decoding's. A row's speed-up is what an
engine could reach at that tau with this drafter's cost, before batching.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

import torch

from trainer import speculative
from trainer.config import ModelConfig
from trainer.model import Drafter
from trainer.target import build_target


@contextlib.contextmanager
def forced_acceptance(continuations: dict, accept: int, vocab: int):
    """DraftState.logits runs as usual, then its argmax is set to the known greedy
    continuation for slots 1..accept and to a wrong token after (bench instrument:
    the acceptance is chosen, the drafter's cost stays real)."""
    real = speculative.DraftState.logits

    def logits(self, block_ids, anchor):
        out = real(self, block_ids, anchor)
        prompt_len, tokens = continuations[id(self.drafter)]
        forced = torch.full_like(out, -1e4)
        for k in range(1, out.shape[0]):
            i = anchor + k - prompt_len
            right = tokens[i] if 0 <= i < len(tokens) else 0
            forced[k, right if k <= accept else (right + 1) % vocab] = 0.0
        return forced

    speculative.DraftState.logits = logits
    try:
        yield
    finally:
        speculative.DraftState.logits = real


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--preset", default="tiny", help="target preset with random weights (tiny, small, qwen3-0.6b, ...)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="auto: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--drafter-layers", type=int, default=2)
    p.add_argument("--checkpoint", help="a trained checkpoint for the measured row (its target replaces --preset)")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--accept", default="0,3,7", help="forced accepted tokens per step, comma-separated (each < block size)")
    p.add_argument("--threads", type=int, help="CPU intra-op threads")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(
        args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32)

    if args.checkpoint:
        from trainer import restore

        loaded = restore.load(args.checkpoint, str(device), dtype=dtype)
        target, drafter = loaded.target, loaded.drafter
    else:
        cfg = ModelConfig(preset=args.preset, block_size=args.block_size, drafter_layers=args.drafter_layers)
        target = build_target(cfg, device, dtype)
        torch.manual_seed(0)
        drafter = Drafter(cfg, target.config, target.embed_tokens, target.lm_head).to(device).eval().requires_grad_(False)
    drafter.to(dtype)
    block = drafter.block_size
    accepts = [int(k) for k in args.accept.split(",") if k.strip()] if args.accept else []
    if any(not 0 <= k < block for k in accepts):
        p.error(f"--accept: each value must be in 0..{block - 1}")

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, target.vocab_size - 1, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]

    # ---- warm-up (allocator, kernel selection), then plain greedy: the baseline and the known continuations
    speculative.speculative_generate(target, drafter, prompts[0], min(args.new_tokens, 2 * block))
    speculative.greedy_generate(target, prompts[0], min(args.new_tokens, 8))
    greedy = [speculative.greedy_generate(target, pr, args.new_tokens) for pr in prompts]
    greedy_s = sum(r.seconds for r in greedy)
    n_tokens = sum(len(r.tokens) for r in greedy)

    def row(name: str, runs: list) -> dict:
        seconds = sum(r.seconds for r in runs)
        steps = sum(len(r.accepted) for r in runs)
        return {
            "row": name,
            "tok_s": n_tokens / seconds,
            "speedup": greedy_s / seconds,
            "tau": sum(a + 1 for r in runs for a in r.accepted) / max(1, steps),
            "forwards_per_token": sum(r.target_forwards for r in runs) / n_tokens,
            "ms_per_step": 1000 * seconds / max(1, steps),
            "identical": sum(r.tokens == gr.tokens for r, gr in zip(runs, greedy)),
        }

    rows = [row("measured", [speculative.speculative_generate(target, drafter, pr, args.new_tokens) for pr in prompts])]
    for k in accepts:
        runs = []
        for pr, gr in zip(prompts, greedy):
            with forced_acceptance({id(drafter): (len(pr), gr.tokens)}, k, target.vocab_size):
                runs.append(speculative.speculative_generate(target, drafter, pr, args.new_tokens))
        rows.append(row(f"accept {k}", runs))

    result = {
        "device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "dtype": str(dtype).replace("torch.", ""), "target": args.checkpoint or args.preset, "block_size": block,
        "drafter_layers": len(drafter.layers), "prompts": len(prompts), "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "greedy_tok_s": n_tokens / greedy_s,
        "greedy_ms_per_token": 1000 * greedy_s / n_tokens, "rows": rows, "torch": torch.__version__,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['target']} on {result['gpu'] or result['device']} ({result['dtype']}), block {block}, "
          f"{result['drafter_layers']} drafter layers, {len(prompts)} prompts x {args.new_tokens} new tokens "
          f"after {args.prompt_len}")
    print(f"greedy: {result['greedy_tok_s']:.1f} tok/s ({result['greedy_ms_per_token']:.2f} ms per token)")
    print(f"{'row':<10} {'tau':>6} {'tok/s':>9} {'speed-up':>9} {'fwd/token':>10} {'ms/step':>8} {'=greedy':>8}")
    for r in rows:
        print(f"{r['row']:<10} {r['tau']:>6.2f} {r['tok_s']:>9.1f} {r['speedup']:>8.2f}x {r['forwards_per_token']:>10.3f} "
              f"{r['ms_per_step']:>8.2f} {r['identical']:>5}/{len(prompts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
