"""What an inference engine needs to know about a trained drafter.

A drafter is only useful when an engine runs it exactly as it was trained. Three
settings fail silently when they differ (acceptance collapses, output stays correct):

- the mask token id: slots 1..B-1 hold its embedding, so another id feeds B-1 of B
  slots an input they never saw;
- the target layers whose hidden states are fused, and how they are numbered;
- the attention of sliding-window layers (``model.sliding_semantics``): engines
  differ. vLLM (``vllm/model_executor/models/qwen3_dflash.py``,
  ``_dflash_layer_causal``) and SGLang (``python/sglang/srt/models/dflash.py``, sliding
  layers as decoder attention with ``window_left = W - 1``) run them causal inside
  the block; z-lab's reference code (``dflash/model.py``: ``Qwen3DFlashAttention``
  sets ``is_causal = False`` for every layer, ``dflash_generate`` passes
  ``is_causal=False`` and no mask) runs them bidirectionally; speculators
  (``src/speculators/models/dflash/``, the anchor block mask) anchors the window at
  the block's anchor. trainer/export.py refuses an engine that would run the
  drafter otherwise.

So every checkpoint carries a ``serving`` section in meta.json (``metadata``), the
mask-token default follows the public drafters (``resolve_mask_token_id``), a resume
with another mask id is refused (``check_resume``), the section is believed only
within bounds (``validate``), and a target is the trained one when what the drafter
depends on is equal (``target_differences``), whatever transformers version wrote
its config. trainer/restore.py rebuilds a drafter from a checkpoint.

This module never writes checkpoints (trainer/checkpoint.py does), never trains, and
imports neither of them (data flows checkpoint -> serving, model -> serving).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from typing import Any, Optional

from trainer.config import ConfigError, ModelConfig

SERVING_FORMAT = 1
META_NAME = "meta.json"  # trainer.checkpoint.META, named here without importing the writer

LAYER_ID_CONVENTION = (
    "0-based index of a target decoder layer; its feature is that layer's output, "
    "which is Hugging Face hidden_states[id + 1] (z-lab dflash and SpecForge number "
    "layers this way; vLLM speculators' aux_hidden_state_layer_ids are id + 1)"
)
SLIDING_SEMANTICS = ("causal_in_block", "bidirectional")  # trainer.masks.SLIDING_SEMANTICS (torch-free here)
LEGACY_SEMANTICS = {"causal-in-block": "causal_in_block"}  # what checkpoints recorded before the choice existed
_FULL_LAYERS = "; full layers see the whole context before the anchor and the whole block (bidirectional)"
SLIDING_DESCRIPTIONS = {
    "causal_in_block": "a sliding layer's query at position p sees keys at positions p-W+1..p over the joint "
                       "positions (context before the anchor, then the block), so it is causal inside the block"
                       + _FULL_LAYERS,
    "bidirectional": "a sliding layer's query at position p sees keys within W-1 positions of p on either side over "
                     "the joint positions (context before the anchor, then the block), so a slot also sees the slots "
                     "after it" + _FULL_LAYERS,
}
ACCEPTANCE_CONVENTION = "accept_len counts accepted draft tokens (0..B-1); tau = accept_len + 1 counts the bonus token"

# Config keys that describe a file or a run, not the network: left out of the hash.
_VOLATILE_CONFIG_KEYS = frozenset({
    "_name_or_path", "transformers_version", "dtype", "torch_dtype", "architectures", "use_cache",
    "output_hidden_states", "output_attentions", "return_dict", "_attn_implementation",
    "_attn_implementation_autoset", "_commit_hash", "id2label", "label2id", "problem_type",
    "chunk_size_feed_forward", "is_encoder_decoder",
})


# ---------------------------------------------------------------------------- target facts


def target_config_hash(config) -> str:
    """sha256 (16 hex digits) of the target's architecture config (a Hugging Face
    config or its dict), without file and runtime keys. Recorded for information
    only: one model's ``to_dict()`` differs between transformers versions (where
    rope_theta sits), so whether a target is the trained one is decided by
    ``target_differences``."""
    raw = config if isinstance(config, dict) else config.to_dict()
    kept = {k: v for k, v in raw.items() if k not in _VOLATILE_CONFIG_KEYS}
    text = json.dumps(kept, sort_keys=True, default=str)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def _field(config, name: str):
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)


def rope_settings(config) -> dict:
    """The target's RoPE as {rope_theta, rope_type, ...scaling fields,
    max_position_embeddings} from a Hugging Face config or its dict, in one form
    whichever transformers version wrote it: 4.x keeps ``rope_theta`` at the top level
    and scaling in ``rope_scaling``; 5.x keeps both in ``rope_parameters``. The
    drafter builds its rotary embedding from the target's config, so it inherits all
    of it."""
    params = _field(config, "rope_parameters")
    if isinstance(params, dict) and params:
        out = dict(params)
    else:
        scaling = _field(config, "rope_scaling")
        out = dict(scaling) if isinstance(scaling, dict) else {}
    if out.get("rope_theta") is None:
        out["rope_theta"] = _field(config, "rope_theta")
    out["rope_type"] = out.pop("type", None) or out.get("rope_type") or "default"
    if isinstance(out["rope_theta"], int) and not isinstance(out["rope_theta"], bool):
        out["rope_theta"] = float(out["rope_theta"])  # 1000000 and 1e6 are one theta
    out["max_position_embeddings"] = _field(config, "max_position_embeddings")
    return out


def target_layer_ids_for(config, k: int) -> list[int]:
    from trainer.target import target_layer_ids  # the one formula, shared with the feature capture

    return target_layer_ids(config.num_hidden_layers, k)


def read_target_config(cfg: ModelConfig):
    """The target's Hugging Face config without loading weights (preset or local path)."""
    if cfg.path:
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(cfg.path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ConfigError([f"model.path: cannot read a model config from '{cfg.path}': {str(e).splitlines()[0]}"]) from None
    from trainer.target import preset_config

    if not cfg.preset:
        raise ConfigError(["model: set either 'path' (a local model directory) or 'preset'"])
    return preset_config(cfg.preset)


# ---------------------------------------------------------------------------- mask token


@functools.lru_cache(maxsize=8)
def _tokenizer_facts(path: str) -> Optional[tuple]:
    """(class name, len(tokenizer), highest special/added id) of the tokenizer in a local
    model directory, or None when the directory holds no tokenizer."""
    if not any(os.path.exists(os.path.join(path, f)) for f in
               ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")):
        return None
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:  # noqa: BLE001 - an unreadable tokenizer is "no tokenizer": the fallback applies
        return None
    ids = [int(i) for i in getattr(tok, "all_special_ids", []) or [] if i is not None]
    added = getattr(tok, "added_tokens_decoder", None) or {}
    ids += [int(i) for i in added]
    return type(tok).__name__, len(tok), max(ids) if ids else None


def tokenizer_info(cfg: ModelConfig) -> Optional[dict]:
    facts = _tokenizer_facts(os.path.abspath(cfg.path)) if cfg.path else None
    if facts is None:
        return None
    name, size, top_special = facts
    return {"path": os.path.abspath(cfg.path), "class": name, "size": size, "max_special_id": top_special}


def resolve_mask_token_id(cfg: ModelConfig, vocab_size: int) -> tuple[int, str]:
    """(mask token id, where it came from).

    ``model.mask_token_id`` when set; otherwise the first id past the target
    tokenizer's tokens and special tokens, as the public Qwen3 drafters use (151669:
    the id a newly added ``<|MASK|>`` gets), when ``model.path`` holds a tokenizer and
    that id has an embedding row; otherwise ``vocab_size - 1``.
    """
    if cfg.mask_token_id is not None:
        return cfg.mask_token_id, "config"
    tok = tokenizer_info(cfg)
    if tok is not None:
        first_free = max(tok["size"], (tok["max_special_id"] or -1) + 1)
        if first_free < vocab_size:
            return first_free, "tokenizer"
    return vocab_size - 1, "vocab_size-1"


# ---------------------------------------------------------------------------- metadata


def metadata(model_cfg: ModelConfig, target_config, mask_token_id: int, mask_token_source: str,
             compute_dtype: str) -> dict:
    """The ``serving`` section of meta.json: everything an engine needs (module docstring)."""
    c = target_config
    heads = c.num_attention_heads
    layer_types = list(model_cfg.layer_types or ["full"] * model_cfg.drafter_layers)
    k = model_cfg.num_target_layers
    return {
        "format": SERVING_FORMAT,
        "target": {
            "preset": None if model_cfg.path else model_cfg.preset,
            "path": os.path.abspath(model_cfg.path) if model_cfg.path else None,
            "model_type": getattr(c, "model_type", None),
            "architectures": list(getattr(c, "architectures", None) or []),
            "config_hash": target_config_hash(c),
            "num_hidden_layers": c.num_hidden_layers,
            "hidden_size": c.hidden_size,
            "vocab_size": c.vocab_size,
            "tie_word_embeddings": bool(getattr(c, "tie_word_embeddings", False)),
            "bos_token_id": getattr(c, "bos_token_id", None),
            "eos_token_id": getattr(c, "eos_token_id", None),
            "pad_token_id": getattr(c, "pad_token_id", None),
        },
        "target_layer_ids": target_layer_ids_for(c, k),
        "layer_id_convention": LAYER_ID_CONVENTION,
        "mask_token_id": int(mask_token_id),
        "mask_token_source": mask_token_source,
        "block_size": model_cfg.block_size,
        "drafter": {
            "architecture": "dflash-qwen3",
            "num_hidden_layers": model_cfg.drafter_layers,
            "layer_types": layer_types,
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_attention_heads": heads,
            "num_key_value_heads": getattr(c, "num_key_value_heads", None) or heads,
            "head_dim": getattr(c, "head_dim", None) or c.hidden_size // heads,
            "rms_norm_eps": getattr(c, "rms_norm_eps", 1e-6),
            "hidden_act": "silu",
            "attention_bias": False,
            "num_target_features": k,
            "shares_target_embeddings_and_lm_head": True,
        },
        "sliding_window": model_cfg.sliding_window if "sliding" in layer_types else None,
        "sliding_semantics": model_cfg.sliding_semantics,
        "attention": SLIDING_DESCRIPTIONS[model_cfg.sliding_semantics],
        "rope": rope_settings(c),
        "dtype": {"weights": "float32", "compute": compute_dtype},
        "tokenizer": tokenizer_info(model_cfg),
        "acceptance": ACCEPTANCE_CONVENTION,
    }


def checkpoint_metadata(model, config_dict: Optional[dict]) -> Optional[dict]:
    """The serving section for a drafter about to be checkpointed; None for any other
    module (checkpoint.save also serves plain modules in tests)."""
    target_config = getattr(model, "target_config", None)
    model_cfg = getattr(model, "model_cfg", None)
    if target_config is None or model_cfg is None:
        return None
    device = next(model.parameters()).device
    if model_cfg.dtype == "auto":
        compute = "bfloat16" if device.type == "cuda" else "float32"
    else:
        compute = model_cfg.dtype
    return metadata(model_cfg, target_config, model.mask_token_id, model.mask_token_source, compute)


def recorded_mask_token_id(meta: dict, vocab_size: int) -> tuple[int, str]:
    """The mask id a checkpoint was trained with. Checkpoints written before the
    serving section used model.mask_token_id, else vocab_size - 1."""
    serving = meta.get("serving") or {}
    if "mask_token_id" in serving:
        recorded, source = serving["mask_token_id"], serving.get("mask_token_source", "recorded")
    else:
        recorded = ((meta.get("config") or {}).get("model") or {}).get("mask_token_id")
        if recorded is None:
            return vocab_size - 1, "vocab_size-1"
        source = "config"
    if not _is_int(recorded) or not 0 <= recorded < vocab_size:
        key = "serving.mask_token_id" if "mask_token_id" in serving else "config.model.mask_token_id"
        raise ConfigError([f"{META_NAME}: {key}: {recorded!r} is not a token id of the target's vocabulary "
                           f"[0, {vocab_size}); the checkpoint's metadata is damaged"])
    return recorded, source


def check_resume(meta: dict, model, path: str) -> None:
    """ConfigError when ``model`` would continue a checkpoint with another mask token id."""
    if not hasattr(model, "mask_token_id") or not hasattr(model, "embed_tokens"):
        return
    recorded, source = recorded_mask_token_id(meta, model.embed_tokens.num_embeddings)
    if model.mask_token_id != recorded:
        now = getattr(model, "mask_token_source", "config")
        raise ConfigError([
            f"model.mask_token_id: checkpoint {path} was trained with mask token id {recorded} ({source}), "
            f"but this configuration gives {model.mask_token_id} ({now}). A drafter served with another mask id "
            f"than it was trained with loses its acceptance in {model.block_size - 1} of {model.block_size} slots. "
            f"Set model.mask_token_id: {recorded} to continue this run, or start a new one (--resume never)."
        ])


def derived_metadata(meta: dict, where: str = META_NAME) -> dict:
    """The serving section of a checkpoint, checked (``validate``: ConfigError naming
    ``where``); rebuilt from its config (without weights) when the checkpoint predates
    the section, and then marked ``derived: true``."""
    if meta.get("serving"):
        return validate(meta["serving"], where, meta.get("config"))
    from trainer import config as config_mod

    cfg = config_mod.from_dict(meta.get("config") or {}, prefix=f"{where}: config")
    target_config = read_target_config(cfg.model)
    mask, source = recorded_mask_token_id(meta, target_config.vocab_size)
    compute = cfg.model.dtype if cfg.model.dtype != "auto" else ("float32" if cfg.placement.device == "cpu" else "auto")
    out = metadata(cfg.model, target_config, mask, source, compute)
    out["derived"] = True
    return validate(out, where)


# ---------------------------------------------------------------------------- validation

# (lowest, highest) of every integer of the section a reader builds or writes something
# from. Past them a value is damage or a typo, never a drafter: a drafter of 100000
# layers is allocated until the process is killed, a block of -4 exports as "ok".
SERVING_BOUNDS = {
    "block_size": (2, 256),
    "target.num_hidden_layers": (1, 1024),
    "target.hidden_size": (1, 1 << 16),
    "target.vocab_size": (1, 1 << 22),
    "drafter.num_hidden_layers": (1, 64),
    "drafter.hidden_size": (1, 1 << 16),
    "drafter.intermediate_size": (1, 1 << 20),
    "drafter.num_attention_heads": (1, 1024),
    "drafter.num_key_value_heads": (1, 1024),
    "drafter.head_dim": (1, 1024),
    "drafter.num_target_features": (1, 64),
}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _at(section: dict, dotted: str):
    value = section
    for key in dotted.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value


def validate(serving: dict, where: str = META_NAME, config: Optional[dict] = None) -> dict:
    """``serving`` with its sliding semantics in today's spelling, once every field a
    reader relies on has the right type and lies within SERVING_BOUNDS, and agrees
    with the run's ``config`` (its model section) where both state it; else
    ConfigError, one line per field, naming ``where``."""
    problems = []

    def bad(field: str, why: str) -> None:
        problems.append(f"{where}: serving.{field}: {why}; the checkpoint's metadata is damaged or not this trainer's")

    if not isinstance(serving, dict):
        raise ConfigError([f"{where}: serving: expected a mapping, got {type(serving).__name__}"])
    for field, (lo, hi) in SERVING_BOUNDS.items():
        value = _at(serving, field)
        if not _is_int(value):
            bad(field, f"expected an integer, got {value!r}")
        elif not lo <= value <= hi:
            bad(field, f"{value} is outside [{lo}, {hi}]")
    vocab, layers = _at(serving, "target.vocab_size"), _at(serving, "target.num_hidden_layers")
    mask = serving.get("mask_token_id")
    if not _is_int(mask) or (_is_int(vocab) and not 0 <= mask < vocab):
        bad("mask_token_id", f"{mask!r} is not a token id of the target's vocabulary of {vocab}")
    ids = serving.get("target_layer_ids")
    if not isinstance(ids, list) or not ids or not all(_is_int(i) and (not _is_int(layers) or 0 <= i < layers) for i in ids):
        bad("target_layer_ids", f"{ids!r} is not a list of layers of the {layers}-layer target")
    elif _is_int(_at(serving, "drafter.num_target_features")) and len(ids) != _at(serving, "drafter.num_target_features"):
        bad("target_layer_ids", f"{len(ids)} ids for drafter.num_target_features {_at(serving, 'drafter.num_target_features')}")
    types, depth = _at(serving, "drafter.layer_types"), _at(serving, "drafter.num_hidden_layers")
    if not isinstance(types, list) or not all(t in ("full", "sliding") for t in types):
        bad("drafter.layer_types", f"{types!r} is not a list of 'full' and 'sliding'")
    elif _is_int(depth) and len(types) != depth:
        bad("drafter.layer_types", f"{len(types)} entries for drafter.num_hidden_layers {depth}")
    if _at(serving, "drafter.hidden_size") != _at(serving, "target.hidden_size"):
        bad("drafter.hidden_size", f"{_at(serving, 'drafter.hidden_size')!r} differs from target.hidden_size "
                                   f"{_at(serving, 'target.hidden_size')!r} (the drafter works at the target's width)")
    semantics = LEGACY_SEMANTICS.get(serving.get("sliding_semantics"), serving.get("sliding_semantics"))
    if semantics not in SLIDING_SEMANTICS:
        bad("sliding_semantics", f"{serving.get('sliding_semantics')!r} is not one of {', '.join(SLIDING_SEMANTICS)}")
    window = serving.get("sliding_window")
    if isinstance(types, list) and "sliding" in types and (not _is_int(window) or not 1 <= window <= 1 << 24):
        bad("sliding_window", f"{window!r} is not a window of 1..{1 << 24} positions")
    theta = _at(serving, "rope.rope_theta")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        bad("rope.rope_theta", f"{theta!r} is not a positive number")
    model = (config or {}).get("model") if isinstance(config, dict) else None
    if isinstance(model, dict):
        for field, key in (("drafter.num_hidden_layers", "drafter_layers"), ("block_size", "block_size"),
                           ("drafter.num_target_features", "num_target_layers")):
            if key in model and model[key] != _at(serving, field):
                bad(field, f"{_at(serving, field)!r} differs from the run's config.model.{key} {model[key]!r}")
    if problems:
        raise ConfigError(problems)
    return {**serving, "sliding_semantics": semantics}


# ---------------------------------------------------------------------------- the target

# What the drafter depends on, as paths into the serving section: the architecture, the
# width and vocabulary, the depth and the captured layers, the shapes its weights were
# built with, and RoPE (normalised by rope_settings). Not the transformers version, the
# file's name or dtype: those leave the features and the drafter's weights unchanged.
TARGET_DEPENDENCIES = (
    "target.model_type", "target.hidden_size", "target.vocab_size", "target.num_hidden_layers", "target_layer_ids",
    "drafter.intermediate_size", "drafter.num_attention_heads", "drafter.num_key_value_heads", "drafter.head_dim",
    "drafter.rms_norm_eps",
)


def _same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) and not isinstance(b, bool):
        return float(a) == float(b)
    return a == b


def _recorded_rope(serving: dict) -> dict:
    rope = dict(serving.get("rope") or {})
    rope["rope_type"] = rope.pop("type", None) or rope.get("rope_type") or "default"
    return rope


def target_differences(recorded: dict, actual: dict) -> list[tuple[str, Any, Any]]:
    """(field, recorded value, actual value) for every TARGET_DEPENDENCIES field and
    RoPE setting where two serving sections (the checkpoint's, and one computed for
    the target at hand) differ; empty when the target is the one trained against."""
    out = [(f, _at(recorded, f), _at(actual, f)) for f in TARGET_DEPENDENCIES if not _same(_at(recorded, f), _at(actual, f))]
    rope_a, rope_b = _recorded_rope(recorded), _recorded_rope(actual)
    for key in sorted(set(rope_a) | set(rope_b)):
        if not _same(rope_a.get(key), rope_b.get(key)):
            out.append((f"rope.{key}", rope_a.get(key), rope_b.get(key)))
    return out
