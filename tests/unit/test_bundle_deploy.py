"""The trainer bundle: reproducible, holding only the trainer side, its hash
following content only. (Its deployment, locally and over sshd:
tests/integration/test_bundle_deploy.py.)"""

from __future__ import annotations

import io
import os
import tarfile

from dflashctl.hosts.bundle import Bundle, build_bundle
from tests import harness
from tests.harness.bundle import source_copy

REPO = harness.REPO


def _members(bundle: Bundle) -> list[tarfile.TarInfo]:
    return tarfile.open(fileobj=io.BytesIO(bundle.data)).getmembers()





def test_bundle_is_reproducible_and_holds_only_the_trainer_side(tmp_path):
    a, b = build_bundle(), build_bundle()
    assert a.hash == b.hash and a.data == b.data and len(a.hash) == 64
    assert "dflashctl/core/contract.py" in a.files and "dflashctl/__init__.py" in a.files
    assert "trainer/__main__.py" in a.files and "trainer/config.py" in a.files
    assert not [f for f in a.files if f.startswith("dflashctl/") and f not in ("dflashctl/__init__.py", "dflashctl/core/__init__.py", "dflashctl/core/contract.py")]
    assert not [f for f in a.files if "__pycache__" in f or f.endswith(".pyc")]
    for m in _members(a):
        assert (m.mtime, m.uid, m.gid, m.uname, m.gname) == (946684800, 0, 0, "", "")
        assert m.mode == (0o755 if m.isdir() else 0o644)
    assert [m.name for m in _members(a) if m.isfile()] == sorted(a.files)
    # Caches and stray mtimes do not change the hash; content does.
    root = source_copy(tmp_path)
    (root / "trainer" / "__pycache__").mkdir(exist_ok=True)
    (root / "trainer" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"junk")
    os.utime(root / "trainer" / "config.py", (1, 1))
    assert build_bundle(str(root)).hash == a.hash
    (root / "trainer" / "config.py").write_text((root / "trainer" / "config.py").read_text() + "\n# changed\n")
    assert build_bundle(str(root)).hash != a.hash
