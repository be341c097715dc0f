"""The supervisor's memory during a compile-artifact copy-back from a hostile host.

    .venv/bin/python -m bench.controller.copyback              # 1.5 GiB behind a 1,000-byte manifest
    .venv/bin/python -m bench.controller.copyback --gib 4

A run host (a ``transport: local`` inventory entry with its own work directory)
holds a manifest claiming 1,000 bytes and a sparse artifact file of ``--gib`` GiB
behind it; ``compile_cache.fetch`` copies it back as the supervisor does. Printed:
the outcome, the seconds, and this process's peak RSS before and after (ru_maxrss).
Target: the copy-back is cut off at the manifest's size and the peak grows by
under 32 MiB whatever the host sends (it grew by the whole stream when the bytes
were read into memory before the size check). Then a true artifact of the same size
(its manifest says so) is copied back whole: the rate of a verified stream into the
store, and the same bound on the peak.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import sys
import tempfile
import time

from bench.common import local_inventory
from dflashctl.hosts.transport import connect
from dflashctl.runs import compile_cache as cc
from trainer import compile_cache as trainer_cache
from trainer import config as trainer_config

TRAINER = {"model": {"preset": "tiny"}, "data": {"buckets": [256], "batch_size": 1, "max_anchors": 16},
           "placement": {"device": "cpu", "target": [0], "drafter": [0]}}


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.5, help="GiB the host sends behind its 1,000-byte manifest")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-copyback-") as tmp:
        inventory = local_inventory(os.path.join(tmp, "inventory.yaml"), {"gpu1": os.path.join(tmp, "gpu1")})
        transport = connect("gpu1", inventory)
        trainer = trainer_config.from_dict(TRAINER).to_dict()
        fields = {"torch": "2.13.0", "triton": "3.5", "cuda": "12.8", "gpu": "cpu", "python": "3.11.0",
                  "bundle": "b" * 64, "config": cc.config_digest(trainer)}
        cfg = trainer_config.from_dict(TRAINER)
        run_dir = os.path.join(tmp, "gpu1", "run")
        manifest = trainer_cache.write(run_dir, fields, cfg, b"k" * 1000, {})
        with open(os.path.join(run_dir, "compile_cache", manifest["file"]), "wb") as f:
            f.truncate(int(args.gib * (1 << 30)))
        cache = cc.LocalCache(os.path.join(tmp, "store"))
        before = peak_mib()
        t0 = time.monotonic()
        out = cc.fetch(transport, run_dir, trainer, "b" * 64, claim="miss", cache=cache)
        print(json.dumps({"case": f"{args.gib:g} GiB behind a 1000-byte manifest", "status": out.status,
                          "message": out.message, "seconds": round(time.monotonic() - t0, 2),
                          "peak_rss_before_mib": round(before, 1), "peak_rss_after_mib": round(peak_mib(), 1),
                          "grew_mib": round(peak_mib() - before, 1)}))
        # A true artifact as large: its manifest says its size and sha256, streamed whole into the store.
        path = os.path.join(run_dir, "compile_cache", manifest["file"])
        sha = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                sha.update(chunk)
        true = {**manifest, "bytes": os.path.getsize(path), "sha256": sha.hexdigest()}
        with open(os.path.join(run_dir, "compile_cache", trainer_cache.MANIFEST_FILE), "w") as f:
            json.dump(true, f)
        before = peak_mib()
        t0 = time.monotonic()
        out = cc.fetch(transport, run_dir, trainer, "b" * 64, claim="miss", cache=cache)
        seconds = time.monotonic() - t0
        print(json.dumps({"case": f"a true {args.gib:g} GiB artifact", "status": out.status,
                          "seconds": round(seconds, 2), "mib_per_s": round(true["bytes"] / 2**20 / seconds, 1),
                          "peak_rss_before_mib": round(before, 1), "peak_rss_after_mib": round(peak_mib(), 1),
                          "grew_mib": round(peak_mib() - before, 1)}))
        ok = out.status == "fetched"
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
