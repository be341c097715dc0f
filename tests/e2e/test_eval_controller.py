"""The controller's side of evaluation, end to end: a playbook's `eval: {after_done:
true}` makes the supervisor run real speculative decoding with the finished run's
drafter on its host, and the report is stored with the run; `dflashctl eval` as a
process says each prompt, and Ctrl-C keeps what was measured. Real parts: the tiny
CPU trainer started by the launcher in tmux on the local host, the real
supervisor, `python -m trainer eval`, a real SQLite file."""

from __future__ import annotations

import json

import pytest
import yaml

from dflashctl.config import EvalSettings, load_inventory, load_playbook
from dflashctl.launch import launch_run
from dflashctl.store import Store
from dflashctl.supervise.supervisor import Supervisor
from tests.harness import cli
from tests.harness.launch import tiny_playbook, uses_tmux

pytestmark = pytest.mark.usefixtures("private_tmux_socket_and_home")


@pytest.mark.slow
def test_the_supervisor_evaluates_a_finished_run_and_stores_the_report(tmp_path):
    inventory = load_inventory(None)
    uses_tmux("local", inventory)
    store = Store(str(tmp_path / "runs.db"))
    pb = tiny_playbook(tmp_path, inventory, "local", name="evaluated",
                   train={"steps": 20, "log_every": 5, "checkpoint_every": 10})
    raw = pb.model_dump(exclude={"trainer", "name", "source"})
    raw.update(trainer=pb.trainer.to_dict(), eval={"after_done": True, "prompts": 2, "max_new_tokens": 8,
                                                    "threads": 1, "timeout": 300})
    path = tmp_path / "playbooks" / "evaluated.yaml"
    path.write_text(yaml.safe_dump(raw))
    pb = load_playbook(str(path), inventory=inventory)
    result = launch_run(pb, inventory, store)
    sup = Supervisor(store, inventory, interval=0.5, playbooks_dir=str(path.parent))
    sup.attach(result.run_id)
    sup.run()  # returns when the run has ended and its evaluation is stored
    assert store.get_run(result.run_id).state == "done"
    [row] = store.evals(result.run_id)
    assert row["error"] is None and row["step"] == 20 and row["tau"] >= 1.0
    assert row["report"]["greedy_identical"] is True
    assert [e for e in store.events(result.run_id, kind="eval") if "measured tau" in e.message]
    listed = cli.invoke("runs", "--json", env={"DFLASHCTL_STORE": store.path})
    [entry] = [r for r in json.loads(listed.stdout) if r["id"] == result.run_id]
    assert entry["eval"]["tau"] == row["tau"]


@pytest.mark.slow
def test_dflashctl_eval_says_each_prompt_and_ctrl_c_keeps_what_was_measured(tmp_path):
    """eval_run runs the trainer's eval in a tmux session beside the run's and reads its
    report as it grows: each prompt is said and stored at once; a Ctrl-C (here: raised
    from the progress callback once two prompts are in) ends the session and keeps
    those prompts as a partial report."""
    from dflashctl.runs.runhost import eval_run, eval_session, part_tmux

    inventory = load_inventory(None)
    uses_tmux("local", inventory)
    store = Store(str(tmp_path / "runs.db"))
    pb = tiny_playbook(tmp_path, inventory, "local", name="measured", train={"steps": 10, "log_every": 5,
                                                                         "checkpoint_every": 10})
    result = launch_run(pb, inventory, store)
    sup = Supervisor(store, inventory, interval=0.5, playbooks_dir=str(tmp_path / "playbooks"))
    sup.attach(result.run_id)
    sup.run()
    assert store.get_run(result.run_id).state == "done"

    said = []

    def progress(step, message):
        said.append(message)
        if message.startswith("prompt 2/"):
            stored = [e for e in store.evals(result.run_id) if e["error"] is None]
            assert stored and stored[-1]["report"]["prompts"] >= 2  # stored as it came, before it is said
            raise KeyboardInterrupt

    settings = EvalSettings(prompts=50, max_new_tokens=16, threads=1, timeout=600)
    with pytest.raises(KeyboardInterrupt):
        eval_run(result.run_id, store, inventory, settings, progress=progress)
    [row] = [e for e in store.evals(result.run_id) if e["error"] is None]
    report = row["report"]
    assert report["complete"] is False and report["stopped"] == "interrupted"
    assert report["prompts"] >= 2 and report["prompts_planned"] == 50 and row["tau"] == report["tau"]
    assert [m for m in said if m.startswith("prompt 1/50: tau ")]
    assert not part_tmux(store.get_run(result.run_id), inventory).has_session(eval_session(store.get_run(result.run_id)))
    listed = cli.invoke("runs", env={"DFLASHCTL_STORE": store.path}, columns=200)
    assert f"{row['tau']:.2f}*" in listed.stdout  # partial, marked
