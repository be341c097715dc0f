"""User text reaches the terminal as given: never read as Rich markup, never as
control characters, and every command printed in a hint runs as printed.

``[``, ``]``, ``[/x]``, ``/`` and ANSI escapes go into run references, host names,
wrappers, work directories, playbook names, event messages and log lines; each
command that shows them is run for real (the command line in this process, its
output captured as a pipe's: tests/harness/cli.py; a real store, a real launch on
the local host with the fake trainer). How Rich renders escaped text alone:
tests/unit/test_markup.py.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from dflashctl.core import contract
from dflashctl.hosts.tmux import SOCKET_ENV, Tmux
from dflashctl.store import Store
from tests import harness
from tests.harness import cli, free_port
from tests.harness.launch import SOCKET, LocalLaunch, end, trainer_pid

pytestmark = pytest.mark.usefixtures("launch_tmux_socket")

REPO = harness.REPO
ANSI = "\x1b[31m"
HOSTILE = ["[/x]", "[bold]loud[/bold]", "a]b[c", "/usr/sbin/[pct]", f"{ANSI}red", "back\\[x]", "\\[x", "x\\", ":smile:"]
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def shown(text: str) -> str:
    """How a terminal should see ``text``: control characters as visible escapes."""
    return text.replace("\x1b", "\\x1b")


# --------------------------------------------------------------------------- the command line


def _cli(args: list[str], env: dict[str, str | None], cwd: Path) -> subprocess.CompletedProcess:
    """The command in this process, in ``cwd``, with ``env``'s variables (tests/harness/cli.py)."""
    return cli.invoke(*args, env=env, cwd=cwd)


def _clean(done: subprocess.CompletedProcess) -> str:
    text = done.stdout + done.stderr
    assert "Traceback" not in text and "MarkupError" not in text, text
    assert not CONTROL.search(text), repr(text)
    return text


@pytest.fixture
def env(tmp_path):
    # PYTHONPATH: what the commands start runs this checkout's code, whatever the working directory.
    values = {"DFLASHCTL_STORE": str(tmp_path / "runs.db"), "DFLASHCTL_HOME": str(tmp_path / "home"),
              SOCKET_ENV: SOCKET, "PYTHONPATH": str(REPO),
              **{name: None for name in ("DFLASHCTL_INVENTORY", "DFLASHCTL_PLAYBOOKS", "DFLASHCTL_DEBUG")}}
    Store(str(tmp_path / "runs.db")).close()  # a store with no runs (status refuses one that does not exist)
    return values


@pytest.mark.parametrize("command, ref", [
    *((["events"], ref) for ref in HOSTILE),
    *((command, ref) for command in (["stop"], ["logs"], ["restart"], ["status", "--once"])
      for ref in ("[/x]", f"{ANSI}red")),
])
def test_a_hostile_run_reference_is_an_error_shown_as_given(env, tmp_path, command, ref):
    done = _cli([*command[:1], ref, *command[1:]], env, tmp_path)
    assert done.returncode != 0
    assert f"error: no run '{shown(ref)}'" in _clean(done)


@pytest.mark.parametrize("name", ["[/x]", f"gpu{ANSI}1", "a]b["])
def test_a_hostile_host_name_is_reported_as_given(env, tmp_path, name):
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {name: {"address": "10.0.0.5"}}}))
    done = _cli(["-i", str(inventory), "hosts"], env, tmp_path)
    assert done.returncode == 2
    assert f"host name '{shown(name)}'" in _clean(done)


# A workdir or wrapper with a control character is refused at load (tests/integration/test_operator_values.py);
# markup in them is shown as given.
@pytest.mark.parametrize("wrapper", [["/usr/sbin/pct", "exec", "200", "--"], ["pct", "exec", "200", "--"],
                                     ["docker", "exec", "[red][/x]"]])
def test_dry_run_shows_wrappers_and_workdirs_as_given(env, tmp_path, wrapper):
    workdir = "/srv/[/x]/w[bold]"
    inventory = tmp_path / "in [/x]" / "inventory.yaml"
    inventory.parent.mkdir(parents=True)
    # Nothing listens on the port: the dry run's read-only env-audit is refused at once.
    inventory.write_text(yaml.safe_dump({"hosts": {"gpu1": {"address": "127.0.0.1", "port": free_port("127.0.0.1"),
                                                             "wrapper": wrapper, "workdir": workdir}}}))
    playbooks = tmp_path / "playbooks"
    playbooks.mkdir()
    (playbooks / "dry.yaml").write_text(yaml.safe_dump({
        "host": "gpu1",
        "trainer": {"model": {"preset": "tiny"}, "data": {"buckets": [256], "batch_size": 1, "max_anchors": 16},
                    "placement": {"device": "cpu", "target": [0], "drafter": [0]}},
    }))
    done = _cli(["-i", str(inventory), "-p", str(playbooks), "launch", "dry", "--dry-run"], env, tmp_path)
    text = _clean(done)
    # The refused audit is an error: the dry run shows every step, then exits 1 (a launch would stop).
    assert done.returncode == 1 and "a launch would stop" in text, text
    assert f"connect  gpu1 via direct [{shown(shlex.join(wrapper))}]" in text
    assert "configure  would run on gpu1: " in text and shown(shlex.quote(workdir)) in text

    hosts = _cli(["-i", str(inventory), "hosts"], env, tmp_path)
    text = _clean(hosts)
    assert hosts.returncode == 0 and "hosts in " in text and "[/x]/inventory.yaml" in text  # the title may wrap
    assert shown(wrapper[-1]) in text


def test_a_launch_into_a_hostile_workdir_and_everything_shown_of_it(tmp_path, env):
    local = LocalLaunch(tmp_path, workdir=tmp_path / "w [/x] [red]")  # control characters are refused at load
    env.update({**local.changes, "PYTHONPATH": env["PYTHONPATH"]})
    name = local.playbook("hostile", {"steps": 100000, "log_every": 2, "checkpoint_every": 4})
    args = ["-i", str(local.inventory_path), "-p", str(local.playbooks)]
    launched = _cli([*args, "launch", name, "--no-watch"], env, tmp_path)
    text = _clean(launched)
    assert launched.returncode == 0, text
    run_id = launched.stdout.split()[-1]
    store = Store(local.store_path)
    run = store.get_run(run_id)
    try:
        assert run.state == "running" and "[/x]" in run.run_dir
        assert f"configure  {shown(run.run_dir)}: config.json, run.sh" in text

        message = f"trainer said [/x] and [red]alarm[/red] {ANSI}boom\x1b[0m :smile:"
        store.add_event(run_id, "crash", message, time.time(), severity="error")
        store.update_run(run_id, exit_reason="[/x] reason")
        with open(Path(run.run_dir, contract.LOG_FILE), "a") as f:
            f.write(f"{ANSI}colored[/x]\x1b[0m line\n")

        events = _cli([*args, "events", run_id], env, tmp_path)
        assert events.returncode == 0 and shown(message) in _clean(events)
        listed = _cli([*args, "runs"], env, tmp_path)
        assert listed.returncode == 0 and "[/x] reason" in _clean(listed)
        status = _cli([*args, "status", run_id, "--once"], env, tmp_path)
        assert status.returncode == 0 and "trainer said [/x] and [red]alarm[/red]" in _clean(status)
        logs = _cli([*args, "logs", run_id, "-n", "100000"], env, tmp_path)
        assert logs.returncode == 0 and "\\x1b[31mcolored[/x]\\x1b[0m line" in _clean(logs)
        stopped = _cli([*args, "stop", run_id, "--timeout", "30"], env, tmp_path)
        assert stopped.returncode == 0 and stopped.stdout.split() == [run_id, "stopped"], _clean(stopped)
    finally:
        end(trainer_pid(run.run_dir))
        Tmux(local.inventory.get("local"), local.inventory, SOCKET).kill(run_id)


def test_a_command_in_a_hint_runs_as_printed(env, tmp_path):
    store = Store(env["DFLASHCTL_STORE"])
    playbook = "my [/x] book"
    run = store.create_run(playbook, "local", {}, time.time())
    store.transition(run.id, "running", "started", time.time())
    store.transition(run.id, "done", "finished", time.time(), exit_code=0)
    done = _cli(["restart", run.id], env, tmp_path)
    text = _clean(done)
    assert done.returncode == 1 and f"error: run {run.id} is done" in text
    (hint,) = [line for line in done.stderr.splitlines() if line.startswith("hint: ")]
    assert shlex.split(hint.split("start a new run: ", 1)[1]) == ["dflashctl", "launch", playbook]
