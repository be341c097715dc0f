"""Training data: the shard format, the converter, the synthetic task and the batch order.

On-disk format
--------------
``data.shards`` names a directory (every ``*.jsonl`` file in it, sorted by name) or a
glob (``/data/qwen3/shard-*.jsonl``). Each shard is UTF-8 JSON Lines, one sample per
line::

    {"input_ids": [151644, 872, 198, ...], "loss_mask": [0, 0, 0, ..., 1, 1]}

- ``input_ids``: token ids of the whole conversation (prompt and response), ints in
  ``[0, vocab_size)``;
- ``loss_mask``: same length, 1 on the response tokens the drafter learns to predict
  (anchors are only drawn there), 0 elsewhere;
- any other key (``"id"``, ``"source"``) is ignored; blank lines are ignored.

At start every line is parsed once and checked (kept: file, byte offset, length);
the tokens are read again from that offset when a batch needs them, so memory holds
an index, not the data. Each shard's scan is kept in the run directory (``index``) and
read back at the next start while the shard is unchanged. A bad or truncated line is reported as ``FILE:LINE: reason``,
skipped and counted; past ``data.error_budget`` bad lines the run stops with
``DataError`` (exit ``EXIT_DATA_ERROR``). Samples with fewer than ``2 * block_size``
loss tokens cannot give a useful block and are skipped silently (counted as
``short``). Samples longer than the largest bucket are cut to it.

Batch order
-----------
Samples go to the smallest length bucket that holds them and are padded to it
(``PAD_ID``, loss mask 0). Epoch ``e`` is planned from ``(seed, e)`` alone: each
bucket's samples are shuffled and cut into batches (the last batch of a bucket is
filled up with that bucket's first samples), then the batches of all buckets are
shuffled together. Batch ``k`` of the run is therefore a pure function of
``(seed, k)``: the data position in a checkpoint is ``{epoch, position}`` plus the
seed, and resuming needs no iterator state.

Modules
-------
``records`` (a record's checks, the error budget), ``shards`` (the index over
shards), ``index`` (a shard's scan, kept), ``synthetic`` (the synthetic task),
``order`` (buckets and the batch order), ``sources`` (what the pipeline reads),
``manifest`` (where the shards are, what wrote them), ``converter`` (chat JSONL to
shards). This package is their public
API; ``trainer.data.regenerate`` (the target writes the responses) builds on them.
"""

from trainer.data.converter import chat_head, chat_records, convert
from trainer.data.manifest import MANIFEST, provenance, regenerated_dir
from trainer.data.order import PAD_ID, BatchOrder, bucket_for, collate
from trainer.data.records import DataError, ErrorBudget, check_record, parse_line
from trainer.data.shards import ShardDataset, shard_paths
from trainer.data.sources import DataSource, Subset, build_source, split_holdout
from trainer.data.synthetic import SyntheticDataset, synthetic_dataset

__all__ = [
    "MANIFEST", "PAD_ID", "BatchOrder", "DataError", "DataSource", "ErrorBudget", "ShardDataset", "Subset",
    "SyntheticDataset", "bucket_for", "build_source", "chat_head", "chat_records", "check_record", "collate",
    "convert", "parse_line", "provenance", "regenerated_dir", "shard_paths", "split_holdout", "synthetic_dataset",
]
