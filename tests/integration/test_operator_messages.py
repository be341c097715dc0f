"""What the operator reads is the trainer's own message and the signature's advice,
through the real supervisor: a fake trainer (tests/harness/fake_trainer.py) in tmux
on the local host, a real SQLite store, the commands as run by the operator, a real
webhook on 127.0.0.1.

An error's numbers are kept wherever it is shown (events, `status`, `runs`): the
crash signature (numbers blanked) is a grouping key, never the text shown. Every
signature's advice reaches the event and the alert, a restarted crash's too.
"""

from __future__ import annotations

import json

import pytest

from dflashctl.core import contract
from dflashctl.core.signatures import BUILTIN_SIGNATURES
from dflashctl.hosts.tmux import SOCKET_ENV
from tests.harness import cli as dflashctl
from tests.harness.local import REPO, SOCKET, issued, kinds, wait_for

pytestmark = pytest.mark.usefixtures("private_tmux_socket")

DATA_ERROR = "shard-3.jsonl:17: not valid JSON: Expecting ',' delimiter: line 1 column 42 (char 41)"
ILLEGAL = "RuntimeError: CUDA error: an illegal memory access was encountered at step 12"


def _cli(env, *args):
    extra = {"DFLASHCTL_STORE": env.store_path, SOCKET_ENV: SOCKET, "COLUMNS": None}  # piped: lines whole
    return dflashctl.invoke("-i", str(env.inventory_path), "-p", str(env.playbooks), *args, env=extra, cwd=REPO)


def test_an_error_with_numbers_reaches_events_status_and_runs_unchanged(local_env):
    pb = local_env.playbook("numbers", {"fault": {"kind": "exit", "after_steps": 4, "message": DATA_ERROR,
                                                  "exit_code": contract.EXIT_DATA_ERROR}})
    run_id = local_env.start(pb)
    store = local_env.store
    sup = local_env.supervisor()
    sup.attach(run_id)
    try:
        wait_for(lambda: store.get_run(run_id).state == "failed", 30, "the data error to end the run", tick=sup.tick)
    finally:
        local_env.tmux.kill(run_id)
        sup.close()
    # The signature is kept for grouping, numbers blanked; it is never what is shown.
    signature = contract.error_signature("InjectedFault", DATA_ERROR)
    assert "shard-N.jsonl:N" in signature
    [crash] = kinds(store, run_id, "crash")
    assert DATA_ERROR in crash.message and "shard-N" not in crash.message
    assert crash.detail["status_error"] == signature  # the grouping key, stored beside the words
    run = store.get_run(run_id)
    assert DATA_ERROR in run.exit_reason and "N.jsonl" not in run.exit_reason
    for args in (["events", run_id], ["events", run_id, "--json"], ["runs"], ["runs", "--json"],
                 ["status", run_id, "--once"], ["status", "--json"]):
        out = _cli(local_env, *args)
        assert out.returncode == 0, (args, out.stderr)
        assert DATA_ERROR in out.stdout or json.dumps(DATA_ERROR)[1:-1] in out.stdout, (args, out.stdout)
        if "--json" not in args:  # the documents keep the signature too, as the detail's grouping key
            assert "shard-N" not in out.stdout, args
    events = json.loads(_cli(local_env, "events", run_id, "--json").stdout)
    assert not [e for e in events if "shard-N" in e["message"]]


def test_a_restart_signatures_advice_is_in_the_event_and_the_alert_payload(local_env, webhook):
    [illegal] = [s for s in BUILTIN_SIGNATURES if s.name == "cuda_illegal_memory_access"]
    assert illegal.action == "restart" and "CUDA_LAUNCH_BLOCKING=1" in illegal.hint
    pb = local_env.playbook("advice", {"fault": {"kind": "exit", "after_steps": 4, "message": ILLEGAL}},
                            alerts={"webhook": webhook.url, "min_severity": "error"})
    run_id = local_env.start(pb)
    store = local_env.store
    sup = local_env.supervisor()
    sup.attach(run_id)
    try:
        wait_for(lambda: issued(store, run_id), 30, "the restart", tick=sup.tick)
        wait_for(lambda: webhook.received, 10, "the alert", tick=sup.tick)
    finally:
        local_env.tmux.kill(run_id)
        sup.close()
    [restarting] = [e for e in kinds(store, run_id, "state") if e.detail.get("to") == "restarting"]
    assert restarting.detail["signature"] == "cuda_illegal_memory_access"
    assert illegal.hint in restarting.message and restarting.detail["advice"] == illegal.hint
    assert "restart 1/5" in restarting.message and "at step 12" in restarting.message  # the words, numbers kept
    [alert] = [a for a in webhook.received if a["kind"] == "crash"]
    assert illegal.hint in alert["message"] and alert["detail"]["advice"] == illegal.hint
    out = _cli(local_env, "events", run_id)
    assert "CUDA_LAUNCH_BLOCKING=1" in out.stdout
