"""``python -m trainer export CKPT OUT --engine ENGINE``: a trained drafter in the layout
the engine loads, refused where the engine would run it otherwise than trained.

Two Hugging Face-style directories (config.json + model.safetensors), from the
public formats' own definitions:

``dflash`` (z-lab's DFlash drafters; read by z-lab's code, SGLang and vLLM):
  config.json is a Qwen3 config of the drafter itself (``num_hidden_layers`` = drafter
  layers, the target's width, heads, RoPE and vocabulary; ``layer_types`` with
  ``full_attention`` / ``sliding_attention``), plus ``architectures:
  ["DFlashDraftModel"]``, ``block_size``, ``num_target_layers`` (the target's depth)
  and ``dflash_config: {mask_token_id, target_layer_ids, block_size}``; target layer
  ids are 0-based and layer i's feature is hidden_states[i + 1]. Tensors (no
  embedding, no lm_head: the drafter uses the target's)::

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
  ``block_size``, ``sliding_window_non_causal``, ``sample_from_anchor: false``
  (slot 0 holds the anchor; B - 1 tokens are drafted) and a ``speculators_config``
  (algorithm dflash, greedy proposals of B - 1 tokens, the verifier: a hub id or an
  absolute path, ``verifier_name``: speculators resolves it from its working directory).

Engines differ in how they run sliding layers (trainer/engines.py: ENGINE_RULES says
what each does and the file and function it was read from); the checkpoint records how they were trained
(``model.sliding_semantics``). ``engine_problems`` refuses an engine that would run
them otherwise, naming the setting that fits; ``engine_keys`` writes the causality
keys the engine reads (``is_causal``, ``dflash_config.causal``,
``sliding_window_non_causal``). Without ``--engine`` the layout is checked for the
engines that read it (FORMAT_ENGINES).

Beside them, ``README.md`` is the model card (trainer/model_card.py) and
``dflashctl_export.json`` keeps the checkpoint's full serving metadata
(trainer/serving.py), the engines checked and the measured tau, with no path of this
machine (``scrub_paths``). No ``auto_map``: the modeling code is the engine's own. Every file is written 0644 and the
directory 0755, so an engine running as another user reads them.

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
from trainer.engines import (  # the rules per engine; importable from here as before
    ENGINE_FORMAT,
    ENGINE_RULES,
    ENGINES,
    FORMAT_ENGINES,
    engine_keys,
    engine_problems,
    engine_warnings,
    exported_layer_types,
    window_never_binds,
)

FORMATS = ("dflash", "speculators")
DTYPES = ("auto", "bfloat16", "float16", "float32")
SPECULATORS_LAYOUT_VERSION = "0.7.0"  # the speculators release whose config layout is written
EXPORT_META = "dflashctl_export.json"
CARD = "README.md"
EVAL_REPORT = "eval.json"  # where dflashctl eval keeps a run's report (dflashctl/runs/evaluate.py, EVAL_FILE)
__all__ = ["ENGINES", "ENGINE_FORMAT", "ENGINE_RULES", "FORMAT_ENGINES", "engine_keys", "engine_problems",
           "window_never_binds", "export", "import_dflash"]

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


def export_problems(serving: dict, fmt: str, engines: tuple = ()) -> list[str]:
    """Why this checkpoint cannot be exported as asked: each line says what an engine
    would run differently from training. Empty when it can."""
    problems = []
    if fmt not in FORMATS:
        problems.append(f"--format: '{fmt}' is not one of {', '.join(FORMATS)}")
    for engine in engines:
        problems += engine_problems(serving, engine)
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
            f"target layer ids {ids}: speculators reads aux_hidden_state_layer_ids (id + 1) as Hugging Face "
            f"hidden_states, and hidden_states[{layers}] is the last layer's output after the final norm; the trainer "
            "captured it before the norm, so the drafter would get other features"
        )
    return problems


def export_warnings(serving: dict, engines: tuple = ()) -> list[str]:
    out = engine_warnings(serving, engines)
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
    types = ["sliding_attention" if x == "sliding" else "full_attention" for x in exported_layer_types(serving)]
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
        "architectures": ["DFlashDraftModel"],  # no auto_map: the modeling file is the engine's own (README.md)
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
        "sliding_window_non_causal": False,  # set by engine_keys
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


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def verifier_name(verifier: Optional[str], serving: dict) -> str:
    """``speculators_config.verifier.name_or_path``: speculators loads it at every
    ``from_pretrained`` (speculators/model.py: ``_load_verifier_weights``, through
    ``load_model_layers``) and resolves it from the working directory it runs in, not
    from the export. So: a hub id, or an absolute path; a path the user gives that
    exists here is written absolute. A preset target has no name an engine resolves:
    ``dflashctl-preset:NAME``, for the trainer's own tools."""
    target = serving.get("target") or {}
    if verifier is None:
        if target.get("path") is None:
            return f"dflashctl-preset:{target.get('preset')}"
        raise ConfigError([
            f"--verifier: speculators loads the verifier by the name in the config, from the working directory it "
            f"runs in; give a hub id (--verifier Qwen/Qwen3-8B) or an absolute path of the target's weights on the "
            f"serving machine (here: --verifier {os.path.abspath(target['path'])})"])
    here = os.path.expanduser(verifier)
    if os.path.isdir(here):
        return os.path.abspath(here)
    if os.path.isabs(here) or _HUB_ID.match(verifier):
        return verifier  # a path of the serving machine, or a hub id: written as given
    raise ConfigError([f"--verifier {verifier}: not a directory here, an absolute path or a hub id (ORG/NAME); "
                       "a relative path would be resolved from whatever directory the engine runs in"])


def read_eval_report(given: Optional[str], ckpt: str, step) -> tuple[Optional[dict], list[str]]:
    """(the eval report of this checkpoint, warnings): ``--eval FILE``, else the run
    directory's eval.json when it measured this step. A report of another step given
    by name is refused: the card would show a figure this drafter never had."""
    run_dir = os.path.dirname(os.path.dirname(ckpt))
    path = given or os.path.join(run_dir, EVAL_REPORT)
    if not os.path.isfile(path):
        if given:
            raise ConfigError([f"--eval {given}: no such file"])
        return None, []
    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
        assert isinstance(report, dict)
    except (OSError, ValueError, AssertionError):
        if given:
            raise ConfigError([f"--eval {given}: not an eval report (python -m trainer eval --json --out FILE)"]) from None
        return None, [f"{path}: not an eval report; the card says no tau was measured"]
    if report.get("step") != step:
        if given:
            raise ConfigError([f"--eval {given}: measured step {report.get('step')}, this checkpoint is step {step}"])
        return None, [f"{path} measured step {report.get('step')}, not step {step}: not in the card"]
    return report, []


def resolve_engines(engine: Optional[str], fmt: Optional[str]) -> tuple[str, tuple]:
    """(layout, engines checked) for ``--engine`` / ``--format``."""
    if engine is not None and engine not in ENGINES:
        raise ConfigError([f"--engine: '{engine}' is not one of {', '.join(ENGINES)}"])
    if engine is None:
        fmt = fmt or "dflash"
        if fmt not in FORMATS:
            raise ConfigError([f"--format: '{fmt}' is not one of {', '.join(FORMATS)}"])
        return fmt, FORMAT_ENGINES[fmt]
    if fmt is not None and fmt != ENGINE_FORMAT[engine]:
        raise ConfigError([f"--format {fmt}: --engine {engine} reads the {ENGINE_FORMAT[engine]} layout; "
                           "leave --format out"])
    return ENGINE_FORMAT[engine], (engine,)


EXPORT_MODE = 0o644  # config, weights, metadata: readable by an engine running as another user


def export(path: str, out_dir: str, fmt: Optional[str] = None, dtype: str = "auto", target_path: Optional[str] = None,
           force: bool = False, engine: Optional[str] = None, verifier: Optional[str] = None,
           eval_report: Optional[str] = None) -> dict:
    """Write checkpoint (or run directory) ``path`` to ``out_dir`` for ``engine`` (its
    layout), or in layout ``fmt`` checked for the engines reading it (FORMAT_ENGINES).

    Beside config.json and model.safetensors: README.md (the model card,
    trainer/model_card.py, with the measured tau of ``eval_report`` or the run's
    eval.json) and dflashctl_export.json, neither naming a path of this machine.

    Returns {"out", "format", "engines", "dtype", "files", "tensors", "warnings"}.
    ConfigError (one line per problem) when an engine would not run the drafter as
    trained, or ``out_dir`` exists and is not empty (``force`` replaces it)."""
    import torch
    from safetensors.torch import save_file

    from dflashctl.core.contract import atomic_write_text
    from trainer import checkpoint, restore
    from trainer import serving as serving_mod
    from trainer.model_card import model_card, scrub_paths

    fmt, engines = resolve_engines(engine, fmt)
    ckpt = checkpoint.resolve_checkpoint(path)
    meta = checkpoint.read_meta(ckpt)
    serving = serving_mod.derived_metadata(meta, os.path.join(ckpt, checkpoint.META))
    if dtype not in DTYPES:
        raise ConfigError([f"--dtype: '{dtype}' is not one of {', '.join(DTYPES)}"])
    problems = export_problems(serving, fmt, engines)
    if problems:
        raise ConfigError([f"cannot export {ckpt} as {fmt}: {p}" for p in problems])
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and os.listdir(out_dir) and not force:
        raise ConfigError([f"{out_dir}: exists and is not empty (--force replaces it)"])
    report, warnings = read_eval_report(eval_report, ckpt, meta.get("step"))
    verifier_ref = verifier_name(verifier, serving) if fmt == "speculators" else None

    name = _dtype_name(serving, dtype)
    state = torch.load(os.path.join(ckpt, "model.pt"), map_location="cpu", weights_only=True)
    tensors = {dflash_name(k): v.to(_torch_dtype(name)).contiguous() for k, v in state.items()}
    if fmt == "dflash":
        config = dflash_config(serving, name)
    else:
        loaded = restore.load(ckpt, "cpu", dtype=_torch_dtype(name), target_path=target_path)
        tensors["embed_tokens.weight"] = loaded.target.embed_tokens.weight.detach().to(_torch_dtype(name)).contiguous()
        tensors["lm_head.weight"] = loaded.target.lm_head.weight.detach().to(_torch_dtype(name)).contiguous().clone()
        config = speculators_config(serving, name, verifier_ref)
    for e in engines:
        for key, value in engine_keys(serving, e).items():
            section, _, leaf = key.rpartition(".")
            (config[section] if section else config)[leaf] = value

    tmp = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    atomic_write_text(os.path.join(tmp, "config.json"), json.dumps(config, indent=2, sort_keys=True) + "\n")
    provenance = {"checkpoint": os.path.basename(ckpt), "step": meta.get("step"), "format": fmt,
                  "engines": list(engines), "dtype": name, "serving": serving,
                  "measured": {k: report.get(k) for k in ("tau", "prompts", "new_tokens", "data", "temperature",
                                                          "greedy_identical")} if report else None}
    atomic_write_text(os.path.join(tmp, EXPORT_META), json.dumps(scrub_paths(provenance), indent=2, sort_keys=True) + "\n")
    layer_types = config.get("layer_types") or config["transformer_layer_config"]["layer_types"]
    atomic_write_text(os.path.join(tmp, CARD), model_card(serving, meta, fmt, engines, config, layer_types, report))
    for entry in os.listdir(tmp):  # mkstemp (and safetensors) create 0600 files
        os.chmod(os.path.join(tmp, entry), EXPORT_MODE)
    os.chmod(tmp, 0o755)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.rename(tmp, out_dir)
    return {"out": out_dir, "format": fmt, "engines": list(engines), "dtype": name, "checkpoint": ckpt,
            "files": sorted(os.listdir(out_dir)), "tensors": len(tensors),
            "warnings": export_warnings(serving, engines) + warnings}


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
    non_causal = config.get("is_causal") is False or dc.get("causal") is False
    model_cfg = ModelConfig(num_target_layers=len(ids), drafter_layers=config["num_hidden_layers"],
                            block_size=dc.get("block_size", config.get("block_size")), layer_types=types,
                            sliding_window=config.get("sliding_window") or ModelConfig.sliding_window,
                            sliding_semantics="bidirectional" if non_causal else "causal_in_block",
                            mask_token_id=dc["mask_token_id"])
    drafter = Drafter(model_cfg, target.config, target.embed_tokens, target.lm_head)
    state = {trainer_name(k): v for k, v in tensors.items()}
    dtype = next(iter(state.values())).dtype
    drafter.to(dtype)
    drafter.load_trainable_state_dict(state)
    return drafter.eval().requires_grad_(False)
