"""Wedged SSH connections against real sshd servers: the server's per-connection
process SIGSTOPped (TCP still up, the kernel still ACKs, nothing answers), as a hung
session or a half-open connection behind a NAT or a jump looks from the client.

The pooled connection must be replaced, not waited on for as long as the wedge
lasts: a session request that gets no answer within connect_timeout drops the
connection (and what is tunnelled through it) and the command runs on a new one;
a command that gets no answer by its deadline drops it for the next command. The
supervisor's probe, on its own cadence, recovers within two poll intervals, and a
wedged connection is never taken for a dead trainer.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import yaml

from dflashctl.config import load_inventory, load_playbook
from dflashctl.core.errors import CommandTimeout
from dflashctl.hosts.transport import Pool, connect
from dflashctl.store import Store
from dflashctl.supervise.supervisor import Supervisor
from tests.harness.fake_trainer import start_fake_run
from tests.harness.local import SOCKET, kill_tmux_servers, kinds, read_status, wait_for, write_playbook

CONNECT_TIMEOUT = 1.0
INTERVAL = 2.0  # the supervisor's poll interval


@pytest.fixture
def inventory(ssh_env, tmp_path):
    """The harness inventory with a short connect_timeout, plus `wedgy`: direct's sshd
    under another name, so its pooled connection is this test's alone."""
    raw = yaml.safe_load(open(ssh_env.inventory_path))
    raw["defaults"]["connect_timeout"] = CONNECT_TIMEOUT
    raw["hosts"]["wedgy"] = dict(raw["hosts"]["direct"])
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_inventory(str(path))


@pytest.fixture
def pool():
    pool = Pool()
    yield pool
    pool.close()


def client_port(transport) -> int:
    return transport.ssh_transport().sock.getsockname()[1]


def test_a_wedged_connection_is_replaced_and_the_command_runs(ssh_env, inventory, pool):
    t = pool.get("direct", inventory)
    t.run(["true"])
    first = t.connection()
    frozen = ssh_env.freeze_connection("direct", client_port(t))
    assert frozen, "no sshd process found for the pooled connection"
    try:
        started = time.monotonic()
        result = t.run(["echo", "through"])
        took = time.monotonic() - started
    finally:
        ssh_env.thaw(frozen)
    assert result.stdout == "through\n"
    assert result.notes == [f"no answer on the open connection for {CONNECT_TIMEOUT:g}s; reconnected"]
    assert CONNECT_TIMEOUT <= took < CONNECT_TIMEOUT + 2.0
    assert t.connection() is not first and not first.is_connected


def test_a_wedged_jump_is_replaced_with_the_connections_through_it(ssh_env, inventory, pool):
    target, jump2 = pool.get("target", inventory), pool.get("jump2", inventory)
    target.run(["true"])
    jump2.run(["true"])
    jump = pool.get("jump", inventory)
    old_jump, old_jump2 = jump.connection(), jump2.connection()
    frozen = ssh_env.freeze_connection("jump", client_port(jump))
    try:
        started = time.monotonic()
        result = target.run(["hostname"])
        took = time.monotonic() - started
        # The tunnel of jump2 rode on the wedged jump connection: replaced with it.
        assert not old_jump2.is_connected
        assert jump2.run(["echo", "again"]).stdout == "again\n"
    finally:
        ssh_env.thaw(frozen)
    assert result.stdout == "ct200\n"
    assert result.notes[0] == f"no answer on the open connection for {CONNECT_TIMEOUT:g}s; reconnected"
    assert "no answer on the jump host's open connection" in result.notes[1] and result.notes[1].endswith("reconnected")
    assert took < 2 * CONNECT_TIMEOUT + 2.0
    assert jump.connection() is not old_jump


def test_no_answer_during_a_command_drops_the_connection_for_the_next_one(ssh_env, inventory, pool):
    t = pool.get("direct", inventory)
    t.run(["true"])
    port = client_port(t)
    frozen: list[int] = []

    def wedge_soon():
        time.sleep(0.5)  # the command's session is open and it is sleeping
        frozen.extend(ssh_env.freeze_connection("direct", port))

    wedger = threading.Thread(target=wedge_soon)
    wedger.start()
    try:
        with pytest.raises(CommandTimeout) as caught:
            t.run(["sh", "-c", "sleep 1; echo late"], timeout=2)
        wedger.join()
        assert "no answer on the open connection" in str(caught.value)
        assert "dropped it, the next command reconnects" in str(caught.value)
        assert t.run(["echo", "next"]).stdout == "next\n"  # while the old one is still frozen
    finally:
        wedger.join()
        ssh_env.thaw(frozen)


def test_the_supervisor_recovers_from_a_wedged_connection_within_two_polls(ssh_env, inventory, tmp_path):
    playbooks = tmp_path / "playbooks"
    path = write_playbook(playbooks, "wedge", "wedgy", {"train": {"steps": 100000, "log_every": 2,
                                                                   "checkpoint_every": 50}},
                          poll_interval=INTERVAL, expect={"stall_window": 60, "startup_budget": 60})
    pb = load_playbook(str(path), inventory=inventory)
    store = Store(str(tmp_path / "runs.db"))
    run_id = start_fake_run(store, inventory, "wedgy", pb.trainer.to_dict(), playbook=pb.name,
                            playbook_source=pb.source, socket=SOCKET, step_s=0.05)
    run_dir = store.get_run(run_id).run_dir
    sup = Supervisor(store, inventory, interval=INTERVAL, playbooks_dir=str(playbooks))
    sup.attach(run_id)
    frozen: list[int] = []
    try:
        wait_for(lambda: store.get_run(run_id).state == "running", 60, "running", every=INTERVAL, tick=sup.tick)
        pid = read_status(run_dir).pid
        # Wedge the very connection the supervisor polls through (the default pool's).
        frozen = ssh_env.freeze_connection("direct", client_port(connect("wedgy", inventory)))  # wedgy is direct's sshd
        assert frozen
        wedged_at = time.monotonic()
        answers = []
        next_tick = wedged_at + INTERVAL / 2  # somewhere between two polls
        while time.monotonic() - wedged_at < 3 * INTERVAL:
            time.sleep(max(0.0, next_tick - time.monotonic()))
            next_tick += INTERVAL
            report = sup.tick()
            answers.append((time.monotonic() - wedged_at, report.hosts.get("wedgy")))
            if isinstance(answers[-1][1], float):
                break
        recovered_after, answer = answers[-1]
        assert isinstance(answer, float), answers  # a probe round trip, not an error text
        assert recovered_after <= 2 * INTERVAL, answers
        assert store.get_run(run_id).state == "running"
        assert not kinds(store, run_id, "crash") and not store.restarts(run_id)
        assert read_status(run_dir).pid == pid  # the trainer was never touched
    finally:
        ssh_env.thaw(frozen)
        status = read_status(run_dir)
        kill_tmux_servers([(inventory.get("wedgy"), inventory, SOCKET)])
        if status and status.pid:
            try:
                os.kill(status.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
