"""Every exit code the README and docs/commands.md promise is produced by a test.

The table of docs/commands.md ("Scripts can gate on these") and the README's rules
are read as written: each (command, code) they name is produced here, through the
command line in this process (tests/harness/cli.py) against a real SQLite store, the
local host, a host whose SSH port is closed (127.0.0.1:9), a real venv for
env-audit and a fake trainer's run in tmux for `eval`; or, where it takes a real
trainer, a second host or a signal to a process, by the test named in ``ELSEWHERE``,
which is checked to exist and to assert that code.
"""

from __future__ import annotations

import ast
import json
import re
import time
from pathlib import Path

import pytest
import yaml

from dflashctl.store import Store
from tests.harness import cli
from tests.harness.local import REPO

# (command, code) -> the test that produces it, where it needs a real trainer, a second
# host or a signal sent to a process.
ELSEWHERE = {
    ("launch", 0): "tests/e2e/test_launch.py::test_launch_demo_on_the_local_host_with_the_cli",
    ("launch", 130): "tests/e2e/test_launch_signals.py::"
                     "test_a_signal_to_launch_foreground_hands_the_run_to_a_background_supervisor",
    ("watch", 130): "tests/e2e/test_supervisor.py::test_watch_ends_cleanly_on_sigint_and_releases_the_run",
    ("stop", 3): "tests/integration/test_stop_hosts.py::"
                 "test_stop_with_one_rank_host_down_stops_the_other_and_its_supervisor_the_rest",
    ("restart", 0): "tests/integration/test_restart_reload.py::"
                    "test_a_restart_after_a_playbook_change_says_so_and_reload_takes_it",
    ("restart", 3): "tests/integration/test_stop_hosts.py::"
                    "test_stop_with_one_rank_host_down_stops_the_other_and_its_supervisor_the_rest",
    ("check", 0): "tests/integration/test_check.py::test_check_reports_route_and_facts_as_json",
    ("advise", 0): "tests/integration/test_placement.py::test_advise_reads_a_run_directory_on_its_host",
}


def documented() -> list[tuple[list[str], set[int]]]:
    """Each row of docs/commands.md's table: its commands and the codes it names; and
    the README's rules (2 bad input, 130 interrupted, 1 any other error; env-audit's
    0-3; 130 for `launch --foreground` and `watch`)."""
    text = (REPO / "docs" / "commands.md").read_text()
    table = text[text.index("| command | 0 | 1 | other |"):]
    table = table[: table.index("\n\n")]
    rows = []
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        codes = {0, 1} | {int(n) for n in re.findall(r"(?:^|, )(\d+) ", cells[3])}
        rows.append((re.findall(r"`([a-z-]+)`", cells[0]), codes))
    readme = (REPO / "README.md").read_text()
    assert "Every command exits 2 for bad input, 130 when interrupted, and 1 for any other error." in readme
    assert "`env-audit` exits 0 clean, 1 warnings, 2 errors, 3 when it could not run" in readme
    assert "Ctrl-C during `launch --foreground` or `watch` exits 130" in readme
    return rows + [(["launch"], {130}), (["watch"], {130}), (["env-audit"], {0, 1, 2, 3})]


def test_every_documented_code_is_produced_here_or_by_a_named_test():
    """Each code of each row, by one of its commands at least (a row of several
    commands says what any of them may answer)."""
    here = set(SCENARIOS) | set(ELSEWHERE) | PRODUCED_BELOW
    missing = [(commands, code) for commands, codes in documented() for code in sorted(codes)
               if not any((c, code) in here for c in commands)]
    assert not missing, f"documented exit codes no test produces: {missing}"
    for (command, code), node in ELSEWHERE.items():
        path, name = node.split("::")
        source = (REPO / path).read_text()
        [fn] = [f for f in ast.parse(source).body if isinstance(f, ast.FunctionDef) and f.name == name]
        body = ast.get_source_segment(source, fn)
        assert re.search(rf"(returncode|wait\([^)]*\)) == {code}\b", body), (command, code, node)
        assert command in body, (command, node)


# --------------------------------------------------------------------------- the scenarios


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A store with a run on the local host (ended, a trainer.log in its directory) and
    a running one on a host whose SSH port is closed; playbooks; a damaged store."""
    root = tmp_path_factory.mktemp("codes")
    inventory = root / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {
        "local": {"transport": "local", "workdir": str(root / "work")},
        "dead": {"transport": "ssh", "address": "127.0.0.1", "port": 9, "user": "nobody", "workdir": "/tmp/dead"}}}))
    store = Store(str(root / "runs.db"))
    run_dir = root / "run"
    run_dir.mkdir()
    (run_dir / "trainer.log").write_text("step 1\n")
    ended = store.create_run("pb", "local", {}, time.time(), run_dir=str(run_dir))
    store.transition(ended.id, "running", "", time.time())
    store.transition(ended.id, "done", "training finished", time.time())
    starting = store.create_run("pb", "local", {}, time.time(), run_dir=str(root / "starting"))  # just launched
    dead = store.create_run("pb", "dead", {}, time.time(), run_dir="/tmp/dead/run")
    store.transition(dead.id, "running", "", time.time())
    playbooks = root / "playbooks"
    playbooks.mkdir()
    base = {"host": "local", "trainer": {"model": {"preset": "tiny"}, "data": {"buckets": [256], "batch_size": 1},
                                         "train": {"steps": 10}, "placement": {"device": "cpu"}}}
    (playbooks / "typo.yaml").write_text(yaml.safe_dump({**base, "trainer": {**base["trainer"],
                                                                            "model": {"preset": "tiny-cycel"}}}))
    (playbooks / "noshards.yaml").write_text(yaml.safe_dump(
        {**base, "trainer": {**base["trainer"], "data": {"buckets": [256], "shards": str(root / "none")}}}))
    (root / "damaged.db").write_text("not a run store " * 100)
    (root / "broken.yaml").write_text("hosts: [this is not a mapping of hosts\n")
    return {"root": root, "inventory": inventory, "store": str(root / "runs.db"), "ended": ended.id, "dead": dead.id,
            "starting": starting.id,
            "playbooks": playbooks}


def _cli(w, *args, store=None, inventory=None):
    return cli.invoke("-i", str(inventory or w["inventory"]), "-p", str(w["playbooks"]), *args, cwd=w["root"],
                      env={"DFLASHCTL_STORE": store or w["store"]})


def _damaged(w, *args):
    return _cli(w, *args, store=str(w["root"] / "damaged.db"))


# (command, code) -> what produces it, given the world.
SCENARIOS = {
    ("launch", 1): lambda w: _cli(w, "launch", str(w["playbooks"] / "noshards.yaml"), "--dry-run"),
    ("launch", 2): lambda w: _cli(w, "launch", str(w["playbooks"] / "typo.yaml")),
    ("stop", 0): lambda w: _cli(w, "stop", w["ended"], "--timeout", "2s"),  # already ended
    ("stop", 1): lambda w: _cli(w, "stop", w["dead"]),  # no host answers: nothing sent
    ("stop", 2): lambda w: _cli(w, "stop", "nosuch"),
    ("restart", 1): lambda w: _cli(w, "restart", w["dead"]),
    ("restart", 2): lambda w: _cli(w, "restart", "nosuch"),
    ("watch", 0): lambda w: _cli(w, "watch", w["starting"], "--once"),  # nothing wrong found
    ("watch", 1): lambda w: _cli(w, "watch", w["dead"], "--once"),  # its host does not answer
    ("watch", 2): lambda w: _cli(w, "watch", "nosuch", "--once"),
    ("status", 0): lambda w: _cli(w, "status", "--once"),
    ("status", 1): lambda w: _damaged(w, "status", "--once"),
    ("status", 2): lambda w: _cli(w, "status", "nosuch"),
    ("runs", 0): lambda w: _cli(w, "runs"),
    ("runs", 1): lambda w: _damaged(w, "runs"),
    ("runs", 2): lambda w: _cli(w, "runs", "--no-such-option"),
    ("events", 0): lambda w: _cli(w, "events", w["ended"]),
    ("events", 1): lambda w: _damaged(w, "events", w["ended"]),
    ("events", 2): lambda w: _cli(w, "events", "nosuch"),
    ("logs", 0): lambda w: _cli(w, "logs", w["ended"]),
    ("logs", 1): lambda w: _damaged(w, "logs", w["ended"]),
    ("logs", 2): lambda w: _cli(w, "logs", "nosuch"),
    ("env-audit", 3): lambda w: _cli(w, "env-audit", "nosuch"),  # bad input: it could not run
    ("check", 1): lambda w: _cli(w, "check", "dead"),
    ("check", 2): lambda w: _cli(w, "check", "nosuch"),
    ("hosts", 0): lambda w: _cli(w, "hosts"),
    ("hosts", 2): lambda w: _cli(w, "hosts", inventory=w["root"] / "broken.yaml"),
    ("trust", 1): lambda w: _cli(w, "trust", "dead", "--yes"),
    ("trust", 2): lambda w: _cli(w, "trust", "nosuch"),
    ("cache", 0): lambda w: _cli(w, "cache", "ls"),
    ("cache", 1): lambda w: _cli(w, "cache", "rm", "no-such-key"),
    ("cache", 2): lambda w: _cli(w, "cache", "rm", "--older-than", "soon"),
    ("advise", 1): lambda w: _cli(w, "advise", w["dead"]),  # the host could not be asked
    ("advise", 2): lambda w: _cli(w, "advise", "nosuch"),
    ("eval", 1): lambda w: _cli(w, "eval", w["dead"]),
    ("eval", 2): lambda w: _cli(w, "eval", "nosuch"),
    ("store", 0): lambda w: _cli(w, "store", "info"),
    ("store", 1): lambda w: _damaged(w, "store", "info"),
    ("store", 2): lambda w: _cli(w, "store", "prune", "--no-such-option"),
}


@pytest.mark.parametrize("key", list(SCENARIOS), ids=[f"{c}-{n}" for c, n in SCENARIOS])
def test_the_documented_code(world, key):
    command, code = key
    done = SCENARIOS[key](world)
    assert done.returncode == code, (done.stdout[-1500:], done.stderr[-1500:])
    if code in (1, 2, 3):  # an error is one message naming what to fix, never a traceback
        assert "Traceback" not in done.stderr and done.stderr.strip(), done.stderr


# --------------------------------------------------------------------------- a real venv, a fake trainer's run

PRODUCED_BELOW = {("env-audit", 0), ("env-audit", 1), ("env-audit", 2), ("eval", 0)}



def test_env_audit_exits_0_clean_1_warnings_2_errors(tmp_path):
    from tests.harness.envs import CUDNN13, cudnn_files, healthy, write_dist

    env = healthy(tmp_path / "venv")
    inventory = env.inventory(tmp_path, extra="    wrapper: env --\n")
    store = {"DFLASHCTL_STORE": str(tmp_path / "runs.db"), "DFLASHCTL_PLAYBOOKS": None}

    def audit():
        return cli.invoke("--inventory", inventory.source, "env-audit", "box", "--json", cwd=tmp_path, env=store)

    clean = audit()
    assert clean.returncode == 0, clean.stdout[-2000:]
    # A stray stack that pins another torch: a warning (the trainer does not import it).
    write_dist(env.site, "sglang", "0.5.3", {"sglang/__init__.py": ""}, ["torch==2.8.0"])
    warned = audit()
    assert warned.returncode == 1 and json.loads(warned.stdout)["exit_code"] == 1, warned.stdout[-2000:]
    # A second cuDNN for another CUDA major: an error.
    write_dist(env.site, *CUDNN13, cudnn_files("cudnn-cu13"))
    assert audit().returncode == 2


@pytest.mark.usefixtures("private_tmux_socket")
def test_eval_exits_0_once_its_report_is_stored(local_env):
    """`dflashctl eval` on a finished run of the fake trainer, whose `-m trainer eval`
    answers as the real one does (tests/harness/fake_trainer.py)."""
    from dflashctl.hosts.tmux import SOCKET_ENV
    from tests.harness.local import SOCKET, wait_for

    pb = local_env.playbook("codes", {"train": {"steps": 4, "log_every": 2, "checkpoint_every": 2}})
    run_id = local_env.start(pb)
    wait_for(lambda: Path(local_env.run_dir(run_id), "exit_code").exists(), 30, "the short run to end")
    done = cli.invoke("-i", str(local_env.inventory_path), "eval", run_id, "--prompts", "2", cwd=REPO,
                      env={"DFLASHCTL_STORE": local_env.store_path, SOCKET_ENV: SOCKET})
    assert done.returncode == 0, done.stderr[-2000:]
    assert [row for row in local_env.store.evals(run_id) if row["error"] is None and row["report"]["prompts"] == 2]

