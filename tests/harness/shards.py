"""Token shards for the data tests: written from samples, and samples of the
synthetic task to write."""

from __future__ import annotations

import json


def write_shard(path, samples, tail: str = "") -> None:
    """``samples`` ((input_ids, loss_mask) pairs) as a JSON Lines shard at ``path``,
    then ``tail`` as it is (a bad or truncated line)."""
    with open(path, "w", encoding="utf-8") as f:
        for ids, mask in samples:
            f.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
        f.write(tail)


def synthetic(n=24, max_len=256, seed=1):
    """``n`` samples of the synthetic task (vocabulary 512, 511 reserved)."""
    from trainer.data import SyntheticDataset

    return SyntheticDataset(n, vocab_size=512, max_len=max_len, min_loss_tokens=16, seed=seed, reserved=(511,))
