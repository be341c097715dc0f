"""flex_attention forward and backward on the DFlash mask at the drafter's shape, with
torch's default kernel configuration against other ``kernel_options`` (tile sizes,
warps, pipeline stages), against inductor's autotuning (``max-autotune``) and against
flash-attention 4's CuTe kernels (``flash``: ``BACKEND="FLASH"``, where the flash-attn-4
package is installed).

    python -m bench.trainer.flex --device cuda                  # reference size: B=16, 2048 context, 512 anchors
    python -m bench.trainer.flex --device cuda --variants default,bwd-64-128
    python -m bench.trainer.flex --device cuda --variants default --window 512 --semantics bidirectional   # a sliding layer

Prints one JSON line per variant: forward and forward+backward milliseconds
(``triton.testing.do_bench`` median; the compile, and any autotuning, is not timed)
and the largest difference of the output and the three gradients from the default
variant's. A variant that does not compile (a tile too large for shared memory) says
so and the others go on.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback

import torch

from bench.common import reference_anchors
from trainer.masks import build_block_mask

VARIANTS = {
    "default": ({}, "default"),
    "bwd-64-128-s3": ({"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
                       "bwd_num_warps": 8, "bwd_num_stages": 3}, "default"),
    "bwd-64-128-s2": ({"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
                       "bwd_num_warps": 8, "bwd_num_stages": 2}, "default"),
    "bwd-32-128": ({"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 32,
                    "bwd_num_warps": 4, "bwd_num_stages": 3}, "default"),
    "bwd-64-64": ({"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                   "bwd_num_warps": 4, "bwd_num_stages": 3}, "default"),
    "fwd-128-64": ({"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 8, "fwd_num_stages": 3}, "default"),
    "autotune": ({}, "max-autotune-no-cudagraphs"),
    # flash-attention 4's CuTe kernels through inductor (needs the flash-attn-4 package)
    "flash": ({"BACKEND": "FLASH"}, "default"),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--window", type=int, help="a sliding layer's mask of this window (default: a full layer's)")
    p.add_argument("--semantics", default="causal_in_block", help="the sliding layer's semantics (trainer/masks.py)")
    args = p.parse_args(argv)

    from torch.nn.attention.flex_attention import flex_attention
    from triton.testing import do_bench

    device = torch.device(args.device)
    anchors, valid = reference_anchors(args.batch, args.ctx, args.anchors, args.block_size, device)
    mask = build_block_mask(anchors, valid, args.ctx, args.block_size, args.window, args.semantics, builder="direct")
    q_len, kv_len = mask.seq_lengths
    q = torch.randn(args.batch, args.heads, q_len, args.head_dim, device=device, dtype=torch.bfloat16)
    k = torch.randn(args.batch, args.kv_heads, kv_len, args.head_dim, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    grad_out = torch.randn_like(q)
    reference = None
    for name in args.variants.split(","):
        options, mode = VARIANTS[name]
        torch._dynamo.reset()
        fn = torch.compile(flex_attention, dynamic=False, mode=None if mode == "default" else mode)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]

        def forward():
            return fn(*leaves, block_mask=mask, enable_gqa=True, kernel_options=options or None)

        def step():
            out = forward()
            out.backward(grad_out)
            return out

        row = {"variant": name, "options": options, "mode": mode, "q_len": q_len, "kv_len": kv_len,
               "window": args.window, "semantics": args.semantics if args.window else None}
        try:
            out = step()
            got = [out.detach()] + [t.grad.detach().clone() for t in leaves]
            with torch.no_grad():
                row["fwd_ms"] = round(do_bench(forward), 3)
            row["fwd_bwd_ms"] = round(do_bench(step, grad_to_none=leaves), 3)
            row["bwd_ms"] = round(row["fwd_bwd_ms"] - row["fwd_ms"], 3)
            reference = reference or got
            row["max_diff"] = [float((a.float() - b.float()).abs().max()) for a, b in zip(got, reference)]
        except Exception as e:  # noqa: BLE001 - a tile that does not fit: report it, try the next
            row["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
            traceback.print_exc()
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
