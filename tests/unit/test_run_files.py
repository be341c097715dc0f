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


def test_a_private_directory_is_made_0700_and_one_others_may_write_is_refused(tmp_path):
    """contract.private_dir: what it makes is 0700 (missing parents too); what exists
    is used only when this user owns it and no one else may write it or a directory
    above it (a sticky one excepted); a symbolic link is judged by where it points."""
    made = contract.private_dir(str(tmp_path / "a" / "b"), "compile cache")
    assert made == str(tmp_path / "a" / "b")
    assert [oct(os.stat(p).st_mode & 0o777) for p in (tmp_path / "a", tmp_path / "a" / "b")] == [oct(0o700)] * 2
    assert contract.private_dir(made) == made  # ours: used again

    open_to_all = tmp_path / "shared"
    open_to_all.mkdir()
    os.chmod(open_to_all, 0o777)
    with pytest.raises(contract.UnsafeDirectory, match=r"shared is writable by its group or others \(mode 777\)"):
        contract.private_dir(str(open_to_all), "run directory")
    with pytest.raises(contract.UnsafeDirectory, match=r"the directory above it, .*/shared, is writable by others"):
        contract.private_dir(str(open_to_all / "mine"), "run directory")
    os.chmod(open_to_all, 0o1777)  # sticky, as /tmp: no one may rename or remove what another made in it
    assert contract.private_dir(str(open_to_all / "mine"))

    link = tmp_path / "link"
    link.symlink_to(open_to_all / "mine")
    assert contract.private_dir(str(link)) == str(link)
    (tmp_path / "file").write_text("")
    with pytest.raises(contract.UnsafeDirectory, match="is not a directory"):
        contract.private_dir(str(tmp_path / "file"))
    if os.geteuid() == 0:  # another owner needs root to make here
        os.chown(open_to_all / "mine", 65534, 65534)
        with pytest.raises(contract.UnsafeDirectory, match="owned by uid 65534"):
            contract.private_dir(str(link), "compile cache")
