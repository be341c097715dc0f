"""The loss's vocabulary projection: trainer.loss.dflash_loss (gradient w.r.t. the
hidden states computed in the forward, two projections per chunk), eager and with
each chunk's softmax and gradient compiled (``--compiled``, as the trainer runs it on
a GPU), against the activation-checkpointed form (forward, forward again in the
backward, backward: three projections).

    python -m bench.trainer.loss                                  # CPU, small vocabulary
    python -m bench.trainer.loss --device cuda --dtype bfloat16 --positions 8192 --hidden 1024 --vocab 151936 --compiled

    python -m bench.trainer.loss --device cuda --dtype bfloat16 --positions 8192 --hidden 1024 --vocab 151936 \
        --chunk 4096 --compiled --region

Prints one JSON line: seconds per forward+backward of each (best of --repeat; the
compiled form's first call, its compile, is not timed), the projections' TFLOP/s
(4 x positions x hidden x vocab per forward+backward) and the largest difference
between the gradients and the checkpointed form's. ``--region``: one chunk's whole loss
region as the trainer runs it (the logits' matmul, the compiled row kernel, the input
gradient's matmul): its milliseconds, its effective TFLOP/s, the floor of its two
matmuls at the measured 790 TFLOP/s, and the same per step at the reference size.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from trainer.loss import dflash_loss, resolve_kernel


def checkpointed_loss(hidden_XH, weight_VH, labels_X, weight_X, chunk):
    """The baseline: one chunk of logits at a time under activation checkpointing."""

    def part(h, lab, w):
        return (F.cross_entropy(F.linear(h, weight_VH).float(), lab, reduction="none") * w).sum()

    total = sum(checkpoint(part, hidden_XH[i:i + chunk], labels_X[i:i + chunk], weight_X[i:i + chunk],
                           use_reentrant=False) for i in range(0, hidden_XH.shape[0], chunk))
    return total / weight_X.sum()


def timed(fn, hidden, repeat, device):
    best, grad = float("inf"), None
    for _ in range(repeat):
        h = hidden.clone().requires_grad_()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn(h).backward()
        if device == "cuda":
            torch.cuda.synchronize()
        best, grad = min(best, time.perf_counter() - start), h.grad
    return best, grad


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--positions", type=int, default=2048, help="query positions (anchors x block size)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--compiled", action="store_true",
                   help="also time the compiled per-chunk softmax (GPU): with the inductor expression and, where "
                        "triton is installed, the triton kernel (trainer.loss_kernel)")
    p.add_argument("--chunk-only", action="store_true",
                   help="with --compiled: also time one chunk's softmax/top-1/gradient alone (triton.testing.do_bench) "
                        "and compare every output with the eager reference")
    p.add_argument("--kernel-configs", default="", metavar="BLOCKxWARPS,...",
                   help="with --chunk-only: also time the triton kernel launched alone with each column block "
                        "and warp count, e.g. 4096x8,8192x8,2048x4 (the trainer's is "
                        "trainer.loss_kernel.BLOCK_V x NUM_WARPS)")
    p.add_argument("--region", action="store_true",
                   help="with --compiled on a GPU: one chunk's whole loss region (two matmuls and the row kernel), "
                        "its effective TFLOP/s against the floor, and per reference step")
    p.add_argument("--reference-positions", type=int, default=16 * 512 * 15,
                   help="with --region: query positions projected per step at the reference size "
                        "(16 sequences x 512 anchors x 15 predicted slots)")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    hidden = torch.randn(1, args.positions, args.hidden, device=args.device, dtype=dtype)
    head = (torch.randn(args.vocab, args.hidden, device=args.device) * 0.05).to(dtype)
    labels = torch.randint(0, args.vocab, (1, args.positions), device=args.device)
    weight = torch.rand(1, args.positions, device=args.device)
    weight[:, ::16] = 0  # a block's anchor (slot 0) is never predicted
    def ours(compiled, kernel="inductor"):
        return lambda h: dflash_loss(h, head, labels, weight, args.chunk, block_size=16, compiled=compiled,
                                     kernel=kernel)[0]

    ckpt_s, ckpt_grad = timed(
        lambda h: checkpointed_loss(h.reshape(-1, args.hidden), head, labels.reshape(-1), weight.reshape(-1),
                                    args.chunk), hidden, args.repeat, args.device)
    row = {"bench": "loss", **vars(args), "torch": torch.__version__, "checkpointed_s": round(ckpt_s, 4)}
    flops = 4 * args.positions * 15 // 16 * args.hidden * args.vocab  # block 16: slot 0 is not projected
    kernels = [("fused", False, "inductor")]
    if args.compiled:
        kernels.append(("compiled", True, "inductor"))
        if resolve_kernel("auto", torch.device(args.device)) == "triton":
            kernels.append(("triton", True, "triton"))
    for name, compiled, kernel in kernels:
        if compiled:
            timed(ours(True, kernel), hidden, 1, args.device)  # the compile
        seconds, grad = timed(ours(compiled, kernel), hidden, args.repeat, args.device)
        row.update({f"{name}_s": round(seconds, 4), f"{name}_speedup": round(ckpt_s / seconds, 2),
                    f"{name}_tflops": round(flops / seconds / 1e12, 1),
                    f"{name}_max_grad_diff": float((grad.float() - ckpt_grad.float()).abs().max())})
    if args.chunk_only and len(kernels) > 1:
        row["chunk"] = chunk_alone(args, head, dtype, [k for _, _, k in kernels[1:]])
    if args.region and len(kernels) > 2:
        row["region"] = region_alone(args, head, dtype)
    print(json.dumps(row))
    return 0


def chunk_alone(args, head, dtype, kernels: list[str]) -> dict:
    """One chunk of logits through each compiled kernel: median milliseconds and the
    largest difference of loss, top-1 and gradient from the eager reference."""
    from triton.testing import do_bench

    from trainer.loss import chunk_cross_entropy, compiled_chunk_cross_entropy

    logits = (torch.randn(args.chunk, args.hidden, device=args.device, dtype=dtype) @ head.T).contiguous()
    labels = torch.randint(0, args.vocab, (args.chunk,), device=args.device)
    labels[:64] = logits[:64].float().argmax(dim=-1)  # some rows whose top-1 is right
    weight = torch.rand(args.chunk, device=args.device)
    ref_loss, ref_top1, ref_grad = chunk_cross_entropy(logits.clone(), labels, weight, True)
    out = {"floor_ms_3_passes": round(3 * logits.numel() * logits.element_size() / 4.8e12 * 1e3, 3)}
    candidates = [(kernel, compiled_chunk_cross_entropy(kernel)) for kernel in kernels]
    if "triton" in kernels:
        from trainer import loss_kernel

        for config in filter(None, args.kernel_configs.split(",")):
            block, warps = (int(x) for x in config.split("x"))
            candidates.append((f"triton-{config}", lambda lg, lb, w, g, b=block, n=warps:
                               loss_kernel.chunk_cross_entropy(lg, lb, w, g, block=b, num_warps=n)))
    for name, fn in candidates:
        loss, top1, grad = fn(logits, labels, weight, True)
        out[name] = {"ms": round(do_bench(lambda: fn(logits, labels, weight, True)), 3),
                     "loss_rel_diff": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
                     "top1_differs": int((top1 != ref_top1).sum()),
                     "top1_right": int(top1.sum()),
                     "grad_max_diff": float((grad.float() - ref_grad.float()).abs().max())}
    return out


def region_alone(args, head, dtype) -> dict:
    """One chunk from hidden states to loss and input gradient as the trainer runs it: the
    logits' matmul, the compiled row kernel, the input gradient's matmul. Median
    milliseconds and effective TFLOP/s (the two matmuls' 4 x chunk x hidden x vocab),
    against the floor of those matmuls at 790 TFLOP/s; then the same for a step at the
    reference size (``--reference-positions`` in chunks of ``--chunk``)."""
    from triton.testing import do_bench

    from trainer.loss import compiled_chunk_cross_entropy

    hidden = torch.randn(args.chunk, args.hidden, device=args.device, dtype=dtype)
    labels = torch.randint(0, args.vocab, (args.chunk,), device=args.device)
    weight = torch.rand(args.chunk, device=args.device)
    row_kernel = compiled_chunk_cross_entropy("triton")

    def region():
        loss, top1, grad = row_kernel(hidden @ head.T, labels, weight, True)
        return loss, top1, grad @ head

    region()
    ms = do_bench(region)
    flops = 4 * args.chunk * args.hidden * args.vocab
    floor_ms = flops / 790e12 * 1e3
    chunks = -(-args.reference_positions // args.chunk)
    return {"chunk_ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1), "floor_ms": round(floor_ms, 3),
            "of_floor": round(ms / floor_ms, 2), "chunks_per_step": chunks, "step_ms": round(ms * chunks, 1),
            "step_floor_ms": round(floor_ms * chunks, 1)}


if __name__ == "__main__":
    sys.exit(main())
