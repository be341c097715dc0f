"""Token shards on disk: their paths, and an index over their lines that rereads tokens.

The format is the package's (trainer/data/__init__.py): JSON Lines of ``input_ids``
and ``loss_mask``. Memory holds each usable line's file, offset and length; a
batch reads its samples' tokens again from there.
"""

from __future__ import annotations

import glob
import os
from array import array
from dataclasses import dataclass, field
from typing import Optional

from trainer.data.records import DataError, ErrorBudget, parse_line


def shard_paths(spec: str) -> list[str]:
    spec = os.path.expanduser(spec)
    paths = sorted(glob.glob(os.path.join(spec, "*.jsonl"))) if os.path.isdir(spec) else sorted(glob.glob(spec))
    if not paths:
        raise DataError(f"data.shards: no *.jsonl shard found at '{spec}'")
    return paths


@dataclass
class ShardDataset:
    """Index over JSONL shards; tokens are re-read from disk per sample."""

    paths: list[str]
    max_len: int
    min_loss_tokens: int
    vocab_size: Optional[int] = None
    errors: ErrorBudget = field(default_factory=lambda: ErrorBudget(10))
    short: int = 0

    def __post_init__(self):
        self.file_idx, self.offsets, self.line_no, self.lengths = array("i"), array("q"), array("q"), array("i")
        for fi, path in enumerate(self.paths):
            self._scan(fi, path)
        if not len(self.lengths):
            raise DataError(
                f"data.shards: no usable sample in {len(self.paths)} shard(s) "
                f"({self.errors.count} bad, {self.short} with fewer than {self.min_loss_tokens} loss tokens)"
            )

    def _scan(self, fi: int, path: str) -> None:
        with open(path, "rb") as f:
            offset, line_no = 0, 0
            for raw in f:
                line_no += 1
                start, offset = offset, offset + len(raw)
                if not raw.strip():
                    continue
                try:
                    ids, mask = parse_line(raw, self.vocab_size)
                except ValueError as e:
                    self.errors.bad(f"{path}:{line_no}", str(e))
                    continue
                if sum(mask[: self.max_len]) < self.min_loss_tokens:
                    self.short += 1
                    continue
                self.file_idx.append(fi)
                self.offsets.append(start)
                self.line_no.append(line_no)
                self.lengths.append(min(len(ids), self.max_len))

    def __len__(self) -> int:
        return len(self.lengths)

    def get(self, i: int) -> tuple[list[int], list[int]]:
        path = self.paths[self.file_idx[i]]
        with open(path, "rb") as f:
            f.seek(self.offsets[i])
            raw = f.readline()
        try:
            ids, mask = parse_line(raw, self.vocab_size)
        except ValueError as e:
            raise DataError(f"{path}:{self.line_no[i]}: {e} (the shard changed after the run started)") from None
        return ids[: self.max_len], mask[: self.max_len]
