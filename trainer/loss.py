"""The DFlash loss: decayed, weighted cross-entropy over block slots, in chunks.

Block slot k (1..B-1) predicts t[a+k]. Its weight is loss_mask * exp(-(k-1)/gamma):
early slots matter most, because a draft is accepted only up to its first wrong
token. Slot 0 (the anchor itself) has weight 0. The loss is normalised by the sum of
the weights.

The vocabulary projection of all N*B query positions would be the largest tensor of
the step (512 anchors x 16 slots x 152K vocab = 2.5 GB in fp32), so it is computed in
chunks of query positions, each under activation checkpointing: only one chunk's
logits exist at a time, in the forward and in the backward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def default_gamma(block_size: int) -> float:
    """The published decay: 7 for B=16, 4 for B=8, else B/2."""
    return {16: 7.0, 8: 4.0}.get(block_size, block_size / 2)


def slot_weights(label_mask_BQ: torch.Tensor, block_size: int, gamma: float) -> torch.Tensor:
    """float [B, Q]: label_mask * exp(-(k-1)/gamma) with k = slot in block; 0 for slot 0."""
    slot_Q = torch.arange(label_mask_BQ.shape[1], device=label_mask_BQ.device) % block_size
    decay_Q = torch.exp(-(slot_Q - 1).clamp(min=0).float() / gamma)
    decay_Q = torch.where(slot_Q == 0, torch.zeros_like(decay_Q), decay_Q)
    return label_mask_BQ.float() * decay_Q


def _chunk_terms(hidden_CH, weight_VH, labels_C, weight_C):
    logits_CV = F.linear(hidden_CH, weight_VH).float()
    ce_C = F.cross_entropy(logits_CV, labels_C, reduction="none")
    correct_C = logits_CV.argmax(dim=-1) == labels_C
    return (ce_C * weight_C).sum(), correct_C


def dflash_loss(
    hidden_BQH: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels_BQ: torch.Tensor,
    weight_BQ: torch.Tensor,
    chunk: int,
    *,
    block_size: int,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted CE over query positions, ``chunk`` positions per vocabulary projection.

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
    hidden_XH = hidden_BQH.reshape(-1, hidden)
    labels_X = labels_BQ.reshape(-1)
    weight_X = weight_BQ.reshape(-1).to(torch.float32)
    use_checkpoint = torch.is_grad_enabled() and hidden_XH.requires_grad

    total = hidden_XH.new_zeros((), dtype=torch.float32)
    correct_parts = []
    for start in range(0, hidden_XH.shape[0], chunk):
        args = (hidden_XH[start : start + chunk], lm_head_weight, labels_X[start : start + chunk], weight_X[start : start + chunk])
        if use_checkpoint:
            part, correct_C = checkpoint(_chunk_terms, *args, use_reentrant=False)
        else:
            part, correct_C = _chunk_terms(*args)
        total = total + part
        correct_parts.append(correct_C)

    weight_sum = weight_X.sum()
    loss = total / weight_sum.clamp(min=1e-6)  # an all-invalid batch gives 0, not NaN

    with torch.no_grad():
        supervised_NK = (weight_X > 0).view(-1, block_size)
        correct_NK = torch.cat(correct_parts).view(-1, block_size) & supervised_NK
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
