"""A run on two hosts that needs no trainer: a start that fails on one host leaves
no process waiting on the others, and a dry run shows each host's run files and
changes nothing. (Two hosts for real: tests/e2e/test_multihost.py.)"""

from __future__ import annotations

import pytest
import yaml

from dflashctl.config import load_playbook
from dflashctl.hosts.bundle import build_bundle
from dflashctl.hosts.tmux import SOCKET_ENV
from dflashctl.launch import launch_run
from dflashctl.store import Store
from tests.harness import cli, environ, free_port
from tests.harness.local import SOCKET
from tests.harness.multihost import pair_playbook

pytestmark = pytest.mark.slow


def test_a_start_that_fails_on_one_host_leaves_no_process_waiting_on_the_others(tmp_path, monkeypatch):
    from dflashctl.config import load_inventory
    from dflashctl.core.errors import DflashError
    from dflashctl.hosts.tmux import Tmux, TmuxError

    (tmp_path / "inventory.yaml").write_text(yaml.safe_dump({"hosts": {
        "one": {"transport": "local", "workdir": str(tmp_path / "w1")},
        "two": {"transport": "local", "workdir": str(tmp_path / "w2")}}}))
    inventory = load_inventory(str(tmp_path / "inventory.yaml"))
    path = pair_playbook(tmp_path / "playbooks", free_port("127.0.0.1"))
    path.write_text(path.read_text().replace("- target2\n- target\n", "- one\n- two\n"))
    playbook = load_playbook(str(path), inventory=inventory)
    real_start = Tmux.start

    def start(self, name, command, cwd=None):
        # Stands in for a tmux that fails on the second host only (a real one cannot be
        # made to fail for one of two hosts of this machine): the first start is real.
        if name.endswith("-r1"):
            raise TmuxError("two: could not start tmux session (no server)")
        return real_start(self, name, command, cwd)

    monkeypatch.setattr(Tmux, "start", start)
    store = Store(str(tmp_path / "runs.db"))
    with environ(**{SOCKET_ENV: SOCKET}):
        with pytest.raises(DflashError, match="could not start tmux session"):
            launch_run(playbook, inventory, store, bundle=build_bundle())
        [run] = store.list_runs()
        tmux = Tmux(inventory.get("one"), inventory, SOCKET)
        try:
            assert run.state == "failed" and "launch failed" in run.exit_reason
            assert not tmux.has_session(run.id)  # rank 0's session, started, was ended again
        finally:
            tmux.kill(run.id)


def test_a_dry_run_on_two_hosts_shows_each_hosts_run_files_and_changes_nothing(tmp_path):

    (tmp_path / "inventory.yaml").write_text(yaml.safe_dump({
        "hosts": {"one": {"transport": "local", "workdir": str(tmp_path / "w1")},
                  "two": {"transport": "local", "workdir": str(tmp_path / "w2")}},
        "groups": {"pair": ["one", "two"]}}))
    path = pair_playbook(tmp_path / "playbooks", 29517)
    path.write_text(path.read_text().replace("- target2\n- target\n", "- pair\n"))
    env = {"DFLASHCTL_INVENTORY": None, "DFLASHCTL_PLAYBOOKS": None, "DFLASHCTL_STORE": str(tmp_path / "runs.db"),
           SOCKET_ENV: SOCKET}
    out = cli.invoke("launch", "pair", "--dry-run", cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    text = out.stderr
    for needle in ("env-audit of one", "env-audit of two", "would check that port 29517 is free on one",
                   "rendezvous at 127.0.0.1:29517 (rank 0 on one); 2 processes", "export RANK=1", "export WORLD_SIZE=2",
                   "export DFLASHCTL_HOST=two", "rm -f exit_code status.rank1.json", "-r1 on two"):
        assert needle in text, needle
    assert not (tmp_path / "runs.db").exists() and not (tmp_path / "w1").exists() and not (tmp_path / "w2").exists()
