"""Checkpoints: atomic, newest-complete-wins, last K kept.

Layout (``RUN_DIR/checkpoints/step-NNNNNNNN/``, NNNNNNNN = optimiser steps done)::

    model.pt     trainable drafter parameters {name: tensor} (fp32 master copy)
    optim.pt     {"optimizer": ..., "scheduler": ...}
    rng.pt       torch CPU generator state and one state per CUDA device
    meta.json    step, data position, python RNG state, config, versions, files,
                 and (for a drafter) ``serving``: what an inference engine needs
                 (trainer/serving.py); written last, so a directory with meta.json
                 is complete

A checkpoint is written into ``.tmp-step-NNNNNNNN-PID`` and renamed into place, so a
crash mid-save leaves a temp directory (removed at the next save), never a half
checkpoint under a real name.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from typing import Any, Optional

import torch

from dflashctl.core import contract
from dflashctl.core.contract import CHECKPOINT_DIR
from trainer import serving

_STEP_DIR = re.compile(r"^step-(\d{8})$")
META = serving.META_NAME


def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, CHECKPOINT_DIR)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _save_tensor_file(obj: Any, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def complete_checkpoints(run_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint, oldest first."""
    root = checkpoint_root(run_dir)
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        m = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if m and _is_complete(path):
            found.append((int(m.group(1)), path))
    return sorted(found)


def _is_complete(path: str) -> bool:
    try:
        files = read_meta(path).get("files", [])
        return isinstance(files, list) and all(os.path.isfile(os.path.join(path, str(name))) for name in files)
    except serving.ConfigError:
        return False


def latest(run_dir: str) -> Optional[str]:
    """The newest complete checkpoint directory, or None."""
    found = complete_checkpoints(run_dir)
    return found[-1][1] if found else None


def resolve_checkpoint(path: str) -> str:
    """A checkpoint directory (holding meta.json), or a run directory's newest one."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isfile(os.path.join(path, META)):
        return path
    newest = latest(path) if os.path.isdir(path) else None
    if newest:
        return newest
    raise serving.ConfigError([f"{path}: not a checkpoint (no {META}) nor a run directory with a complete checkpoint"])


MAX_META_BYTES = 64 << 20  # a meta.json is some KiB (config, RNG state, file list)


def read_meta(ckpt: str) -> dict:
    """A checkpoint's meta.json; ConfigError naming it when it is not a JSON object,
    is larger than MAX_META_BYTES or nests deeper than ``contract.MAX_DEPTH`` (a
    checkpoint may come from anyone: nesting is bounded before it is parsed, never
    a bare RecursionError)."""
    where = os.path.join(ckpt, META)
    try:
        with open(where, encoding="utf-8") as f:
            text = f.read(MAX_META_BYTES + 1)
    except (OSError, ValueError) as e:
        raise serving.ConfigError([f"{where}: cannot be read as JSON: {e}"]) from None
    if len(text) > MAX_META_BYTES:
        raise serving.ConfigError([f"{where}: larger than {MAX_META_BYTES >> 20} MiB; a checkpoint's metadata is "
                                   "some KiB"])
    if contract.json_depth_exceeds(text):
        raise serving.ConfigError([f"{where}: nests deeper than {contract.MAX_DEPTH} levels; a checkpoint's "
                                   "metadata is a few levels deep"])
    try:
        meta = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise serving.ConfigError([f"{where}: cannot be read as JSON: {str(e)[:200]}"]) from None
    if not isinstance(meta, dict):
        raise serving.ConfigError([f"{where}: expected a JSON object, got {type(meta).__name__}"])
    return meta


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def save(run_dir: str, step: int, model, optimizer, scheduler, data_state: dict,
         extra: Optional[dict] = None, keep: int = 3) -> str:
    """Write checkpoint ``step`` atomically; prune to the newest ``keep``. Returns its path."""
    root = checkpoint_root(run_dir)
    os.makedirs(root, exist_ok=True)
    for name in os.listdir(root):  # left by a crash during an earlier save
        if name.startswith(".tmp-step-"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    final = os.path.join(root, f"step-{step:08d}")
    if _is_complete(final):
        # The same step saved again (a stop right after a periodic save): the state after
        # `step` steps is the same, and replacing it would leave a moment with none.
        return final
    tmp = os.path.join(root, f".tmp-step-{step:08d}-{os.getpid()}")
    os.makedirs(tmp)
    _save_tensor_file({k: v.cpu() for k, v in trainable_state(model).items()}, os.path.join(tmp, "model.pt"))
    _save_tensor_file({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                      os.path.join(tmp, "optim.pt"))
    rng = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    _save_tensor_file(rng, os.path.join(tmp, "rng.pt"))
    py_version, py_state, py_gauss = random.getstate()
    meta = {
        "step": step,
        "time": time.time(),
        "data": data_state,
        "rng_python": [py_version, list(py_state), py_gauss],
        "torch": torch.__version__,
        "files": ["model.pt", "optim.pt", "rng.pt"],
        **(extra or {}),
    }
    serving_meta = serving.checkpoint_metadata(model, meta.get("config"))
    if serving_meta is not None:
        meta["serving"] = serving_meta
    with open(os.path.join(tmp, META), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if os.path.exists(final):  # an incomplete directory of that name (damaged by hand or by the disk)
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    for _, old in complete_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load(path: str, model, optimizer=None, scheduler=None, restore_rng: bool = True) -> dict:
    """Restore a checkpoint into ``model`` (and optimiser/scheduler); returns its metadata.

    A drafter whose mask token id differs from the one the checkpoint was trained
    with is refused (ConfigError) before anything is restored."""
    meta = read_meta(path)
    serving.check_resume(meta, model, path)
    state = torch.load(os.path.join(path, "model.pt"), map_location="cpu", weights_only=True)
    params = dict(model.named_parameters())
    missing = [n for n, p in params.items() if p.requires_grad and n not in state]
    unexpected = [n for n in state if n not in params]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint {path} does not fit the drafter: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor)
    if optimizer is not None or scheduler is not None:
        opt = torch.load(os.path.join(path, "optim.pt"), map_location="cpu", weights_only=True)
        if optimizer is not None:
            optimizer.load_state_dict(opt["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(opt["scheduler"])
    if restore_rng:
        rng = torch.load(os.path.join(path, "rng.pt"), map_location="cpu", weights_only=True)
        torch.set_rng_state(rng["torch_cpu"])
        if "cuda" in rng and torch.cuda.is_available() and len(rng["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(rng["cuda"])
        version, state_list, gauss = meta["rng_python"]
        random.setstate((version, tuple(state_list), gauss))
    return meta
