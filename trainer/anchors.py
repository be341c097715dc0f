"""Anchor sampling and block inputs.

An anchor a is a position where a drafted block starts: slot 0 holds the real token
t[a] (at inference: the token the target just verified), slots 1..B-1 hold MASK and
are trained to predict t[a+1] .. t[a+B-1].

Position a is an eligible anchor iff
- the whole block fits: a + B - 1 <= S - 1;
- loss_mask[a] and loss_mask[a+1] are set: the anchor is a response token (a token
  the drafter would see as "last accepted") and the block has at least one
  supervised label (as SpecForge: "anchors whose clean token and first target are
  supervised").
A sequence with fewer than 2B loss tokens gives no anchor (all invalid).

The number of anchor slots N depends only on the padded length S (a length bucket),
never on the data, so every tensor and mask of a bucket has one static shape and the
compiled kernels are not rebuilt per batch.
"""

from __future__ import annotations

from typing import Optional

import torch


def anchor_slots(seq_len: int, max_anchors: int, block_size: int) -> int:
    """N for a bucket: at most ``max_anchors``, and no more than the positions a block fits at."""
    fits = seq_len - block_size + 1
    if fits < 1:
        raise ValueError(f"sequence length {seq_len} is shorter than one block of {block_size}")
    if max_anchors < 1:
        raise ValueError(f"max_anchors must be at least 1, got {max_anchors}")
    return min(max_anchors, fits)


def eligible_anchors(loss_mask_BS: torch.Tensor, block_size: int) -> torch.Tensor:
    """Boolean [B, S]: positions that may start a block (module docstring)."""
    loss_BS = loss_mask_BS > 0
    seq_len = loss_BS.shape[1]
    last = seq_len - block_size  # the last anchor whose block fits
    eligible_BS = torch.zeros_like(loss_BS)
    eligible_BS[:, : last + 1] = loss_BS[:, : last + 1] & loss_BS[:, 1 : last + 2]
    enough_B = loss_BS.sum(dim=1) >= 2 * block_size
    return eligible_BS & enough_B[:, None]


def sample_anchors(
    loss_mask_BS: torch.Tensor,
    max_anchors: int,
    block_size: int,
    generator: Optional[torch.Generator] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to N distinct eligible anchors per sequence, uniformly at random, sorted.

    Returns (anchors_BN long, valid_BN bool), N = anchor_slots(S, ...). Unused slots
    are padding: valid False, anchor 0, placed after the valid ones.
    """
    batch, seq_len = loss_mask_BS.shape
    device = loss_mask_BS.device
    num_slots = anchor_slots(seq_len, max_anchors, block_size)
    eligible_BS = eligible_anchors(loss_mask_BS, block_size)

    # A random order of the eligible positions: ineligible ones sort after them all.
    rand_device = generator.device if generator is not None else device
    score_BS = torch.rand(batch, seq_len, generator=generator, device=rand_device).to(device)
    score_BS = score_BS.masked_fill(~eligible_BS, 2.0)
    picked_BN = score_BS.argsort(dim=1, stable=True)[:, :num_slots]
    picked_valid_BN = eligible_BS.gather(1, picked_BN)

    sentinel = seq_len  # sorts after every real position
    position_BN = torch.where(picked_valid_BN, picked_BN, torch.full_like(picked_BN, sentinel))
    position_BN = position_BN.sort(dim=1).values
    valid_BN = position_BN < sentinel
    anchors_BN = torch.where(valid_BN, position_BN, torch.zeros_like(position_BN))
    return anchors_BN, valid_BN


def build_block_inputs(
    input_ids_BS: torch.Tensor,
    anchors_BN: torch.Tensor,
    valid_BN: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    loss_mask_BS: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drafter inputs and labels for the packed blocks (Q = N * B).

    block n = [t[a], MASK x (B-1)] at positions a .. a+B-1; slot k >= 1 is labelled
    t[a+k] (the same position, not the next one); slot 0 is never supervised.
    label_mask_BQ: valid block, slot >= 1, and (when given) loss_mask at the label.
    Invalid blocks get MASK everywhere and positions 0..B-1 (harmless: they see nothing).
    """
    batch, seq_len = input_ids_BS.shape
    num_blocks = anchors_BN.shape[1]
    slot_K = torch.arange(block_size, device=input_ids_BS.device)
    position_BNK = anchors_BN[:, :, None] + slot_K  # valid anchors keep the block inside the sequence
    gather_BQ = position_BNK.clamp(max=seq_len - 1).reshape(batch, num_blocks * block_size)

    labels_BQ = input_ids_BS.gather(1, gather_BQ)
    is_anchor_slot_BNK = (slot_K == 0).expand(batch, num_blocks, block_size)
    keep_BNK = is_anchor_slot_BNK & valid_BN[:, :, None]
    block_ids_BQ = torch.where(
        keep_BNK.reshape(batch, -1), labels_BQ, torch.full_like(labels_BQ, mask_token_id)
    )

    label_mask_BNK = valid_BN[:, :, None] & ~is_anchor_slot_BNK & (position_BNK < seq_len)
    label_mask_BQ = label_mask_BNK.reshape(batch, -1)
    if loss_mask_BS is not None:
        label_mask_BQ = label_mask_BQ & (loss_mask_BS.gather(1, gather_BQ) > 0)
    position_ids_BQ = position_BNK.reshape(batch, -1)
    return block_ids_BQ, position_ids_BQ, labels_BQ, label_mask_BQ
