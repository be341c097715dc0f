"""Building one batch's DFlash BlockMask: the ``direct`` builder (tables computed from
the anchors) against torch's create_block_mask, eager and (optionally) compiled.

    python -m bench.trainer.masks                                   # CPU, B=2
    python -m bench.trainer.masks --device cuda --batch 16          # reference size on a GPU
    python -m bench.trainer.masks --device cuda --builders direct,eager,compiled --ctx 1024 --anchors 64
    python -m bench.trainer.masks --device cuda --builders direct --check-dense --attention   # both sliding semantics

Prints one JSON line per builder and layer type (sliding layers once per
``--semantics``): milliseconds per call (best of --repeat, after one untimed call,
which for ``compiled`` is the cold compile and is reported apart), peak memory on a
GPU, and whether its tables equal the first builder's (block counts and the sets of
listed tiles, partial and full). ``--check-dense`` also renders the dense boolean mask
and checks the tables against it tile by tile (``dense_agrees``: every listed-full
tile all visible, every partial one mixed, every unlisted one empty); ``--attention``
times compiled flex_attention forward and forward+backward on the mask (bf16, the
drafter's head shape) and gives its largest difference from SDPA on the dense mask.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from bench.common import reference_anchors, sync
from trainer.masks import SLIDING_SEMANTICS, TILE, build_block_mask, dense_mask


def tables(mask) -> list[list[list[frozenset]]]:
    """Per table (partial, full), per batch row and Q tile, the set of listed KV tiles."""
    out = []
    for num, idx in ((mask.kv_num_blocks, mask.kv_indices), (mask.full_kv_num_blocks, mask.full_kv_indices)):
        num, idx = num.cpu(), idx.cpu()
        out.append([[frozenset(idx[b, 0, q, :num[b, 0, q]].tolist()) for q in range(num.shape[2])]
                    for b in range(num.shape[0])])
    return out


def listed(num, idx, kv_tiles: int) -> torch.Tensor:
    """Dense [B, Qt, KVt] bool of a BlockMask table pair (num_blocks, indices)."""
    num, idx = num[:, 0], idx[:, 0].long()
    keep = (torch.arange(idx.shape[-1], device=idx.device) < num[..., None]).to(torch.int32)
    return torch.zeros(*idx.shape[:2], kv_tiles, dtype=torch.int32, device=idx.device).scatter_(-1, idx, keep).bool()


def dense_agrees(mask, dense) -> bool:
    """The BlockMask's tables are the dense mask's tiles: full where every pair is
    visible, partial where some are, unlisted where none."""
    batch, _, q_len, kv_len = dense.shape
    qt, kt = -(-q_len // TILE), -(-kv_len // TILE)
    padded = torch.zeros(batch, qt * TILE, kt * TILE, dtype=torch.bool, device=dense.device)
    padded[:, :q_len, :kv_len] = dense[:, 0]
    t = padded.view(batch, qt, TILE, kt, TILE).transpose(2, 3)
    any_t, all_t = t.any(-1).any(-1), t.all(-1).all(-1)
    full = listed(mask.full_kv_num_blocks, mask.full_kv_indices, kt)
    partial = listed(mask.kv_num_blocks, mask.kv_indices, kt)
    return bool(torch.equal(full, all_t) and torch.equal(partial, any_t & ~all_t))


def attention_figures(mask, dense, heads: int = 16, kv_heads: int = 8, head_dim: int = 128) -> dict:
    """Compiled flex_attention on ``mask``: forward and forward+backward ms, and the
    largest difference of its output from SDPA with the dense mask."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention
    from triton.testing import do_bench

    batch, _, q_len, kv_len = dense.shape
    device = dense.device
    q = torch.randn(batch, heads, q_len, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(batch, kv_heads, kv_len, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(batch, kv_heads, kv_len, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    fn = torch.compile(flex_attention, dynamic=False)
    out = fn(q, k, v, block_mask=mask, enable_gqa=True)
    with torch.no_grad():
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=dense, enable_gqa=True)
    grad = torch.randn_like(out)

    def step():
        fn(q, k, v, block_mask=mask, enable_gqa=True).backward(grad)

    with torch.no_grad():
        fwd = do_bench(lambda: fn(q, k, v, block_mask=mask, enable_gqa=True))
    both = do_bench(step, grad_to_none=[q, k, v])
    return {"fwd_ms": round(fwd, 3), "fwd_bwd_ms": round(both, 3),
            "max_diff_vs_sdpa": float((out.float() - torch.nan_to_num(ref)).abs().max())}


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
    p.add_argument("--semantics", default=",".join(SLIDING_SEMANTICS),
                   help=f"comma list of the sliding layers' semantics ({', '.join(SLIDING_SEMANTICS)})")
    p.add_argument("--check-dense", action="store_true",
                   help="check each mask's tables against the dense boolean mask (B x Q x KV bytes)")
    p.add_argument("--attention", action="store_true",
                   help="time compiled flex_attention on each mask and compare it with SDPA on the dense mask (GPU)")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    anchors, valid = reference_anchors(args.batch, args.ctx, args.anchors, args.block_size, device)
    layers = [("full", None, SLIDING_SEMANTICS[0])] + [("sliding", args.window, s) for s in args.semantics.split(",")]
    for layer, window, semantics in layers:
        reference = None
        dense = dense_mask(anchors, valid, args.ctx, args.block_size, window, semantics) \
            if args.check_dense or args.attention else None
        for name in args.builders.split(","):
            def build():
                return build_block_mask(anchors, valid, args.ctx, args.block_size, window, semantics, builder=name)
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
            row = {"builder": name, "layer": layer, "window": window, "batch": args.batch, "q_len": mask.seq_lengths[0],
                   "kv_len": mask.seq_lengths[1], "ms": round(best * 1e3, 2), "first_call_s": round(first_s, 2),
                   "full_tiles": sum(len(s) for b in got[1] for s in b), "same_as_first": got == reference}
            if layer == "sliding":
                row["semantics"] = semantics
            if device.type == "cuda":
                row["peak_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20)
            if dense is not None:
                row["dense_agrees"] = dense_agrees(mask, dense)
            if args.attention and name == args.builders.split(",")[0]:
                row.update(attention_figures(mask, dense))
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
