"""A second, unprivileged user of a run host (tests/harness/users.py: a real other
uid) who makes the directories a run will use before it does: the work directory, a
run directory. Each is refused, naming the path, its owner and the fix, before
anything is written into it or read from it; what the run makes itself is its
user's alone (mode 0700, files 0600)."""

from __future__ import annotations

import os
import secrets
import shutil
import stat

import pytest
import yaml

from dflashctl.config import load_inventory
from dflashctl.core.errors import TransportError
from dflashctl.hosts import deploy
from dflashctl.hosts.transport import connect
from tests.harness.users import plant, stranger


@pytest.fixture
def shared(tmp_path):
    """A fresh name in /tmp, where every user may make one; removed afterwards."""
    path = f"/tmp/dflashctl-shared-{secrets.token_hex(6)}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _transport(tmp_path, workdir: str):
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump({"hosts": {"local": {"transport": "local", "workdir": workdir}}}))
    return connect("local", load_inventory(str(path)))


def test_a_work_directory_another_user_made_first_is_refused(tmp_path, shared):
    uid, _ = stranger()
    plant(shared, {"runs/.keep": b""}, mode=0o777)
    with pytest.raises(TransportError) as refused:
        deploy.check(_transport(tmp_path, shared), shared)
    said = str(refused.value)
    assert f"the work directory {shared} is not private" in said and f"owner uid {uid}" in said, said
    assert "use a directory of your own" in said
    assert not os.path.exists(os.path.join(shared, "bundles"))  # nothing was made in it


def test_a_run_directory_another_user_made_first_is_refused_and_ours_are_private(tmp_path, shared):
    uid, _ = stranger()
    transport = _transport(tmp_path, str(tmp_path / "work"))
    run_dir = os.path.join(shared, "runs", "r1")
    plant(run_dir, {}, mode=0o755)
    with pytest.raises(TransportError) as refused:
        deploy.write_run_files(transport, run_dir, {"run.sh": "#!/bin/sh\n", "config.json": "{}\n"})
    assert f"the run directory {run_dir} is not private" in str(refused.value), str(refused.value)
    assert os.listdir(run_dir) == []  # nothing of the run written where the stranger can read or swap it

    # One of our own: made 0700, its files 0600 (scripts 0700), whatever the umask.
    ours = str(tmp_path / "work" / "runs" / "r2")
    deploy.check(transport, str(tmp_path / "work"))
    deploy.write_run_files(transport, ours, {"run.sh": "#!/bin/sh\n", "config.json": "{}\n"})
    assert stat.S_IMODE(os.stat(ours).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.join(ours, "run.sh")).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.join(ours, "config.json")).st_mode) == 0o600


def test_a_directory_of_ours_others_may_write_is_refused_with_both_fixes(tmp_path):
    """Ours, but group-writable (a umask of 002): what the group's members put there
    would be used, so it is refused; the fix says how to make it private when the
    group is the user's own."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    os.chmod(workdir, 0o775)
    with pytest.raises(TransportError) as refused:
        deploy.check(_transport(tmp_path, str(workdir)), str(workdir))
    said = str(refused.value)
    assert "is not private: mode drwxrwxr-x" in said and f"chmod go-w {workdir}" in said, said
    os.chmod(workdir, 0o755)
    assert deploy.check(_transport(tmp_path, str(workdir)), str(workdir))["workdir"] == str(workdir)
