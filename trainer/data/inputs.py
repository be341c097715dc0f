"""What ``regenerate`` reads prompts from, detected from the input itself.

| format | what | a line |
| --- | --- | --- |
| ``synthetic`` | the built-in task's prompts | (the word ``synthetic``) |
| ``shards`` | trainer shards (directory, glob or one file) | ``{"input_ids": [...], "loss_mask": [...]}`` |
| ``sharegpt`` | ShareGPT, as SpecForge's data scripts write it | ``{"conversations": [{"from": "human", "value": ...}, ...]}`` (``role``/``content`` entries too) |
| ``messages`` | OpenAI chat | ``{"messages": [{"role": "user", "content": ...}, ...]}`` |
| ``prompt`` | plain prompts | ``{"prompt": ...[, "system": ...]}`` |

A JSONL file's format is that of its first record. A conversation's prompt is every
turn up to its last user turn (earlier assistant turns stay as context); the target
writes the reply to it, through its chat template with the generation prompt.
"""

from __future__ import annotations

import json
import os
from typing import Iterator, Optional

from trainer.data.records import DataError, ErrorBudget, jsonl_objects

FORMATS = {
    "synthetic": "the synthetic task's prompts",
    "shards": "trainer shards (input_ids, loss_mask)",
    "sharegpt": "ShareGPT conversations JSONL (SpecForge)",
    "messages": "OpenAI messages JSONL",
    "prompt": "prompt JSONL",
}
_EXPECTED = ('one JSON object a line: {"conversations": [...]} (ShareGPT), {"messages": [...]} (OpenAI), '
             '{"prompt": "..."} or {"input_ids": [...], "loss_mask": [...]} (trainer shards)')
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
          "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system"}


def _first_record(path: str):
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if raw.strip():
                try:
                    return json.loads(raw)
                except ValueError as e:
                    raise DataError(f"{path}:{line_no}: not JSON ({e}); expected {_EXPECTED}") from None
    raise DataError(f"{path}: empty file, no prompt to regenerate; expected {_EXPECTED}")


def detect(source: str) -> str:
    """The format of ``source`` (module docstring), or a DataError naming it and why."""
    if source == "synthetic":
        return "synthetic"
    if not os.path.isfile(source):
        if os.path.isdir(source) or any(c in source for c in "*?["):
            return "shards"
        raise DataError(f"{source}: no such file or directory (give a JSONL file, a shard directory or 'synthetic')")
    first = _first_record(source)
    if isinstance(first, dict):
        if "input_ids" in first:
            return "shards"
        if isinstance(first.get("conversations"), list):
            return "sharegpt"
        if isinstance(first.get("messages"), list):
            return "messages"
        if isinstance(first.get("prompt"), str):
            return "prompt"
    keys = sorted(first)[:6] if isinstance(first, dict) else type(first).__name__
    raise DataError(f"{source}:1: a record with {keys}; expected {_EXPECTED}")


def _text(content) -> str:
    """A message's text: a string, or OpenAI's list of parts (text parts only)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise ValueError("a message content that is not text")


def conversation(turns, role_key: str, text_key: str) -> list[dict]:
    """Chat messages [{role, content}] up to the last user turn: what the target answers."""
    if not isinstance(turns, list) or not turns:
        raise ValueError("an empty conversation")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise ValueError("a turn that is not an object")
        role = turn.get(role_key, turn.get("role", turn.get("from")))
        if role not in _ROLES:
            raise ValueError(f"a turn of role {role!r} (one of {', '.join(sorted(_ROLES))})")
        messages.append({"role": _ROLES[role], "content": _text(turn.get(text_key, turn.get("content",
                                                                                            turn.get("value"))))})
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last_user is None:
        raise ValueError("no user turn")
    return messages[:last_user + 1]


def chat_messages(path: str, fmt: str, errors: ErrorBudget) -> Iterator[list[dict]]:
    """The prompts of a chat JSONL file of format ``fmt`` as chat messages; a bad line
    is reported to ``errors`` (file:line: why) and skipped."""
    for where, obj in jsonl_objects(path, errors):
        try:
            if not isinstance(obj, dict):
                raise ValueError("not a JSON object")
            if fmt == "sharegpt":
                yield conversation(obj.get("conversations"), "from", "value")
            elif fmt == "messages":
                yield conversation(obj.get("messages"), "role", "content")
            else:
                if not isinstance(obj.get("prompt"), str):
                    raise ValueError('no "prompt" string')
                system = obj.get("system") if isinstance(obj.get("system"), str) else None
                yield ([{"role": "system", "content": system}] if system else []) + \
                    [{"role": "user", "content": obj["prompt"]}]
        except ValueError as e:
            errors.bad(where, f"{e}; expected the {FORMATS[fmt]} of line 1")


def chat_prompt_ids(tokenizer, messages: list[dict], template: dict) -> list[int]:
    """Token ids of ``messages`` through the chat template, generation prompt added; a
    tokenizer without a template takes the contents one a line."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template)
    else:
        text = "\n".join(m["content"] for m in messages)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def template_hash(tokenizer) -> Optional[str]:
    """sha256 (16 hex digits) of the tokenizer's chat template; None without one."""
    import hashlib

    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return None
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
