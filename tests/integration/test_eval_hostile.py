"""A run host that writes its own eval.json: a tau no drafter can reach (99.5 with a
block of 8), fields of the wrong type, a report that is not JSON. ``dflashctl eval``
refuses each with one clear message, stores none of its numbers, and ends the
evaluation's session; it never crashes. Real parts: the local host, tmux, a real
SQLite file; the host's `python` is a script that writes the report given."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from dflashctl.config import EvalSettings, load_inventory
from dflashctl.runs.access import LaunchError
from dflashctl.runs.evaluate import eval_run
from dflashctl.store import Store
from tests.harness.launch import RUN_SOCKET, uses_tmux

pytestmark = pytest.mark.usefixtures("private_tmux_socket_and_home")

GOOD_ROW = {"index": 0, "tau": 3.0, "new_tokens": 8, "target_forwards": 3}


def _report(**changes) -> dict:
    report = {"step": 20, "prompts": 1, "prompts_planned": 1, "complete": True, "tau": 3.0,
              "speed": {"speedup": 1.5}, "per_prompt": [GOOD_ROW]}
    report.update(changes)
    return report


@pytest.mark.parametrize("text, said", [
    (json.dumps(_report(tau=99.5)), "tau is out of range (99.5; expected 1..8)"),
    (json.dumps(_report(tau=0.2)), "tau is out of range (0.2; expected 1..8)"),
    (json.dumps(_report(per_prompt=[{**GOOD_ROW, "tau": 42}])), "per_prompt[0].tau is out of range"),
    (json.dumps(_report(prompts="many")), "prompts is not an integer"),
    (json.dumps(_report(per_prompt=[{**GOOD_ROW, "index": "x"}])), "per_prompt[0].index is not an integer"),
    (json.dumps(_report(per_prompt=7)), "per_prompt is not a list"),
    (json.dumps(_report(speed="fast")), "speed is not an object"),
    ('{"tau": 3.0, "per_prompt": [', "before its first prompt"),  # not JSON: as if nothing was written
])
def test_a_report_the_host_made_up_is_refused_and_said(tmp_path, text, said):
    report = tmp_path / "report.json"
    report.write_text(text)
    python = tmp_path / "hostile-python"
    python.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = --out ] && out=$2; shift; done\n'
                      f'cat {report} > "$out"\n')
    python.chmod(0o755)
    (tmp_path / "inventory.yaml").write_text(yaml.safe_dump({"hosts": {"local": {
        "transport": "local", "workdir": str(tmp_path / "work"), "python": str(python)}}}))
    inventory = load_inventory(str(tmp_path / "inventory.yaml"))
    uses_tmux("local", inventory)
    run_dir = tmp_path / "work" / "runs" / "r1"
    run_dir.mkdir(parents=True)
    store = Store(str(tmp_path / "runs.db"))
    run = store.create_run("pb", "local", {"python": str(python), "trainer": {"model": {"block_size": 8}}},
                           time.time(), run_dir=str(run_dir), tmux_session="r1", tmux_socket=RUN_SOCKET)
    with pytest.raises(LaunchError) as refused:
        eval_run(run.id, store, inventory, EvalSettings(prompts=1, timeout=30), poll=0.2)
    assert said in str(refused.value), str(refused.value)
    [row] = store.evals(run.id)
    assert row["tau"] is None and row["report"] is None and said in row["error"]
