"""The import contracts in pyproject.toml (import-linter): the rooms import only
downwards, no circle, status never draws, the supervisor core stays pure, the
controller never imports torch, the trainer imports only the contract.

``scripts/test.sh`` runs ``lint-imports`` before the tests; these tests show the
contracts hold on this tree and that they do fail on the imports they forbid (on a
copy of the tree with one such import added)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import harness

REPO = harness.REPO
LINT = str(Path(sys.executable).with_name("lint-imports"))


def _lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([LINT, "--no-cache", "--config", str(root / "pyproject.toml")], cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True, timeout=120)


def test_the_contracts_hold_on_this_tree():
    done = _lint(REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


@pytest.fixture
def tree_copy(tmp_path: Path) -> Path:
    for name in ("dflashctl", "trainer"):
        shutil.copytree(REPO / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _add_import(root: Path, module: str, line: str) -> None:
    """Append ``line`` to the module's file (a package's ``__init__.py``)."""
    base = root / module.replace(".", "/")
    path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    path.write_text(path.read_text() + f"\n{line}\n")


@pytest.mark.parametrize("module, line, contract", [
    ("dflashctl.core.errors", "from dflashctl.store import Store", "import only downwards"),
    ("dflashctl.hosts.transport", "import dflashctl.store", "import only downwards"),
    ("dflashctl.hosts.parsers", "from dflashctl.hosts import probe", "No import circle"),
    ("trainer.loss", "import trainer.step", "No import circle"),
    ("dflashctl.status.model", "import textual", "never draw"),
    ("dflashctl.supervise.supervisor_core", "from dflashctl.store import Store", "supervisor core is pure"),
    ("dflashctl.supervise.detectors", "import torch", "never imports torch"),
    ("trainer.model", "from dflashctl.core import errors", "imports nothing of the controller"),
    ("trainer.loss", "from dflashctl.core.units import fmt_duration", "imports nothing of the controller"),
])
def test_a_forbidden_import_breaks_its_contract(tree_copy: Path, module: str, line: str, contract: str):
    done = _lint(tree_copy)
    assert done.returncode == 0, done.stdout  # the copy holds before the change
    _add_import(tree_copy, module, line)
    done = _lint(tree_copy)
    assert done.returncode != 0
    broken = [l for l in done.stdout.splitlines() if " BROKEN" in l]
    assert len(broken) >= 1 and any(contract in l for l in broken), done.stdout
