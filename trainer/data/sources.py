"""What the pipeline reads: a data set, its batch order, padded batches by index.

``build_source`` picks the data set the config asks for (shards, regenerated shards
or the synthetic task) and sets the held-out samples aside for eval.
"""

from __future__ import annotations

import random
from typing import Optional

from trainer.data.manifest import regenerated_dir
from trainer.data.order import BatchOrder, collate
from trainer.data.records import DataError, ErrorBudget
from trainer.data.shards import ShardDataset, shard_paths
from trainer.data.synthetic import synthetic_dataset


class Subset:
    """The samples ``indices`` of a data set, as a data set (``len``, ``lengths``, ``get``)."""

    def __init__(self, dataset, indices: list[int]):
        self.base, self.indices = dataset, list(indices)
        self.lengths = [dataset.lengths[i] for i in self.indices]
        self.errors, self.short = dataset.errors, dataset.short

    def __len__(self) -> int:
        return len(self.indices)

    def get(self, i: int) -> tuple[list[int], list[int]]:
        return self.base.get(self.indices[i])


def split_holdout(count: int, holdout: int, seed: int) -> tuple[list[int], list[int]]:
    """(training indices, held-out indices) of ``count`` samples: ``holdout`` of them
    chosen from ``seed`` alone, so training and eval agree on them without a file."""
    if holdout >= count:
        raise DataError(f"data.holdout: {holdout} held out of {count} samples leaves none to train on")
    held = sorted(random.Random(f"holdout-{seed}").sample(range(count), holdout))
    chosen = set(held)
    return [i for i in range(count) if i not in chosen], held


class DataSource:
    """What the pipeline reads: a data set, its batch order, and padded batches by index.
    ``holdout`` samples (``data.holdout``) are set aside: training never reads them,
    eval measures on them (``self.holdout``, None when none are held out)."""

    def __init__(self, dataset, buckets: list[int], batch_size: int, seed: int, holdout: int = 0):
        self.holdout = None
        if holdout:
            train, held = split_holdout(len(dataset), holdout, seed)
            dataset, self.holdout = Subset(dataset, train), Subset(dataset, held)
        self.dataset = dataset
        self.order = BatchOrder(dataset.lengths, buckets, batch_size, seed)

    def batch(self, k: int) -> dict:
        epoch, position, bucket, indices = self.order.batch(k)
        samples = [self.dataset.get(i) for i in indices]
        input_ids, loss_mask = collate(samples, bucket)
        return {"input_ids": input_ids, "loss_mask": loss_mask, "bucket": bucket, "index": k, "epoch": epoch,
                "seq_tokens": sum(min(len(ids), bucket) for ids, _ in samples)}

    def first_index(self, bucket: int) -> int:
        """A batch index of ``bucket`` (for the compile warm-up, which needs real shapes)."""
        for k, (b, _) in enumerate(self.order.plan(0)):
            if b == bucket:
                return k
        raise KeyError(bucket)

    def buckets_used(self) -> list[int]:
        return sorted(self.order.groups)

    def fingerprint(self) -> dict:
        return {"samples": len(self.dataset), "tokens": int(sum(self.dataset.lengths))}


def build_source(cfg, vocab_size: int, mask_token_id: Optional[int], log=None, index_dir: Optional[str] = None,
                 workers: int = 1, progress=None) -> DataSource:
    """The data source the config asks for (shards, or the synthetic task when none);
    the shards' scans kept in ``index_dir`` (trainer/data/index.py) where given, a
    first scan of many large shards spread over ``workers`` processes."""
    d, block = cfg.data, cfg.model.block_size
    max_len, min_loss = max(d.buckets), 2 * block
    shards = d.shards if d.regenerate is None else regenerated_dir(cfg)
    if shards is None:
        dataset = synthetic_dataset(cfg, vocab_size, mask_token_id)
    else:
        budget = ErrorBudget(d.error_budget, log)
        dataset = ShardDataset(shard_paths(shards), max_len, min_loss, vocab_size, budget, index_dir=index_dir,
                               workers=workers, progress=progress or (lambda p: None),
                               log=log or (lambda line: None))
    return DataSource(dataset, d.buckets, d.batch_size, d.seed, d.holdout)
