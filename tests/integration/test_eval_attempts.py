"""Each eval is one attempt with its own id, through the real eval_run: a fake
trainer's run (tests/harness/fake_trainer.py, whose `-m trainer eval` answers as the
real one does, without torch) in tmux on the local host, a real SQLite store, the
`runs` and `status` commands.

Two evals started back to back each store their own report: the second, whose start
is late, never reads the first's files (they are named by the attempt). The tau a run
shows is its largest complete eval's, and the views say which eval that was.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflashctl.config import EvalSettings
from dflashctl.hosts.tmux import SOCKET_ENV
from dflashctl.runs.evaluate import eval_files, eval_run
from tests.harness import cli as dflashctl
from tests.harness.fake_trainer import FAKE_EVAL
from tests.harness.local import REPO, SOCKET, wait_for

pytestmark = pytest.mark.usefixtures("private_tmux_socket")


def _eval(env, run_id, how: dict, prompts: int, tokens: int) -> dict:
    Path(env.run_dir(run_id), FAKE_EVAL).write_text(json.dumps(how))
    said: list[str] = []
    report = eval_run(run_id, env.store, env.inventory, EvalSettings(prompts=prompts, max_new_tokens=tokens,
                                                                      timeout=60),
                      progress=lambda step, text: said.append(text), poll=0.2)
    return {"report": report, "said": said}


def test_two_evals_back_to_back_each_store_their_own_report_under_a_late_start(local_env):
    pb = local_env.playbook("evals", {"train": {"steps": 6, "log_every": 2, "checkpoint_every": 2}})
    run_id = local_env.start(pb)
    store = local_env.store
    wait_for(lambda: Path(local_env.run_dir(run_id), "exit_code").exists(), 30, "the short run to end")
    first = _eval(local_env, run_id, {"tau": 7.0, "speedup": 2.0}, prompts=1, tokens=8)
    assert first["report"]["prompts"] == 1 and first["report"]["complete"]
    # The second starts 3 s late: the first's report and exit status lie in the run directory meanwhile.
    second = _eval(local_env, run_id, {"tau": 5.5, "speedup": 3.0, "delay_s": 3.0}, prompts=3, tokens=16)
    assert second["report"]["prompts"] == 3 and second["report"]["tau"] == 5.5
    rows = store.evals(run_id)
    assert [(r["report"]["prompts"], r["tau"], r["error"]) for r in rows] == [(1, 7.0, None), (3, 5.5, None)]
    assert rows[0]["attempt"] and rows[1]["attempt"] and rows[0]["attempt"] != rows[1]["attempt"]
    for row in rows:  # each attempt's files, named by its id, none shared
        files = eval_files(row["attempt"])
        for name in files:
            assert Path(local_env.run_dir(run_id), name).exists(), name
        stored = json.loads(Path(local_env.run_dir(run_id), files.report).read_text())
        assert stored["prompts"] == row["report"]["prompts"]
    assert [m for m in second["said"] if m.startswith("prompt 3/3: tau 5.50")]
    assert not [m for m in second["said"] if "7.00" in m]  # nothing of the first's said as the second's

    # A third, smaller eval later does not replace the larger one's tau; the views say which eval it is.
    _eval(local_env, run_id, {"tau": 4.0, "speedup": 1.5}, prompts=1, tokens=8)
    env = {"DFLASHCTL_STORE": local_env.store_path, SOCKET_ENV: SOCKET}
    listed = json.loads(dflashctl.invoke("runs", "--json", env=env, cwd=REPO).stdout)
    [entry] = [r for r in listed if r["id"] == run_id]
    assert entry["tau"] == 5.5 and entry["eval"]["attempt"] == rows[1]["attempt"]
    assert (entry["eval"]["prompts"], entry["eval"]["new_tokens"], entry["eval"]["newer"]) == (3, 48, 1)
    table = dflashctl.invoke("runs", env=env, cwd=REPO, columns=200).stdout
    assert "5.50" in table and "3p/48t+1" in table
    status = json.loads(dflashctl.invoke("status", run_id, "--json", env=env, cwd=REPO).stdout)
    [view] = [r for r in status["runs"] if r["id"] == run_id]
    assert view["tau"] == 5.5 and view["tau_eval"]["attempt"] == rows[1]["attempt"] and view["tau_eval"]["newer"] == 1
