"""What an inference engine needs to know about a trained drafter, and getting it back.

A drafter is only useful when an engine runs it exactly as it was trained. Three
settings fail silently when they differ (acceptance collapses, output stays correct):

- the mask token id: slots 1..B-1 hold its embedding, so another id feeds B-1 of B
  slots an input they never saw;
- the target layers whose hidden states are fused, and how they are numbered;
- the attention of sliding-window layers: causal inside the block here (as z-lab's
  reference), where an engine told ``causal: false`` would make them bidirectional.

So every checkpoint carries a ``serving`` section in meta.json (``metadata``), the
mask-token default follows the public drafters (``resolve_mask_token_id``), and a
resume with another mask id is refused (``check_resume``). ``load`` rebuilds the
frozen target and the trained drafter from a checkpoint, for ``export`` and ``eval``.

This module never writes checkpoints (trainer/checkpoint.py does) and never trains.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Optional

from trainer.config import ConfigError, ModelConfig

SERVING_FORMAT = 1

LAYER_ID_CONVENTION = (
    "0-based index of a target decoder layer; its feature is that layer's output, "
    "which is Hugging Face hidden_states[id + 1] (z-lab dflash and SpecForge number "
    "layers this way; vLLM speculators' aux_hidden_state_layer_ids are id + 1)"
)
SLIDING_SEMANTICS = "causal-in-block"
SLIDING_DESCRIPTION = (
    "a sliding layer's query at position p sees keys at positions p-W+1..p over the "
    "joint positions (context before the anchor, then the block), so it is causal "
    "inside the block; full layers see the whole context before the anchor and the "
    "whole block (bidirectional)"
)
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
    config or its dict), without file and runtime keys: equal hashes mean the same
    network shape, RoPE and vocabulary."""
    raw = config if isinstance(config, dict) else config.to_dict()
    kept = {k: v for k, v in raw.items() if k not in _VOLATILE_CONFIG_KEYS}
    text = json.dumps(kept, sort_keys=True, default=str)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def rope_settings(config) -> dict:
    """The target's RoPE as {rope_theta, rope_type, ...scaling fields}; the drafter
    builds its rotary embedding from the target's config, so it inherits all of it."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        out = dict(params)
    else:
        scaling = getattr(config, "rope_scaling", None)
        out = dict(scaling) if isinstance(scaling, dict) else {}
        out.setdefault("rope_theta", getattr(config, "rope_theta", None))
    out.setdefault("rope_type", out.pop("type", None) or "default")
    out["max_position_embeddings"] = getattr(config, "max_position_embeddings", None)
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
        "sliding_semantics": SLIDING_SEMANTICS,
        "attention": SLIDING_DESCRIPTION,
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
        return int(serving["mask_token_id"]), serving.get("mask_token_source", "recorded")
    configured = ((meta.get("config") or {}).get("model") or {}).get("mask_token_id")
    if configured is not None:
        return int(configured), "config"
    return vocab_size - 1, "vocab_size-1"


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


def derived_metadata(meta: dict) -> dict:
    """The serving section of a checkpoint; rebuilt from its config (without weights)
    when the checkpoint predates the section, and then marked ``derived: true``."""
    if meta.get("serving"):
        return meta["serving"]
    from trainer import config as config_mod

    cfg = config_mod.from_dict(meta.get("config") or {})
    target_config = read_target_config(cfg.model)
    mask, source = recorded_mask_token_id(meta, target_config.vocab_size)
    compute = cfg.model.dtype if cfg.model.dtype != "auto" else ("float32" if cfg.placement.device == "cpu" else "auto")
    out = metadata(cfg.model, target_config, mask, source, compute)
    out["derived"] = True
    return out


# ---------------------------------------------------------------------------- checkpoints


def resolve_checkpoint(path: str) -> str:
    """A checkpoint directory (holding meta.json), or a run directory's newest one."""
    from trainer import checkpoint

    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isfile(os.path.join(path, checkpoint.META)):
        return path
    latest = checkpoint.latest(path) if os.path.isdir(path) else None
    if latest:
        return latest
    raise ConfigError([f"{path}: not a checkpoint (no {checkpoint.META}) nor a run directory with a complete checkpoint"])


def read_meta(ckpt: str) -> dict:
    from trainer import checkpoint

    with open(os.path.join(ckpt, checkpoint.META), encoding="utf-8") as f:
        return json.load(f)


@dataclass
class Loaded:
    """A checkpoint brought back: its config and metadata, the frozen target, the drafter."""

    path: str
    meta: dict
    serving: dict
    cfg: Any  # TrainerConfig
    target: Any  # trainer.target.Target
    drafter: Any  # trainer.model.Drafter


def load(path: str, device: str = "cpu", dtype=None, target_path: Optional[str] = None) -> Loaded:
    """Rebuild the target and the trained drafter of checkpoint (or run directory) ``path``.

    ``target_path`` replaces model.path (the target on this machine); the target's
    config must hash as recorded, else ConfigError: features from another network are
    meaningless to the drafter. The drafter keeps the recorded mask token id.
    """
    from trainer import checkpoint, config as config_mod
    from trainer.model import Drafter
    from trainer.target import build_target, default_dtype

    ckpt = resolve_checkpoint(path)
    meta = read_meta(ckpt)
    cfg = config_mod.from_dict(meta.get("config") or {})
    if target_path:
        cfg.model.path = target_path
    serving = derived_metadata(meta)
    dtype = dtype or default_dtype(cfg.model, device)
    target = build_target(cfg.model, device, dtype)
    recorded_hash = (serving.get("target") or {}).get("config_hash")
    actual = target_config_hash(target.config)
    if recorded_hash and recorded_hash != actual:
        where = cfg.model.path or f"preset {cfg.model.preset}"
        raise ConfigError([
            f"model.path: the target ({where}) has config hash {actual}, but the drafter was trained against "
            f"{recorded_hash} ({(serving.get('target') or {}).get('path') or (serving.get('target') or {}).get('preset')}); "
            "give the same target with --target PATH"
        ])
    cfg.model.mask_token_id = int(serving["mask_token_id"])
    drafter = Drafter(cfg.model, target.config, target.embed_tokens, target.lm_head).to(device)
    drafter.mask_token_source = serving.get("mask_token_source", drafter.mask_token_source)
    checkpoint.load(ckpt, drafter, restore_rng=False)
    drafter.eval().requires_grad_(False)
    return Loaded(path=ckpt, meta=meta, serving=serving, cfg=cfg, target=target, drafter=drafter)
