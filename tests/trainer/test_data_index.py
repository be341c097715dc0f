"""The shards' scans kept in the run directory (trainer/data/index.py): read back while
a shard is unchanged, with the same samples and the same bad lines counted; scanned
again, and the kept file replaced, when the shard or the scan's bounds changed or the
file is not what a scan writes (cut short, edited, planted)."""

from __future__ import annotations

import json
import os

import pytest

from tests.harness.shards import synthetic, write_shard
from trainer.data import DataError, ErrorBudget, ShardDataset, shard_paths
from trainer.data import index


def _shards(tmp_path, bad: bool = True) -> str:
    ds = synthetic(8)
    shards = tmp_path / "shards"
    shards.mkdir()
    good = [ds.get(i) for i in range(8)]
    write_shard(shards / "a.jsonl", good[:4], tail='{"input_ids": [1, 2, 3], "loss_mask": [0, 1]}\n' if bad else "")
    write_shard(shards / "b.jsonl", [([5] * 40, [0] * 30 + [1] * 10)] + good[4:])  # one too short
    return str(shards)


def _open(shards: str, index_dir, budget: int = 5, max_len: int = 256, lines=None) -> ShardDataset:
    return ShardDataset(shard_paths(shards), max_len, 16, 512, ErrorBudget(budget, (lines if lines is not None
                                                                                      else []).append),
                        index_dir=str(index_dir))


def _same(a: ShardDataset, b: ShardDataset) -> bool:
    return (list(a.file_idx), list(a.offsets), list(a.line_no), list(a.lengths), a.short, a.errors.count) == \
        (list(b.file_idx), list(b.offsets), list(b.line_no), list(b.lengths), b.short, b.errors.count)


def test_a_kept_scan_is_read_back_with_the_same_samples_and_bad_lines(tmp_path):
    shards, idx = _shards(tmp_path), index.directory(str(tmp_path / "run"))
    first_lines, again_lines = [], []
    first = _open(shards, idx, lines=first_lines)
    assert (first.kept, len(first.rescanned)) == (0, 2) and first.rescanned[0] == "a.jsonl: none kept"
    assert sorted(os.listdir(idx)) == sorted(os.path.basename(index.index_file(idx, p)) for p in first.paths)
    assert all(os.stat(os.path.join(idx, f)).st_mode & 0o777 == 0o600 for f in os.listdir(idx))
    again = _open(shards, idx, lines=again_lines)
    assert (again.kept, again.rescanned) == (2, [])
    assert _same(first, again) and (len(again), again.short, again.errors.count) == (8, 1, 1)
    assert again_lines == first_lines and "a.jsonl:5: 'input_ids' has 3 tokens" in again_lines[0]
    assert [again.get(i) for i in range(len(again))] == [first.get(i) for i in range(len(first))]
    # the budget holds for bad lines read back as for bad lines scanned
    with pytest.raises(DataError, match="over data.error_budget=0"):
        _open(shards, idx, budget=0)


def test_a_changed_shard_or_other_bounds_are_scanned_again(tmp_path):
    shards, idx = _shards(tmp_path), index.directory(str(tmp_path / "run"))
    first = _open(shards, idx)
    with open(os.path.join(shards, "b.jsonl"), "a") as f:  # a sample appended: the shard grew
        f.write(json.dumps({"input_ids": [7] * 50, "loss_mask": [1] * 50}) + "\n")
    grown = _open(shards, idx)
    assert grown.kept == 1 and len(grown.rescanned) == 1 and grown.rescanned[0].startswith("b.jsonl: made for another size")
    assert len(grown) == len(first) + 1
    assert _open(shards, idx).kept == 2  # the file kept for the grown shard is read next time
    shorter = _open(shards, idx, max_len=128)  # another largest bucket: lengths are cut to it
    assert shorter.kept == 0 and all("max_len" in why for why in shorter.rescanned)
    assert max(shorter.lengths) == 128


@pytest.mark.parametrize("damage", ["cut", "header", "count", "order", "bounds", "long", "not-an-object"])
def test_a_kept_file_that_is_not_what_a_scan_writes_is_scanned_again_and_replaced(tmp_path, damage):
    shards, idx = _shards(tmp_path, bad=False), index.directory(str(tmp_path / "run"))
    first = _open(shards, idx)
    path = index.index_file(idx, first.paths[0])
    head, body = open(path, "rb").read().split(b"\n", 1)
    header = json.loads(head)
    n = header["count"]
    offsets = memoryview(bytearray(body))[:8 * n].cast("q")
    if damage == "cut":
        blob = head + b"\n" + body[:-3]
    elif damage == "header":
        blob = b"{not json\n" + body
    elif damage == "not-an-object":
        blob = b"[1, 2]\n" + body
    elif damage == "count":
        blob = json.dumps({**header, "count": n + 1}).encode() + b"\n" + body
    else:
        raw = bytearray(body)
        if damage == "order":
            raw[0:8], raw[8:16] = raw[8:16], raw[0:8]  # two offsets swapped
        elif damage == "bounds":
            raw[8 * (n - 1):8 * n] = (header["size"] + 10).to_bytes(8, "little")  # past the shard's end
        else:  # a length over the largest bucket
            raw[16 * n:16 * n + 4] = (100000).to_bytes(4, "little", signed=True)
        blob = head + b"\n" + bytes(raw)
    assert offsets[0] < offsets[1]
    with open(path, "wb") as f:
        f.write(blob)
    read = _open(shards, idx)
    why = {"cut": "cut short?", "header": "header is not JSON", "not-an-object": "header is not an object",
           "count": "where 5 lines need"}.get(damage, "out of order or out of bounds")
    assert read.kept == 1 and len(read.rescanned) == 1 and why in read.rescanned[0], read.rescanned
    assert _same(first, read)  # what a scan finds, whatever the file said
    assert _open(shards, idx).kept == 2  # and the file written again by that scan is read


def test_a_scan_over_the_budget_keeps_nothing(tmp_path):
    shards, idx = _shards(tmp_path), index.directory(str(tmp_path / "run"))
    with pytest.raises(DataError):
        _open(shards, idx, budget=0)
    assert os.listdir(idx) == []


def test_no_index_dir_keeps_nothing_and_says_nothing(tmp_path):
    shards = _shards(tmp_path)
    plain = ShardDataset(shard_paths(shards), 256, 16, 512, ErrorBudget(5, lambda line: None))
    assert (plain.kept, plain.rescanned, len(plain)) == (0, [], 8)
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------- a first scan spread over processes


def _many(tmp_path, bad_in_c: int = 1) -> str:
    ds = synthetic(12)
    shards = tmp_path / "shards"
    shards.mkdir()
    good = [ds.get(i) for i in range(12)]
    write_shard(shards / "a.jsonl", good[:5])
    write_shard(shards / "b.jsonl", good[5:8])
    write_shard(shards / "c.jsonl", good[8:], tail='{"input_ids": [1, 2, 3], "loss_mask": [0, 1]}\n' * bad_in_c)
    return str(shards)


def test_the_groups_of_shards_balance_their_bytes():
    from trainer.data.scan_workers import plan

    groups = plan({"a": 100, "b": 60, "c": 50, "d": 10}, 2)
    assert groups == [["a", "d"], ["b", "c"]]  # 110 bytes each
    assert plan({"a": 1}, 8) == [["a"]] and sorted(sum(plan({"a": 5, "b": 5, "c": 5}, 3), [])) == ["a", "b", "c"]


def test_a_first_scan_in_worker_processes_finds_what_one_process_finds(tmp_path, monkeypatch):
    from trainer.data import scan_workers

    monkeypatch.setattr(scan_workers, "MIN_BYTES", 0)  # a few kilobytes stand for a corpus worth the processes
    shards, idx = _many(tmp_path), index.directory(str(tmp_path / "run"))
    serial = ShardDataset(shard_paths(shards), 256, 16, 512, ErrorBudget(5, lambda line: None))
    said, seen, bad = [], [], []
    apart = ShardDataset(shard_paths(shards), 256, 16, 512, ErrorBudget(5, bad.append), index_dir=str(idx),
                         workers=2, progress=seen.append, log=said.append)
    assert _same(serial, apart) and len(apart) == 12 and apart.errors.count == 1
    assert "c.jsonl:5: 'input_ids' has 3 tokens" in bad[0]  # named in the trainer, as a scan names it
    assert (apart.kept, apart.rescanned) == (0, ["a.jsonl: none kept", "b.jsonl: none kept", "c.jsonl: none kept"])
    assert said[0].startswith("data: scanning 3 shard(s)") and said[0].endswith("in 2 processes")
    assert said[-1].startswith("data: 3 of 3 shard(s) scanned apart")
    assert seen[-1]["shards_done"] == seen[-1]["shards"] == 3 and seen[-1]["bytes_done"] == seen[-1]["bytes"]
    assert not [f for f in os.listdir(idx) if f.startswith(scan_workers.LOG_PREFIX)]  # the workers' logs removed
    again = _open(shards, idx)
    assert again.kept == 3 and _same(serial, again)


def test_a_shard_past_the_budget_in_a_worker_is_named_by_the_trainer(tmp_path, monkeypatch):
    from trainer.data import scan_workers

    monkeypatch.setattr(scan_workers, "MIN_BYTES", 0)  # as above
    shards, idx = _many(tmp_path, bad_in_c=3), index.directory(str(tmp_path / "run"))
    with pytest.raises(DataError, match=r"over data.error_budget=1; first: .*c.jsonl:5: 'input_ids' has 3 tokens"):
        ShardDataset(shard_paths(shards), 256, 16, 512, ErrorBudget(1, lambda line: None), index_dir=str(idx),
                     workers=3)
    kept = sorted(os.listdir(idx))
    assert index.index_file(str(idx), os.path.join(shards, "c.jsonl")).split("/")[-1] not in kept and len(kept) == 2


def test_the_scan_beats_as_phase_indexing_in_status_json(tmp_path):
    """What the supervisor reads while worker processes scan (contract.PHASE_INDEXING,
    judged by its beat): the phase and the shards and bytes done, in status.json."""
    from dflashctl.core import contract
    from trainer.train import StatusFile, scan_progress

    status = StatusFile(str(tmp_path))
    show = scan_progress(status, log_every_s=3600)
    show({"shards_done": 2, "shards": 5, "bytes_done": 10, "bytes": 50, "elapsed_s": 1.0})
    written = json.loads((tmp_path / contract.STATUS_FILE).read_text())
    assert written["phase"] == contract.PHASE_INDEXING and written["detail"]["data"]["shards_done"] == 2
    parsed = contract.parse_status((tmp_path / contract.STATUS_FILE).read_text())
    assert parsed.phase == contract.PHASE_INDEXING  # a phase the controller knows
