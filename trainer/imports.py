"""What a trainer start imports, and what it keeps that from costing.

Three costs of every start that the trainer never uses (``python -X importtime`` and
py-spy of warm starts on an H200 host, bench/RESULTS.md):

- transformers imports some optional packages eagerly when they are installed:
  scikit-learn (with scipy) for assisted generation's candidate generator (1.2 s),
  scipy.optimize for object-detection losses (0.6 s), torchvision and torchaudio for
  image and audio utilities. ``hide_unused`` makes them look absent (``sys.modules[name]
  = None``: ``importlib.util.find_spec`` then answers None and a plain ``import``
  raises ImportError) while the start imports; ``show_again`` undoes it after, so a
  later import of one of them works as usual.
- transformers calls ``importlib.metadata.packages_distributions()`` once, which reads
  the file list of every installed distribution: 0.6 s on an image with a few hundred
  packages. ``remember_package_map`` answers it from a JSON file in the host's cache,
  valid while no directory of ``sys.path`` changed (installing or removing a package
  changes its site-packages directory). The file is this host's own and is never sent
  anywhere (it is not in the compile artifacts).
- inductor's cache key hashes triton's compiler sources and its 400+ MB libtriton.so
  (``triton_key``) in the warm-up: 0.3-0.4 s. ``prehash_triton`` computes that
  (memoised) key in a thread while torch imports; hashing releases the GIL.

Nothing here imports torch.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import threading
from typing import Optional

from trainer.bytecode import host_cache

# Packages the trainer's code paths never use, that a dependency imports when present.
UNUSED = ("sklearn", "scipy", "torchvision", "torchaudio")
PACKAGE_MAP_FILE = "packages-distributions.json"

# What a start imports before its first step (a standby imports these while it waits).
MODULES = (
    "torch", "torch._dynamo", "torch._inductor.compile_fx", "torch.nn.attention.flex_attention",
    "transformers", "trainer.target", "trainer.model", "trainer.pipeline", "trainer.compile",
    "trainer.compile_cache", "trainer.checkpoint", "trainer.data", "trainer.optim", "trainer.step",
    "trainer.attention", "trainer.anchors", "trainer.profiling", "trainer.distributed",
)


def hide_unused(names: tuple[str, ...] = UNUSED) -> list[str]:
    """Make ``names`` look not installed to this process; returns those hidden (a
    package already imported is left alone)."""
    hidden = []
    for name in names:
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]
            hidden.append(name)
    return hidden


def show_again(hidden: list[str]) -> None:
    """Undo ``hide_unused`` for ``hidden`` (those still hidden): later imports work."""
    for name in hidden:
        if name in sys.modules and sys.modules[name] is None:
            del sys.modules[name]


def _path_stamp() -> list:
    """Each directory of sys.path that holds distributions, with its modification time:
    what installing or removing a package changes (a working directory that only holds
    code, where files come and go, does not count)."""
    stamp = []
    for entry in sys.path:
        try:
            with os.scandir(entry or ".") as it:
                if any(e.name.endswith((".dist-info", ".egg-info")) for e in it):
                    stamp.append([entry, os.stat(entry or ".").st_mtime_ns])
        except OSError:
            continue
    return stamp


def _valid_map(value) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, list) and all(isinstance(d, str) for d in v) for k, v in value.items())


def remember_package_map(cache_dir: Optional[str]) -> str:
    """Answer ``importlib.metadata.packages_distributions()`` from PACKAGE_MAP_FILE in
    this host's cache (``bytecode.host_cache``) while sys.path's
    directories are unchanged, else compute it once and write the file. Returns 'hit',
    'saved' or 'computed' (the file could not be written)."""
    path = os.path.join(host_cache(cache_dir), PACKAGE_MAP_FILE)
    original = getattr(importlib.metadata.packages_distributions, "__wrapped__",  # a second call: the real one
                       importlib.metadata.packages_distributions)
    stamp = _path_stamp()
    mapping, outcome = None, "hit"
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        if isinstance(saved, dict) and saved.get("path") == stamp and _valid_map(saved.get("map")):
            mapping = saved["map"]
    except (OSError, ValueError):
        pass
    if mapping is None:
        mapping = {k: list(v) for k, v in original().items()}
        outcome = "saved"
        try:
            from dflashctl.core.contract import atomic_write_text

            os.makedirs(os.path.dirname(path), exist_ok=True)
            atomic_write_text(path, json.dumps({"path": stamp, "map": mapping}))
        except OSError:
            outcome = "computed"

    def packages_distributions() -> dict:
        return {k: list(v) for k, v in mapping.items()}

    packages_distributions.__wrapped__ = original
    importlib.metadata.packages_distributions = packages_distributions
    return outcome


def prehash_triton() -> Optional[threading.Thread]:
    """Start computing triton's memoised cache key in a daemon thread (None without triton).
    Imports triton here, in the calling thread, first: the subpackages the key walks
    (triton.compiler, triton.backends) are imported by then, so the thread only reads
    and hashes files."""
    try:
        import triton  # noqa: F401
        try:
            from triton.runtime.cache import triton_key
        except ImportError:
            from triton.compiler.compiler import triton_key
    except Exception:  # noqa: BLE001 - no triton, or one that keys its cache otherwise: nothing to prepare
        return None

    def run() -> None:
        try:
            triton_key()
        except Exception:  # noqa: BLE001 - inductor computes it again, and reports its own error
            pass

    thread = threading.Thread(target=run, name="prehash-triton", daemon=True)
    thread.start()
    return thread
