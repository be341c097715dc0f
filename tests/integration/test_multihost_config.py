"""A run on several hosts, as configured: inventory groups, playbook ``hosts``, the
rendezvous, and the run files each host's process gets (no host is reached here;
tests/e2e/test_multihost.py runs one for real)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dflashctl.config import load_inventory, load_playbook
from dflashctl.core import contract
from dflashctl.hosts.probe import PROBE_SOURCE, ProbeArgs, parse_probe_host, probe_args_json

INVENTORY = """
hosts:
  a: {address: 10.0.0.1}
  b: {address: 10.0.0.2, python: /opt/py/bin/python, env: {NCCL_SOCKET_IFNAME: eth1}}
  c: {address: 10.0.0.3}
groups:
  pair: [a, b]
"""


@pytest.fixture
def inventory(tmp_path):
    path = tmp_path / "inventory.yaml"
    path.write_text(INVENTORY)
    return load_inventory(str(path))


def playbook(tmp_path, inventory, text: str):
    path = tmp_path / "pb.yaml"
    path.write_text(text)
    return load_playbook(str(path), inventory=inventory)


def test_the_probe_reads_a_ranks_own_status_and_metrics(tmp_path):
    (tmp_path / contract.status_file(1)).write_text(json.dumps({"phase": "training", "step": 7, "pid": 1}))
    (tmp_path / contract.metrics_file(1)).write_text('{"time": 1.0, "step": 7}\n')
    (tmp_path / contract.STATUS_FILE).write_text(json.dumps({"phase": "failed", "step": 1, "pid": 1}))
    args = probe_args_json([ProbeArgs(run_dir=str(tmp_path), nvidia_smi=False, rank=1)])
    answer = subprocess.run([sys.executable, "-I", "-S", "-c", PROBE_SOURCE, args], capture_output=True, text=True)
    [result] = parse_probe_host(answer.stdout).runs
    assert (result.status.phase, result.status.step) == ("training", 7) and '"step": 7' in result.metrics_chunk


def parsed_and_paired(result, entries, host):
    """A host's answer as the supervisor's tick reads it: parsed, and paired with what was asked."""
    from dflashctl.hosts.probe import pair

    parsed = parse_probe_host(result.stdout)
    return parsed, pair([w.args_of(rank) for w, rank in entries], parsed.runs, host)


@pytest.fixture()
def two_host_run(tmp_path):
    """A supervisor (not claiming) attached to run r: rank 0 on local host a, rank 1 on
    local host b; yields (supervisor, watched run, inventory)."""
    from dflashctl.store import Store
    from dflashctl.supervise.supervisor import Supervisor

    (tmp_path / "inventory.yaml").write_text("hosts:\n  a: {transport: local}\n  b: {transport: local}\n")
    inventory = load_inventory(str(tmp_path / "inventory.yaml"))
    store = Store(str(tmp_path / "runs.db"))
    store.create_run("pb", "a", {}, 1.0, run_id="r", run_dir="/w/a/r", tmux_session="r",
                     hosts=[{"rank": 0, "host": "a", "run_dir": "/w/a/r", "tmux_session": "r"},
                            {"rank": 1, "host": "b", "run_dir": "/w/b/r", "tmux_session": "r-r1"}])
    sup = Supervisor(store, inventory, claim=False)
    try:
        yield sup, sup.attach("r"), inventory
    finally:
        sup.close()


def test_an_answer_listing_fewer_runs_than_asked_marks_the_rank_unanswered(two_host_run):
    from dflashctl.hosts.probe import probe_command
    from dflashctl.hosts.transport import connect

    sup, w, inventory = two_host_run
    # Host b's real probe, asked for no run: an answer that lost the one it was asked for.
    result = connect("b", inventory).run(probe_command(sys.executable, []))
    members: dict = {}
    sup._members("b", [(w, 1)], (result, 0.0, 0.1), *parsed_and_paired(result, [(w, 1)], "b"), members)
    [member] = members["r"]
    assert member.result is None and "no entry for this run" in member.error


def test_an_answer_naming_another_run_directory_is_not_taken_for_the_rank(tmp_path, two_host_run):
    from dflashctl.hosts.probe import probe_command
    from dflashctl.hosts.transport import connect

    sup, w, inventory = two_host_run
    # Host b's real probe, asked about another directory: an answer out of order.
    other = ProbeArgs(run_dir=str(tmp_path / "other"), nvidia_smi=False, rank=1)
    result = connect("b", inventory).run(probe_command(sys.executable, [other]))
    members: dict = {}
    sup._members("b", [(w, 1)], (result, 0.0, 0.1), *parsed_and_paired(result, [(w, 1)], "b"), members)
    [member] = members["r"]
    assert member.result is None and "where '/w/b/r' was asked" in member.error
    assert w.member_args[1].run_dir == "/w/b/r"  # its next poll still asks about its own files


def test_a_rank0_answer_naming_another_run_directory_is_reported_and_not_acted_on(tmp_path):
    from dflashctl.hosts.probe import probe_command
    from dflashctl.hosts.transport import connect
    from dflashctl.store import Store
    from dflashctl.supervise import supervisor_core as core
    from dflashctl.supervise.supervisor import Supervisor, TickReport, _Tick

    (tmp_path / "inventory.yaml").write_text("hosts:\n  a: {transport: local}\n")
    inventory = load_inventory(str(tmp_path / "inventory.yaml"))
    store = Store(str(tmp_path / "runs.db"))
    store.create_run("pb", "a", {}, 1.0, run_id="r", run_dir=str(tmp_path / "r"), tmux_session="r")
    sup = Supervisor(store, inventory, claim=False)
    try:
        w = sup.attach("r")
        before = w.state
        # Host a's real probe, asked about another directory (its answer names that one).
        other = ProbeArgs(run_dir=str(tmp_path / "other"), nvidia_smi=False)
        result = connect("a", inventory).run(probe_command(sys.executable, [other]))
        report, t = TickReport(0.0, 0.0, {}, {}), _Tick()
        sup._host_answer("a", [(w, 0)], (result, 0.0, 0.1), *parsed_and_paired(result, [(w, 0)], "a"), report, t, {})
        events = [x for _, x in t.writes if isinstance(x, core.Event)]
        assert len(events) == 1 and events[0].severity == "warning" and "was asked: not taken" in events[0].message
        assert not t.actions and w.state is before  # nothing concluded from another run's answer
    finally:
        sup.close()
