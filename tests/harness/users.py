"""A second, unprivileged user of this machine: the attacker of the shared-host tests.

The tests run as root (as CI does). The attacker's steps run in a child process that
has dropped to another uid (``nobody``) before it runs anything, so what it makes is
really that user's and what it cannot reach it really cannot. A test that cannot
become another user (not root) is skipped, saying why.

    uid, gid = stranger()
    as_stranger("import os, sys; os.mkdir(sys.argv[1])", "/tmp/x")
"""

from __future__ import annotations

import os
import pwd
import subprocess

import pytest

# The system's own Python, reachable by any user (a checkout's venv may not be).
PYTHON = "/usr/bin/python3"


def stranger() -> tuple[int, int]:
    """(uid, gid) of an unprivileged user other than this one; skips the test when
    this process cannot become it (not root)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the attacker runs as a second, unprivileged uid")
    try:
        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        return 65534, 65534


def as_stranger(script: str, *args: str, input: bytes | None = None, check: bool = True,
                timeout: float = 60) -> subprocess.CompletedProcess:
    """Run Python ``script`` (stdlib only) as the stranger, with ``args`` and ``input``
    on stdin; its stdout and stderr captured as text. ``check``: a failure fails the test."""
    uid, gid = stranger()

    def drop() -> None:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)

    done = subprocess.run([PYTHON, "-I", "-c", script, *args], input=input, capture_output=True,
                          preexec_fn=drop, cwd="/", timeout=timeout,
                          env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "LANG": "C.UTF-8"})
    if check:
        assert done.returncode == 0, f"the stranger's step failed: {done.stderr.decode(errors='replace')[-800:]}"
    return done


def plant(path: str, files: dict[str, bytes] | None = None, mode: int = 0o755) -> None:
    """As the stranger: make the directory ``path`` (and its missing parents) mode
    ``mode`` and write ``files`` (relative path -> bytes) into it."""
    import json

    payload = json.dumps({k: v.hex() for k, v in (files or {}).items()}).encode()
    as_stranger(
        "import json, os, sys\n"
        "root = sys.argv[1]\n"
        "os.makedirs(root, exist_ok=True)\n"
        "os.chmod(root, int(sys.argv[2], 8))\n"
        "for rel, data in json.load(sys.stdin).items():\n"
        "    p = os.path.join(root, rel)\n"
        "    os.makedirs(os.path.dirname(p), exist_ok=True)\n"
        "    open(p, 'wb').write(bytes.fromhex(data))\n",
        path, oct(mode)[2:], input=payload)
