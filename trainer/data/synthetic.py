"""The synthetic task: a learnable data set made from the seed, for tests and the demo.

It stands in for shards when ``data.shards`` is unset; ``data.regenerate`` can take
its prompts too.
"""

from __future__ import annotations

import random
from typing import Optional

from trainer.data.records import DataError, ErrorBudget


class SyntheticDataset:
    """A learnable task for tests and the demo, fully determined by the seed.

    Each sample is a prompt of random tokens (loss mask 0) followed by a response
    that walks a fixed cycle of ``alphabet`` tokens: every response token is the
    cycle successor of the one before. The drafter can learn it from the anchor
    token alone (slot k predicts the k-th successor), so loss falls and the
    acceptance length rises within a few hundred CPU steps.
    """

    def __init__(self, n: int, vocab_size: int, max_len: int, min_loss_tokens: int, seed: int,
                 alphabet: int = 8, reserved: tuple[int, ...] = ()):
        rng = random.Random(f"synthetic-{seed}")
        skip = set(reserved)
        usable = [t for t in range(1, vocab_size) if t not in skip]
        if len(usable) < alphabet + 1:
            raise DataError(f"synthetic task: vocabulary of {vocab_size} is too small")
        self.cycle = rng.sample(usable, alphabet)
        self.samples: list[tuple[list[int], list[int]]] = []
        min_len = min(max_len, 2 * min_loss_tokens + 16)
        for _ in range(n):
            length = rng.randint(min_len, max_len)
            prompt = rng.randint(4, max(4, length - min_loss_tokens - 1))
            ids = [rng.choice(usable) for _ in range(prompt)]
            pos = rng.randrange(alphabet)
            for _ in range(length - prompt):
                ids.append(self.cycle[pos])
                pos = (pos + 1) % alphabet
            self.samples.append((ids, [0] * prompt + [1] * (length - prompt)))
        self.lengths = [len(ids) for ids, _ in self.samples]
        self.errors = ErrorBudget(0)
        self.short = 0

    def __len__(self) -> int:
        return len(self.samples)

    def get(self, i: int) -> tuple[list[int], list[int]]:
        return self.samples[i]


def synthetic_dataset(cfg, vocab_size: int, mask_token_id: Optional[int]) -> SyntheticDataset:
    """The synthetic task of ``cfg.data`` (the MASK token never in it)."""
    d = cfg.data
    reserved = (mask_token_id,) if mask_token_id is not None else ()
    return SyntheticDataset(d.synthetic_samples, vocab_size, max(d.buckets), 2 * cfg.model.block_size, d.seed,
                            alphabet=d.synthetic_alphabet, reserved=reserved)
