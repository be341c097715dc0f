"""Run files are written by the trainer, possibly as root, into a directory others
can write to: never through a symbolic link."""

from __future__ import annotations

import os

import pytest

from dflashctl.core import contract


def test_metrics_lines_are_never_appended_through_a_symlink(tmp_path):
    system_file = tmp_path / "passwd"
    system_file.write_text("root:x:0:0::/root:/bin/sh\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    link = run_dir / contract.METRICS_FILE
    link.symlink_to(system_file)
    with pytest.raises(OSError, match="symbolic link"):
        contract.append_line(str(link), '{"step": 1}')
    assert system_file.read_text() == "root:x:0:0::/root:/bin/sh\n"


def test_metrics_lines_append_to_a_plain_file(tmp_path):
    path = str(tmp_path / contract.METRICS_FILE)
    contract.append_line(path, '{"step": 1}')
    contract.append_line(path, '{"step": 2}\n')
    assert open(path).read() == '{"step": 1}\n{"step": 2}\n'
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o644 & ~_umask())


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old
