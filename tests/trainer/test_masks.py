"""DFlash masks and attention paths, against a dense reference built independently.

Each of the known bugs in public DFlash trainers (docs/DFLASH.md) has a test here or
in test_anchors_loss.py (bug 1) that fails on the buggy behaviour.
"""

import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask, flex_attention

from trainer.anchors import sample_anchors
from trainer.attention import (
    FLEX_COMPILED,
    FLEX_EAGER,
    SDPA,
    AttentionPath,
    attend,
    build_layer_masks,
    select_attention_path,
)
from trainer.config import ConfigError
from trainer.masks import (
    SLIDING_SEMANTICS,
    build_block_mask,
    compiled_block_mask_builder,
    dense_mask,
    dflash_mask_mod,
    one_block_mask,
)

TILE = 128  # create_block_mask's default block size; kernels evaluate whole tiles


# ----------------------------------------------------------------------------- reference


def reference_mask(anchors, valid, ctx_len, block_size, window=None, padded_to=None, semantics="causal_in_block"):
    """[B, Q, KV] bool straight from the rules in DFLASH.md, one anchor at a time.
    Sliding layers: ``causal_in_block`` sees slots o-W+1..o, ``bidirectional`` the
    slots within W-1 of o on either side; both see context keys a+o-W+1..a-1."""
    batch, num_blocks = len(anchors), len(anchors[0])
    q_len, kv_len = padded_to or (num_blocks * block_size, ctx_len + num_blocks * block_size)
    ref = torch.zeros(batch, q_len, kv_len, dtype=torch.bool)
    for b in range(batch):
        for n in range(num_blocks):
            if not valid[b][n]:
                continue
            a = anchors[b][n]
            for o in range(block_size):
                q = n * block_size + o
                lowest = 0 if window is None else max(0, a + o - (window - 1))
                ref[b, q, lowest:a] = True  # context strictly before the anchor
                highest = o if semantics == "causal_in_block" else o + (window or 0) - 1
                for o2 in range(block_size):
                    if window is None or o - (window - 1) <= o2 <= highest:
                        ref[b, q, ctx_len + n * block_size + o2] = True
    return ref


def tiles(ref):
    """Per 128x128 tile of a padded reference: (any visible, all visible)."""
    batch, q_len, kv_len = ref.shape
    t = ref.view(batch, q_len // TILE, TILE, kv_len // TILE, TILE).permute(0, 1, 3, 2, 4)
    return t.any(-1).any(-1), t.all(-1).all(-1)


def listed_blocks(num_blocks, indices, shape):
    """Dense [B, Qtiles, KVtiles] bool from a BlockMask's (num_blocks, indices) pair."""
    dense = torch.zeros(shape, dtype=torch.bool)
    for b in range(shape[0]):
        for r in range(shape[1]):
            for c in indices[b, 0, r, : num_blocks[b, 0, r]].tolist():
                dense[b, r, c] = True
    return dense


def round_up(x):
    return (x + TILE - 1) // TILE * TILE


def make_anchors(seq_len, block_size, max_anchors, loss_spans, seed=0):
    loss_mask = torch.zeros(len(loss_spans), seq_len)
    for b, (lo, hi) in enumerate(loss_spans):
        loss_mask[b, lo:hi] = 1
    return sample_anchors(loss_mask, max_anchors, block_size, torch.Generator().manual_seed(seed))


CASES = [
    # (seq_len, block_size, max_anchors, loss spans per sequence, window)
    (40, 4, 3, [(5, 40), (0, 30)], None),  # few anchors
    (40, 4, 3, [(5, 40), (0, 30)], 6),
    (200, 8, 40, [(20, 200), (100, 180)], None),  # many anchors, padding to 128 on both axes
    (200, 8, 40, [(20, 200), (100, 180)], 12),
    (200, 8, 40, [(20, 200), (190, 200)], 5),  # window < block; second sequence skipped (< 2B loss tokens)
    (64, 4, 61, [(1, 64), (30, 64)], 3),  # every position an anchor: blocks overlap in position
]


# Every case under each sliding semantics (the full-layer cases once: semantics only shapes windows).
SEM_CASES = [(*case, sem) for case in CASES for sem in SLIDING_SEMANTICS if case[-1] is not None or sem == SLIDING_SEMANTICS[0]]


@pytest.mark.parametrize("seq_len,block_size,max_anchors,spans,window,semantics", SEM_CASES)
def test_dense_mask_matches_reference(seq_len, block_size, max_anchors, spans, window, semantics):
    anchors, valid = make_anchors(seq_len, block_size, max_anchors, spans)
    got = dense_mask(anchors, valid, seq_len, block_size, window, semantics)[:, 0]
    want = reference_mask(anchors.tolist(), valid.tolist(), seq_len, block_size, window, semantics=semantics)
    assert got.shape == want.shape
    assert torch.equal(got, want), f"{(got != want).sum()} mismatches"


@pytest.mark.parametrize("seq_len,block_size,max_anchors,spans,window,semantics", SEM_CASES)
def test_block_mask_matches_reference_tile_by_tile(seq_len, block_size, max_anchors, spans, window, semantics):
    anchors, valid = make_anchors(seq_len, block_size, max_anchors, spans)
    q_len, kv_len = anchors.shape[1] * block_size, seq_len + anchors.shape[1] * block_size
    bm = build_block_mask(anchors, valid, seq_len, block_size, window, semantics, builder="eager")
    assert bm.shape == (2, 1, q_len, kv_len)
    want = reference_mask(anchors.tolist(), valid.tolist(), seq_len, block_size, window,
                          (round_up(q_len), round_up(kv_len)), semantics)
    any_t, all_t = tiles(want)
    shape = any_t.shape
    partial = listed_blocks(bm.kv_num_blocks, bm.kv_indices, shape)
    full = listed_blocks(bm.full_kv_num_blocks, bm.full_kv_indices, shape)
    # Kernels skip unlisted tiles and skip the mask_mod on full ones: both must be exact.
    assert torch.equal(full, all_t)
    assert torch.equal(partial, any_t & ~all_t)
    # Inside partial tiles the kernel evaluates the mask_mod over the padded grid.
    mod = dflash_mask_mod(anchors, valid, seq_len, block_size, window, semantics)
    got = create_mask(mod, 2, 1, round_up(q_len), round_up(kv_len), device="cpu")[:, 0]
    assert torch.equal(got, want)


@pytest.mark.parametrize("semantics", SLIDING_SEMANTICS)
@pytest.mark.parametrize("anchor,window", [(0, 3), (5, 3), (5, 64), (30, 1), (30, 6), (30, 12)])
def test_one_block_mask_of_decoding_is_the_training_rule(anchor, window, semantics):
    # Decoding with a draft KV cache masks one block over the context before it.
    want = dense_mask(torch.tensor([[anchor]]), torch.tensor([[True]]), anchor, 8, window, semantics)[0, 0]
    assert torch.equal(one_block_mask(anchor, 8, window, semantics), want)


def test_sliding_semantics_differ_only_in_the_slots_after_the_query():
    anchors, valid = torch.tensor([[20]]), torch.tensor([[True]])
    causal = dense_mask(anchors, valid, 32, 8, 3, "causal_in_block")[0, 0]
    both = dense_mask(anchors, valid, 32, 8, 3, "bidirectional")[0, 0]
    assert torch.equal(causal[:, :32], both[:, :32])  # the context: keys a+o-2..a-1 under both
    assert both[0, 32:35].tolist() == [True, True, True] and causal[0, 32:35].tolist() == [True, False, False]
    assert torch.equal(both[:, 32:], torch.ones(8, 8, dtype=torch.bool).triu(-2).tril(2))
    with pytest.raises(ValueError, match="not one of"):
        dense_mask(anchors, valid, 32, 8, 3, "causal")


def test_bug2_context_is_strictly_before_the_anchor():
    anchors, valid = torch.tensor([[7, 20]]), torch.tensor([[True, True]])
    m = dense_mask(anchors, valid, 32, 4)[0, 0]
    for n, a in enumerate([7, 20]):
        rows = m[n * 4 : n * 4 + 4]
        assert rows[:, a - 1].all(), "the token before the anchor must be visible"
        assert not rows[:, a].any(), "the anchor's own target feature does not exist at inference"
        assert not rows[:, a + 1 : 32].any()


def test_bug3_blocks_never_see_each_other_even_when_positions_overlap():
    # Anchors 10 and 11 cover positions 10..13 and 11..14; sequence 1 has other anchors.
    anchors = torch.tensor([[10, 11, 30], [2, 3, 4]])
    valid = torch.ones(2, 3, dtype=torch.bool)
    ctx, bs = 40, 4
    for window in (None, 8):
        m = dense_mask(anchors, valid, ctx, bs, window)[:, 0]
        for b in range(2):
            for n in range(3):
                rows = m[b, n * bs : (n + 1) * bs, ctx:]
                own = torch.zeros_like(rows)
                own[:, n * bs : (n + 1) * bs] = True
                assert not (rows & ~own).any(), f"block {n} of sequence {b} sees another block"
                # Each sequence uses its own anchors (indexed by b, not shared across the batch).
                a = anchors[b, n].item()
                assert not m[b, n * bs, a:ctx].any()
                if window is None:
                    assert m[b, n * bs, :a].all()


def test_bug4_block_is_bidirectional_in_full_layers_causal_in_sliding():
    anchors, valid = torch.tensor([[5]]), torch.tensor([[True]])
    full = dense_mask(anchors, valid, 16, 4)[0, 0, :, 16:]
    assert full.all(), "slot 0 must see slot 3 in a full layer"
    sliding = dense_mask(anchors, valid, 16, 4, window=64)[0, 0, :, 16:]
    assert torch.equal(sliding, torch.ones(4, 4, dtype=torch.bool).tril())
    assert dense_mask(anchors, valid, 16, 4, 64, "bidirectional")[0, 0, :, 16:].all(), "bidirectional sliding layer"


def test_invalid_blocks_see_nothing():
    anchors, valid = make_anchors(48, 4, 10, [(0, 48), (41, 48)])  # sequence 1: 7 < 2B loss tokens
    assert not valid[1].any()
    m = dense_mask(anchors, valid, 48, 4)[:, 0]
    assert not m[1].any()
    invalid_rows = (~valid[0]).repeat_interleave(4)
    assert not m[0, invalid_rows].any()


def test_bug5_padded_rows_are_clamped_and_masked():
    # Q = 5 * 4 = 20 and KV = 50 + 20 = 70: both far from a multiple of 128.
    anchors, valid = torch.tensor([[3, 9, 17, 30, 41]]), torch.tensor([[True, True, False, True, True]])
    mod = dflash_mask_mod(anchors, valid, 50, 4, window=7)
    padded = create_mask(mod, 1, 1, TILE, TILE, device="cpu")[0, 0]  # what a kernel evaluates for the tile
    assert not padded[20:].any() and not padded[:, 70:].any()
    assert torch.equal(padded[:20, :70], reference_mask(anchors.tolist(), valid.tolist(), 50, 4, 7)[0])
    for builder in ("eager", "direct"):
        assert build_block_mask(anchors, valid, 50, 4, builder=builder).shape == (1, 1, 20, 70)

    # The same rule without the clamp reads the anchor table out of bounds.
    def unclamped(b, h, q_idx, kv_idx):
        return kv_idx < anchors[b, q_idx // 4]

    with pytest.raises(IndexError):
        create_mask(unclamped, 1, 1, TILE, TILE, device="cpu")


def test_bug6_compiled_block_mask_does_not_recompile_across_anchor_counts():
    # Dynamo's guards decide recompiles the same way for every backend; the eager
    # backend keeps this test at about a second on CPU (inductor: ~20 s per compile).
    builder = compiled_block_mask_builder("eager")
    seq_len, bs, max_anchors = 96, 4, 12
    spans = [[(0, 96), (88, 96)], [(86, 96), (0, 9)], [(0, 0), (0, 20)]]  # 12, 5, 7, 8, 0 valid
    warm_anchors, warm_valid = make_anchors(seq_len, bs, max_anchors, spans[0])
    build_block_mask(warm_anchors, warm_valid, seq_len, bs, builder=builder)  # warm-up: one compile

    valid_counts = set()
    with torch.compiler.set_stance("fail_on_recompile"):
        for seed, loss_spans in enumerate(spans):
            anchors, valid = make_anchors(seq_len, bs, max_anchors, loss_spans, seed=seed)
            assert anchors.shape == (2, max_anchors)  # static per bucket, whatever the data
            valid_counts.update(valid.sum(1).tolist())
            got = build_block_mask(anchors, valid, seq_len, bs, builder=builder)
            want = build_block_mask(anchors, valid, seq_len, bs, builder="eager")
            assert torch.equal(got.to_dense(), want.to_dense())
        assert len(valid_counts) >= 4  # several anchor counts went through one compiled entry

        # The bug: anchor tables sized to the anchors found recompile on every new count.
        with pytest.raises(RuntimeError, match="recompile"):
            build_block_mask(anchors[:, :5], valid[:, :5], seq_len, bs, builder=builder)


# ----------------------------------------------------------------------------- direct builder


def sampled(seq_len, block_size, max_anchors, spans):
    def sampled():
        return make_anchors(seq_len, block_size, max_anchors, spans)

    return sampled


def hand_picked():
    """ctx_len 300 (not a multiple of 128), 20 blocks of 16: Q = 320, KV = 620.

    Sequence 0: the first Q tile's anchors are all 255 (context tile 0 full, tile 1
    one key short of full), the second's all at ctx_len (context tiles 0 and 1
    full), then anchors 0, 17 (invalid), 128 and 299. Sequence 1: spread anchors,
    the second half invalid.
    """
    anchors = torch.tensor([[255] * 8 + [300] * 8 + [0, 17, 128, 299], [3 + 14 * n for n in range(20)]])
    valid = torch.ones(2, 20, dtype=torch.bool)
    valid[0, 17] = False
    valid[1, 10:] = False
    return anchors, valid


DIRECT_CASES = [
    # (anchors and valid flags, ctx_len, block_size, window, assert that full tiles occur)
    *[(sampled(s, bs, n, spans), s, bs, w, False) for s, bs, n, spans, w in CASES],
    (sampled(700, 8, 60, [(200, 700), (0, 650)]), 700, 8, None, True),
    (sampled(700, 8, 60, [(200, 700), (0, 650)]), 700, 8, 7, False),  # window < block
    (sampled(700, 8, 60, [(200, 700), (0, 650)]), 700, 8, 300, False),
    (sampled(130, 4, 40, [(0, 130), (60, 130)]), 130, 4, None, False),
    (sampled(130, 4, 40, [(0, 130), (60, 130)]), 130, 4, 2, False),
    (sampled(256, 16, 24, [(0, 256), (100, 256)]), 256, 16, None, False),  # blocks aligned to tiles
    (sampled(256, 16, 24, [(0, 256), (100, 256)]), 256, 16, 20, False),
    (hand_picked, 300, 16, None, True),
    (hand_picked, 300, 16, 1, False),  # each query sees its own slot only
    (hand_picked, 300, 16, 3, False),  # window < block
    (hand_picked, 300, 16, 16, False),
    (hand_picked, 300, 16, 100, False),
    (hand_picked, 300, 16, 128, False),  # anchor 255, slot 0: lowest context key 128, a tile edge
    (hand_picked, 300, 16, 1000, True),  # window longer than the context
]


def assert_same_tables(got, want):
    """Equal block counts and, per (b, tile row), equal sets of listed tiles, on both axes."""
    assert got.shape == want.shape and got.BLOCK_SIZE == want.BLOCK_SIZE
    for kind in ("kv", "full_kv", "q", "full_q"):
        num, indices = getattr(got, f"{kind}_num_blocks"), getattr(got, f"{kind}_indices")
        want_num, want_indices = getattr(want, f"{kind}_num_blocks"), getattr(want, f"{kind}_indices")
        assert indices.shape == want_indices.shape and indices.dtype == want_indices.dtype == torch.int32, kind
        assert torch.equal(num, want_num), kind
        shape = (indices.shape[0], indices.shape[2], indices.shape[3])
        assert torch.equal(listed_blocks(num, indices, shape), listed_blocks(want_num, want_indices, shape)), kind


DIRECT_SEM_CASES = [(*case, sem) for case in DIRECT_CASES for sem in SLIDING_SEMANTICS
                    if case[3] is not None or sem == SLIDING_SEMANTICS[0]]


@pytest.mark.parametrize("make,ctx_len,block_size,window,has_full,semantics", DIRECT_SEM_CASES)
def test_direct_block_mask_matches_create_block_mask(make, ctx_len, block_size, window, has_full, semantics):
    anchors, valid = make()
    got = build_block_mask(anchors, valid, ctx_len, block_size, window, semantics, builder="direct")
    want = build_block_mask(anchors, valid, ctx_len, block_size, window, semantics, builder="eager")
    assert_same_tables(got, want)
    if has_full:  # the full-tile tables are exercised, not only empty ones
        assert want.full_kv_num_blocks.sum() > 0


def as_kernel_sees(bm):
    """``bm`` with a mask_mod that applies its tile tables the way the fused kernel does.

    Eager flex_attention evaluates the mask_mod over the whole [Q, KV] grid and
    ignores the tables; the kernel skips unlisted tiles and skips the mask_mod on
    full ones.
    """
    shape = (bm.kv_indices.shape[0], bm.kv_indices.shape[2], bm.kv_indices.shape[3])
    partial = listed_blocks(bm.kv_num_blocks, bm.kv_indices, shape)
    full = listed_blocks(bm.full_kv_num_blocks, bm.full_kv_indices, shape)
    mask_mod = bm.mask_mod

    def kernel_mask_mod(b, h, q_idx, kv_idx):
        q_tile, kv_tile = q_idx // TILE, kv_idx // TILE
        return full[b, q_tile, kv_tile] | (partial[b, q_tile, kv_tile] & mask_mod(b, h, q_idx, kv_idx))

    return BlockMask.from_kv_blocks(
        bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
        BLOCK_SIZE=TILE, mask_mod=kernel_mask_mod, seq_lengths=bm.seq_lengths,
    )


@pytest.mark.parametrize("window,semantics", [(None, "causal_in_block"), (1000, "causal_in_block"), (3, "bidirectional")])
def test_flex_attention_with_direct_and_create_block_masks_agree(window, semantics):
    torch.manual_seed(0)
    anchors, valid = hand_picked()
    ctx_len, bs = 300, 16
    q = torch.randn(2, 4, 320, 16)
    k, v = torch.randn(2, 2, 620, 16), torch.randn(2, 2, 620, 16)
    path = AttentionPath(FLEX_EAGER, "cpu")
    out = {}
    for builder in ("direct", "eager"):
        bm = as_kernel_sees(build_block_mask(anchors, valid, ctx_len, bs, window, semantics, builder=builder))
        out[builder] = attend(q, k, v, bm, path)
    assert torch.equal(out["direct"], out["eager"])
    dense = dense_mask(anchors, valid, ctx_len, bs, window, semantics)
    assert (attend(q, k, v, dense, AttentionPath(SDPA, "cpu")) - out["direct"]).abs().max() < 1e-5


def test_build_block_mask_refuses_an_unknown_builder():
    anchors, valid = make_anchors(40, 4, 3, [(5, 40)])
    with pytest.raises(ValueError, match="not one of"):
        build_block_mask(anchors, valid, 40, 4, builder="dense")


# ----------------------------------------------------------------------------- attention paths


def _a_gpu(monkeypatch, capability=(9, 0), flash=None, found=True):
    """CI has no GPU and no flash-attn-4: the device query, the package's version and the
    module lookups are replaced to stand for a GPU of ``capability`` with flash-attn-4
    ``flash`` installed (None: not installed) and ``found`` deciding whether flash_attn.cute
    and torch's FLASH lowering are found."""
    import importlib.util

    import trainer.attention as attention

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(attention, "installed_version", lambda name: flash if name == "flash-attn-4" else None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if found else None)


def test_flex_kernel_flash_needs_a_hopper_or_blackwell_gpu_and_flash_attention_4(monkeypatch):
    import trainer.attention as attention

    with warnings.catch_warnings():
        assert select_attention_path("cpu", "auto", flex_kernel="flash").name == "sdpa"  # CPU: dense SDPA, as ever
        if not torch.cuda.is_available():
            with pytest.raises(ConfigError, match="'flash' refused: no CUDA GPU"):
                select_attention_path("cuda", "auto", flex_kernel="flash")
        _a_gpu(monkeypatch, flash=None, found=False)
        with pytest.raises(ConfigError, match="flash-attn-4 is not installed"):
            select_attention_path("cuda", "auto", flex_kernel="flash")
        # A release before the one that fixed its Hopper block-sparse backward is refused, naming both.
        _a_gpu(monkeypatch, flash="4.0.0b25")
        with pytest.raises(ConfigError, match="flash-attn-4 4.0.0b25 is older than 4.0.0b26"):
            select_attention_path("cuda", "auto", flex_kernel="flash")
        _a_gpu(monkeypatch, capability=(8, 0), flash="4.0.0b36")
        with pytest.raises(ConfigError, match="not Hopper or Blackwell"):
            select_attention_path("cuda", "auto", flex_kernel="flash")
        _a_gpu(monkeypatch, flash="4.0.0b36", found=False)  # installed, yet flash_attn.cute is not found
        with pytest.raises(ConfigError, match="flash_attn.cute"):
            select_attention_path("cuda", "auto", flex_kernel="flash")
        _a_gpu(monkeypatch, flash="4.0.0b36")
        path = select_attention_path("cuda", "auto", flex_kernel="flash")
    assert path.flash and path.hopper_tiles  # set as on every Hopper path; the FLASH options come first
    assert path.describe() == ("flex_compiled: flex_attention on flash-attention 4's kernels "
                               "(flash-attn-4 4.0.0b36; compile.flex_kernel flash)")
    # The FLASH options reach flex_attention for 16-bit inputs of head dim up to 128 only; other
    # calls take torch's defaults (the Hopper tiles fit only that range too).
    seen = []
    monkeypatch.setattr(attention, "_flex_compiled", lambda *a, kernel_options=None, **k: seen.append(kernel_options))
    for head_dim, dtype in ((128, torch.bfloat16), (64, torch.float16), (256, torch.bfloat16), (128, torch.float32)):
        q = torch.zeros(1, 2, 16, head_dim, dtype=dtype)
        attention.attend(q, q, q, None, path)
    assert seen == [attention.FLASH_OPTIONS, attention.FLASH_OPTIONS, None, None]


@pytest.mark.parametrize(
    "capability, flash, found, chosen, why",
    [
        ((9, 0), "4.0.0b36", True, "flash", "flash-attn-4 4.0.0b36; compile.flex_kernel auto"),
        ((10, 0), "4.0.0b36", True, "flash", "flash-attn-4 4.0.0b36; compile.flex_kernel auto"),
        ((9, 0), None, False, "tiles", "compile.flex_kernel auto: flash-attn-4 is not installed"),
        ((9, 0), "4.0.0b25", True, "tiles", "compile.flex_kernel auto: flash-attn-4 4.0.0b25 is older than 4.0.0b26"),
        ((8, 0), "4.0.0b36", True, "defaults", "compile.flex_kernel auto: the GPU is not Hopper or Blackwell "
                                               "(compute capability 8.0)"),
        ((12, 0), "4.0.0b36", True, "defaults", "compile.flex_kernel auto: the GPU is not Hopper or Blackwell"),
    ],
)
def test_flex_kernel_auto_is_flash_where_it_can_run_else_triton(monkeypatch, capability, flash, found, chosen, why):
    _a_gpu(monkeypatch, capability, flash, found)
    with warnings.catch_warnings():
        path = select_attention_path("cuda", "auto")
        triton = select_attention_path("cuda", "auto", flex_kernel="triton")
    assert path.flash is (chosen == "flash") and path.hopper_tiles is (capability[0] == 9)
    assert why in path.describe()
    kernels = "flash-attention 4's kernels" if chosen == "flash" else "its own Triton kernels"
    assert path.describe().startswith(f"flex_compiled: flex_attention on {kernels}")
    # triton: what auto gives where flash cannot run, whatever is installed
    assert not triton.flash and triton.hopper_tiles is (capability[0] == 9)
    assert triton.describe().endswith("(compile.flex_kernel triton)")


def test_flex_kernel_auto_without_torchs_flash_lowering_is_triton(monkeypatch):
    import importlib.util

    import trainer.attention as attention

    _a_gpu(monkeypatch, flash="4.0.0b36")
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == attention.FLASH_LOWERING else object())
    with warnings.catch_warnings():
        path = select_attention_path("cuda", "auto")
    assert not path.flash and "has no FLASH backend for flex_attention" in path.describe()


def test_flex_kernel_tiles_are_for_hopper_and_head_dims_up_to_128(monkeypatch):
    import trainer.attention as attention

    with warnings.catch_warnings():
        with pytest.raises(ConfigError, match="compile.flex_kernel"):
            select_attention_path("cuda", "auto", flex_kernel="fastest")
        if not torch.cuda.is_available():
            assert not select_attention_path("cuda", "auto").hopper_tiles  # no GPU to ask: torch's defaults
        # CI has no GPU: the device query is replaced to stand for each kind of GPU.
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(attention, "installed_version", lambda name: None)  # no flash-attn-4: auto is triton
        for capability, tiles in (((9, 0), True), ((8, 0), False), ((10, 0), False)):
            monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
            assert select_attention_path("cuda", "auto").hopper_tiles is tiles
            assert select_attention_path("cuda", "auto", flex_kernel="triton").hopper_tiles is tiles
            assert not select_attention_path("cuda", "auto", flex_kernel="default").hopper_tiles
        assert not select_attention_path("cpu", "auto").hopper_tiles

    # The options reach flex_attention for 16-bit inputs of head dim up to 128 only (fp32 or
    # wider heads would not fit shared memory in those tiles). The compiled kernel itself
    # needs a GPU: a recorder stands in for it.
    seen = []
    monkeypatch.setattr(attention, "_flex_compiled", lambda *a, kernel_options=None, **k: seen.append(kernel_options))
    path = AttentionPath(FLEX_COMPILED, "cuda", hopper_tiles=True)
    for head_dim, dtype in ((128, torch.bfloat16), (64, torch.float16), (256, torch.bfloat16), (128, torch.float32)):
        q = torch.zeros(1, 2, 4, head_dim, dtype=dtype)
        attention.attend(q, q, q, None, path)
    q = torch.zeros(1, 2, 4, 64, dtype=torch.bfloat16)
    attention.attend(q, q, q, None, AttentionPath(FLEX_COMPILED, "cuda"))
    assert seen == [attention.HOPPER_BWD_TILES, attention.HOPPER_BWD_TILES, None, None, None]


def test_bug7_gpu_path_refuses_the_dense_fallback():
    # Only the selection logic is exercised: no GPU is needed to choose a path.
    with warnings.catch_warnings():  # selection installs a process-wide filter; keep it local here
        assert select_attention_path("cuda", "auto") == AttentionPath(FLEX_COMPILED, "cuda")
        assert select_attention_path("cuda:3", "on").name == FLEX_COMPILED
        with pytest.raises(ConfigError, match="allow_eager"):
            select_attention_path("cuda", "off")
        assert select_attention_path("cuda", "off", allow_eager=True).name == FLEX_EAGER
        assert select_attention_path("cpu", "auto").name == SDPA
        assert select_attention_path("cpu", "off").name == SDPA
        with pytest.raises(ConfigError, match="no backward on CPU"):
            select_attention_path("cpu", "on")
        assert select_attention_path("cuda", "auto").mask_builder == "direct"
        assert select_attention_path("cuda", "auto", mask_builder="compiled").mask_builder == "compiled"
        assert select_attention_path("cuda", "auto", mask_builder="eager").mask_builder == "eager"

        # After choosing the compiled GPU path, a silent eager fallback is an error,
        # even when torch already showed its once-per-process warning.
        q = torch.randn(1, 2, 8, 16)
        bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, 1, 1, 8, 8, device="cpu")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            flex_attention(q, q, q, block_mask=bm)  # torch now counts its warning as shown
        select_attention_path("cuda", "auto")
        for _ in range(2):
            with pytest.raises(UserWarning, match="without torch.compile"):
                flex_attention(q, q, q, block_mask=bm)


@pytest.mark.parametrize("mask_builder", ["direct", "eager"])
def test_compiled_path_can_build_its_block_masks_without_compiling(mask_builder):
    # The compiled mask builder's cold compile grows with the bucket; the flex path
    # may build BlockMasks directly or eagerly instead, never dense tensors.
    anchors, valid = make_anchors(40, 4, 6, [(3, 40)])
    path = AttentionPath(FLEX_COMPILED, "cpu", mask_builder)
    masks = build_layer_masks(path, anchors, valid, 40, 4, ["full", "sliding"], 6)
    for layer_type, window in (("full", None), ("sliding", 6)):
        got = masks.for_layer(layer_type)
        want = build_block_mask(anchors, valid, 40, 4, window, builder="eager")
        assert not isinstance(got, torch.Tensor)
        assert torch.equal(got.to_dense(), want.to_dense()) and torch.equal(got.kv_indices, want.kv_indices)


@pytest.mark.parametrize("window,semantics", [(None, "causal_in_block"), (5, "causal_in_block"), (5, "bidirectional")])
def test_flex_and_sdpa_paths_agree(window, semantics):
    torch.manual_seed(0)
    seq_len, bs = 40, 4
    anchors, valid = make_anchors(seq_len, bs, 6, [(3, 40), (0, 36)])
    valid[0, 2] = False  # an invalid block in the middle
    q = torch.randn(2, 4, 6 * bs, 16)
    k = torch.randn(2, 2, seq_len + 6 * bs, 16)
    v = torch.randn(2, 2, seq_len + 6 * bs, 16)
    types = ["sliding" if window else "full"]
    out = {}
    for path in (AttentionPath(SDPA, "cpu"), AttentionPath(FLEX_EAGER, "cpu")):
        masks = build_layer_masks(path, anchors, valid, seq_len, bs, types, window or 0, semantics)
        out[path.name] = attend(q, k, v, masks.for_layer(types[0]), path)
    assert (out[SDPA] - out[FLEX_EAGER]).abs().max() < 1e-5
    assert torch.isfinite(out[SDPA]).all()
    assert out[SDPA][0, :, 2 * bs : 3 * bs].abs().max() == 0  # rows that see nothing are zeros
    # and the dense path agrees with a plain softmax over the reference mask
    ref = reference_mask(anchors.tolist(), valid.tolist(), seq_len, bs, window, semantics=semantics)[:, None]
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = (q @ kk.transpose(-1, -2) / 4.0).masked_fill(~ref, float("-inf"))
    manual = torch.nan_to_num(scores.softmax(-1)) @ vv
    assert (manual - out[SDPA]).abs().max() < 1e-5


def test_sdpa_path_trains_on_cpu():
    anchors, valid = make_anchors(24, 4, 4, [(0, 24)])
    mask = dense_mask(anchors, valid, 24, 4)
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    kv = torch.randn(1, 1, 40, 8, requires_grad=True)
    out = attend(q, kv, kv, mask, AttentionPath(SDPA, "cpu"))
    out.square().sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(kv.grad).all()
