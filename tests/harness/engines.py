"""What each serving engine runs, written from its documented rule (not its code):
which keys a drafter's block query may see, per layer. Used by the engine-rule
tests (tests/trainer/test_engine_rules.py) and the export's public loaders
(tests/trainer/test_export.py).

The rules, per layer, for the query at position qp (block slot o of the block
anchored at a, so qp = a + o) and a key at position kp (context 0..a-1, then the
block a..a+B-1), with window W:

- vLLM (vllm/model_executor/models/qwen3_dflash.py, ``_dflash_layer_causal``) and
  SGLang (python/sglang/srt/models/dflash.py): a ``sliding_attention`` layer is
  causal over keys qp-W+1..qp; a ``full_attention`` layer sees every key it is
  given. An explicit ``dflash_config.causal: false`` / ``is_causal: false`` makes
  vLLM's layers non-causal, windowed by its attention backend's own rule (not
  stated here: the export writes it only where the window never binds).
- z-lab's reference code (dflash/model.py: ``is_causal = False`` for every layer,
  ``dflash_generate`` passes no mask): non-causal; flash-attention turns the
  sliding window into a symmetric one, |qp - kp| < W; eager and sdpa drop it.
- speculators (src/speculators/models/dflash/, the anchor block mask): a sliding
  layer sees context keys a-W..a-1 and its block causally (o' <= o) when
  ``sliding_window_non_causal`` is false, the whole block when true.
"""

from __future__ import annotations


def engine_visible(engine: str, layer_type: str, qp, kp, anchor: int, window: int, keys: dict):
    """Boolean [B, K]: which keys the engine lets each block query see (module docstring).
    None where the engine's rule is not a documented one (vLLM's non-causal window)."""
    import torch

    everything = torch.ones(qp.shape[0], kp.shape[1], dtype=torch.bool)
    if layer_type == "full":
        return everything
    if engine in ("vllm", "sglang"):
        causal = keys.get("dflash_config.causal", keys.get("is_causal", True))
        if not causal:
            return everything if window >= int(qp.max()) + 1 else None
        return (kp <= qp) & (kp > qp - window)
    if engine == "zlab":  # flash-attention's symmetric window, every layer non-causal
        return (kp - qp).abs() < window
    if engine == "speculators":
        in_block = kp >= anchor
        ctx_ok = ~in_block & (kp >= anchor - window)
        block_ok = in_block & (keys["sliding_window_non_causal"] | (kp <= qp))
        return ctx_ok | block_ok
    raise AssertionError(engine)
