"""The batch order: samples in length buckets, each epoch's plan, batches padded to a bucket.

Batch ``k`` is a pure function of ``(seed, k)`` (the package's docstring says how),
so a checkpoint's data position is two numbers and resuming needs no iterator state.
"""

from __future__ import annotations

import random

PAD_ID = 0


def bucket_for(length: int, buckets: list[int]) -> int:
    for b in sorted(buckets):
        if length <= b:
            return b
    return max(buckets)


class BatchOrder:
    """Global batch ``k`` -> (epoch, position, bucket, sample indices); pure in (seed, k)."""

    def __init__(self, lengths, buckets: list[int], batch_size: int, seed: int):
        self.batch_size, self.seed = batch_size, seed
        self.groups: dict[int, list[int]] = {}
        for i, n in enumerate(lengths):
            self.groups.setdefault(bucket_for(n, buckets), []).append(i)
        self.per_epoch = sum(-(-len(g) // batch_size) for g in self.groups.values())
        self._plan_epoch: int | None = None
        self._plan: list[tuple[int, list[int]]] = []

    def plan(self, epoch: int) -> list[tuple[int, list[int]]]:
        if self._plan_epoch != epoch:
            rng = random.Random(f"order-{self.seed}-{epoch}")
            batches = []
            for bucket in sorted(self.groups):
                idx = list(self.groups[bucket])
                rng.shuffle(idx)
                for s in range(0, len(idx), self.batch_size):
                    chunk = idx[s : s + self.batch_size]
                    chunk += (idx * self.batch_size)[: self.batch_size - len(chunk)]
                    batches.append((bucket, chunk))
            rng.shuffle(batches)
            self._plan_epoch, self._plan = epoch, batches
        return self._plan

    def batch(self, k: int) -> tuple[int, int, int, list[int]]:
        epoch, position = divmod(k, self.per_epoch)
        bucket, indices = self.plan(epoch)[position]
        return epoch, position, bucket, indices

    def state(self, batches_done: int) -> dict:
        epoch, position = divmod(batches_done, self.per_epoch)
        return {"epoch": epoch, "position": position, "batches_done": batches_done,
                "batches_per_epoch": self.per_epoch, "rng": {"kind": "seeded-per-epoch", "seed": self.seed}}

    def resume_from(self, state: dict) -> int:
        """The global batch index to continue from; a changed data set keeps (epoch, position)."""
        return int(state["epoch"]) * self.per_epoch + min(int(state["position"]), self.per_epoch - 1)


def collate(samples: list[tuple[list[int], list[int]]], bucket: int):
    """Pad to the bucket: ``input_ids_BS`` (long) and ``loss_mask_BS`` (bool)."""
    import torch

    ids = torch.full((len(samples), bucket), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(samples), bucket), dtype=torch.bool)
    for b, (i, m) in enumerate(samples):
        n = min(len(i), bucket)
        ids[b, :n] = torch.tensor(i[:n], dtype=torch.long)
        mask[b, :n] = torch.tensor(m[:n], dtype=torch.bool)
    return ids, mask
