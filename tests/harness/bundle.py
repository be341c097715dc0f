"""The bundle's sources, copied where a test may change them."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.harness import REPO


def source_copy(tmp_path: Path) -> Path:
    """The bundle's sources copied somewhere they can be changed."""
    root = tmp_path / "src"
    for rel in ("trainer", "dflashctl/__init__.py", "dflashctl/core/__init__.py", "dflashctl/core/contract.py"):
        src, dst = REPO / rel, root / rel
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dst)
    return root
