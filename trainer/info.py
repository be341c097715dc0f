"""``python -m trainer info CKPT``: what a checkpoint holds and what serving it needs.

Reads meta.json only (no weights, no target model): the step, the run's figures at
that step, and the serving metadata (trainer/serving.py), rebuilt from the run's
configuration for checkpoints written before it existed. Never writes anything.
"""

from __future__ import annotations

import time


def describe(path: str) -> dict:
    """{checkpoint, step, saved, tokens, versions, training, serving} of a checkpoint
    (or of a run directory's newest one)."""
    import os

    from trainer import checkpoint, serving
    from trainer.eval import training_figure

    ckpt = checkpoint.resolve_checkpoint(path)
    meta = checkpoint.read_meta(ckpt)
    step = int(meta.get("step") or 0)
    return {
        "checkpoint": ckpt,
        "step": step,
        "saved": meta.get("time"),
        "tokens": meta.get("tokens"),
        "torch": meta.get("torch"),
        "data": meta.get("data"),
        "training": training_figure(ckpt, step),
        "serving": serving.derived_metadata(meta, os.path.join(ckpt, checkpoint.META)),
    }


def format_text(info: dict) -> str:
    s = info["serving"]
    t, d = s["target"], s["drafter"]
    saved = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["saved"])) if info.get("saved") else "n/a"
    tok = s.get("tokenizer")
    rope = dict(s.get("rope") or {})
    lines = [
        f"checkpoint        {info['checkpoint']}",
        f"step              {info['step']} (saved {saved}, {info.get('tokens') or 0} query tokens trained)",
    ]
    if info.get("training"):
        tr = info["training"]
        lines.append(f"accept_len        {tr['accept_len']:.2f} at step {tr['step']} (tau estimate {tr['tau_estimate']:.2f})")
    lines += [
        "serving" + ("           (rebuilt from the run configuration: the checkpoint predates this metadata)"
                     if s.get("derived") else ""),
        f"  target          {t.get('path') or 'preset ' + str(t.get('preset'))}: {t.get('model_type')}, "
        f"{t['num_hidden_layers']} layers, hidden {t['hidden_size']}, vocab {t['vocab_size']}",
        f"  config hash     {t['config_hash']}",
        f"  target layers   {s['target_layer_ids']}",
        f"                  {s['layer_id_convention']}",
        f"  mask token id   {s['mask_token_id']} ({s['mask_token_source']})",
        f"  block size      {s['block_size']}",
        f"  drafter         {d['architecture']}: {d['num_hidden_layers']} layers {d['layer_types']}, hidden "
        f"{d['hidden_size']}, {d['num_attention_heads']} heads / {d['num_key_value_heads']} kv, head dim "
        f"{d['head_dim']}, mlp {d['intermediate_size']}, fuses {d['num_target_features']} target layers",
        f"  sliding window  " + (f"{s['sliding_window']} ({s['sliding_semantics']})" if s["sliding_window"]
                                 else "none (no sliding layers)"),
        f"  attention       {s['attention']}",
        f"  rope            theta {rope.pop('rope_theta', None)}, type {rope.pop('rope_type', None)}, max positions "
        f"{rope.pop('max_position_embeddings', None)}" + (f", {rope}" if rope else ""),
        f"  dtype           weights {s['dtype']['weights']}, compute {s['dtype']['compute']}",
        f"  tokenizer       " + (f"{tok['path']} ({tok['class']}, {tok['size']} tokens)" if tok else "none (token ids only)"),
        f"  acceptance      {s['acceptance']}",
    ]
    return "\n".join(lines)
