"""A checkpoint brought back: the frozen target and the trained drafter, for ``eval``,
``export --engine speculators`` and the benches.

The target may be given anew (``--target PATH``: the same model on this machine). It
is the one trained against when what the drafter depends on is equal
(serving.target_differences: architecture, width, vocabulary, depth and captured
layers, head shapes, RoPE normalised); otherwise ConfigError naming the first field
that differs. Not the config hash: ``config.to_dict()`` differs between transformers
versions for one model (4.57 keeps ``rope_theta`` at the top level, 5.x inside
``rope_parameters``), and a different transformers version is not a different target.

Data flows one way: restore -> checkpoint, model, target -> serving.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from trainer import checkpoint, serving
from trainer.config import ConfigError


@dataclass
class Loaded:
    """A checkpoint brought back: its config and metadata, the frozen target, the drafter."""

    path: str
    meta: dict
    serving: dict
    cfg: Any  # TrainerConfig
    target: Any  # trainer.target.Target
    drafter: Any  # trainer.model.Drafter


def _where(target: dict) -> str:
    return target.get("path") or f"preset {target.get('preset')}"


def check_target(recorded: dict, cfg_model, target_config, ckpt: str) -> None:
    """ConfigError when the target at hand is not the one the drafter was trained against."""
    actual = serving.metadata(cfg_model, target_config, recorded["mask_token_id"],
                              recorded.get("mask_token_source", "recorded"), "float32")
    diffs = serving.target_differences(recorded, actual)
    if not diffs:
        return
    trained, here = _where(recorded.get("target") or {}), _where(actual["target"])
    fields = "; ".join(f"{f}: trained {a!r}, this target {b!r}" for f, a, b in diffs)
    if trained == here:
        raise ConfigError([f"model.path: the target ({here}) changed since checkpoint {ckpt} was trained against it: "
                           f"{fields}. Give the target as it was then with --target PATH"])
    raise ConfigError([f"model.path: the target ({here}) is not the one checkpoint {ckpt} was trained against: "
                       f"{fields}. Give the target the drafter was trained against ({trained}) with --target PATH"])


def load(path: str, device: str = "cpu", dtype=None, target_path: Optional[str] = None) -> Loaded:
    """Rebuild the target and the trained drafter of checkpoint (or run directory) ``path``.

    ``target_path`` replaces model.path (the target on this machine); it must be the
    target trained against (``check_target``), else ConfigError: features from another
    network are meaningless to the drafter. The drafter keeps the recorded mask token id.
    """
    from trainer import config as config_mod
    from trainer.model import Drafter
    from trainer.target import build_target, default_dtype

    ckpt = checkpoint.resolve_checkpoint(path)
    meta = checkpoint.read_meta(ckpt)
    where = os.path.join(ckpt, checkpoint.META)
    cfg = config_mod.from_dict(meta.get("config") or {}, prefix=f"{where}: config")
    recorded = serving.derived_metadata(meta, where)
    if target_path:
        cfg.model.path = target_path
    cfg.model.sliding_semantics = recorded["sliding_semantics"]
    dtype = dtype or default_dtype(cfg.model, device)
    target = build_target(cfg.model, device, dtype)
    check_target(recorded, cfg.model, target.config, ckpt)
    cfg.model.mask_token_id = int(recorded["mask_token_id"])
    drafter = Drafter(cfg.model, target.config, target.embed_tokens, target.lm_head).to(device)
    drafter.mask_token_source = recorded.get("mask_token_source", drafter.mask_token_source)
    checkpoint.load(ckpt, drafter, restore_rng=False)
    drafter.eval().requires_grad_(False)
    return Loaded(path=ckpt, meta=meta, serving=recorded, cfg=cfg, target=target, drafter=drafter)
