"""Compile-cache test data: a run's configuration as the controller writes it, and a
compile artifact's manifest and bytes (the cache store's tests, unit and through a host)."""

from __future__ import annotations

import hashlib
import json
import time

from dflashctl.runs.runhost import run_files
from trainer import compile_cache as trainer_cache
from trainer import config as trainer_config

TRAINER = {"model": {"preset": "tiny"}, "data": {"buckets": [256], "batch_size": 1, "max_anchors": 16},
           "placement": {"device": "cpu", "target": [0], "drafter": [0]}}


def run_config(trainer: dict | None = None, gpus=(), bundle_dir: str = "/w/bundles/" + "b" * 64) -> dict:
    env = {"PYTHONPATH": bundle_dir}
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    return {"trainer": trainer_config.from_dict(trainer or TRAINER).to_dict(), "gpus": list(gpus), "env": env,
            "python": "python3", "compile_cache": None}


def written(config: dict) -> dict:
    """The trainer configuration as the run's config.json holds it."""
    return json.loads(run_files("r", "/r", config, "s")["config.json"])


def artifact(config: str, bundle: str = "b" * 64, gpu: str = "cpu", torch: str = "2.13.0",
             data: bytes = b"compiled kernels " * 4096) -> tuple[dict, bytes]:
    fields = {"torch": torch, "triton": "3.5", "cuda": "12.8", "gpu": gpu, "python": "3.12.3", "bundle": bundle,
              "config": config}
    key = trainer_cache.key_of(fields)
    return {"v": 1, "key": key, "fields": fields, "shape": {}, "file": f"{key}.bin", "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(), "created": time.time(), "artifacts": {"inductor": 3}}, data
