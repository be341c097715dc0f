"""The lanes themselves (tests/conftest.py): collecting the unit lane imports no torch."""

from __future__ import annotations

import sys

import pytest

from tests import conftest


def test_collecting_the_unit_lane_imports_no_torch():
    seen = conftest.torch_after_unit_module
    if seen is None:
        pytest.skip("another lane was collected before the unit lane here; `pytest tests/unit` (or the default "
                    "run, which collects the unit lane first) checks it")
    assert seen is False, f"torch was in sys.modules once {seen} was collected: import it inside the tests that need it"
    if all(conftest.lane_of(item.path) == "unit" for item in conftest.collected):
        assert "torch" not in sys.modules, "a unit test imported torch"


def test_no_harness_module_shadows_a_module_the_harness_scripts_import():
    """tests/harness/fake_trainer.py and compile_race.py run as scripts: their folder
    is first on sys.path, so a harness module named like a package (``trainer``) or
    a standard module would be imported in its place."""
    import importlib.util
    from pathlib import Path

    harness = Path(conftest.TESTS / "harness")
    names = sorted(p.stem for p in harness.glob("*.py") if p.stem != "__init__")
    shadowing = [name for name in names if importlib.util.find_spec(name) is not None]
    assert not shadowing, f"tests/harness modules named like importable modules: {shadowing}"


def test_no_test_file_imports_another():
    """Shared code lives in tests/harness; a test module imports no test module (it
    would collect its tests twice and tie the lanes together)."""
    import ast

    offenders = []
    for path in sorted(conftest.TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(part.startswith("test_") for name in names for part in name.split(".")):
                offenders.append(f"{path.relative_to(conftest.TESTS)}:{node.lineno}")
    assert not offenders, offenders
