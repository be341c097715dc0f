"""Training data: shard format and its errors, batch order, synthetic task, converter."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests import harness
from tests.harness.shards import synthetic, write_shard
from tests.harness.tiny import make_tokenizer
from trainer.data import (
    PAD_ID,
    BatchOrder,
    DataError,
    DataSource,
    ErrorBudget,
    ShardDataset,
    bucket_for,
    check_record,
    collate,
    convert,
    shard_paths,
)

REPO = str(harness.REPO)


# ---------------------------------------------------------------------------- records


@pytest.mark.parametrize("record, problem", [
    ({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, None),
    ({"input_ids": [1, 2, 3], "loss_mask": [0, 1]}, "'input_ids' has 3 tokens but 'loss_mask' has 2"),
    ({"loss_mask": [0, 1]}, "missing 'input_ids'"),
    ({"input_ids": [1, 2]}, "missing 'loss_mask'"),
    ({"input_ids": [1, 2.5], "loss_mask": [0, 1]}, "input_ids[1] = 2.5 is not a token id"),
    ({"input_ids": [1, "x"], "loss_mask": [0, 1]}, "input_ids[1] = 'x' is not a token id"),
    ({"input_ids": [1, 900], "loss_mask": [0, 1]}, "input_ids[1] = 900 is out of range [0, 512)"),
    ({"input_ids": [1, -1], "loss_mask": [0, 1]}, "input_ids[1] = -1 is out of range"),
    ({"input_ids": [1, 2], "loss_mask": [0, 2]}, "loss_mask[1] = 2 is not 0 or 1"),
    ({"input_ids": [1], "loss_mask": [1]}, "fewer than 2 tokens"),
    ([1, 2], "expected a JSON object, got list"),
])
def test_check_record(record, problem):
    got = check_record(record, vocab_size=512)
    assert (got is None) if problem is None else (problem in got)


def test_shards_skip_and_name_bad_lines_within_budget(tmp_path):
    ds = synthetic(6)
    good = [ds.get(i) for i in range(6)]
    write_shard(tmp_path / "a.jsonl", good[:3], tail='{"input_ids": [1, 2, 3], "loss_mask": [0, 1]}\n\n')
    # b: a truncated last line, as a writer killed mid-record leaves it
    write_shard(tmp_path / "b.jsonl", good[3:], tail=json.dumps({"input_ids": good[0][0], "loss_mask": good[0][1]})[:40])
    lines = []
    dataset = ShardDataset(shard_paths(str(tmp_path)), 256, 16, 512, ErrorBudget(2, lines.append))
    assert len(dataset) == 6 and dataset.errors.count == 2
    assert lines[0].startswith(f"data error: {tmp_path / 'a.jsonl'}:4: 'input_ids' has 3 tokens")
    assert f"{tmp_path / 'b.jsonl'}:4: not valid JSON (truncated line?)" in lines[1]
    assert [dataset.get(i) for i in range(6)] == good  # tokens re-read from their offsets


def test_shards_over_budget_raise_data_error(tmp_path):
    write_shard(tmp_path / "a.jsonl", [synthetic(1).get(0)], tail="not json\n{}\n")
    with pytest.raises(DataError, match=r"2 bad records, over data.error_budget=1; first: .*a.jsonl:2: not valid JSON"):
        ShardDataset(shard_paths(str(tmp_path)), 256, 16, 512, ErrorBudget(1, lambda line: None))


def test_shards_short_samples_are_skipped_and_counted(tmp_path):
    write_shard(tmp_path / "a.jsonl", [([5] * 40, [0] * 30 + [1] * 10), synthetic(1).get(0)])
    dataset = ShardDataset(shard_paths(str(tmp_path)), 256, 16, 512, ErrorBudget(0))
    assert (len(dataset), dataset.short, dataset.errors.count) == (1, 1, 0)


def test_no_usable_sample_and_missing_shards_are_data_errors(tmp_path):
    with pytest.raises(DataError, match="no \\*.jsonl shard found"):
        shard_paths(str(tmp_path / "nothing-here"))
    write_shard(tmp_path / "a.jsonl", [([5] * 40, [0] * 40)])
    with pytest.raises(DataError, match="no usable sample"):
        ShardDataset(shard_paths(str(tmp_path)), 256, 16, 512, ErrorBudget(0))


def test_shard_glob_and_long_samples_cut_to_largest_bucket(tmp_path):
    write_shard(tmp_path / "x-1.jsonl", [([7] * 300, [1] * 300)])
    write_shard(tmp_path / "y-1.jsonl", [([7] * 50, [1] * 50)])
    dataset = ShardDataset(shard_paths(str(tmp_path / "x-*.jsonl")), 256, 16, 512, ErrorBudget(0))
    assert list(dataset.lengths) == [256] and len(dataset.get(0)[0]) == 256


def test_shard_changed_under_the_run_is_a_data_error(tmp_path):
    write_shard(tmp_path / "a.jsonl", [synthetic(1).get(0)])
    dataset = ShardDataset(shard_paths(str(tmp_path)), 256, 16, 512, ErrorBudget(0))
    (tmp_path / "a.jsonl").write_text("garbage\n")
    with pytest.raises(DataError, match="a.jsonl:1: .*changed after the run started"):
        dataset.get(0)


# ---------------------------------------------------------------------------- batch order


def test_bucket_for():
    assert [bucket_for(n, [256, 128]) for n in (1, 128, 129, 256, 999)] == [128, 128, 256, 256, 256]


def test_batch_order_is_pure_covers_every_sample_and_keeps_buckets():
    lengths = [100] * 7 + [200] * 5
    order = BatchOrder(lengths, [128, 256], batch_size=2, seed=3)
    assert order.per_epoch == 4 + 3  # 7 short -> 4 batches (last filled up), 5 long -> 3
    fresh = BatchOrder(lengths, [128, 256], batch_size=2, seed=3)
    assert [order.batch(k) for k in range(20)] == [fresh.batch(k) for k in reversed(range(20))][::-1]
    for epoch in range(3):
        batches = [order.batch(epoch * order.per_epoch + p) for p in range(order.per_epoch)]
        assert {i for _, _, _, idx in batches for i in idx} == set(range(12))
        for _, _, bucket, idx in batches:
            assert len(idx) == 2 and {bucket_for(lengths[i], [128, 256]) for i in idx} == {bucket}
    assert order.plan(0) != order.plan(1)  # reshuffled every epoch
    assert BatchOrder(lengths, [128, 256], 2, seed=4).plan(0) != order.plan(0)


def test_batch_order_state_round_trip():
    order = BatchOrder([100] * 10, [128], batch_size=1, seed=0)
    state = order.state(23)
    assert (state["epoch"], state["position"], state["rng"]["seed"]) == (2, 3, 0)
    assert order.resume_from(json.loads(json.dumps(state))) == 23


def test_collate_pads_to_the_bucket():
    ids, mask = collate([([1, 2, 3], [0, 1, 1]), ([4, 5], [1, 1])], 128)
    assert ids.shape == mask.shape == (2, 128)
    assert ids[0, :4].tolist() == [1, 2, 3, PAD_ID] and mask[1, :3].tolist() == [True, True, False]


# ---------------------------------------------------------------------------- synthetic task


def test_synthetic_task_is_deterministic_and_follows_its_rule():
    a, b = synthetic(16), synthetic(16)
    assert a.samples == b.samples and a.samples != synthetic(16, seed=2).samples
    successor = {t: a.cycle[(i + 1) % len(a.cycle)] for i, t in enumerate(a.cycle)}
    for ids, mask in a.samples:
        assert sum(mask) > 16 and len(ids) <= 256 and 511 not in ids  # min_loss_tokens=16
        response = [t for t, m in zip(ids, mask) if m]
        assert all(successor[x] == y for x, y in zip(response, response[1:]))


def test_data_source_batches():
    source = DataSource(synthetic(8), [128, 256], batch_size=2, seed=0)
    batch = source.batch(0)
    assert batch["input_ids"].shape == (2, batch["bucket"]) and batch["loss_mask"].dtype.is_floating_point is False
    assert batch["seq_tokens"] == int((batch["input_ids"] != PAD_ID).sum())
    assert source.batch(source.first_index(128))["bucket"] == 128


# ---------------------------------------------------------------------------- converter


CHAT_LINES = [
    {"prompt": "what is two plus three", "response": "five"},
    "this line is not JSON",
    {"prompt": "hello", "response": "i am fine thanks", "system": "be brief"},
    {"prompt": "hello"},
]


def write_chat(path) -> str:
    path.write_text("".join((json.dumps(x) if isinstance(x, dict) else x) + "\n" for x in CHAT_LINES))
    return str(path)


def test_convert_with_chat_template_masks_the_response(tmp_path):
    from transformers import AutoTokenizer

    tok_dir = make_tokenizer(tmp_path / "tok", chat_template=True)
    lines = []
    manifest = convert(write_chat(tmp_path / "in.jsonl"), str(tmp_path / "out"), tok_dir, log=lines.append)
    assert (manifest["samples"], manifest["bad_records"], manifest["chat_template"]) == (2, 2, True)
    assert f"{tmp_path / 'in.jsonl'}:2: not valid JSON" in lines[0] and f"{tmp_path / 'in.jsonl'}:4: expected" in lines[1]
    tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    records = [json.loads(x) for x in (tmp_path / "out" / "shard-00000.jsonl").read_text().splitlines()]
    words = [tok.convert_ids_to_tokens(r["input_ids"]) for r in records]
    assert words[0] == ["<|user|>", "what", "is", "two", "plus", "three", "<end>", "<|assistant|>", "five", "<end>"]
    assert [w for w, m in zip(words[0], records[0]["loss_mask"]) if m] == ["five", "<end>"]
    assert words[1][:3] == ["<|system|>", "be", "brief"]
    assert [w for w, m in zip(words[1], records[1]["loss_mask"]) if m] == ["i", "am", "fine", "thanks", "<end>"]
    # the shards read back through the trainer's own loader
    dataset = ShardDataset(shard_paths(str(tmp_path / "out")), 128, 1, manifest["vocab_size"], ErrorBudget(0))
    assert len(dataset) == 2


def test_convert_without_chat_template_appends_eos(tmp_path):
    tok_dir = make_tokenizer(tmp_path / "tok", chat_template=False)
    convert(write_chat(tmp_path / "in.jsonl"), str(tmp_path / "out"), tok_dir, log=lambda line: None)
    first = json.loads((tmp_path / "out" / "shard-00000.jsonl").read_text().splitlines()[0])
    assert first["loss_mask"] == [0, 0, 0, 0, 0, 1, 1]  # "what is two plus three" | "five" <eos>
    assert first["input_ids"][-1] == 1


def test_convert_cli(tmp_path):
    tok_dir = make_tokenizer(tmp_path / "tok", chat_template=True)
    args = [sys.executable, "-m", "trainer.data", "convert", write_chat(tmp_path / "in.jsonl"), str(tmp_path / "out"),
            "--tokenizer", tok_dir, "--shard-size", "1"]
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["shards"] == ["shard-00000.jsonl", "shard-00001.jsonl"]
    assert "in.jsonl:2: not valid JSON" in done.stderr
    over = subprocess.run(args[:-2] + ["--error-budget", "1"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert over.returncode == 3 and "over data.error_budget=1" in over.stderr
