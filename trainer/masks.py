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

Sliding-window layers (window W) add, for the query at position p = a + o, a window
over the joint positions; ``semantics`` (``model.sliding_semantics``) names which one,
after the engines that run it (trainer/SERVING_EXPORT.md has where each was read):

- ``causal_in_block`` (vLLM, SGLang, SpecForge): the usual "keys within the last W
  positions, causal": context key j additionally needs ``j >= p - (W - 1)``; block
  key at slot o' additionally needs ``o - (W - 1) <= o' <= o`` (causal inside the
  block; the lower bound only binds when W < B);
- ``bidirectional`` (z-lab's reference code: every layer non-causal, the window
  symmetric): context key j needs ``j >= p - (W - 1)`` as above (every context key
  is before p, so only the left side binds); block key at slot o' needs
  ``|o' - o| <= W - 1``: the slots after o are visible too.

So every query row sees at most two intervals of keys: ``[lo, min(a, S))`` of the
context and a run of its own block's slots. A BlockMask lists, per 128x128 tile,
whether every (query, key) pair of it is visible (full) or only some (partial);
three builders compute the same tables (build_block_mask):

- ``direct``: from the row intervals, a few vectorised ops on [B, Q, KV/128] int32
  tensors (46 MB each at B=16, Q=8192, KV=11264); nothing to compile, no [B, Q, KV]
  mask.
- ``eager``: torch's create_block_mask; it materialises the boolean [B, Q, KV]
  mask on every call (92 MB per sequence at Q=8192, KV=11264: 1.5 GB at B=16).
- ``compiled``: torch.compile(create_block_mask); fast per call once compiled, but
  its cold compile grows with the bucket: measured on an H200 (torch 2.11), 10 s
  at Q=1024/KV=2048 and 212 s at Q=8192/KV=11264, per bucket and layer type.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

TILE = 128  # flex_attention's default BlockMask tile, on both axes
MASK_BUILDERS = ("direct", "compiled", "eager")
CAUSAL_IN_BLOCK = "causal_in_block"
BIDIRECTIONAL = "bidirectional"
SLIDING_SEMANTICS = (CAUSAL_IN_BLOCK, BIDIRECTIONAL)


def check_semantics(semantics: str) -> str:
    if semantics not in SLIDING_SEMANTICS:
        raise ValueError(f"sliding semantics {semantics!r} is not one of {', '.join(SLIDING_SEMANTICS)}")
    return semantics


def window_bounds(anchor, slot, block_size: int, window: int, semantics: str = CAUSAL_IN_BLOCK):
    """(ctx_lo, own_lo, own_hi) of a sliding layer's query at block slot ``slot`` of the
    block anchored at ``anchor`` (tensors, broadcast): it sees context keys
    [ctx_lo, anchor) and its own block's slots [own_lo, own_hi) (module docstring)."""
    ctx_lo = (anchor + slot - (window - 1)).clamp(min=0)
    own_lo = (slot - (window - 1)).clamp(min=0)
    own_hi = slot + 1 if check_semantics(semantics) == CAUSAL_IN_BLOCK else (slot + window).clamp(max=block_size)
    return ctx_lo, own_lo, own_hi


def dflash_mask_mod(
    anchors_BN: torch.Tensor,
    valid_BN: torch.Tensor,
    ctx_len: int,
    block_size: int,
    window: Optional[int] = None,
    semantics: str = CAUSAL_IN_BLOCK,
) -> MaskMod:
    """The DFlash visibility rule (module docstring) over per-batch anchor tables."""
    if window is not None and window < 1:
        raise ValueError(f"sliding window must be at least 1, got {window}")
    causal = check_semantics(semantics) == CAUSAL_IN_BLOCK
    num_blocks = anchors_BN.shape[1]

    def mask_mod(b, h, q_idx, kv_idx):
        q_block = q_idx // block_size
        q_slot = q_idx % block_size
        # Padded query rows have q_block >= N: wrap before any table lookup, mask after
        # (a remainder, not a clamp: flash-attention's CuTe kernels take no maximum/minimum).
        row = q_block % num_blocks
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
            after = kv_slot <= q_slot if causal else kv_slot <= q_slot + (window - 1)
            block_visible = block_visible & after & (kv_slot >= q_slot - (window - 1))
        return (ctx_visible | block_visible) & valid_BN[b, row] & in_range

    return mask_mod


def one_block_mask(anchor: int, block_size: int, window: int, semantics: str = CAUSAL_IN_BLOCK,
                   device: Union[str, torch.device] = "cpu") -> torch.Tensor:
    """Boolean [B, anchor + B] of a sliding layer for one block whose context is the
    ``anchor`` positions before it (decoding with a draft KV cache): the same rule."""
    slot = torch.arange(block_size, device=device)
    ctx_lo, own_lo, own_hi = window_bounds(torch.tensor(anchor, device=device), slot, block_size, window, semantics)
    keys_ctx, keys_own = torch.arange(anchor, device=device), torch.arange(block_size, device=device)
    ctx_ok = keys_ctx[None, :] >= ctx_lo[:, None]
    own_ok = (keys_own[None, :] >= own_lo[:, None]) & (keys_own[None, :] < own_hi[:, None])
    return torch.cat([ctx_ok, own_ok], dim=1)


def mask_lengths(num_blocks: int, ctx_len: int, block_size: int) -> tuple[int, int]:
    """(Q_LEN, KV_LEN) of the DFlash layout."""
    return num_blocks * block_size, ctx_len + num_blocks * block_size


def compiled_block_mask_builder(backend: str = "inductor") -> Callable[..., BlockMask]:
    """``torch.compile(create_block_mask)`` with static shapes.

    The anchor tables have a fixed shape per length bucket (see anchors.anchor_slots),
    so one compiled entry per (bucket, device) serves every batch: the anchor values
    and the number of valid anchors are data, not shapes, and do not recompile.
    """
    from trainer.compile import PerLane

    return PerLane(create_block_mask, backend=backend, dynamic=False)  # a compiled copy per thread


_compiled_create_block_mask: Optional[Callable[..., BlockMask]] = None


def _default_compiled_builder() -> Callable[..., BlockMask]:
    global _compiled_create_block_mask
    if _compiled_create_block_mask is None:  # created once: every call shares its cache entries
        _compiled_create_block_mask = compiled_block_mask_builder()
    return _compiled_create_block_mask


def direct_block_mask(
    anchors_BN: torch.Tensor,
    valid_BN: torch.Tensor,
    ctx_len: int,
    block_size: int,
    window: Optional[int] = None,
    semantics: str = CAUSAL_IN_BLOCK,
) -> BlockMask:
    """The BlockMask of create_block_mask(dflash_mask_mod(...)), computed from the anchors.

    Each query row sees a context interval and an interval of its own block (module
    docstring), both empty for invalid blocks and padded rows. Their overlaps with
    a KV tile add up to the number of keys the row sees in it: the tile is full if
    every row of the Q tile sees all 128 keys (so never when it holds padded rows or
    columns), partial if some row sees some key and it is not full. The tables have
    create_block_mask's format and order (listed tiles first, ascending) and stay on
    the anchors' device.
    """
    batch, num_blocks = anchors_BN.shape
    q_len, kv_len = mask_lengths(num_blocks, ctx_len, block_size)
    device = anchors_BN.device
    q_tiles, kv_tiles = -(-q_len // TILE), -(-kv_len // TILE)

    rows = torch.arange(q_tiles * TILE, device=device)
    block, slot = rows // block_size, rows % block_size
    row = block.clamp(max=num_blocks - 1)
    anchor = anchors_BN[:, row]  # [B, Qpad]
    live = valid_BN[:, row] & (block < num_blocks)
    ctx_lo = torch.zeros_like(anchor)
    own_lo, own_hi = ctx_len + row * block_size, ctx_len + (row + 1) * block_size
    if window is not None:
        ctx_lo, lo, hi = window_bounds(anchor, slot, block_size, window, semantics)
        own_lo, own_hi = own_lo + lo, own_lo + hi
    ctx_hi = torch.where(live, anchor.clamp(max=ctx_len), 0)
    own_hi = torch.where(live, own_hi, 0)

    starts = torch.arange(kv_tiles, device=device, dtype=torch.int32) * TILE
    seen = _overlap(ctx_lo, ctx_hi, starts) + _overlap(own_lo, own_hi, starts)  # [B, Qpad, KVtiles]
    seen = seen.view(batch, q_tiles, TILE, kv_tiles)
    full = seen.amin(2) == TILE
    partial = (seen.amax(2) > 0) & ~full
    return BlockMask.from_kv_blocks(
        *_ordered(partial),
        *_ordered(full),
        BLOCK_SIZE=TILE,
        mask_mod=dflash_mask_mod(anchors_BN, valid_BN, ctx_len, block_size, window, semantics),
        seq_lengths=(q_len, kv_len),
    )


def _overlap(lo: torch.Tensor, hi: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Length of [lo, hi) (per row, broadcast to [B, Qpad]) inside each tile [s, s + TILE)."""
    lo, hi = lo.to(torch.int32).unsqueeze(-1), hi.to(torch.int32).unsqueeze(-1)
    return (torch.minimum(hi, starts + TILE) - torch.maximum(lo, starts)).clamp(min=0)


def _ordered(tiles_BQK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_blocks [B, 1, Qt], indices [B, 1, Qt, KVt]) of a tile table, listed tiles first."""
    tiles = tiles_BQK.to(torch.int32).unsqueeze(1)
    indices = torch.argsort(tiles, dim=-1, descending=True, stable=True)
    return tiles.sum(-1, dtype=torch.int32), indices.to(torch.int32)


def build_block_mask(
    anchors_BN: torch.Tensor,
    valid_BN: torch.Tensor,
    ctx_len: int,
    block_size: int,
    window: Optional[int] = None,
    semantics: str = CAUSAL_IN_BLOCK,
    *,
    builder: Union[str, Callable[..., BlockMask]] = "direct",
) -> BlockMask:
    """flex_attention BlockMask [B, 1, Q, KV] (heads broadcast) for one batch.

    ``builder`` is one of MASK_BUILDERS (costs in the module docstring) or a
    create_block_mask-like function, e.g. ``compiled_block_mask_builder("eager")``
    to exercise Dynamo's guards cheaply.
    """
    if builder == "direct":
        return direct_block_mask(anchors_BN, valid_BN, ctx_len, block_size, window, semantics)
    if isinstance(builder, str):
        if builder not in MASK_BUILDERS:
            raise ValueError(f"mask builder {builder!r} is not one of {MASK_BUILDERS}")
        builder = _default_compiled_builder() if builder == "compiled" else create_block_mask
    q_len, kv_len = mask_lengths(anchors_BN.shape[1], ctx_len, block_size)
    mask_mod = dflash_mask_mod(anchors_BN, valid_BN, ctx_len, block_size, window, semantics)
    return builder(mask_mod, anchors_BN.shape[0], None, q_len, kv_len, device=anchors_BN.device)


def dense_mask(
    anchors_BN: torch.Tensor,
    valid_BN: torch.Tensor,
    ctx_len: int,
    block_size: int,
    window: Optional[int] = None,
    semantics: str = CAUSAL_IN_BLOCK,
) -> torch.Tensor:
    """Boolean mask [B, 1, Q, KV] from the same mask_mod, for SDPA (CPU, small sizes only)."""
    q_len, kv_len = mask_lengths(anchors_BN.shape[1], ctx_len, block_size)
    mask_mod = dflash_mask_mod(anchors_BN, valid_BN, ctx_len, block_size, window, semantics)
    return create_mask(mask_mod, anchors_BN.shape[0], 1, q_len, kv_len, device=anchors_BN.device)
