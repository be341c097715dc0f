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

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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
        assert got == {"hidden": ["sklearn"], "available": False, "imported": False}
    else:  # the proof the stand-in looks installed
        assert got == {"hidden": [], "available": True, "imported": True}
