"""One chunk's cross-entropy, top-1 and logit gradient as a single Triton kernel.

The loss chunk is [C, V] bf16 logits (4096 x 151936 at the reference size: 1.2 GB).
What it needs from them is row-wise: log-sum-exp, the label's logit, the first
argmax, and the gradient weight * (softmax - onehot). The pointwise expression
compiled by inductor (``trainer.loss.chunk_cross_entropy(in_place=False)``) does
that in a reduction kernel and a pointwise kernel with fp32 intermediates; this
kernel gives each row one program that reads its logits twice (an online
max/sum-exp/argmax pass, then the gradient pass, whose reads the L2 cache partly
serves) and writes the bf16 gradient once.

It is called inside ``torch.compile`` (``trainer.loss.compiled_chunk_cross_entropy``),
so inductor compiles it with the rest of the chunk's graph and the compiled kernel
travels in the compile artifacts like every other. Values equal the eager
reference: the same log-sum-exp in fp32, the first of tied maxima as the top-1
(what greedy decoding picks), the gradient rounded once to the logits' dtype.

Without triton (a CPU build of torch) the module imports, and its kernel is never
chosen (``trainer.loss.resolve_kernel``).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU build of torch: resolve_kernel never picks this kernel
    triton = tl = None

BLOCK_V = 4096  # columns per iteration of a row's loop
NUM_WARPS = 8


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


@_jit
def _chunk_ce_kernel(logits_ptr, stride_row, labels_ptr, weight_ptr, loss_ptr, correct_ptr, grad_ptr, stride_grad,
                     V, BLOCK: tl.constexpr, NEED_GRAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    label = tl.load(labels_ptr + row).to(tl.int64)
    weight = tl.load(weight_ptr + row)
    cols = tl.arange(0, BLOCK)
    # Pass 1: running max, sum of exp against it, and the first argmax.
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    best = tl.full((), float("-inf"), tl.float32)
    best_at = tl.zeros((), tl.int64)
    for start in range(0, V, BLOCK):
        at = start + cols
        x = tl.load(row_ptr + at, mask=at < V, other=float("-inf")).to(tl.float32)
        block_max = tl.max(x, axis=0)
        # The argmax is a second reduction: only for a block with a new maximum (a few
        # per row). Strictly greater: a tie with an earlier block keeps the first.
        if block_max > best:
            best_at = tl.argmax(x, axis=0, tie_break_left=True).to(tl.int64) + start
            best = block_max
        new_m = tl.maximum(m, block_max)
        s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
        m = new_m
    lse = m + tl.log(s)
    target = tl.load(row_ptr + label).to(tl.float32)
    tl.store(loss_ptr + row, (lse - target) * weight)
    tl.store(correct_ptr + row, (best_at == label).to(tl.int8))
    if NEED_GRAD:
        # Pass 2: weight * (softmax - onehot), in the gradient's dtype.
        grad_row = grad_ptr + row * stride_grad
        for start in range(0, V, BLOCK):
            at = start + cols
            x = tl.load(row_ptr + at, mask=at < V, other=0.0).to(tl.float32)
            g = (tl.exp(x - lse) - (at == label).to(tl.float32)) * weight
            tl.store(grad_row + at, g.to(grad_ptr.dtype.element_ty), mask=at < V)


def chunk_cross_entropy(logits_CV: torch.Tensor, labels_C: torch.Tensor, weight_C: torch.Tensor, need_grad: bool,
                        block: int = BLOCK_V, num_warps: int = NUM_WARPS):
    """Same contract as ``trainer.loss.chunk_cross_entropy``: (sum of weight x CE,
    top-1 == label, d(sum)/d logits in the logits' dtype or None). ``block`` and
    ``num_warps``: the launch (``python -m bench.trainer.loss --kernel-configs`` compares them)."""
    if triton is None:
        raise RuntimeError("the triton loss kernel needs the triton package (train.loss_kernel: inductor)")
    rows, vocab = logits_CV.shape
    logits_CV = logits_CV if logits_CV.stride(1) == 1 else logits_CV.contiguous()
    loss_C = torch.empty(rows, dtype=torch.float32, device=logits_CV.device)
    correct_C = torch.empty(rows, dtype=torch.int8, device=logits_CV.device)
    # Without NEED_GRAD nothing is stored through grad_ptr; a 1-element stand-in keeps
    # the compiler from treating the logits as written.
    grad_CV = torch.empty_like(logits_CV) if need_grad else logits_CV.new_empty(1)
    _chunk_ce_kernel[(rows,)](
        logits_CV, logits_CV.stride(0), labels_C, weight_C.to(torch.float32), loss_C, correct_C, grad_CV,
        grad_CV.stride(0) if need_grad else 0, vocab, BLOCK=block, NEED_GRAD=need_grad, num_warps=num_warps,
    )
    return loss_C.sum(), correct_C.bool(), grad_CV if need_grad else None
