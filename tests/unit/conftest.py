"""The unit lane stays pure: a test here that starts a process or opens a SQLite
database fails at once, naming what it did (it belongs in tests/integration)."""

from __future__ import annotations

import sqlite3
import subprocess

import pytest


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a unit test {what}: move it to tests/integration")

    return refuse


@pytest.fixture(autouse=True)
def _pure(monkeypatch):
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("started a process"))
    monkeypatch.setattr(sqlite3, "connect", _refuse("opened a SQLite database"))
    monkeypatch.setenv("DFLASHCTL_SSH_CONFIG", "paramiko")  # the ssh config read in-process, not by `ssh -G`
