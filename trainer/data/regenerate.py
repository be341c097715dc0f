"""Responses written by the target: ``python -m trainer.data regenerate IN OUT --model TARGET``.

A drafter learns to predict what its target writes. Trained on responses some
other model wrote, it learns those, and in serving the target decodes otherwise:
training acceptance high, measured tau near 1. The standard recipe (z-lab's DFlash
data, SpecForge's regeneration scripts) is to keep the prompts and let the target
write the responses; this module does that and writes shards in the trainer's
format (trainer/data/).

Input (trainer/data/inputs.py, detected and said): shards (the tokens before each
sample's first loss token are the prompt), ShareGPT ``conversations`` JSONL (what
SpecForge's scripts write), OpenAI ``messages`` JSONL, prompt JSONL (``{"prompt":
...[, "system": ...]}``), through the target's tokenizer and its chat template
(``thinking`` passed to templates that have the switch), or ``synthetic`` (the
prompts of the built-in synthetic task).

Decoding: greedy, or sampled at ``temperature`` (after ``top_k`` and ``top_p``, as
Hugging Face's generate orders them); a KV-cached loop over batches of
prompts, left-padded to the longest of the batch (prompts are sorted by length
within a shard, so little is padding), position ids counted from each prompt's
first real token. A response ends at the target's end-of-sequence token (kept, in
the loss) or after ``max_new_tokens``.

Resuming and crashes: output shard ``k`` holds the prompts ``[k * shard_size,
(k + 1) * shard_size)`` of the input, and is written whole (temporary file and
rename), so a shard on disk is complete. A restarted regeneration keeps the shards
there and writes the others; batches are formed within a shard and sampling is
seeded per shard from ``(seed, k)``, so a shard is the same bytes whether written
in one go or after a kill. ``manifest.json`` records the settings first: a resumed
run with other settings, or another chat template, is refused (another directory,
or delete it).
Provenance (``manifest.json``): the target (path or preset, config hash, weight
files' fingerprint), the decoding settings (top_p and top_k included), the chat
template's sha256, the input and its format, the counts.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict
from typing import Callable, Optional

from dflashctl.core.contract import REGENERATE_BEAT_S
from trainer.data import inputs
from trainer.data.manifest import MANIFEST
from trainer.data.order import PAD_ID
from trainer.data.records import DataError, ErrorBudget
from trainer.data.shards import ShardDataset, shard_paths

FORMAT = "jsonl input_ids+loss_mask v1"
PROGRESS_EVERY_S = 10.0


# ---------------------------------------------------------------------------- prompts


def synthetic_prompts(cfg, vocab_size: int, mask_token_id: Optional[int], count: Optional[int]) -> list[list[int]]:
    from trainer.data.synthetic import synthetic_dataset

    dataset = synthetic_dataset(cfg, vocab_size, mask_token_id)
    prompts = [ids[: mask.index(1)] for ids, mask in dataset.samples]
    return prompts[:count] if count else prompts


def shard_prompts(spec: str, vocab_size: int, count: Optional[int], log=None) -> list[list[int]]:
    """The prompts of trainer-format shards: each sample's tokens before its first loss token."""
    dataset = ShardDataset(shard_paths(spec), max_len=1 << 30, min_loss_tokens=1, vocab_size=vocab_size,
                           errors=ErrorBudget(10, log))
    prompts = []
    for i in range(len(dataset)):
        ids, mask = dataset.get(i)
        first = mask.index(1)
        if first:
            prompts.append(ids[:first])
        if count and len(prompts) == count:
            break
    return prompts


def chat_prompts(path: str, fmt: str, tokenizer, thinking: Optional[bool], count: Optional[int],
                 log=None) -> list[list[int]]:
    """Prompts of a chat JSONL file of format ``fmt`` (trainer/data/inputs.py) through the
    tokenizer's chat template, generation prompt added."""
    template = {} if thinking is None else {"enable_thinking": thinking}
    prompts = []
    for messages in inputs.chat_messages(path, fmt, ErrorBudget(10, log)):
        prompts.append(inputs.chat_prompt_ids(tokenizer, messages, template))
        if count and len(prompts) == count:
            break
    return prompts


# ---------------------------------------------------------------------------- decoding


def filter_logits(logits_BV, top_k: int = 0, top_p: float = 1.0):
    """Logits with the tokens outside the ``top_k`` largest, then outside the smallest set
    whose probability reaches ``top_p``, set to -inf (Hugging Face's TopK then TopP
    warpers); 0 and 1.0 keep every token."""
    import torch

    if top_k and top_k < logits_BV.shape[-1]:
        kth = torch.topk(logits_BV, top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
    if top_p < 1.0:
        sorted_BV, order_BV = torch.sort(logits_BV, descending=True, dim=-1)
        mass_BV = torch.softmax(sorted_BV, dim=-1).cumsum(-1)
        drop_BV = mass_BV - torch.softmax(sorted_BV, dim=-1) >= top_p  # the mass before a token already reaches p
        logits_BV = logits_BV.masked_fill(drop_BV.scatter(-1, order_BV, drop_BV), float("-inf"))
    return logits_BV


def decode_batch(model, prompts: list[list[int]], max_new_tokens: int, temperature: float, eos: set[int],
                 device, generator=None, on_step: Optional[Callable[[int], None]] = None, top_k: int = 0,
                 top_p: float = 1.0) -> list[list[int]]:
    """The target's response to each prompt (a list of token ids, eos included when reached).
    ``on_step(n)`` after each of the n decoding steps (a long batch's sign of life)."""
    import torch

    width = max(len(p) for p in prompts)
    ids_BP = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    mask_BP = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, p in enumerate(prompts):  # left padding: every prompt ends at the last column
        ids_BP[b, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask_BP[b, width - len(p):] = 1
    ids_BP, mask_BP = ids_BP.to(device), mask_BP.to(device)
    positions_BP = (mask_BP.cumsum(-1) - 1).clamp(min=0)
    out: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)  # on the host: one device sync per token (the tolist below), not one per row
    from transformers import DynamicCache

    from trainer.speculative import _cache_keyword, _takes

    cache = {_cache_keyword(type(model)): DynamicCache()}
    # Only the last position's logits: a prompt's full [B, P, V] would not fit a large vocabulary.
    last = {"logits_to_keep": 1} if _takes(type(model), "logits_to_keep") else {}
    with torch.inference_mode():
        step = model(input_ids=ids_BP, attention_mask=mask_BP, position_ids=positions_BP, use_cache=True,
                     **cache, **last)
        last_pos = positions_BP[:, -1:]
        for n in range(max_new_tokens):
            if on_step is not None:
                on_step(n)
            logits_BV = step.logits[:, -1, :].float()
            if temperature > 0:
                probs_BV = torch.softmax(filter_logits(logits_BV / temperature, top_k, top_p), dim=-1)
                next_B = torch.multinomial(probs_BV.cpu(), 1, generator=generator).squeeze(1).to(device)
            else:
                next_B = logits_BV.argmax(dim=-1)
            for b, t in enumerate(next_B.tolist()):
                if not done[b]:
                    out[b].append(t)
                    done[b] = t in eos
            if all(done):
                break
            mask_BP = torch.cat([mask_BP, torch.ones_like(mask_BP[:, :1])], dim=1)
            last_pos = last_pos + 1
            step = model(input_ids=next_B[:, None], attention_mask=mask_BP, position_ids=last_pos, use_cache=True,
                         **cache)
    return out


# ---------------------------------------------------------------------------- provenance


def weights_fingerprint(path: Optional[str]) -> Optional[str]:
    """sha256 over the weight files' names, sizes and first MiB (cheap on a 16 GB model,
    and it changes when the weights do); None for a preset (its weights are seeded)."""
    if not path:
        return None
    h = hashlib.sha256()
    names = sorted(n for n in os.listdir(path) if n.endswith((".safetensors", ".bin", ".pt")))
    for name in names:
        full = os.path.join(path, name)
        h.update(f"{name}\0{os.path.getsize(full)}\0".encode())
        with open(full, "rb") as f:
            h.update(f.read(1 << 20))
    return h.hexdigest()[:16] if names else None


def sampling_mode(settings) -> str:
    if settings.temperature == 0:
        return "greedy"
    mode = f"sampled at temperature {settings.temperature}"
    if settings.top_k:
        mode += f", top_k {settings.top_k}"
    if settings.top_p < 1.0:
        mode += f", top_p {settings.top_p}"
    return mode


def settings_of(settings, source: str, source_format: str, chat_template: Optional[str], dtype: str) -> dict:
    """What decides the shards' bytes: the manifest's ``provenance`` (compared on resume).
    ``chat_template``: the template's sha256 (inputs.template_hash), None without one."""
    decoding = {k: v for k, v in asdict(settings).items() if k not in ("out", "source")}
    decoding.update(chat_template=chat_template, dtype=dtype, mode=sampling_mode(settings))
    return {"source": source, "source_format": source_format, "decoding": decoding}


def differences(before: dict, now: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two provenance records."""
    out = []
    for key in sorted(set(before) | set(now)):
        a, b = before.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}")
    return out


# ---------------------------------------------------------------------------- the regeneration


def regenerate(source: str, out_dir: str, cfg, device: str = "cpu", log: Callable[[str], None] = print,
               on_progress: Callable[[dict], None] = lambda p: None, clock: Callable[[], float] = time.monotonic,
               target=None, should_stop: Callable[[], bool] = lambda: False) -> Optional[dict]:
    """Regenerate the responses of ``source`` with the target of ``cfg.model`` (or
    ``target``, that target already built) into ``out_dir`` with
    ``cfg.data.regenerate``'s settings (module docstring); returns the manifest.
    Shards already there are kept (resume). Once ``should_stop()`` says so (checked
    after every batch) it returns None: the shards written are kept."""
    import torch

    from trainer.config import RegenerateConfig

    settings = cfg.data.regenerate or RegenerateConfig()
    before = torch.get_num_threads()
    if settings.threads and torch.device(device).type == "cpu":
        torch.set_num_threads(settings.threads)  # recorded: a sum's order, so its last bit, may follow it
    try:
        return _regenerate(source, out_dir, cfg, settings, device, log, on_progress, clock, target, should_stop)
    finally:
        torch.set_num_threads(before)


def _regenerate(source, out_dir, cfg, settings, device, log, on_progress, clock, target, should_stop):
    """regenerate() with its settings and threads in place."""
    import torch

    from dflashctl.core.contract import atomic_write_text
    from trainer.serving import target_config_hash
    from trainer.target import build_target, default_dtype

    fmt = inputs.detect(source)  # bad input is named before the target loads
    tokenizer = None
    if cfg.model.path and os.path.isfile(os.path.join(cfg.model.path, "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path, local_files_only=True)
    if fmt not in ("synthetic", "shards") and tokenizer is None:
        raise DataError(f"{source}: {inputs.FORMATS[fmt]} needs the target's tokenizer, and "
                        f"{cfg.model.path or 'preset ' + str(cfg.model.preset)} has none (no tokenizer_config.json"
                        f"{' there' if cfg.model.path else ''}): give a model directory with its tokenizer")
    target = target or build_target(cfg.model, device, default_dtype(cfg.model, device))
    dtype = target.dtype
    model = target.model
    mask_token_id = cfg.model.mask_token_id if cfg.model.mask_token_id is not None else target.vocab_size - 1
    if fmt == "synthetic":
        prompts = synthetic_prompts(cfg, target.vocab_size, mask_token_id, settings.samples)
    elif fmt == "shards":
        prompts = shard_prompts(source, target.vocab_size, settings.samples, log)
    else:
        prompts = chat_prompts(source, fmt, tokenizer, settings.thinking, settings.samples, log)
    if not prompts:
        raise DataError(f"{source}: no prompt to regenerate")
    template = inputs.template_hash(tokenizer) if fmt not in ("synthetic", "shards") else None
    log(f"regenerate: {source}: {inputs.FORMATS[fmt]}, {len(prompts)} prompts"
        + (f", chat template sha256 {template}" if template else ""))
    eos = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos if isinstance(gen_eos, list) else [gen_eos]):
        if isinstance(value, int):
            eos.add(value)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)

    provenance = {
        "target": {"path": os.path.abspath(cfg.model.path) if cfg.model.path else None, "preset": None
                   if cfg.model.path else cfg.model.preset, "config_hash": target_config_hash(target.config),
                   "weights": weights_fingerprint(cfg.model.path), "vocab_size": target.vocab_size},
        **settings_of(settings, source if source == "synthetic" else os.path.abspath(source), fmt, template,
                      str(dtype).replace("torch.", "")),
        "eos_token_ids": sorted(eos),
        "prompts": len(prompts),
    }
    os.makedirs(out_dir, exist_ok=True)
    manifest_path = os.path.join(out_dir, MANIFEST)
    if os.path.exists(manifest_path):
        with open(manifest_path, encoding="utf-8") as f:
            before = json.load(f).get("provenance")
        if before != provenance:
            changed = differences(before or {}, provenance)
            then = ((before or {}).get("decoding") or {}).get("chat_template")
            why = (f"another chat template (sha256 {then} then, {template} now): resumed, the shards would mix two "
                   "templates" if "decoding.chat_template" in changed else f"{', '.join(changed)} differ")
            raise DataError(f"{out_dir}: holds shards regenerated with other settings ({why}); "
                            "regenerate into another directory, or delete it to start again")
    else:
        atomic_write_text(manifest_path, json.dumps({"format": FORMAT, "complete": False, "provenance": provenance},
                                                    indent=2, sort_keys=True))

    for name in os.listdir(out_dir):  # what a killed writer left half-written (never renamed into place)
        if name.startswith(".tmp-"):
            os.unlink(os.path.join(out_dir, name))
    size = settings.shard_size
    shards = [f"shard-{k:05d}.jsonl" for k in range(-(-len(prompts) // size))]
    kept = [k for k, name in enumerate(shards) if os.path.exists(os.path.join(out_dir, name))]
    if kept:
        log(f"regenerate: {len(kept)} of {len(shards)} shards already in {out_dir}; writing the other "
            f"{len(shards) - len(kept)}")
    began, last_said, new_tokens, done_prompts = clock(), 0.0, 0, len(kept) * size
    state = {"shard": 0, "shards": len(shards), "prompts_done": done_prompts, "prompts": len(prompts),
             "tok_s": None, "eta_s": None}
    last_beat = clock()

    def beat(n: int) -> None:  # status.json rewritten while one batch decodes: the controller sees it alive
        nonlocal last_beat
        if clock() - last_beat >= REGENERATE_BEAT_S / 2:
            last_beat = clock()
            on_progress({**state, "batch_step": n, "batch_steps": settings.max_new_tokens})
    for k, name in enumerate(shards):
        if k in kept:
            continue
        chunk = prompts[k * size:(k + 1) * size]
        generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + k)
        order = sorted(range(len(chunk)), key=lambda i: (len(chunk[i]), i))
        responses: list[Optional[list[int]]] = [None] * len(chunk)
        for b in range(0, len(order), settings.batch_size):
            if should_stop():
                log(f"regenerate: stopped; {k} of {len(shards)} shards written, a restart continues from them")
                return None
            batch = order[b:b + settings.batch_size]
            for i, response in zip(batch, decode_batch(model, [chunk[i] for i in batch], settings.max_new_tokens,
                                                       settings.temperature, eos, target.device, generator, beat,
                                                       settings.top_k, settings.top_p)):
                responses[i] = response
                new_tokens += len(response)
            done_prompts += len(batch)
            elapsed = clock() - began
            rate = new_tokens / elapsed if elapsed > 0 else None
            remaining = len(prompts) - done_prompts
            per_prompt = elapsed / max(1, done_prompts - len(kept) * size)
            state = {"shard": k + 1, "shards": len(shards), "prompts_done": done_prompts, "prompts": len(prompts),
                     "tok_s": rate, "eta_s": remaining * per_prompt}
            on_progress(state)
            last_beat = clock()
            if elapsed - last_said >= PROGRESS_EVERY_S or done_prompts == len(prompts):
                last_said = elapsed
                log(f"regenerate: shard {k + 1}/{len(shards)}, {done_prompts}/{len(prompts)} prompts, "
                    f"{rate or 0:.0f} tok/s, ETA {state['eta_s']:.0f}s")
        lines = [json.dumps({"input_ids": p + r, "loss_mask": [0] * len(p) + [1] * len(r)}, separators=(",", ":"))
                 + "\n" for p, r in zip(chunk, responses)]
        atomic_write_text(os.path.join(out_dir, name), "".join(lines))

    counts = {"samples": 0, "tokens": 0, "loss_tokens": 0}
    for name in shards:
        with open(os.path.join(out_dir, name), "rb") as f:
            for raw in f:
                obj = json.loads(raw)
                counts["samples"] += 1
                counts["tokens"] += len(obj["input_ids"])
                counts["loss_tokens"] += sum(obj["loss_mask"])
    manifest = {"format": FORMAT, "complete": True, "shards": shards, **counts, "provenance": provenance,
                "seconds": clock() - began, "new_tokens_this_run": new_tokens}
    atomic_write_text(manifest_path, json.dumps(manifest, indent=2, sort_keys=True))
    return manifest


def ensure_regenerated(cfg, device: str, log: Callable[[str], None], on_progress=lambda p: None,
                       target=None, should_stop: Callable[[], bool] = lambda: False) -> Optional[str]:
    """``data.regenerate`` before training: the shards in the run directory, written
    now unless a complete regeneration with these settings is already there; None
    when ``should_stop`` ended it first."""
    from trainer.data.manifest import regenerated_dir

    out = regenerated_dir(cfg)
    try:
        with open(os.path.join(out, MANIFEST), encoding="utf-8") as f:
            if json.load(f).get("complete"):
                return out  # the settings were checked when it was written; a restart trains on it as it is
    except (OSError, ValueError):
        pass
    log(f"regenerate: the target writes the responses of {cfg.data.regenerate.source} into {out}")
    done = regenerate(cfg.data.regenerate.source, out, cfg, device, log, on_progress, target=target,
                      should_stop=should_stop)
    return out if done is not None else None
