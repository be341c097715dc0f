"""DFlash attention masks: one mask_mod, two renderings (BlockMask and dense boolean).

Layout of one batch row (S context positions, N blocks of B slots):

    keys    = [context 0..S-1 | block 0 slots 0..B-1 | block 1 ... | block N-1]   (KV = S + N*B)
    queries = [block 0 slots 0..B-1 | ... | block N-1]                             (Q  = N*B)

Block n has anchor a = anchors[b, n] and covers token positions a .. a+B-1. For the
query in block n, slot o (token position a + o):

- context key j is visible iff ``j < a``. Strictly: at inference the drafter is run
  right after the target verified token a, whose hidden state is not computed yet.
- block key (block m, slot o') is visible iff ``m == n``: the block is bidirectional
  inside and blind to every other block, whatever their positions (blocks may
  overlap in position; visibility is decided by block identity, never by position).
- a block whose valid flag is False sees nothing (its output is zero and unused).
- query rows q >= N*B and key columns kv >= S + N*B exist only when a kernel or
  create_block_mask pads the lengths to a multiple of its tile (128): they see
  nothing, and every table lookup uses a clamped index so they never read out of
  bounds.

Sliding-window layers (window W) add, for the query at position p = a + o, the usual
"keys within the last W positions, causal" rule over the joint positions:

- context key j additionally needs ``j >= p - (W - 1) = a + o - (W - 1)``;
- block key at slot o' additionally needs ``o' <= o`` (causal inside the block) and
  ``o' >= o - (W - 1)`` (only binds when W < B).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def dflash_mask_mod(
    anchors_BN: torch.Tensor,
    valid_BN: torch.Tensor,
    ctx_len: int,
    block_size: int,
    window: Optional[int] = None,
) -> MaskMod:
    """The DFlash visibility rule (module docstring) over per-batch anchor tables."""
    if window is not None and window < 1:
        raise ValueError(f"sliding window must be at least 1, got {window}")
    num_blocks = anchors_BN.shape[1]

    def mask_mod(b, h, q_idx, kv_idx):
        q_block = q_idx // block_size
        q_slot = q_idx % block_size
        # Padded query rows have q_block >= N: clamp before any table lookup, mask after.
        row = q_block.clamp(0, num_blocks - 1)
        anchor = anchors_BN[b, row]
        in_range = q_block < num_blocks

        is_ctx = kv_idx < ctx_len
        ctx_visible = is_ctx & (kv_idx < anchor)
        kv_block = (kv_idx - ctx_len) // block_size
        kv_slot = (kv_idx - ctx_len) % block_size
        # kv_block >= N for padded key columns, so they never equal a real q_block.
        block_visible = ~is_ctx & (kv_block == q_block)
        if window is not None:
            ctx_visible = ctx_visible & (kv_idx >= anchor + q_slot - (window - 1))
            block_visible = block_visible & (kv_slot <= q_slot) & (kv_slot >= q_slot - (window - 1))
        return (ctx_visible | block_visible) & valid_BN[b, row] & in_range

    return mask_mod


def mask_lengths(num_blocks: int, ctx_len: int, block_size: int) -> tuple[int, int]:
    """(Q_LEN, KV_LEN) of the DFlash layout."""
    return num_blocks * block_size, ctx_len + num_blocks * block_size


def compiled_block_mask_builder(backend: str = "inductor") -> Callable[..., BlockMask]:
    """``torch.compile(create_block_mask)`` with static shapes.

    The anchor tables have a fixed shape per length bucket (see anchors.anchor_slots),
    so one compiled entry per (bucket, device) serves every batch: the anchor values
    and the number of valid anchors are data, not shapes, and do not recompile.
    """
    return torch.compile(create_block_mask, backend=backend, dynamic=False)


_compiled_create_block_mask: Optional[Callable[..., BlockMask]] = None


def _default_compiled_builder() -> Callable[..., BlockMask]:
    global _compiled_create_block_mask
    if _compiled_create_block_mask is None:  # created once: every call shares its cache entries
        _compiled_create_block_mask = compiled_block_mask_builder()
    return _compiled_create_block_mask


def build_block_mask(
    anchors_BN: torch.Tensor,
    valid_BN: torch.Tensor,
    ctx_len: int,
    block_size: int,
    window: Optional[int] = None,
    *,
    compiled: bool = True,
    builder: Optional[Callable[..., BlockMask]] = None,
) -> BlockMask:
    """flex_attention BlockMask [B, 1, Q, KV] (heads broadcast) for one batch.

    ``compiled`` uses the shared compiled create_block_mask; the eager one
    materialises the boolean [B, Q, KV] mask first (92 MB at Q=8192, KV=11264: fine
    on a GPU, unlike the dense score matrix of eager flex_attention). The compiled
    one is faster per call, but its cold compile grows with the bucket: measured on
    an H200 (torch 2.11), 10 s at Q=1024/KV=2048 but 212 s at Q=8192/KV=11264, per
    bucket and layer type, until the compile cache is warm.
    ``builder`` overrides the function used, e.g. ``compiled_block_mask_builder("eager")``
    to exercise Dynamo's guards cheaply.
    """
    q_len, kv_len = mask_lengths(anchors_BN.shape[1], ctx_len, block_size)
    fn = builder or (_default_compiled_builder() if compiled else create_block_mask)
    mask_mod = dflash_mask_mod(anchors_BN, valid_BN, ctx_len, block_size, window)
    return fn(mask_mod, anchors_BN.shape[0], None, q_len, kv_len, device=anchors_BN.device)


def dense_mask(
    anchors_BN: torch.Tensor,
    valid_BN: torch.Tensor,
    ctx_len: int,
    block_size: int,
    window: Optional[int] = None,
) -> torch.Tensor:
    """Boolean mask [B, 1, Q, KV] from the same mask_mod, for SDPA (CPU, small sizes only)."""
    q_len, kv_len = mask_lengths(anchors_BN.shape[1], ctx_len, block_size)
    mask_mod = dflash_mask_mod(anchors_BN, valid_BN, ctx_len, block_size, window)
    return create_mask(mask_mod, anchors_BN.shape[0], 1, q_len, kv_len, device=anchors_BN.device)
