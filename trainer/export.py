"""``python -m trainer export CKPT OUT``: a trained drafter in the layout engines load.

Two Hugging Face-style directories (config.json + model.safetensors), from the
public formats' own definitions:

``dflash`` (z-lab's DFlash drafters, which SGLang's and vLLM's DFlash loaders read):
  config.json is a Qwen3 config of the drafter itself (``num_hidden_layers`` = drafter
  layers, the target's width, heads, RoPE and vocabulary; ``layer_types`` with
  ``full_attention`` / ``sliding_attention``), plus ``architectures:
  ["DFlashDraftModel"]``, ``block_size``, ``num_target_layers`` (the target's depth)
  and ``dflash_config: {mask_token_id, target_layer_ids, block_size}``; target layer
  ids are 0-based and layer i's feature is hidden_states[i + 1]. No ``is_causal``
  or ``dflash_config.causal`` key is written: without it, engines run sliding layers
  causal and full layers bidirectional, as this trainer trains them (either key
  would force one rule on every layer). Tensors (no embedding, no lm_head: the
  drafter uses the target's)::

      fc.weight                    [H, K*H]   fuses the K target features
      hidden_norm.weight           [H]        RMSNorm after fc
      layers.{i}.input_layernorm.weight, layers.{i}.post_attention_layernorm.weight   [H]
      layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q,k}_norm.weight
      layers.{i}.mlp.{gate,up,down}_proj.weight
      norm.weight                  [H]        final RMSNorm

``speculators`` (vLLM speculators): the same tensors plus ``embed_tokens.weight`` and
  ``lm_head.weight`` copied from the target; config.json carries
  ``speculators_model_type: "dflash"``, the drafter's Qwen3 config under
  ``transformer_layer_config``, ``aux_hidden_state_layer_ids`` = target layer id + 1
  (speculators numbers hidden states, not layers), ``mask_token_id``,
  ``block_size``, ``sliding_window_non_causal: false``, ``sample_from_anchor: false``
  (slot 0 holds the anchor; B - 1 tokens are drafted) and a ``speculators_config``
  (algorithm dflash, greedy proposals of B - 1 tokens, the verifier).

Beside them, ``dflashctl_export.json`` keeps the checkpoint's full serving metadata
(trainer/serving.py). The export refuses what an engine would run differently from
training (``export_problems``), first of all sliding layers run bidirectionally.

``import_dflash`` reads a ``dflash`` directory back into a Drafter (the round trip
the tests check). This module never changes a checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Optional

from trainer.config import ConfigError

FORMATS = ("dflash", "speculators")
DTYPES = ("auto", "bfloat16", "float16", "float32")
SLIDING_ATTENTION = ("causal", "bidirectional")
SPECULATORS_LAYOUT_VERSION = "0.7.0"  # the speculators release whose config layout is written
EXPORT_META = "dflashctl_export.json"

_TOP_NAMES = {"fuse.weight": "fc.weight", "fuse_norm.weight": "hidden_norm.weight", "norm.weight": "norm.weight"}
_LAYER_NAMES = {"input_norm.weight": "input_layernorm.weight", "post_norm.weight": "post_attention_layernorm.weight"}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def dflash_name(name: str) -> str:
    """The public name of one of the drafter's own tensors (module docstring)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = _LAYER.match(name)
    if not m:
        raise KeyError(f"no DFlash name for drafter tensor '{name}'")
    rest = re.sub(r"^attn\.", "self_attn.", _LAYER_NAMES.get(m.group(2), m.group(2)))
    return f"layers.{m.group(1)}.{rest}"


def trainer_name(name: str) -> str:
    """The inverse of dflash_name."""
    top = {v: k for k, v in _TOP_NAMES.items()}
    if name in top:
        return top[name]
    m = _LAYER.match(name)
    if not m:
        raise KeyError(f"'{name}' is not a DFlash drafter tensor")
    inverse = {v: k for k, v in _LAYER_NAMES.items()}
    rest = re.sub(r"^self_attn\.", "attn.", inverse.get(m.group(2), m.group(2)))
    return f"layers.{m.group(1)}.{rest}"


# ---------------------------------------------------------------------------- checks


def export_problems(serving: dict, fmt: str, sliding_attention: str = "causal") -> list[str]:
    """Why this checkpoint cannot be exported as asked: each line says what an engine
    would run differently from training. Empty when it can."""
    problems = []
    if fmt not in FORMATS:
        problems.append(f"--format: '{fmt}' is not one of {', '.join(FORMATS)}")
    drafter = serving.get("drafter") or {}
    sliding = [i for i, t in enumerate(drafter.get("layer_types") or []) if t == "sliding"]
    semantics = serving.get("sliding_semantics")
    if sliding and semantics != "causal-in-block":
        problems.append(
            f"sliding layers {sliding} were trained with attention '{semantics}', which the public configs cannot "
            "express: DFlash engines run sliding layers causal inside the block"
        )
    if sliding and sliding_attention == "bidirectional":
        problems.append(
            f"--sliding-attention bidirectional: layers {sliding} were trained causal inside the block (a slot saw "
            "only the slots before it); run bidirectionally (dflash_config.causal / is_causal false, speculators "
            "sliding_window_non_causal) every slot would also see the slots after it, inputs it never saw in "
            "training, and acceptance would drop without any error"
        )
    vocab = (serving.get("target") or {}).get("vocab_size")
    mask = serving.get("mask_token_id")
    if mask is None or (vocab is not None and not 0 <= mask < vocab):
        problems.append(f"mask token id {mask} is not a token of the target's vocabulary of {vocab}")
    ids = serving.get("target_layer_ids") or []
    layers = (serving.get("target") or {}).get("num_hidden_layers")
    if not ids or (layers is not None and not all(0 <= i < layers for i in ids)):
        problems.append(f"target layer ids {ids} are not layers of the {layers}-layer target")
    if fmt == "speculators" and layers is not None and any(i + 1 >= layers for i in ids):
        problems.append(
            f"target layer ids {ids}: speculators number them +1 and reserve hidden state {layers} (the last "
            "layer) for the verifier; a drafter reading the last layer cannot be written in that layout"
        )
    return problems


def export_warnings(serving: dict) -> list[str]:
    out = []
    drafter = serving.get("drafter") or {}
    types = drafter.get("layer_types") or []
    if "sliding" in types:
        out.append(
            "sliding layers: the engine must run them causal inside the block with window "
            f"{serving.get('sliding_window')} (vLLM's qwen3_dflash and z-lab's dflash do when the config sets no "
            "causal override); older references that ignore layer_types run them as full bidirectional layers"
        )
        if "full" in types:
            out.append("mixed full and sliding layers: vLLM needs its V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1)")
    if serving.get("derived"):
        out.append("this checkpoint predates the serving metadata; it was rebuilt from the run's configuration")
    if serving.get("mask_token_source") == "vocab_size-1" and (serving.get("target") or {}).get("path"):
        out.append(
            f"mask token id {serving.get('mask_token_id')} is vocab_size - 1 (the target directory had no tokenizer "
            "with a free id), not the public drafters' choice (the first id past the tokenizer's special tokens): "
            "an engine must take the id from this config, never pick its own"
        )
    return out


# ---------------------------------------------------------------------------- configs


def _dtype_name(serving: dict, dtype: str) -> str:
    if dtype == "auto":
        compute = (serving.get("dtype") or {}).get("compute", "float32")
        return compute if compute in ("bfloat16", "float16", "float32") else "bfloat16"
    return dtype


def drafter_qwen3_config(serving: dict, dtype: str) -> dict:
    """The drafter's own Qwen3 config (what both formats describe the network with)."""
    d, t, rope = serving["drafter"], serving["target"], dict(serving.get("rope") or {})
    types = ["sliding_attention" if x == "sliding" else "full_attention" for x in d["layer_types"]]
    max_pos = rope.pop("max_position_embeddings", None)
    theta = rope.get("rope_theta")
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    scaling = None if scaling.get("rope_type", "default") == "default" and len(scaling) <= 1 else scaling
    from transformers import __version__ as transformers_version

    return {
        "model_type": "qwen3",
        "hidden_size": d["hidden_size"],
        "intermediate_size": d["intermediate_size"],
        "num_hidden_layers": d["num_hidden_layers"],
        "num_attention_heads": d["num_attention_heads"],
        "num_key_value_heads": d["num_key_value_heads"],
        "head_dim": d["head_dim"],
        "hidden_act": d.get("hidden_act", "silu"),
        "rms_norm_eps": d["rms_norm_eps"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "layer_types": types,
        "use_sliding_window": "sliding_attention" in types,
        "sliding_window": serving.get("sliding_window") if "sliding_attention" in types else None,
        "max_window_layers": d["num_hidden_layers"],
        "max_position_embeddings": max_pos,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rope_parameters": dict(rope),
        "vocab_size": t["vocab_size"],
        "tie_word_embeddings": t.get("tie_word_embeddings", False),
        "bos_token_id": t.get("bos_token_id"),
        "eos_token_id": t.get("eos_token_id"),
        "pad_token_id": t.get("pad_token_id"),
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
        "transformers_version": transformers_version,
    }


def dflash_config(serving: dict, dtype: str) -> dict:
    cfg = drafter_qwen3_config(serving, dtype)
    block = serving["block_size"]
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        **cfg,
        "block_size": block,
        "num_target_layers": serving["target"]["num_hidden_layers"],
        "dflash_config": {
            "mask_token_id": serving["mask_token_id"],
            "target_layer_ids": list(serving["target_layer_ids"]),
            "block_size": block,
        },
    }


def speculators_config(serving: dict, dtype: str, verifier: str) -> dict:
    cfg = drafter_qwen3_config(serving, dtype)
    block, target = serving["block_size"], serving["target"]
    return {
        "architectures": ["DFlashDraftModel"],
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_LAYOUT_VERSION,
        "transformer_layer_config": {k: v for k, v in cfg.items() if k not in ("dtype", "torch_dtype")},
        "draft_vocab_size": target["vocab_size"],
        "block_size": block,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [i + 1 for i in serving["target_layer_ids"]],
        "mask_token_id": serving["mask_token_id"],
        "sliding_window_non_causal": False,
        "sample_from_anchor": False,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": block - 1,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(target.get("architectures") or [])},
        },
        "dtype": dtype,
        "torch_dtype": dtype,
        "transformers_version": cfg["transformers_version"],
    }


# ---------------------------------------------------------------------------- export


def _torch_dtype(name: str):
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def export(path: str, out_dir: str, fmt: str = "dflash", dtype: str = "auto", sliding_attention: str = "causal",
           target_path: Optional[str] = None, force: bool = False) -> dict:
    """Write checkpoint (or run directory) ``path`` to ``out_dir`` in format ``fmt``.

    Returns {"out", "format", "dtype", "files", "tensors", "warnings"}. ConfigError
    (one line per problem) when the export would not run as trained, or ``out_dir``
    exists and is not empty (``force`` replaces it)."""
    import torch
    from safetensors.torch import save_file

    from dflashctl.contract import atomic_write_text
    from trainer import serving as serving_mod

    ckpt = serving_mod.resolve_checkpoint(path)
    meta = serving_mod.read_meta(ckpt)
    serving = serving_mod.derived_metadata(meta)
    if sliding_attention not in SLIDING_ATTENTION:
        raise ConfigError([f"--sliding-attention: '{sliding_attention}' is not one of {', '.join(SLIDING_ATTENTION)}"])
    if dtype not in DTYPES:
        raise ConfigError([f"--dtype: '{dtype}' is not one of {', '.join(DTYPES)}"])
    problems = export_problems(serving, fmt, sliding_attention)
    if problems:
        raise ConfigError([f"cannot export {ckpt} as {fmt}: {p}" for p in problems])
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and os.listdir(out_dir) and not force:
        raise ConfigError([f"{out_dir}: exists and is not empty (--force replaces it)"])

    name = _dtype_name(serving, dtype)
    state = torch.load(os.path.join(ckpt, "model.pt"), map_location="cpu", weights_only=True)
    tensors = {dflash_name(k): v.to(_torch_dtype(name)).contiguous() for k, v in state.items()}
    if fmt == "dflash":
        config = dflash_config(serving, name)
    else:
        loaded = serving_mod.load(ckpt, "cpu", dtype=_torch_dtype(name), target_path=target_path)
        tensors["embed_tokens.weight"] = loaded.target.embed_tokens.weight.detach().to(_torch_dtype(name)).contiguous()
        tensors["lm_head.weight"] = loaded.target.lm_head.weight.detach().to(_torch_dtype(name)).contiguous().clone()
        verifier = serving["target"].get("path") or f"dflashctl-preset:{serving['target'].get('preset')}"
        config = speculators_config(serving, name, target_path or verifier)
    if sliding_attention == "bidirectional":  # allowed only without sliding layers: full layers already are
        if fmt == "dflash":
            config["is_causal"] = False
            config["dflash_config"]["causal"] = False
        else:
            config["sliding_window_non_causal"] = True

    tmp = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    atomic_write_text(os.path.join(tmp, "config.json"), json.dumps(config, indent=2, sort_keys=True) + "\n")
    provenance = {"checkpoint": ckpt, "step": meta.get("step"), "format": fmt, "dtype": name, "serving": serving}
    atomic_write_text(os.path.join(tmp, EXPORT_META), json.dumps(provenance, indent=2, sort_keys=True) + "\n")
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.rename(tmp, out_dir)
    return {"out": out_dir, "format": fmt, "dtype": name, "checkpoint": ckpt,
            "files": sorted(os.listdir(out_dir)), "tensors": len(tensors), "warnings": export_warnings(serving)}


# ---------------------------------------------------------------------------- import


def read_dflash(out_dir: str) -> tuple[dict, dict]:
    """(config, {public name: tensor}) of a ``dflash`` directory."""
    from safetensors.torch import load_file

    with open(os.path.join(out_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    return config, load_file(os.path.join(out_dir, "model.safetensors"))


def import_dflash(out_dir: str, target):
    """A fresh Drafter for ``target`` built from an exported ``dflash`` directory alone:
    its config gives the shape, mask id and layers, its tensors the weights."""
    from trainer.config import ModelConfig
    from trainer.model import Drafter
    from trainer.target import target_layer_ids

    config, tensors = read_dflash(out_dir)
    dc = config["dflash_config"]
    ids = list(dc["target_layer_ids"])
    if ids != target_layer_ids(target.config.num_hidden_layers, len(ids)) or ids != target.layer_ids:
        raise ConfigError([f"{out_dir}: target layer ids {ids} differ from the ones this target captures ({target.layer_ids})"])
    types = ["sliding" if t == "sliding_attention" else "full" for t in config["layer_types"]]
    model_cfg = ModelConfig(num_target_layers=len(ids), drafter_layers=config["num_hidden_layers"],
                            block_size=dc.get("block_size", config.get("block_size")), layer_types=types,
                            sliding_window=config.get("sliding_window") or ModelConfig.sliding_window,
                            mask_token_id=dc["mask_token_id"])
    drafter = Drafter(model_cfg, target.config, target.embed_tokens, target.lm_head)
    state = {trainer_name(k): v for k, v in tensors.items()}
    dtype = next(iter(state.values())).dtype
    drafter.to(dtype)
    drafter.load_trainable_state_dict(state)
    return drafter.eval().requires_grad_(False)
