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
an index, not the data. A bad or truncated line is reported as ``FILE:LINE: reason``,
skipped and counted; past ``data.error_budget`` bad lines the run stops with
``DataError`` (exit ``EXIT_DATA_ERROR``). Samples with fewer than ``2 * block_size``
loss tokens cannot give a useful block and are skipped silently (counted as
``short``). Samples longer than the largest bucket are cut to it.

``python -m trainer.data convert IN.jsonl OUT_DIR --tokenizer PATH`` makes shards from
chat-style lines ``{"prompt": ..., "response": ...}`` (optional ``"system"``) with a
local tokenizer (never fetched): the chat template when the tokenizer has one, and
the loss mask on the response tokens. It writes ``shard-NNNNN.jsonl`` and
``manifest.json`` (counts, tokenizer, source).

Batch order
-----------
Samples go to the smallest length bucket that holds them and are padded to it
(``PAD_ID``, loss mask 0). Epoch ``e`` is planned from ``(seed, e)`` alone: each
bucket's samples are shuffled and cut into batches (the last batch of a bucket is
filled up with that bucket's first samples), then the batches of all buckets are
shuffled together. Batch ``k`` of the run is therefore a pure function of
``(seed, k)``: the data position in a checkpoint is ``{epoch, position}`` plus the
seed, and resuming needs no iterator state.
"""

from __future__ import annotations

import glob
import json
import os
import random
import sys
from array import array
from dataclasses import dataclass, field
from typing import Optional

PAD_ID = 0


class DataError(Exception):
    """Bad training data: too many bad records, no usable sample, or shards changed under the run."""


# ---------------------------------------------------------------------------- records


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


# ---------------------------------------------------------------------------- data sets


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


# ---------------------------------------------------------------------------- batch order


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


def build_source(cfg, vocab_size: int, mask_token_id: Optional[int], log=None) -> DataSource:
    """The data source the config asks for (shards, or the synthetic task when none)."""
    d, block = cfg.data, cfg.model.block_size
    max_len, min_loss = max(d.buckets), 2 * block
    shards = d.shards if d.regenerate is None else regenerated_dir(cfg)
    if shards is None:
        dataset = synthetic_dataset(cfg, vocab_size, mask_token_id)
    else:
        budget = ErrorBudget(d.error_budget, log)
        dataset = ShardDataset(shard_paths(shards), max_len, min_loss, vocab_size, budget)
    return DataSource(dataset, d.buckets, d.batch_size, d.seed, d.holdout)


def synthetic_dataset(cfg, vocab_size: int, mask_token_id: Optional[int]) -> SyntheticDataset:
    """The synthetic task of ``cfg.data`` (the MASK token never in it)."""
    d = cfg.data
    reserved = (mask_token_id,) if mask_token_id is not None else ()
    return SyntheticDataset(d.synthetic_samples, vocab_size, max(d.buckets), 2 * cfg.model.block_size, d.seed,
                            alphabet=d.synthetic_alphabet, reserved=reserved)


def regenerated_dir(cfg) -> str:
    """Where ``data.regenerate`` writes its shards (relative: in the run directory)."""
    out = os.path.expanduser(cfg.data.regenerate.out)
    return out if os.path.isabs(out) else os.path.join(cfg.run_dir or ".", out)


MANIFEST = "manifest.json"


def provenance(cfg) -> Optional[dict]:
    """The manifest beside the run's shards (what wrote them: regenerate's target and
    decoding settings, or convert's tokenizer), or None (synthetic data, no manifest)."""
    shards = cfg.data.shards if cfg.data.regenerate is None else regenerated_dir(cfg)
    if shards is None:
        return None
    spec = os.path.expanduser(shards)
    where = spec if os.path.isdir(spec) else os.path.dirname(spec)
    try:
        with open(os.path.join(where, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


# ---------------------------------------------------------------------------- converter


def chat_records(path: str, errors: ErrorBudget, keys: tuple[str, ...] = ("prompt", "response")):
    """The objects of a chat JSONL file whose ``keys`` are strings, in order; a bad line
    is reported to ``errors`` (file:line: why) and skipped."""
    expected = "{" + ", ".join(f'"{k}": "..."' for k in keys) + "}"
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except ValueError as e:
                errors.bad(f"{path}:{line_no}", f"not valid JSON: {e}")
                continue
            if not isinstance(obj, dict) or not all(isinstance(obj.get(k), str) for k in keys):
                errors.bad(f"{path}:{line_no}", f"expected {expected}")
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
