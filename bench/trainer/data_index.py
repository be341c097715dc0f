"""The data's start cost: a shard scan (every line parsed and checked) against reading
the scan kept in the run directory (trainer/data/index.py), as a restart does.

    .venv/bin/python -m bench.trainer.data_index                       # 4 shards x 5,000 samples
    .venv/bin/python -m bench.trainer.data_index --shards 8 --samples 10000 --max-len 4096
    .venv/bin/python -m bench.trainer.data_index --workers 2     # the first scan in 2 processes too

Samples have 200 to ``--max-len`` tokens of a 151,936-token vocabulary, the response
the last part of each (what the converter writes). Printed: the scan in one process
(and in ``--workers`` processes, trainer/data/scan_workers.py), the first read of the
kept scan and the best of three more, per sample and in all, and the kept files' size.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time

from bench.common import print_markdown


def write_shards(directory: str, shards: int, samples: int, max_len: int, seed: int = 0) -> int:
    rng = random.Random(seed)
    size = 0
    for s in range(shards):
        path = os.path.join(directory, f"shard-{s:03d}.jsonl")
        with open(path, "w") as f:
            for _ in range(samples):
                n = rng.randint(200, max_len)
                prompt = rng.randint(50, n - 64)
                f.write(json.dumps({"input_ids": [rng.randrange(151936) for _ in range(n)],
                                    "loss_mask": [0] * prompt + [1] * (n - prompt)}) + "\n")
        size += os.path.getsize(path)
    return size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--samples", type=int, default=5000, help="samples a shard")
    p.add_argument("--max-len", type=int, default=2048, help="the largest bucket, and the longest sample")
    p.add_argument("--workers", type=int, default=1, help="also time the first scan in this many processes")
    p.add_argument("--keep", help="a directory to write the shards in and keep (default: a temporary one)")
    args = p.parse_args()

    from trainer.data import ErrorBudget, ShardDataset, shard_paths
    from trainer.data import index

    work = args.keep or tempfile.mkdtemp(prefix="bench-data-index-")
    try:
        shards = os.path.join(work, "shards")
        os.makedirs(shards, exist_ok=True)
        size = write_shards(shards, args.shards, args.samples, args.max_len)
        index_dir = index.directory(os.path.join(work, "run"))

        def start(workers: int = 1) -> tuple[float, ShardDataset]:
            t = time.perf_counter()
            ds = ShardDataset(shard_paths(shards), args.max_len, 16, 151936, ErrorBudget(0), index_dir=index_dir,
                              workers=workers)
            return time.perf_counter() - t, ds

        rows = []
        if args.workers > 1:
            apart_s, ds = start(args.workers)
            assert ds.kept == 0, ds.rescanned
            shutil.rmtree(index_dir)
            index_dir = index.directory(os.path.join(work, "run"))
            rows.append((f"scan in {args.workers} processes (the first start)", f"{apart_s:.2f} s"))
        scan_s, ds = start()
        assert ds.kept == 0, ds.rescanned
        first_s, again = start()
        assert again.kept == args.shards and list(again.lengths) == list(ds.lengths)
        best_s = min(start()[0] for _ in range(3))
        kept_bytes = sum(os.path.getsize(os.path.join(index_dir, f)) for f in os.listdir(index_dir))
        n = len(ds)
        print_markdown([
            (f"{args.shards} shards, {n:,} samples, {size / 1e6:,.0f} MB of JSON lines", ""),
            ("scan (the first start)", f"{scan_s:.2f} s ({1e3 * scan_s / n:.3f} ms a sample)"),
            *rows,
            ("kept scans read (a restart), first", f"{1e3 * first_s:.1f} ms"),
            ("kept scans read, best of 3", f"{1e3 * best_s:.1f} ms ({scan_s / best_s:,.0f}x faster than the scan)"),
            ("kept files", f"{kept_bytes / 1e6:.2f} MB ({kept_bytes / n:.0f} bytes a sample)"),
        ], value_header="figure")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
