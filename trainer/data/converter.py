"""The converter: chat-style JSONL tokenized into training shards, with a manifest.

``python -m trainer.data convert IN.jsonl OUT_DIR --tokenizer PATH`` makes shards from
chat-style lines ``{"prompt": ..., "response": ...}`` (optional ``"system"``) with a
local tokenizer (never fetched): the chat template when the tokenizer has one, and
the loss mask on the response tokens. It writes ``shard-NNNNN.jsonl`` and
``manifest.json`` (counts, tokenizer, source).
"""

from __future__ import annotations

import json
import os
from typing import Optional

from trainer.data.records import ErrorBudget, jsonl_objects


def chat_records(path: str, errors: ErrorBudget, keys: tuple[str, ...] = ("prompt", "response")):
    """The objects of a chat JSONL file whose ``keys`` are strings, in order; a bad line
    is reported to ``errors`` (file:line: why) and skipped."""
    expected = "{" + ", ".join(f'"{k}": "..."' for k in keys) + "}"
    for where, obj in jsonl_objects(path, errors):
        if not isinstance(obj, dict) or not all(isinstance(obj.get(k), str) for k in keys):
            errors.bad(where, f"expected {expected}")
            continue
        yield obj


def _messages(prompt: str, system: Optional[str]) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


def chat_head(tok, prompt: str, system: Optional[str], **template) -> str:
    """The text a response follows: the chat template with its generation prompt (``template``:
    the template's switches, e.g. enable_thinking), or the system line and the prompt."""
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template(_messages(prompt, system), tokenize=False, add_generation_prompt=True,
                                       **template)
    return (system + "\n" if system else "") + prompt


def _encode(tok, prompt: str, response: str, system: Optional[str]) -> tuple[list[int], list[int]]:
    head = chat_head(tok, prompt, system)
    if getattr(tok, "chat_template", None):
        full = tok.apply_chat_template(_messages(prompt, system) + [{"role": "assistant", "content": response}],
                                       tokenize=False)
        # Some templates rewrite earlier turns; then the reply is taken verbatim.
        tail = full[len(head):] if full.startswith(head) else response + (tok.eos_token or "")
    else:
        tail = response + (tok.eos_token or "")
    p = tok(head, add_special_tokens=False)["input_ids"]
    r = tok(tail, add_special_tokens=False)["input_ids"]
    return p + r, [0] * len(p) + [1] * len(r)


def convert(in_path: str, out_dir: str, tokenizer: str, shard_size: int = 10000,
            error_budget: int = 10, log=None) -> dict:
    """Tokenize chat-style JSONL into shards; returns the manifest written beside them."""
    from transformers import AutoTokenizer

    from dflashctl.core.contract import atomic_write_text

    tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    os.makedirs(out_dir, exist_ok=True)
    errors = ErrorBudget(error_budget, log)
    shards, lines = [], []
    counts = {"samples": 0, "tokens": 0, "loss_tokens": 0}

    def flush():
        if lines:
            name = f"shard-{len(shards):05d}.jsonl"
            atomic_write_text(os.path.join(out_dir, name), "".join(lines))
            shards.append(name)
            lines.clear()

    for obj in chat_records(in_path, errors):
        ids, mask = _encode(tok, obj["prompt"], obj["response"], obj.get("system"))
        lines.append(json.dumps({"input_ids": ids, "loss_mask": mask}, separators=(",", ":")) + "\n")
        counts["samples"] += 1
        counts["tokens"] += len(ids)
        counts["loss_tokens"] += sum(mask)
        if len(lines) >= shard_size:
            flush()
    flush()
    manifest = {**counts, "bad_records": errors.count, "shards": shards, "source": os.path.abspath(in_path),
                "tokenizer": os.path.abspath(tokenizer), "vocab_size": len(tok),
                "chat_template": bool(getattr(tok, "chat_template", None)), "format": "jsonl input_ids+loss_mask v1"}
    atomic_write_text(os.path.join(out_dir, "manifest.json"), json.dumps(manifest, indent=2))
    return manifest
