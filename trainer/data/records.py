"""One sample's record: its checks, and the budget of bad records a run tolerates.

A shard line, a converter input line or a regenerated prompt that is bad is reported
as ``FILE:LINE: reason`` to an ``ErrorBudget``, skipped and counted; past the budget
the run stops with ``DataError``.
"""

from __future__ import annotations

import json
import sys
from array import array
from typing import Optional


class DataError(Exception):
    """Bad training data: too many bad records, no usable sample, or shards changed under the run."""


def check_record(obj, vocab_size: Optional[int]) -> str | None:
    """Why a parsed line is not a valid sample, or None when it is."""
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    ids, mask = obj.get("input_ids"), obj.get("loss_mask")
    if not isinstance(ids, list):
        return "missing 'input_ids' (a list of token ids)"
    if not isinstance(mask, list):
        return "missing 'loss_mask' (a list of 0/1, one per token)"
    if len(ids) != len(mask):
        return f"'input_ids' has {len(ids)} tokens but 'loss_mask' has {len(mask)}"
    if len(ids) < 2:
        return "fewer than 2 tokens"
    try:  # array() checks every element in C: fast on big shards, strict about type
        typed = array("q", ids)
    except (TypeError, OverflowError):
        bad = next(i for i, t in enumerate(ids) if type(t) is not int or not -(2**63) <= t < 2**63)
        return f"input_ids[{bad}] = {ids[bad]!r} is not a token id"
    if min(typed) < 0 or (vocab_size is not None and max(typed) >= vocab_size):
        bad = next(i for i, t in enumerate(typed) if t < 0 or (vocab_size is not None and t >= vocab_size))
        limit = f" [0, {vocab_size})" if vocab_size is not None else " (non-negative)"
        return f"input_ids[{bad}] = {typed[bad]} is out of range{limit}"
    if not set(mask) <= {0, 1} or any(type(m) is float for m in set(mask)):
        bad = next(i for i, m in enumerate(mask) if m not in (0, 1) or type(m) is float)
        return f"loss_mask[{bad}] = {mask[bad]!r} is not 0 or 1"
    return None


def parse_line(raw: bytes, vocab_size: Optional[int]) -> tuple[list[int], list[int]]:
    """Parse one shard line; ValueError with the reason when it is bad."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        hint = " (truncated line?)" if not raw.rstrip().endswith(b"}") else ""
        raise ValueError(f"not valid JSON{hint}: {e}") from None
    why = check_record(obj, vocab_size)
    if why:
        raise ValueError(why)
    return obj["input_ids"], obj["loss_mask"]


class ErrorBudget:
    """Counts bad records; reports each one; raises DataError past the budget."""

    def __init__(self, budget: int, log=None):
        self.budget = budget
        self.count = 0
        self.first: str | None = None
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))

    def bad(self, where: str, why: str) -> None:
        self.count += 1
        self.first = self.first or f"{where}: {why}"
        over = self.count > self.budget
        self.log(f"data error: {where}: {why} -- {'over budget' if over else 'skipped'} ({self.count} bad, budget {self.budget})")
        if over:
            raise DataError(
                f"{self.count} bad records, over data.error_budget={self.budget}; first: {self.first}"
            )


def jsonl_objects(path: str, errors: ErrorBudget):
    """(where, object) of each non-blank line of a JSONL file, ``where`` = file:line; a
    line that is not JSON is reported to ``errors`` and skipped."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                yield f"{path}:{line_no}", json.loads(raw)
            except ValueError as e:
                errors.bad(f"{path}:{line_no}", f"not valid JSON: {e}")
