"""Building one batch's DFlash BlockMask: the ``direct`` builder (tables computed from
the anchors) against torch's create_block_mask, eager and (optionally) compiled.

    python bench/bench_masks.py                                   # CPU, B=2
    python bench/bench_masks.py --device cuda --batch 16          # reference size on a GPU
    python bench/bench_masks.py --device cuda --builders direct,eager,compiled --ctx 1024 --anchors 64

Prints one JSON line per builder and layer type: milliseconds per call (best of
--repeat, after one untimed call, which for ``compiled`` is the cold compile and is
reported apart), peak memory on a GPU, and whether its tables equal the first
builder's (block counts and the sets of listed tiles, partial and full).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trainer.anchors import sample_anchors  # noqa: E402
from trainer.masks import build_block_mask  # noqa: E402


def tables(mask) -> list[list[list[frozenset]]]:
    """Per table (partial, full), per batch row and Q tile, the set of listed KV tiles."""
    out = []
    for num, idx in ((mask.kv_num_blocks, mask.kv_indices), (mask.full_kv_num_blocks, mask.full_kv_indices)):
        num, idx = num.cpu(), idx.cpu()
        out.append([[frozenset(idx[b, 0, q, :num[b, 0, q]].tolist()) for q in range(num.shape[2])]
                    for b in range(num.shape[0])])
    return out


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reference_anchors(batch: int, ctx: int, anchors: int, block_size: int, device: torch.device):
    """(anchors, valid) of a batch of full-length sequences (64 prompt tokens, the rest
    supervised), seeded: the masks every bench builds."""
    torch.manual_seed(0)
    loss_mask = torch.ones(batch, ctx, dtype=torch.bool, device=device)
    loss_mask[:, :64] = False
    return sample_anchors(loss_mask, anchors, block_size)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=2, help="sequences per batch (default 2)")
    p.add_argument("--ctx", type=int, default=2048, help="sequence length (default 2048)")
    p.add_argument("--anchors", type=int, default=512, help="anchors per sequence (default 512)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--window", type=int, default=512, help="sliding window of the sliding layer type")
    p.add_argument("--builders", default="direct,eager", help="comma list of direct/eager/compiled")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)

    device = torch.device(args.device)
    anchors, valid = reference_anchors(args.batch, args.ctx, args.anchors, args.block_size, device)
    for layer, window in (("full", None), ("sliding", args.window)):
        reference = None
        for name in args.builders.split(","):
            def build():
                return build_block_mask(anchors, valid, args.ctx, args.block_size, window, builder=name)
            t0 = time.perf_counter()
            mask = build()
            sync(device)
            first_s = time.perf_counter() - t0
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            best = float("inf")
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                mask = build()
                sync(device)
                best = min(best, time.perf_counter() - t0)
            got = tables(mask)
            reference = reference or got
            row = {"builder": name, "layer": layer, "batch": args.batch, "q_len": mask.seq_lengths[0],
                   "kv_len": mask.seq_lengths[1], "ms": round(best * 1e3, 2), "first_call_s": round(first_s, 2),
                   "full_tiles": sum(len(s) for b in got[1] for s in b), "same_as_first": got == reference}
            if device.type == "cuda":
                row["peak_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20)
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
