"""Where the run's shards are, and the manifest beside them that says what wrote them.

Regenerated shards live in the run directory; ``provenance`` reads the manifest that
convert or regenerate wrote there, for ``python -m trainer info``.
"""

from __future__ import annotations

import json
import os
from typing import Optional


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
