"""The serving engines' own model code that runs on a CPU, for the export tests: z-lab's
``dflash`` package (PyPI dflash 0.1.0, ``dflash/model.py``) and vLLM speculators
(PyPI speculators 0.9.0, ``speculators/models/dflash``). scripts/setup.sh installs both
without their dependencies; ``available()`` says which are here.

speculators' package ``__init__`` imports every algorithm, and two of them import its
training-data tooling (an OpenAI client, ``datasets``, ``hs_connectors``) that the
model code never uses. ``speculators_dflash`` therefore builds the package from its own
modules without running that ``__init__``: ``speculators.config`` and
``speculators.model`` (what the DFlash model imports from the package), then
``speculators.models.dflash`` itself, then ``reload_schemas`` as the ``__init__`` does.
Everything that runs is speculators' code.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types


def available(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def zlab_model():
    """z-lab's ``dflash.model`` module (DFlashDraftModel, extract_context_feature)."""
    return importlib.import_module("dflash.model")


def speculators_dflash():
    """speculators' ``speculators.models.dflash`` module (module docstring)."""
    if "speculators.models.dflash" in sys.modules:
        return sys.modules["speculators.models.dflash"]
    root = importlib.util.find_spec("speculators").submodule_search_locations[0]
    package = types.ModuleType("speculators")
    package.__path__ = [root]
    sys.modules["speculators"] = package
    config = importlib.import_module("speculators.config")
    model = importlib.import_module("speculators.model")
    for name in ("SpeculatorModelConfig", "SpeculatorsConfig", "VerifierConfig", "reload_schemas"):
        setattr(package, name, getattr(config, name))
    package.SpeculatorModel = model.SpeculatorModel
    models = types.ModuleType("speculators.models")
    models.__path__ = [os.path.join(root, "models")]
    sys.modules["speculators.models"] = models
    package.models = models
    dflash = importlib.import_module("speculators.models.dflash")
    config.reload_schemas()
    return dflash
