"""The DFlash loss: decayed, weighted cross-entropy over block slots, in chunks.

Block slot k (1..B-1) predicts t[a+k]. Its weight is loss_mask * exp(-(k-1)/gamma):
early slots matter most, because a draft is accepted only up to its first wrong
token. Slot 0 (the anchor itself) has weight 0. The loss is normalised by the sum of
the weights.

The vocabulary projection of all N*B query positions would be the largest tensor of
the step (512 anchors x 16 slots x 152K vocab = 2.5 GB in fp32), so it is computed in
chunks of query positions and only one chunk's logits exist at a time. The lm_head
is frozen, so the gradient of the loss w.r.t. the hidden states is all the backward
needs: it is computed in the forward, chunk by chunk (softmax - onehot, times the
weights, times W), and the backward only scales it. That is two vocabulary
projections per chunk; activation checkpointing would take three (forward, forward
again, backward), and at a 152K vocabulary the projection is most of the drafter's
work.
"""

from __future__ import annotations

import functools
import importlib.util
import math

import torch
import torch.nn.functional as F

from trainer.compile import thread_safe_compile, sharing


def default_gamma(block_size: int) -> float:
    """The published decay: 7 for B=16, 4 for B=8, else B/2."""
    return {16: 7.0, 8: 4.0}.get(block_size, block_size / 2)


def slot_weights(label_mask_BQ: torch.Tensor, block_size: int, gamma: float) -> torch.Tensor:
    """float [B, Q]: label_mask * exp(-(k-1)/gamma) with k = slot in block; 0 for slot 0."""
    slot_Q = torch.arange(label_mask_BQ.shape[1], device=label_mask_BQ.device) % block_size
    decay_Q = torch.exp(-(slot_Q - 1).clamp(min=0).float() / gamma)
    decay_Q = torch.where(slot_Q == 0, torch.zeros_like(decay_Q), decay_Q)
    return label_mask_BQ.float() * decay_Q


def chunk_cross_entropy(logits_CV: torch.Tensor, labels_C: torch.Tensor, weight_C: torch.Tensor, need_grad: bool,
                        in_place: bool = True):
    """One chunk: (sum of weight x CE, top-1 == label, d(sum)/d logits in the logits'
    dtype or None). ``labels_C`` must be valid indices (callers clamp -100 to 0 and
    give those rows weight 0).

    Eager (``in_place``), each op is a pass of its own over an fp32 [C, V] tensor, done
    in place where possible: at a 152K vocabulary that costs more than the projections
    themselves. For the compiler (``in_place=False``) the gradient is one pointwise
    expression, the label's -1 a comparison with the column index rather than an
    indexed write into the probabilities: inductor then reads the chunk's logits in
    one reduction pass and one pointwise pass and never stores fp32 probabilities.
    Both give the same values."""
    logits = logits_CV.float()
    max_C = logits.amax(dim=-1)
    lse_C = max_C + torch.log(torch.exp(logits - max_C[:, None]).sum(dim=-1))
    target_C = logits.gather(1, labels_C[:, None]).squeeze(1)
    # What greedy decoding picks: the first of tied maxima (bf16 logits tie often
    # at a 152K vocabulary, so "label's logit == max" would overcount).
    correct_C = logits.argmax(dim=-1) == labels_C
    total = ((lse_C - target_C) * weight_C).sum()
    if not need_grad:
        return total, correct_C, None
    # d(weight * CE)/d logits = weight * (softmax - onehot).
    if not in_place:
        onehot_CV = torch.arange(logits.shape[1], device=logits.device)[None, :] == labels_C[:, None]
        grad_CV = (torch.exp(logits - lse_C[:, None]) - onehot_CV.to(logits.dtype)) * weight_C[:, None]
        return total, correct_C, grad_CV.to(logits_CV.dtype)
    probs_CV = logits.sub_(lse_C[:, None]).exp_()
    probs_CV[torch.arange(probs_CV.shape[0], device=probs_CV.device), labels_C] -= 1
    return total, correct_C, probs_CV.mul_(weight_C[:, None]).to(logits_CV.dtype)


LOSS_KERNELS = ("auto", "triton", "inductor")


@functools.lru_cache(maxsize=None)
def resolve_kernel(requested: str, device: torch.device) -> str:
    """The compiled chunk's kernel: ``triton`` (``trainer.loss_kernel``: one pass for
    the statistics, one for the gradient) on a CUDA device where triton is installed,
    else ``inductor`` (the pointwise expression above, fused by the compiler).
    ``auto`` picks triton where it can; asking for triton where it cannot is an error."""
    if requested not in LOSS_KERNELS:
        raise ValueError(f"loss kernel {requested!r} is not one of {', '.join(LOSS_KERNELS)}")
    installed = importlib.util.find_spec("triton") is not None
    usable = device.type == "cuda" and installed
    if requested == "triton" and not usable:
        raise ValueError("train.loss_kernel: triton needs a CUDA device and the triton package "
                         f"(device {device}, triton {'installed' if installed else 'missing'}); use auto or inductor")
    return "triton" if requested in ("auto", "triton") and usable else "inductor"


def _fusable_chunk_cross_entropy(logits_CV, labels_C, weight_C, need_grad):
    return chunk_cross_entropy(logits_CV, labels_C, weight_C, need_grad, in_place=False)


def _triton_chunk_cross_entropy(logits_CV, labels_C, weight_C, need_grad):
    from trainer import loss_kernel

    return loss_kernel.chunk_cross_entropy(logits_CV, labels_C, weight_C, need_grad)


_compiled_chunk_cross_entropy: dict[tuple[str, str], object] = {}


def compiled_chunk_cross_entropy(kernel: str = "inductor"):
    """torch.compile of one chunk's loss with ``kernel`` (``resolve_kernel``), created
    once per kernel and sharing mode and safe in every thread (static shapes: one entry
    per chunk shape and device, compiled in the trainer's warm-up like the attention)."""
    key = (kernel, sharing())
    if key not in _compiled_chunk_cross_entropy:
        fn = _triton_chunk_cross_entropy if kernel == "triton" else _fusable_chunk_cross_entropy
        _compiled_chunk_cross_entropy[key] = thread_safe_compile(fn, dynamic=False)
    return _compiled_chunk_cross_entropy[key]


class _ChunkedLinearCE(torch.autograd.Function):
    """sum_x weight_x * CE(hidden_x @ W^T, label_x) over chunks of positions, and
    whether each position's top-1 prediction is its label. W (the lm_head) gets no
    gradient: it is frozen."""

    @staticmethod
    def forward(ctx, hidden_XH, weight_VH, labels_X, weight_X, chunk, kernel):
        need_grad = ctx.needs_input_grad[0]
        ce = compiled_chunk_cross_entropy(kernel) if kernel else chunk_cross_entropy
        grad_XH = torch.empty_like(hidden_XH) if need_grad else None
        correct_X = torch.empty_like(labels_X, dtype=torch.bool)
        total = hidden_XH.new_zeros((), dtype=torch.float32)
        for start in range(0, hidden_XH.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits_CV = F.linear(hidden_XH[rows], weight_VH)
            loss_C, correct_X[rows], grad_CV = ce(logits_CV, labels_X[rows].clamp(min=0), weight_X[rows], need_grad)
            total += loss_C
            if need_grad:
                grad_XH[rows] = (grad_CV @ weight_VH).to(grad_XH.dtype)
        ctx.mark_non_differentiable(correct_X)
        if need_grad:
            ctx.save_for_backward(grad_XH)
        return total, correct_X

    @staticmethod
    def backward(ctx, grad_total, _grad_correct):
        (grad_XH,) = ctx.saved_tensors
        return grad_XH * grad_total.to(grad_XH.dtype), None, None, None, None, None


def dflash_loss(
    hidden_BQH: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels_BQ: torch.Tensor,
    weight_BQ: torch.Tensor,
    chunk: int,
    *,
    block_size: int,
    compiled: bool = False,
    kernel: str = "inductor",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted CE over query positions, ``chunk`` positions per vocabulary projection;
    ``compiled`` runs each chunk's softmax and gradient as compiled kernels (GPU), with
    ``kernel`` (``resolve_kernel``: triton or inductor).

    ``weight_BQ`` at slot 0 of a block is not read: the anchor is given, never predicted,
    and its position is not projected.

    Returns (loss, stats); stats are detached tensors (no host sync here):
      tokens       supervised positions (weight > 0)
      acc          top-1 accuracy over them
      slot_correct, slot_count, slot_acc   per block slot, shape [block_size];
                   slot_acc is NaN where a slot had no supervised position (slot 0)
      accept_len   mean over blocks with a supervised slot 1 of the run of leading
                   correct slots from slot 1 (stops at the first wrong or unsupervised
                   slot; 0..B-1). Published acceptance lengths (tau) also count the
                   target's bonus token: tau = accept_len + 1.
      blocks       blocks counted in accept_len
    """
    batch, q_len, hidden = hidden_BQH.shape
    if q_len % block_size:
        raise ValueError(f"query length {q_len} is not a multiple of block_size {block_size}")
    if block_size < 2:
        raise ValueError(f"block_size {block_size}: a block needs an anchor and at least one slot to predict")
    # Slot 0 (the anchor) has weight 0 in every block: it never goes through the
    # vocabulary projection, which is the step's largest matmul (1/B of it saved).
    def predicted(t_BQ: torch.Tensor, *trailing: int) -> torch.Tensor:  # slots 1..B-1 of every block, flat
        return t_BQ.reshape(-1, block_size, *trailing)[:, 1:].reshape(-1, *trailing)

    hidden_XH = predicted(hidden_BQH, hidden)
    labels_X = predicted(labels_BQ)
    # A label of -100 (the cross-entropy convention for "none") carries no weight.
    weight_X = torch.where(labels_X >= 0, predicted(weight_BQ).to(torch.float32), 0.0)
    total, correct_X = _ChunkedLinearCE.apply(hidden_XH, lm_head_weight.detach(), labels_X, weight_X, chunk,
                                              kernel if compiled else None)

    weight_sum = weight_X.sum()
    loss = total / weight_sum.clamp(min=1e-6)  # an all-invalid batch gives 0, not NaN

    with torch.no_grad():
        # Per block, slots 0..B-1 again: slot 0 is never supervised (nor counted correct).
        supervised_NK = F.pad((weight_X > 0).view(-1, block_size - 1), (1, 0))
        correct_NK = F.pad(correct_X.view(-1, block_size - 1), (1, 0)) & supervised_NK
        slot_count = supervised_NK.sum(dim=0).float()
        slot_correct = correct_NK.sum(dim=0).float()
        tokens = slot_count.sum()
        # Leading run from slot 1: cumprod of (correct and supervised) stops at the first miss.
        run_N = correct_NK[:, 1:].long().cumprod(dim=1).sum(dim=1).float()
        counted_N = supervised_NK[:, 1]
        blocks = counted_N.sum().float()
        stats = {
            "tokens": tokens,
            "acc": slot_correct.sum() / tokens.clamp(min=1),
            "slot_correct": slot_correct,
            "slot_count": slot_count,
            "slot_acc": torch.where(slot_count > 0, slot_correct / slot_count.clamp(min=1), math.nan),
            "accept_len": (run_N * counted_N).sum() / blocks.clamp(min=1),
            "blocks": blocks,
        }
    return loss, stats
