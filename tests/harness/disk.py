"""A full disk, for real: a small tmpfs mounted for a test (mounting needs root:
the test is skipped, with the reason, otherwise) and filled to its last byte."""

from __future__ import annotations

import os
import subprocess

import pytest


def mount_tmpfs(where: str, size: str, mode: str | None = None) -> None:
    """A tmpfs of ``size`` on ``where``; ``mode`` its root's (a run directory root must
    be private: "0700"; tmpfs's own default is 1777)."""
    os.makedirs(where, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("a full disk is simulated with a small tmpfs, which needs root to mount")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}" + (f",mode={mode}" if mode else ""), "tmpfs",
                           where], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")


def fill(directory: str) -> str:
    """Write a file in ``directory`` until its filesystem has no byte left; its path."""
    path = os.path.join(directory, "filler")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (65536, 4096, 512, 1):  # unbuffered: nothing left to flush at close
            try:
                while os.write(fd, b"\0" * size):
                    pass
            except OSError:
                pass
    finally:
        os.close(fd)
    return path
