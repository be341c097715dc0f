"""The model card (README.md) an export ships, and what an export may say of the machine
it came from.

The card says what the drafter was trained on and against, how it must be served
(block size, mask token id, target layer ids and their numbering, layer types), and
the acceptance measured by ``python -m trainer eval`` with the prompts it was measured
on. Nothing in an export names a path of the training machine: ``scrub_paths`` keeps
only the last component of every absolute path it finds.
"""

from __future__ import annotations

import os
import re
from typing import Any, Optional

_ABSOLUTE = re.compile(r"(?<![\w.~-])/(?:[^\s/'\"]+/)*([^\s/'\"]+)/?")


def scrub_paths(value: Any) -> Any:
    """``value`` (JSON-like) with every absolute path, alone or inside a text, cut to its
    last component: ``/data/models/Qwen3-8B`` becomes ``Qwen3-8B``."""
    if isinstance(value, dict):
        return {k: scrub_paths(v) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub_paths(v) for v in value]
    if isinstance(value, str):
        return _ABSOLUTE.sub(lambda m: m.group(1), value)
    return value


def target_name(serving: dict) -> str:
    target = serving.get("target") or {}
    if target.get("path"):
        return os.path.basename(os.path.normpath(target["path"]))
    return f"preset {target.get('preset')}"


def _training_data(config: dict) -> str:
    data = config.get("data") or {}
    regen = data.get("regenerate")
    if data.get("shards"):
        text = f"token shards `{scrub_paths(data['shards'])}`"
    elif regen:
        text = f"prompts of `{scrub_paths(regen.get('source'))}`"
    else:
        text = f"the synthetic task ({data.get('synthetic_samples')} samples)"
    if regen:
        sampling = "greedy" if not regen.get("temperature") else f"temperature {regen['temperature']}"
        text += (f", responses written by the target itself (`data.regenerate`: up to {regen.get('max_new_tokens')} "
                 f"new tokens, {sampling})")
    if data.get("holdout"):
        text += f"; {data['holdout']} samples held out for the eval"
    return text


def _measured(report: Optional[dict]) -> list[str]:
    if not report:
        return ["Not measured. `python -m trainer eval CHECKPOINT --json --out eval.json`, then export with "
                "`--eval eval.json`, puts the figure here."]
    tau = report.get("tau")
    lines = [f"- tau **{tau:.2f}** accepted tokens per verification step (accepted drafts + 1; at most "
             f"{report.get('block_size')})" if isinstance(tau, (int, float)) else "- tau: none measured",
             f"- prompts: {report.get('prompts')} of {scrub_paths(report.get('data'))}, {report.get('new_tokens')} "
             f"new tokens in all, temperature {report.get('temperature')}, step {report.get('step')}, "
             f"{report.get('device')} {report.get('dtype')}"]
    if report.get("greedy_identical") is not None:
        lines.append(f"- output identical to plain greedy decoding: {'yes' if report['greedy_identical'] else 'no'}")
    speed = (report.get("speed") or {}).get("speedup")
    if speed:
        lines.append(f"- {speed:.2f}x plain greedy decoding on that hardware, batch 1")
    training = report.get("training") or {}
    if training.get("tau_estimate") is not None:
        lines.append(f"- training's estimate at that step: {training['tau_estimate']:.2f} (accept_len + 1)")
    return lines


def model_card(serving: dict, meta: dict, fmt: str, engines: tuple, config: dict, layer_types: list[str],
               eval_report: Optional[dict]) -> str:
    """README.md of an export (module docstring)."""
    target, drafter = serving.get("target") or {}, serving.get("drafter") or {}
    ids = list(serving.get("target_layer_ids") or [])
    run_config = meta.get("config") or {}
    types = ", ".join(layer_types)
    window = (f"; sliding window {serving.get('sliding_window')}, trained {serving.get('sliding_semantics')}"
              if "sliding_attention" in layer_types else "")
    numbering = f"hidden state ids {[i + 1 for i in ids]} (`aux_hidden_state_layer_ids`)" if fmt == "speculators" \
        else "0-based; layer i's feature is Hugging Face `hidden_states[i + 1]`"
    lines = [
        "---",
        "tags: [dflash, speculative-decoding, drafter]",
        "---",
        "",
        f"# DFlash drafter for {target_name(serving)}",
        "",
        f"A block drafter (DFlash) trained by dflashctl's trainer: step {meta.get('step')}, "
        f"{drafter.get('num_hidden_layers')} layers, exported for {', '.join(engines)} ({fmt} layout).",
        "It drafts blocks for the target below only; it has no embeddings or lm_head of its own "
        "(the target's are used).",
        "",
        "## Target",
        "",
        "| field | value |",
        "| --- | --- |",
        f"| target | {target_name(serving)} ({target.get('model_type')}, {target.get('num_hidden_layers')} layers, "
        f"hidden {target.get('hidden_size')}, vocabulary {target.get('vocab_size')}) |",
        f"| config hash | `{target.get('config_hash')}` (sha256 of its architecture config) |",
        f"| RoPE | theta {(serving.get('rope') or {}).get('rope_theta')}, "
        f"max positions {(serving.get('rope') or {}).get('max_position_embeddings')} |",
        "",
        "## What an engine must use",
        "",
        "| field | value |",
        "| --- | --- |",
        f"| block size | {serving.get('block_size')} (slot 0 the last accepted token, {serving.get('block_size', 1) - 1} "
        "drafted) |",
        f"| mask token id | {serving.get('mask_token_id')} ({serving.get('mask_token_source')}): slots 1.. of a block |",
        f"| target layer ids | {ids}: {numbering} |",
        f"| layers | {types}{window} |",
        "",
        "A different mask token id or layer numbering gives no error: acceptance collapses.",
        "",
        "## Training",
        "",
        f"Trained on {_training_data(run_config)}; {(run_config.get('train') or {}).get('steps')} steps planned, "
        f"this is step {meta.get('step')}; weights {(serving.get('dtype') or {}).get('weights')}, compute "
        f"{(serving.get('dtype') or {}).get('compute')}.",
        "",
        "## Measured acceptance (`python -m trainer eval`, real speculative decoding)",
        "",
        *_measured(eval_report),
        "",
        "## Files",
        "",
        "`config.json`, `model.safetensors` and `dflashctl_export.json` (the trainer's full serving metadata). "
        + ("The modeling code is the engine's own: vLLM and SGLang read this layout; with z-lab's package "
           "(`pip install dflash`): `from dflash.model import DFlashDraftModel; "
           "DFlashDraftModel.from_pretrained(THIS_DIRECTORY)`." if fmt == "dflash" else
           "speculators: `DFlashDraftModel.from_pretrained(THIS_DIRECTORY)`; it loads the verifier named in "
           f"`speculators_config.verifier.name_or_path` (`{config['speculators_config']['verifier']['name_or_path']}`)"
           ", resolved from the working directory."),
        "",
    ]
    return "\n".join(lines)
