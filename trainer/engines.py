"""How each serving engine runs a drafter's layers, and what an export may write for it.

A drafter is worth something only when the engine builds the attention it trained
with. Engines differ on sliding layers: each rule below names the file and function of
the engine's public code it was read from (``EngineRule.code``), and the tests build
each engine's mask from that code (tests/harness/engines.py) against the trainer's.

Per layer, for the query at position p = a + o (slot o of the block anchored at a),
keys are the context 0..a-1 then the block a..a+B-1, window W:

- trained ``causal_in_block``: keys p-W+1..p (causal inside the block);
- trained ``bidirectional``: keys within W-1 of p on either side;
- a full layer: the whole context and the whole block, in every engine.

A sliding layer whose window never binds (W covers every position the target
reaches) and that trained ``bidirectional`` sees exactly what a full layer sees, so
it is exported as ``full_attention`` (``exported_layer_types``): every engine then
runs it as trained, with no key to set. Every other sliding layer is exported as
``sliding_attention`` and refused where the engine would run it otherwise
(``engine_problems``), with the setting that fits.
"""

from __future__ import annotations

from dataclasses import dataclass

ENGINES = ("vllm", "sglang", "zlab", "speculators")
ENGINE_FORMAT = {"vllm": "dflash", "sglang": "dflash", "zlab": "dflash", "speculators": "speculators"}
FORMAT_ENGINES = {"dflash": ("vllm", "sglang"), "speculators": ("speculators",)}  # checked when no --engine is named


@dataclass(frozen=True)
class EngineRule:
    """What an engine does with a drafter's layers, and where that was read."""

    name: str  # as users know it
    code: str  # file: function(s), in the engine's public repository or package
    rule: str  # what it runs, in the notation of the module docstring


ENGINE_RULES = {
    "vllm": EngineRule(
        "vLLM",
        "vllm/model_executor/models/qwen3_dflash.py: _dflash_layer_causal, _resolve_layer_attention; "
        "vllm/v1/attention/backends/flash_attn.py: FlashAttentionImpl.__init__",
        "a sliding_attention layer is causal with the window (W-1, 0), keys p-W+1..p; a full_attention layer is "
        "non-causal over every key; is_causal, else dflash_config.causal, sets the causality of every layer at once; "
        "a non-causal sliding layer keeps (W-1, 0), which releases with _maybe_symmetrize_window widen to "
        "(W-1, W-1) and earlier ones run causal"),
    "sglang": EngineRule(
        "SGLang",
        "python/sglang/srt/models/dflash.py: _get_dflash_layer_attention_params; "
        "python/sglang/srt/speculative/dflash_utils.py: get_dflash_attention_sliding_window_size",
        "a sliding_attention layer is AttentionType.DECODER (causal) with window_left = W-1, keys p-W+1..p; a "
        "full_attention layer is ENCODER_ONLY (non-causal); no key changes either"),
    "zlab": EngineRule(
        "z-lab's dflash package (PyPI dflash 0.1.0)",
        "dflash/model.py: Qwen3DFlashAttention.__init__, _attention_mask",
        "a sliding_attention layer is causal unless the config's is_causal is false, masked q-k < W (and k-q < W "
        "when non-causal); a full_attention layer is non-causal unless is_causal is true; the April 2026 "
        "revision on GitHub ran every layer non-causal (is_causal = False in Qwen3DFlashAttention.__init__)"),
    "speculators": EngineRule(
        "speculators 0.9.0",
        "speculators/models/dflash/attention.py: create_anchor_block_mask_mod; "
        "speculators/models/dflash/core.py: DFlashDraftModel._build_attention_mask",
        "a sliding_attention layer sees context keys a-W..a-1 (the window anchored at the block's anchor a) and "
        "its block causally (sliding_window_non_causal: false) or whole (true); a full_attention layer sees the "
        "context before a and the whole block"),
}


def rule_text(engine: str) -> str:
    r = ENGINE_RULES[engine]
    return f"{r.name} ({r.code}): {r.rule}"


def window_never_binds(serving: dict) -> bool:
    """True when W covers every position the target reaches (max_position_embeddings):
    then no key a sliding layer could see is ever outside its window."""
    window, max_pos = serving.get("sliding_window"), (serving.get("rope") or {}).get("max_position_embeddings")
    return isinstance(window, int) and isinstance(max_pos, int) and window >= max_pos


def trained_as_full(serving: dict) -> bool:
    """A bidirectional sliding layer whose window never binds trained as a full layer."""
    return serving.get("sliding_semantics") == "bidirectional" and window_never_binds(serving)


def exported_layer_types(serving: dict) -> list[str]:
    """The trainer's layer types ('full' / 'sliding') as the export describes them: a
    sliding layer that trained as a full one (``trained_as_full``) is 'full'."""
    types = list((serving.get("drafter") or {}).get("layer_types") or [])
    return ["full" if t == "sliding" and trained_as_full(serving) else t for t in types]


def sliding_layers(serving: dict) -> list[int]:
    """The layers exported as sliding_attention."""
    return [i for i, t in enumerate(exported_layer_types(serving)) if t == "sliding"]


def engine_problems(serving: dict, engine: str) -> list[str]:
    """Why ``engine`` would run this drafter's layers otherwise than trained, with the
    setting that would fit; empty when it runs them as trained."""
    sliding = sliding_layers(serving)
    if not sliding:
        return []
    semantics, window = serving.get("sliding_semantics"), serving.get("sliding_window")
    max_pos = (serving.get("rope") or {}).get("max_position_embeddings")
    trained = (f"layers {sliding} were trained with model.sliding_semantics: {semantics} "
               f"(window {window}: a slot saw " + ("only the slots before it)" if semantics == "causal_in_block"
                                                  else "the slots after it too)"))
    rule = rule_text(engine)
    never_binds = (f"model.sliding_window: {max_pos} or more (the target's max_position_embeddings: the window "
                   "never binds")
    if engine in ("vllm", "sglang") and semantics == "bidirectional":
        return [f"--engine {engine}: {trained}; {rule}. It would not run the symmetric window of {window} the "
                f"drafter was trained with. Fits: --engine zlab, model.sliding_semantics: causal_in_block (train "
                f"again), or {never_binds}, and the layers are exported as full attention)"]
    if engine == "speculators" and not window_never_binds(serving):
        return [f"--engine speculators: {trained}; {rule}; this drafter's slot o saw context keys a+o-W+1..a-1, so "
                f"the two agree only where the window never binds. Fits: {never_binds}), full layers only, or "
                + ("--engine vllm / --engine sglang / --engine zlab" if semantics == "causal_in_block"
                   else "--engine zlab")]
    return []


def engine_keys(serving: dict, engine: str) -> dict:
    """The causality keys ``engine`` reads, set so it runs the drafter as trained; none
    where its default does (sliding layers causal, full layers non-causal)."""
    bidirectional = bool(sliding_layers(serving)) and serving.get("sliding_semantics") == "bidirectional"
    if engine == "speculators":
        return {"sliding_window_non_causal": bidirectional}
    if engine == "zlab" and bidirectional:
        return {"is_causal": False}  # dflash 0.1.0 reads it: sliding layers get the symmetric window
    return {}  # vLLM: is_causal would set every layer, full ones included; SGLang reads none


def engine_warnings(serving: dict, engines: tuple) -> list[str]:
    types = exported_layer_types(serving)
    out = []
    if "sliding" in types:
        out.append(f"sliding layers (window {serving.get('sliding_window')}, {serving.get('sliding_semantics')}): "
                   + "; ".join(rule_text(e) for e in engines)
                   + "; an engine not named here may run them otherwise (check with --engine)")
        if "zlab" in engines:
            out.append("--engine zlab: serve with the dflash package 0.1.0 or later: earlier revisions of z-lab's "
                       "dflash/model.py ran every layer non-causal, whatever the config says")
        if "full" in types and "vllm" in engines:
            out.append("mixed full and sliding layers: vLLM needs its V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1)")
    if trained_as_full(serving) and "sliding" in ((serving.get("drafter") or {}).get("layer_types") or []):
        out.append(f"sliding layers with window {serving.get('sliding_window')} (never binding, bidirectional) are "
                   "exported as full_attention: they trained exactly as full layers")
    return out
