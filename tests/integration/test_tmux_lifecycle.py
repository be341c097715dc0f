"""tmux lifecycle calls ride the host's kept-open connection (tests/harness: `target`
is reached through the jump host and runs every command inside `pct exec 200 --`):
start, rename, signal keys, kill, and a whole standby restart, each without a new
SSH login to the host or a new forward through the jump. Each lifecycle call is one
command on the connection; kill is one too (it used to be two)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from dflashctl.core import contract
from dflashctl.hosts import transport
from dflashctl.hosts.tmux import SOCKET_ENV, Tmux, TmuxError
from dflashctl.runs.runhost import restart_run, standby_session, start_standby
from dflashctl.store import Store
from tests.harness import environ
from tests.harness.fake_trainer import start_fake_run
from tests.harness.local import SOCKET, kill_tmux_servers, read_status, wait_for
from trainer import config as trainer_config


class Commands:
    """Commands run on each host while counting (the real transport, timed as it runs)."""

    def __init__(self, monkeypatch):
        self.seen: list[tuple[str, list[str]]] = []
        real = transport.Transport.run

        def run(t, argv, **kw):
            self.seen.append((t.name, [str(a) for a in argv]))
            return real(t, argv, **kw)

        # Counting only: every command still runs for real on the host.
        monkeypatch.setattr(transport.Transport, "run", run)

    def on(self, host: str) -> list[list[str]]:
        return [argv for name, argv in self.seen if name == host]


def _logins(ssh_env, host: str) -> int:
    return ssh_env.log(host).count("Accepted publickey")


def _forwards(ssh_env, host: str) -> int:
    target = ssh_env.server(host)
    return ssh_env.log("jump").count(f"target {target.address} port {target.port}")


@pytest.fixture
def target_tmux(ssh_env):
    with environ(**{SOCKET_ENV: SOCKET}):
        tmux = Tmux(ssh_env.inventory.get("target"), ssh_env.inventory)
        tmux.has_session("warm-up")  # the connection is open from here on
        yield tmux
        kill_tmux_servers([(ssh_env.inventory.get("target"), ssh_env.inventory, SOCKET)])


def test_each_lifecycle_call_is_one_command_on_the_open_connection(ssh_env, target_tmux, monkeypatch):
    commands = Commands(monkeypatch)
    logins, forwards = _logins(ssh_env, "target"), _forwards(ssh_env, "target")
    name = f"life-{time.monotonic_ns()}"
    target_tmux.start(name, "sleep 60")
    with pytest.raises(TmuxError, match=f"a tmux session named {name} already exists"):
        target_tmux.start(name, "sleep 60")
    assert target_tmux.has_session(name) and not target_tmux.has_session(name[:-1])  # exact names, no prefix
    target_tmux.rename(name, name + "-b")
    target_tmux.send_keys(name + "-b", "C-c")
    wait_for(lambda: not target_tmux.has_session(name + "-b"), 10, "the session to end on Ctrl-C")
    target_tmux.start(name, "sleep 60")
    assert target_tmux.kill(name) is True and target_tmux.kill(name) is False
    assert not target_tmux.has_session(name)
    # Every call above on the kept-open connection: no login, no forward through the jump.
    assert _logins(ssh_env, "target") == logins and _forwards(ssh_env, "target") == forwards
    kills = [argv for argv in commands.on("target") if "dflashctl-tmux-kill" in argv]
    assert len(kills) == 2 and all(argv[-2:] == [SOCKET, name] for argv in kills)  # one command per kill


def test_a_standby_restart_through_the_wrapper_opens_no_connection(ssh_env, tmp_path, monkeypatch):
    with environ(**{SOCKET_ENV: SOCKET}):
        store = Store(str(tmp_path / "runs.db"))
        inventory = ssh_env.inventory
        trainer = trainer_config.from_dict({"model": {"preset": "tiny"}, "train": {"steps": 100000, "log_every": 1}})
        run_id = start_fake_run(store, inventory, "target", trainer.to_dict(), socket=SOCKET)
        run = store.get_run(run_id)
        try:
            first = wait_for(lambda: read_status(run.run_dir) and read_status(run.run_dir).pid, 30, "the trainer")
            start_standby(run_id, store, inventory)
            wait_for(lambda: Path(run.run_dir, contract.STANDBY_FILE).exists(), 30, "the standby ready")
            commands = Commands(monkeypatch)
            logins, forwards = _logins(ssh_env, "target"), _forwards(ssh_env, "target")
            restart_run(run_id, False, store, inventory)
            wait_for(lambda: read_status(run.run_dir) and read_status(run.run_dir).pid not in (None, first), 30,
                     "the standby to take over")
            assert _logins(ssh_env, "target") == logins and _forwards(ssh_env, "target") == forwards
            # The whole restart (the standby's session looked at, the previous session killed, the
            # standby's renamed and woken) is one host command: one round trip.
            [call] = commands.on("target")
            assert "dflashctl-restart" in call, call
            assert Tmux(inventory.get("target"), inventory).has_session(run.tmux_session)
            assert not Tmux(inventory.get("target"), inventory).has_session(standby_session(run.tmux_session))
        finally:
            kill_tmux_servers([(inventory.get("target"), inventory, SOCKET)])
