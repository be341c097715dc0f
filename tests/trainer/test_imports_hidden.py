"""trainer.imports.hide_unused: a package the trainer never uses, that transformers
imports eagerly when installed (scikit-learn), looks absent to a trainer process.
A real transformers and a stand-in ``sklearn`` package (with its dist-info, so
transformers believes it installed) in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests import harness

REPO = str(harness.REPO)

_CHILD = textwrap.dedent("""
    import json, sys
    from trainer import imports
    hidden = imports.hide_unused() if sys.argv[1] == "hide" else []
    from transformers.utils import import_utils
    available = import_utils._is_package_available("sklearn")[0]
    try:
        import sklearn  # noqa: F401
        imported = True
    except ImportError:
        imported = False
    print(json.dumps({"hidden": hidden, "available": available, "imported": imported}))
""")


@pytest.fixture()
def site_with_sklearn(tmp_path):
    (tmp_path / "sklearn").mkdir()
    (tmp_path / "sklearn" / "__init__.py").write_text("__version__ = '9.9'\n")
    dist = tmp_path / "scikit_learn-9.9.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: scikit-learn\nVersion: 9.9\n")
    (dist / "top_level.txt").write_text("sklearn\n")
    return tmp_path


@pytest.mark.parametrize("mode", ["hide", "plain"])
def test_a_hidden_package_is_absent_to_transformers(site_with_sklearn, mode):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site_with_sklearn), REPO]))
    out = subprocess.run([sys.executable, "-c", _CHILD, mode], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if mode == "hide":
        from trainer.imports import UNUSED

        assert got == {"hidden": list(UNUSED), "available": False, "imported": False}
    else:  # the proof the stand-in looks installed
        assert got == {"hidden": [], "available": True, "imported": True}


_CHILD_AFTER = textwrap.dedent("""
    import json
    from trainer import imports
    hidden = imports.hide_unused(("sklearn",))
    from transformers.utils import import_utils  # noqa: F401
    during = "sklearn" in __import__("sys").modules
    imports.show_again(hidden)
    import sklearn
    print(json.dumps({"hidden": hidden, "version": sklearn.__version__}))
""")


def test_a_package_hidden_for_the_start_imports_as_usual_after_it(site_with_sklearn):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site_with_sklearn), REPO]))
    out = subprocess.run([sys.executable, "-c", _CHILD_AFTER], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"hidden": ["sklearn"], "version": "9.9"}


# ----------------------------------------------------------------------------- installed-package map

_CHILD_MAP = textwrap.dedent("""
    import importlib.metadata, json, sys
    from trainer import imports
    real = importlib.metadata.packages_distributions()
    outcome = imports.remember_package_map(sys.argv[1])
    answered = importlib.metadata.packages_distributions()
    answered["changed-by-the-caller"] = ["x"]  # a copy each call: the next answer is intact
    again = importlib.metadata.packages_distributions()
    print(json.dumps({"outcome": outcome, "same": again == real, "has_sklearn": again.get("sklearn")}))
""")


def _map_child(site, cache):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), REPO]))
    out = subprocess.run([sys.executable, "-c", _CHILD_MAP, str(cache)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_installed_package_map_is_kept_until_a_package_is_installed(site_with_sklearn, tmp_path):
    from trainer import imports

    cache = tmp_path / "cache"
    cache.mkdir()  # made first: a new folder beside the stand-in package would change the site's directory
    first = _map_child(site_with_sklearn, cache)
    assert first == {"outcome": "saved", "same": True, "has_sklearn": ["scikit-learn"]}
    assert _map_child(site_with_sklearn, cache)["outcome"] == "hit"

    # A package installed into a directory of sys.path changes that directory: computed again.
    time.sleep(0.01)
    dist = site_with_sklearn / "newpkg-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: newpkg\nVersion: 1.0\n")
    (dist / "top_level.txt").write_text("newpkg\n")
    assert _map_child(site_with_sklearn, cache) == {"outcome": "saved", "same": True, "has_sklearn": ["scikit-learn"]}
    saved = json.loads((cache / imports.PACKAGE_MAP_FILE).read_text())
    assert saved["map"]["newpkg"] == ["newpkg"]

    # A file that is not a map of names (damaged, or written by something else) is replaced.
    for bad in ("{not json", json.dumps({"path": saved["path"], "map": {"sklearn": "scikit-learn"}})):
        (cache / imports.PACKAGE_MAP_FILE).write_text(bad)
        assert _map_child(site_with_sklearn, cache)["outcome"] == "saved"
    assert _map_child(site_with_sklearn, cache)["outcome"] == "hit"


# ----------------------------------------------------------------------------- triton's cache key

_CHILD_TRITON = textwrap.dedent("""
    import json
    from trainer import imports
    thread = imports.prehash_triton()
    thread.join(10)
    from triton.runtime.cache import triton_key, CALLS
    key = triton_key()
    print(json.dumps({"thread": thread.name, "key": key, "calls": len(CALLS)}))
""")


def test_triton_s_cache_key_is_computed_once_beside_the_imports(tmp_path):
    # A stand-in triton (CI has none): its memoised key counts its computations.
    runtime = tmp_path / "triton" / "runtime"
    runtime.mkdir(parents=True)
    (tmp_path / "triton" / "__init__.py").write_text("")
    (runtime / "__init__.py").write_text("")
    (runtime / "cache.py").write_text(textwrap.dedent("""
        import functools
        CALLS = []

        @functools.lru_cache()
        def triton_key():
            CALLS.append(1)
            return "key-1"
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), REPO]))
    out = subprocess.run([sys.executable, "-c", _CHILD_TRITON], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"thread": "prehash-triton", "key": "key-1", "calls": 1}
    if not _has_triton():  # this machine has no triton: nothing is started
        from trainer import imports

        assert imports.prehash_triton() is None


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None
