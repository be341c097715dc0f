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
from typing import Callable, Optional

from trainer.data import index
from trainer.data.records import DataError, ErrorBudget, parse_line


def shard_paths(spec: str) -> list[str]:
    spec = os.path.expanduser(spec)
    paths = sorted(glob.glob(os.path.join(spec, "*.jsonl"))) if os.path.isdir(spec) else sorted(glob.glob(spec))
    if not paths:
        raise DataError(f"data.shards: no *.jsonl shard found at '{spec}'")
    return paths


@dataclass
class ShardDataset:
    """Index over JSONL shards; tokens are re-read from disk per sample. With
    ``index_dir`` (``trainer.data.index``), each shard's scan is kept there and read
    back at the next start while the shard is unchanged."""

    paths: list[str]
    max_len: int
    min_loss_tokens: int
    vocab_size: Optional[int] = None
    errors: ErrorBudget = field(default_factory=lambda: ErrorBudget(10))
    short: int = 0
    index_dir: Optional[str] = None
    workers: int = 1  # processes for a first scan of many large shards (trainer/data/scan_workers.py)
    progress: Callable[[dict], None] = lambda p: None  # that scan's shards and bytes done, as it goes
    log: Callable[[str], None] = lambda line: None
    rescanned: list[str] = field(default_factory=list)  # "<shard>: why its kept scan was not used"
    kept: int = 0  # shards whose kept scan was read

    def __post_init__(self):
        self.file_idx, self.offsets, self.line_no, self.lengths = array("i"), array("q"), array("q"), array("i")
        idents = {p: self._identity(p) for p in self.paths} if self.index_dir else {}
        kept = {p: index.load(self.index_dir, ident) for p, ident in idents.items()}  # each read once
        cold = {p: why for p, (scan, why) in kept.items() if scan is None}
        apart = self._scan_apart(cold) if self.workers > 1 and cold else {}
        for fi, path in enumerate(self.paths):
            scan = self._kept(path, idents[path], kept[path], apart.get(path)) if idents else None
            if scan is None:
                scan = index.scan_shard(path, self.max_len, self.min_loss_tokens, self.vocab_size, self.errors)
                # kept only where the shard did not change while it was read
                if idents and self._identity(path) == idents[path]:
                    index.save(self.index_dir, idents[path], scan)
            else:  # its bad lines count against the budget at every start, as a scan's do
                for line_no, why in scan.bad:
                    self.errors.bad(f"{path}:{line_no}", why)
            self.short += scan.short
            self.file_idx.extend(array("i", [fi]) * len(scan.lengths))
            self.offsets.extend(scan.offsets)
            self.line_no.extend(scan.line_no)
            self.lengths.extend(scan.lengths)
        if not len(self.lengths):
            raise DataError(
                f"data.shards: no usable sample in {len(self.paths)} shard(s) "
                f"({self.errors.count} bad, {self.short} with fewer than {self.min_loss_tokens} loss tokens)"
            )

    def _identity(self, path: str) -> dict:
        return index.identity(path, self.max_len, self.min_loss_tokens, self.vocab_size)

    def _kept(self, path: str, ident: dict, loaded: tuple[Optional[index.ShardScan], str],
              scanned_apart: Optional[str]) -> Optional[index.ShardScan]:
        """The shard's kept scan as ``loaded`` at the start, or as a scan worker of this
        start kept it (``scanned_apart``: why there was none before: a shard scanned, not
        read back); None where there is none."""
        scan, why = index.load(self.index_dir, ident) if scanned_apart else loaded
        if scan is None or scanned_apart:
            self.rescanned.append(f"{os.path.basename(path)}: {scanned_apart or why}")
        else:
            self.kept += 1
        return scan

    def _scan_apart(self, cold: dict[str, str]) -> dict[str, str]:
        """The shards with no kept scan (path -> why), scanned in worker processes where
        it pays (trainer/data/scan_workers.py); returns those it scanned so."""
        from trainer.data import scan_workers

        return scan_workers.scan_apart(cold, self.index_dir, self.max_len, self.min_loss_tokens, self.vocab_size,
                                       self.errors.budget, self.workers, self.progress, self.log)

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
