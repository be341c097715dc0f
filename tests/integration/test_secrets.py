"""A playbook's secrets (``env:`` values marked secret, read from the controller's
environment or a file, or named like a token) reach the trainer's environment, and
nothing else: not another user of the run host (tests/harness/users.py: a real
other uid), not the run store, not ``runs --json`` or ``events``."""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path

import pytest
import yaml

from dflashctl.hosts.tmux import Tmux
from dflashctl.store import Store
from tests.harness import environ
from tests.harness.launch import SOCKET, LocalLaunch, end, trainer_pid
from tests.harness.users import as_stranger, stranger
from tests.harness.waiting import wait_for

pytestmark = pytest.mark.usefixtures("launch_tmux_socket")

READ = "import sys; sys.stdout.write(open(sys.argv[1]).read())"


@pytest.fixture
def host_home():
    """A work directory's parent any user of the host may look into (as a home or
    /data often is), unlike the test's own tmp_path; removed afterwards."""
    path = Path(f"/tmp/dflashctl-home-{secrets.token_hex(6)}")
    path.mkdir(mode=0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _launch(tmp_path: Path, host_home: Path, env: dict) -> tuple[LocalLaunch, str]:
    local = LocalLaunch(tmp_path, workdir=host_home / "work")
    name = local.playbook("secret", {"steps": 100000, "log_every": 2, "checkpoint_every": 0})
    path = local.playbooks / f"{name}.yaml"
    raw = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**raw, "env": env}, sort_keys=False))
    launched = local.invoke("launch", name, "--no-watch")
    assert launched.returncode == 0, launched.stdout + launched.stderr
    return local, launched.stdout.split()[-1]


def _nothing_holds(local: LocalLaunch, run_id: str, values: list[str]) -> None:
    """No other user reads the run's files; the store, ``runs --json`` and ``events`` hold none of ``values``."""
    run = Store(local.store_path).get_run(run_id)
    for name in ("run.sh", "config.json", "secrets.env", "trainer.log"):
        done = as_stranger(READ, str(Path(run.run_dir, name)), check=False)
        assert done.returncode != 0 and b"PermissionError" in done.stderr, (name, done.stdout[:200])
    stored = b"".join(p.read_bytes() for p in Path(local.store_path).parent.glob(Path(local.store_path).name + "*"))
    said = local.invoke("runs", "--json").stdout + local.invoke("events", run_id).stdout
    for value in values:
        assert value.encode() not in stored, f"the store holds {value}"
        assert value not in said


def test_a_token_in_a_playbooks_env_is_read_by_no_other_user_and_never_stored(tmp_path, host_home):
    """The plainest case: a token written in ``env:`` as any other value."""
    stranger()
    local, run_id = _launch(tmp_path, host_home, {"WANDB_API_KEY": "plain-token-7f3a", "OMP_NUM_THREADS": "1"})
    run = Store(local.store_path).get_run(run_id)
    try:
        pid = wait_for(lambda: trainer_pid(run.run_dir), 60, "the trainer's status.json")
        environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert b"WANDB_API_KEY=plain-token-7f3a" in environment and b"OMP_NUM_THREADS=1" in environment
        _nothing_holds(local, run_id, ["plain-token-7f3a"])
    finally:
        end(trainer_pid(run.run_dir))
        Tmux(local.inventory.get("local"), local.inventory, SOCKET).kill(run_id)


def test_secrets_from_the_controllers_environment_and_a_file_reach_the_trainer_and_its_restart(tmp_path, host_home):
    stranger()
    key = tmp_path / "key"
    key.write_text("file-secret-91c2\n")
    env = {"HF_TOKEN": {"from_env": "DFLASH_TEST_SECRET"}, "MODEL_KEY_PATH": {"from_file": str(key)},
           "LABEL": {"value": "marked-secret-5d", "secret": True}}
    values = ["env-secret-44b1", "file-secret-91c2", "marked-secret-5d"]
    with environ(DFLASH_TEST_SECRET="env-secret-44b1"):
        local, run_id = _launch(tmp_path, host_home, env)
    run = Store(local.store_path).get_run(run_id)
    try:
        wanted = {b"HF_TOKEN=env-secret-44b1", b"MODEL_KEY_PATH=file-secret-91c2", b"LABEL=marked-secret-5d"}
        first = wait_for(lambda: trainer_pid(run.run_dir), 60, "the trainer's status.json")
        assert wanted <= set(Path(f"/proc/{first}/environ").read_bytes().split(b"\0"))
        again = _restarted(local, run_id, run.run_dir, first)
        assert wanted <= set(Path(f"/proc/{again}/environ").read_bytes().split(b"\0"))
        assert b"env-secret-44b1" in _evaluators_environment(local, run_id, tmp_path)
        _nothing_holds(local, run_id, values)
    finally:
        end(trainer_pid(run.run_dir))
        Tmux(local.inventory.get("local"), local.inventory, SOCKET).kill(run_id)


def _restarted(local: LocalLaunch, run_id: str, run_dir: str, before: int) -> int:
    """``dflashctl restart``: run.sh rewritten from the store (which holds no secret)."""
    done = local.invoke("restart", run_id)
    assert done.returncode == 0, done.stdout + done.stderr
    return wait_for(lambda: trainer_pid(run_dir, other_than=before), 60, "the restarted trainer")


def _evaluators_environment(local: LocalLaunch, run_id: str, tmp_path: Path) -> bytes:
    """``dflashctl eval``'s process gets the secrets too (from the run's secrets.env,
    never its command line): the host's `python` here writes its environment aside
    and a plain report."""
    from dflashctl.config import EvalSettings
    from dflashctl.runs.evaluate import eval_run

    seen = tmp_path / "eval-environ"
    python = tmp_path / "eval-python"
    python.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = --out ] && out=$2; shift; done\n'
                      f"env > {seen}\n"
                      'echo \'{"prompts": 1, "prompts_planned": 1, "complete": true, "tau": 2.0}\' > "$out"\n')
    python.chmod(0o755)
    store = Store(local.store_path)
    store.update_run(run_id, config={**store.get_run(run_id).config, "python": str(python)})
    eval_run(run_id, store, local.inventory, EvalSettings(prompts=1, timeout=30), poll=0.2)
    return seen.read_bytes()


def test_restart_reload_reads_a_rotated_secret_again_and_a_plain_restart_keeps_the_launched_one(tmp_path, host_home):
    """A token rotated in its file after the launch: a plain restart keeps the value
    written at launch (the store holds none to write again); ``--reload`` reads the
    playbook's secrets again and the new process has the new value, from a fresh
    start (a standby's environment would hold the old one). An unreadable secret
    refuses the reload before anything is stopped."""
    key = tmp_path / "key"
    key.write_text("first-token-3a1e\n")
    local, run_id = _launch(tmp_path, host_home, {"HF_TOKEN": {"from_file": str(key)}})
    run = Store(local.store_path).get_run(run_id)
    try:
        first = wait_for(lambda: trainer_pid(run.run_dir), 60, "the trainer's status.json")
        key.write_text("rotated-token-88c4\n")
        kept = _restarted(local, run_id, run.run_dir, first)
        assert b"HF_TOKEN=first-token-3a1e" in Path(f"/proc/{kept}/environ").read_bytes().split(b"\0")

        key.unlink()
        refused = local.invoke("restart", run_id, "--reload")
        assert refused.returncode == 2 and "env.HF_TOKEN: cannot read" in refused.stderr, refused.stderr
        assert trainer_pid(run.run_dir) == kept  # nothing stopped

        key.write_text("rotated-token-88c4\n")
        reloaded = local.invoke("restart", run_id, "--reload")
        assert reloaded.returncode == 0, reloaded.stdout + reloaded.stderr
        assert "secrets read again: HF_TOKEN" in reloaded.stderr
        again = wait_for(lambda: trainer_pid(run.run_dir, other_than=kept), 60, "the reloaded trainer")
        assert b"HF_TOKEN=rotated-token-88c4" in Path(f"/proc/{again}/environ").read_bytes().split(b"\0")
        _nothing_holds(local, run_id, ["first-token-3a1e", "rotated-token-88c4"])
    finally:
        end(trainer_pid(run.run_dir))
        Tmux(local.inventory.get("local"), local.inventory, SOCKET).kill(run_id)
