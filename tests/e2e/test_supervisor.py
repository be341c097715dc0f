"""`dflashctl watch` as a process on the local host with the fake trainer: SIGINT
ends it cleanly and releases the run it claimed. (Everything else of the
supervisor loop runs in process: tests/integration/test_supervisor.py.)"""

from __future__ import annotations

import signal
import subprocess

import pytest

from dflashctl.hosts.tmux import SOCKET_ENV
from tests.harness import cli
from tests.harness.local import REPO, SOCKET, wait_for

pytestmark = pytest.mark.usefixtures("private_tmux_socket")


def test_watch_ends_cleanly_on_sigint_and_releases_the_run(local_env, tmp_path):
    pb = local_env.playbook("interrupted")
    run_id = local_env.start(pb)
    store = local_env.store
    out = open(tmp_path / "watch.out", "w")
    proc = cli.popen("-i", str(local_env.inventory_path), "-p", str(local_env.playbooks), "watch", run_id,
                     "--interval", "0.2", env={"DFLASHCTL_STORE": local_env.store_path, SOCKET_ENV: SOCKET},
                     cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: (store.get_run(run_id).supervisor or {}).get("pid") == proc.pid, 30, "the watch to claim the run")
        wait_for(lambda: store.get_run(run_id).state == "running", 30, "the run seen running")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130  # interrupted; the run goes on
    finally:
        if proc.poll() is None:
            proc.kill()
        local_env.tmux.kill(run_id)
    text = (tmp_path / "watch.out").read_text()
    assert "trainer started" in text and "stopped watching; the runs go on" in text and "Traceback" not in text
    assert store.get_run(run_id).supervisor is None
