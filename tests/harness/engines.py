"""Which keys each serving engine lets a drafter's block query see, written from the
engine's code (file and function named per engine, as in trainer/engines.py), from
the exported config alone. Used by the engine-rule tests
(tests/trainer/test_engine_rules.py) and the export's loaders (tests/trainer/test_export.py).

The query at position qp (slot o of the block anchored at a, qp = a + o) and keys at
positions kp: the context 0..a-1, then the block a..a+B-1.
"""

from __future__ import annotations

SLIDING = "sliding_attention"


def _vllm(config: dict, layer: int, qp, kp):
    """vllm/model_executor/models/qwen3_dflash.py: ``_dflash_layer_causal`` (is_causal, else
    dflash_config.causal, else layer_types[i] == sliding_attention) and
    ``_resolve_layer_attention`` (the window: dflash_config.swa_window_size, else
    sliding_window); vllm/v1/attention/backends/flash_attn.py: ``FlashAttentionImpl.__init__``
    turns a window W into (W-1, 0). A non-causal layer with a window: (W-1, W-1) in
    releases with ``_maybe_symmetrize_window``, causal before them: None (no one rule)."""
    dflash = config.get("dflash_config") or {}
    if config.get("is_causal") is not None:
        causal = bool(config["is_causal"])
    elif dflash.get("causal") is not None:
        causal = bool(dflash["causal"])
    else:
        causal = config["layer_types"][layer] == SLIDING
    window = dflash.get("swa_window_size", config.get("sliding_window")) if config["layer_types"][layer] == SLIDING \
        else None
    if window is not None and not causal:
        return None
    visible = (kp <= qp) if causal else (kp >= 0) & (qp >= 0)
    return visible & (qp - kp <= window - 1) if window is not None else visible


def _sglang(config: dict, layer: int, qp, kp):
    """python/sglang/srt/models/dflash.py: ``_get_dflash_layer_attention_params`` (sliding:
    AttentionType.DECODER, causal, window_left from
    python/sglang/srt/speculative/dflash_utils.py ``get_dflash_attention_sliding_window_size``
    = W - 1; full: ENCODER_ONLY, window -1)."""
    if config["layer_types"][layer] != SLIDING:
        return (kp >= 0) & (qp >= 0)
    return (kp <= qp) & (qp - kp <= config["sliding_window"] - 1)


def _zlab(config: dict, layer: int, qp, kp):
    """dflash 0.1.0 (PyPI), dflash/model.py: ``Qwen3DFlashAttention.__init__`` (causal = the
    layer slides, unless the config's is_causal says otherwise; window only on sliding
    layers) and ``_attention_mask`` (causal: k <= q; window: q - k < W, and k - q < W when
    non-causal)."""
    sliding = config["layer_types"][layer] == SLIDING
    causal = sliding if config.get("is_causal") is None else bool(config["is_causal"])
    visible = (kp >= 0) & (qp >= 0)
    if causal:
        visible = visible & (kp <= qp)
    if sliding:
        window = config["sliding_window"]
        visible = visible & (qp - kp < window)
        if not causal:
            visible = visible & (kp - qp < window)
    return visible


def _speculators(config: dict, layer: int, qp, kp, anchor: int):
    """speculators 0.9.0, speculators/models/dflash/attention.py: ``create_anchor_block_mask_mod``
    (context before the anchor, within ``sliding_window`` of it on a sliding layer; the
    block whole, or causal on a sliding layer unless sliding_window_non_causal), as
    ``DFlashDraftModel._build_attention_mask`` (core.py) calls it per layer type."""
    tl = config["transformer_layer_config"]
    window = tl["sliding_window"] if tl["layer_types"][layer] == SLIDING else None
    non_causal = window is None or config["sliding_window_non_causal"]
    in_block = (kp >= anchor) & (qp >= 0)  # [B, K]
    context = ~in_block & ((kp >= anchor - window) if window is not None else True)
    block = in_block & (True if non_causal else (kp <= qp))
    return context | block


def engine_visible(engine: str, config: dict, layer: int, anchor: int, block: int):
    """Boolean [B, anchor + B]: what ``engine`` lets each query of the block anchored at
    ``anchor`` see in ``layer``, given the exported ``config``. None where the engine's
    code gives no single answer (vLLM's non-causal sliding layer)."""
    import torch

    qp = torch.arange(anchor, anchor + block)[:, None]
    kp = torch.arange(anchor + block)[None, :]
    if engine == "vllm":
        return _vllm(config, layer, qp, kp)
    if engine == "sglang":
        return _sglang(config, layer, qp, kp)
    if engine == "zlab":
        return _zlab(config, layer, qp, kp)
    if engine == "speculators":
        return _speculators(config, layer, qp, kp, anchor)
    raise AssertionError(engine)
