"""A second, unprivileged user of the run host (tests/harness/users.py: a real other
uid) who makes a run's directories first: a shared compile cache holding bytecode
they compiled, a bytecode generation that no ``cache rm`` can pass, a run directory.
The trainer refuses each before it reads anything from it, naming the path, the
owner and the fix."""

from __future__ import annotations

import importlib._bootstrap_external as bootstrap
import os
import secrets
import shutil
import subprocess
import sys

import pytest

from tests.harness import tiny
from tests.harness.users import plant, stranger


@pytest.fixture
def shared():
    """A fresh name in /tmp, where every user may make one; removed afterwards."""
    path = f"/tmp/dflashctl-shared-{secrets.token_hex(6)}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_bytecode_another_user_planted_in_a_shared_cache_never_runs(tmp_path, shared):
    """The stranger made the playbook's compile cache first, with bytecode for a
    module the trainer imports (valid for its source's size and time: anyone can
    stat it) and a generation no ``cache rm`` reaches. A process that keeps its
    bytecode there refuses the directory instead of importing from it."""
    uid, _ = stranger()
    from trainer import bytecode

    package = tmp_path / "pkg"
    source = package / "victim" / "__init__.py"
    source.parent.mkdir(parents=True)
    source.write_text("VALUE = 'genuine'\n")
    st = os.stat(source)
    code = compile("VALUE = 'planted'\n", str(source), "exec")
    pyc = bytes(bootstrap._code_to_timestamp_pyc(code, int(st.st_mtime), st.st_size))
    plant(shared, {f"{bytecode.PREFIX_DIR}/{bytecode.member_name(str(source))}": pyc,
                   f"{bytecode.PREFIX_DIR}/{bytecode.GENERATION_FILE}": b"999999\n"}, mode=0o755)

    script = ("import sys; sys.path.insert(0, sys.argv[2]); from trainer import bytecode\n"
              "prefix = bytecode.keep(sys.argv[1], 'victim')\n"
              "bytecode.drop_if_outdated(prefix, '1')  # cache rm on the controller\n"
              "import victim; print(victim.VALUE)\n")
    done = subprocess.run([sys.executable, "-B", "-c", script, shared, str(package)], cwd=tiny.REPO,
                          capture_output=True, text=True, timeout=60)
    assert "planted" not in done.stdout, "the stranger's bytecode ran"
    assert done.returncode != 0 and "UnsafeDirectory" in done.stderr, done.stderr[-800:]
    assert f"{shared}/{bytecode.PREFIX_DIR} is owned by uid {uid}" in done.stderr, done.stderr[-800:]


@pytest.mark.parametrize("whose", ["compile cache", "run directory"])
def test_the_trainer_refuses_a_directory_another_user_made_first(tmp_path, shared, whose):
    uid, _ = stranger()
    plant(shared, {}, mode=0o777)
    run_dir = shared if whose == "run directory" else str(tmp_path / "run")
    cfg = tiny.tiny_config(train={"steps": 2, "log_every": 1, "checkpoint_every": 0},
                           compile={"cache_dir": shared if whose == "compile cache" else str(tmp_path / "cache")})
    done = tiny.cli("--config", tiny.write_config(tmp_path, cfg), "--run-dir", run_dir)
    assert done.returncode == 2, done.stderr[-800:]
    assert f"{shared} is owned by uid {uid}" in done.stderr and "use a directory of your own" in done.stderr
    assert whose in done.stderr
    assert os.listdir(shared) == []  # nothing written into it: no lock, no config, no status


def test_torchs_default_inductor_cache_another_user_made_first_is_refused(tmp_path, monkeypatch):
    """No compile.cache_dir and no TORCHINDUCTOR_CACHE_DIR: inductor's cache is torch's
    default, ``<tmp>/torchinductor_<user>``, a name anyone can guess in a directory anyone
    may write. The stranger made it first (what they put there would be loaded as
    compiled code): the trainer refuses it before compiling into it or loading from it.
    A sticky temporary directory of the test's own stands for /tmp."""
    import getpass

    from dflashctl.core import contract

    uid, _ = stranger()
    shared_tmp = f"/tmp/dflashctl-tmp-{secrets.token_hex(6)}"
    os.mkdir(shared_tmp)
    os.chmod(shared_tmp, 0o1777)
    try:
        default = os.path.join(shared_tmp, f"torchinductor_{getpass.getuser()}")
        plant(default, {"fxgraph/planted": b"code"}, mode=0o777)
        monkeypatch.setenv("TMPDIR", shared_tmp)
        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        cfg = tiny.tiny_config(train={"steps": 2, "log_every": 1, "checkpoint_every": 0})
        t = tiny.run_trainer(cfg, tmp_path / "run")
        assert t.proc.returncode == contract.EXIT_CONFIG_ERROR, t.output[-2000:]
        assert f"{default} is owned by uid {uid}" in t.output and "compile.cache_dir sets one" in t.output, t.output[-2000:]
        assert sorted(os.listdir(default)) == ["fxgraph"]  # nothing of the trainer's written into it
        # the same name, made by the trainer's own user: used
        shutil.rmtree(default)
        t = tiny.run_trainer(cfg, tmp_path / "run2")
        assert t.proc.returncode == contract.EXIT_DONE, t.output[-2000:]
        assert os.stat(default).st_uid == os.geteuid() and not os.stat(default).st_mode & 0o022
    finally:
        shutil.rmtree(shared_tmp, ignore_errors=True)
