"""flash-attention 4's kernels behind flex_attention (``compile.flex_kernel: flash``, and
``auto`` where they run) checked against flex_attention's own Triton kernels, at the
drafter's attention shape, on the DFlash masks of a full and of a sliding layer.

    python -m bench.trainer.flash_check --device cuda                   # parity, then 10,000 launches
    python -m bench.trainer.flash_check --device cuda --launches 0      # parity only
    python -m bench.trainer.flash_check --device cuda --launches 100000 --batch 1

Both paths are the trainer's own (``trainer.attention.attend`` on the paths that
``select_attention_path`` gives for ``flash`` and for ``triton``).

1. Parity, per mask: the output and the three gradients of both paths against an fp32
   reference (the Triton kernels with torch's default tiles on fp32 copies of the same
   inputs), for an upstream gradient whose scale differs per token. One JSON line per
   mask: each tensor's largest absolute and relative (norm of the difference over the
   reference's norm) error on each path, the relative difference between the two, and
   ``pass``: flash-attention 4's relative error is at most ``--ratio`` times the Triton
   kernels' plus ``--slack``.
2. Canary: ``--launches`` forward and backward launches on fresh random inputs each,
   the full and the sliding mask in turn, each compared with the Triton kernels on the
   same inputs (every value finite; the relative difference of each tensor under
   ``--threshold``), counted on the GPU and read every ``--progress`` launches. Its
   JSON line: launches, non-finite launches, the largest relative difference per
   tensor, launches over the threshold, seconds.

Exit code 1 when a mask fails its parity, a canary launch fails, or flash-attention 4's
kernels cannot run here (the reason is printed).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch

from bench.common import reference_anchors, sync
from trainer.attention import FLEX_COMPILED, AttentionPath, attend, select_attention_path
from trainer.config import ConfigError
from trainer.masks import CAUSAL_IN_BLOCK, build_block_mask

TENSORS = ("out", "dq", "dk", "dv")


@dataclass(frozen=True)
class Shape:
    """The drafter's attention at the reference size (bench.trainer.flex's defaults)."""

    batch: int = 2
    ctx: int = 2048
    anchors: int = 512
    block_size: int = 16
    heads: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    window: int = 512  # the sliding layer's
    semantics: str = CAUSAL_IN_BLOCK
    dtype: torch.dtype = torch.bfloat16


def paths(device: torch.device) -> tuple[AttentionPath, AttentionPath]:
    """(flash-attention 4's path, the Triton kernels' path) as the trainer selects them;
    ConfigError saying why when flash-attention 4's kernels cannot run on ``device``."""
    # One compiled flex_attention serves three options x two masks here: room for them all
    # (a variant past the limit would run eagerly, which the selection makes an error).
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 16)
    flash = select_attention_path(device, "on", flex_kernel="flash")
    triton = select_attention_path(device, "on", flex_kernel="triton")
    return flash, triton


def masks(shape: Shape, device: torch.device) -> dict:
    """{'full': BlockMask, 'sliding': BlockMask} of the reference anchors."""
    anchors, valid = reference_anchors(shape.batch, shape.ctx, shape.anchors, shape.block_size, device)
    return {"full": build_block_mask(anchors, valid, shape.ctx, shape.block_size, None, shape.semantics),
            "sliding": build_block_mask(anchors, valid, shape.ctx, shape.block_size, shape.window, shape.semantics)}


def inputs(shape: Shape, mask, device: torch.device, dtype: Optional[torch.dtype] = None) -> tuple:
    """Fresh (q, k, v, upstream gradient) for ``mask``; the upstream gradient's scale
    differs per token (exp of a normal draw), as a loss's per-token weights do."""
    q_len, kv_len = mask.seq_lengths
    dtype = dtype or shape.dtype
    q = torch.randn(shape.batch, shape.heads, q_len, shape.head_dim, device=device, dtype=dtype)
    k = torch.randn(shape.batch, shape.kv_heads, kv_len, shape.head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    scale = torch.randn(shape.batch, 1, q_len, 1, device=device).exp()
    return q, k, v, (torch.randn_like(q, dtype=torch.float32) * scale).to(dtype)


def run(path: AttentionPath, q, k, v, grad_out, mask) -> list[torch.Tensor]:
    """[out, dq, dk, dv] of one forward and backward launch on ``path``."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = attend(*leaves, mask, path)
    grads = torch.autograd.grad(out, leaves, grad_out)
    return [out.detach(), *grads]


def _errors(got: list[torch.Tensor], ref: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(largest absolute, relative) error of each tensor, as GPU scalars (no sync)."""
    out = []
    for a, b in zip(got, ref):
        diff = a.float() - b.float()
        out.append((diff.abs().max(), diff.norm() / b.float().norm().clamp_min(torch.finfo(torch.float32).tiny)))
    return out


def parity(shape: Shape, device: torch.device, ratio: float = 2.0, slack: float = 1e-3, seed: int = 0) -> list[dict]:
    """One row per mask: both paths' errors against the fp32 reference, and ``pass``."""
    flash, triton = paths(device)
    reference = AttentionPath(FLEX_COMPILED, device.type)  # torch's default tiles: the fp32 path
    rows = []
    for name, mask in masks(shape, device).items():
        torch.manual_seed(seed)
        q, k, v, grad_out = inputs(shape, mask, device)
        ref = run(reference, q.float(), k.float(), v.float(), grad_out.float(), mask)
        got = {"flash": run(flash, q, k, v, grad_out, mask), "triton": run(triton, q, k, v, grad_out, mask)}
        errors = {p: _errors(g, ref) for p, g in got.items()}
        between = _errors(got["flash"], got["triton"])
        row = {"mask": name, "q_len": mask.seq_lengths[0], "kv_len": mask.seq_lengths[1],
               "window": shape.window if name == "sliding" else None, "errors": {}}
        ok = True
        for i, tensor in enumerate(TENSORS):
            (f_max, f_rel), (t_max, t_rel) = errors["flash"][i], errors["triton"][i]
            f_rel, t_rel = float(f_rel), float(t_rel)
            row["errors"][tensor] = {"flash_max": float(f_max), "flash_rel": f_rel, "triton_max": float(t_max),
                                     "triton_rel": t_rel, "flash_vs_triton_rel": float(between[i][1])}
            ok = ok and f_rel <= ratio * t_rel + slack  # a NaN fails too
        row["pass"] = ok
        rows.append(row)
    return rows


def canary(shape: Shape, device: torch.device, launches: int, threshold: float = 0.02, progress: int = 500) -> dict:
    """``launches`` launches on fresh inputs, full and sliding masks in turn, each compared
    with the Triton kernels; the counts are kept on the GPU and read every ``progress``."""
    flash, triton = paths(device)
    both = list(masks(shape, device).values())
    worst = torch.zeros(len(TENSORS), device=device)
    nonfinite = torch.zeros((), dtype=torch.int64, device=device)
    over = torch.zeros((), dtype=torch.int64, device=device)
    started = time.perf_counter()

    def summary(done: int) -> dict:
        return {"launches": done, "nonfinite": int(nonfinite), "over_threshold": int(over), "threshold": threshold,
                "max_rel_diff": dict(zip(TENSORS, worst.tolist())), "seconds": round(time.perf_counter() - started, 1)}

    for i in range(launches):
        mask = both[i % len(both)]
        q, k, v, grad_out = inputs(shape, mask, device)
        got, ref = run(flash, q, k, v, grad_out, mask), run(triton, q, k, v, grad_out, mask)
        finite = torch.stack([torch.isfinite(t).all() for t in got + ref]).all()
        rel = torch.stack([r for _, r in _errors(got, ref)]).nan_to_num(nan=float("inf"))
        nonfinite += ~finite
        over += (rel > threshold).any()
        torch.maximum(worst, rel, out=worst)
        if progress and (i + 1) % progress == 0 and i + 1 < launches:
            sync(device)
            print(json.dumps({"progress": summary(i + 1)}), flush=True)
    sync(device)
    return summary(launches)


def main(argv=None) -> int:
    d = Shape()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--launches", type=int, default=10000, help="canary launches (0: parity only; default 10000)")
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--ctx", type=int, default=d.ctx)
    p.add_argument("--anchors", type=int, default=d.anchors)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--kv-heads", type=int, default=d.kv_heads)
    p.add_argument("--head-dim", type=int, default=d.head_dim)
    p.add_argument("--window", type=int, default=d.window, help="the sliding layer's window")
    p.add_argument("--semantics", default=d.semantics, help="the sliding layer's semantics (trainer/masks.py)")
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--ratio", type=float, default=2.0, help="parity: flash's error may be this times triton's ...")
    p.add_argument("--slack", type=float, default=1e-3, help="... plus this (relative error)")
    p.add_argument("--threshold", type=float, default=0.02,
                   help="canary: the relative difference to the Triton kernels a launch may have, per tensor")
    p.add_argument("--progress", type=int, default=500, help="canary: read the counts every this many launches")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.head_dim > 128:
        p.error("--head-dim: the trainer runs flash-attention 4's kernels for head dim <= 128 only")

    device = torch.device(args.device)
    shape = Shape(args.batch, args.ctx, args.anchors, args.block_size, args.heads, args.kv_heads, args.head_dim,
                  args.window, args.semantics, getattr(torch, args.dtype))
    try:
        flash, triton = paths(device)
    except ConfigError as e:
        print(json.dumps({"error": str(e)}), flush=True)
        return 1
    print(json.dumps({"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
                      "flash": flash.describe(), "triton": triton.describe(),
                      "shape": {**vars(shape), "dtype": str(shape.dtype)}}), flush=True)
    rows = parity(shape, device, args.ratio, args.slack, args.seed)
    for row in rows:
        print(json.dumps(row), flush=True)
    ok = all(row["pass"] for row in rows)
    if args.launches > 0:
        torch.manual_seed(args.seed + 1)
        result = canary(shape, device, args.launches, args.threshold, args.progress)
        result["pass"] = result["nonfinite"] == 0 and result["over_threshold"] == 0
        print(json.dumps({"canary": result}), flush=True)
        ok = ok and result["pass"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
