"""The status console in a real terminal: `dflashctl status` in a tmux pane of
120x40 against a real run (the fake trainer, started by the launcher's own run.sh
in tmux) watched by a real `dflashctl watch` process. Captures of the pane show
the step advancing; `/` `r` `y` in the detail view typed into its filter (no
restart); a held write lock on the store shown as "store busy"; SIGSTOP on the trainer shows the stall within its stall
window; kill -9 on the supervisor turns the run "unsupervised" within two poll
intervals; then `w` `y` starts a supervisor again from the screen (the run shows
supervised), the log view pauses on PageUp ("paused, N new lines, End to
follow") and follows again on End, and `a` splits the console's pane with a real
tmux attach to the run's own session; a console outside tmux hands its terminal
to that attach and comes back on the detach (C-b d).

Every tmux server here is on a socket private to this test process and every
process it starts is ended by its pid.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

from dflashctl.config import load_inventory, load_playbook
from dflashctl.hosts.tmux import SOCKET_ENV, Tmux
from dflashctl.store import Store
from tests import harness
from tests.harness import environ
from tests.harness.fake_trainer import start_fake_run
from tests.harness.local import read_status, write_playbook

SOCKET = f"dflash-tui-{os.getpid()}"
POLL_S = 1.0
STALL_S = 4.0
REPO = harness.REPO


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", "-L", SOCKET, *args], capture_output=True, text=True, check=True).stdout


def pane(session: str) -> str:
    done = subprocess.run(["tmux", "-L", SOCKET, "capture-pane", "-p", "-t", session], capture_output=True, text=True)
    if done.returncode:
        raise AssertionError(f"tmux session {session} is gone: {done.stderr.strip()}")
    return done.stdout


def pane_pid(session: str) -> int:
    return int(tmux("display-message", "-p", "-t", session, "#{pane_pid}").strip())


def wait_pane(session: str, predicate, timeout: float, what: str) -> tuple[str, float]:
    """(the capture that satisfied ``predicate``, seconds it took)."""
    start = time.monotonic()
    text = ""
    while time.monotonic() - start < timeout:
        text = pane(session)
        if predicate(text):
            return text, time.monotonic() - start
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}; the pane shows:\n{text}")


def row(text: str, run_id: str) -> str:
    return next((line for line in text.splitlines() if line.lstrip().startswith(run_id[:12])), "")


def step_of(text: str, run_id: str) -> int | None:
    match = re.search(r"(\d[\d,]*)/100,000", row(text, run_id))
    return int(match.group(1).replace(",", "")) if match else None


@pytest.mark.slow
def test_status_in_tmux_follows_a_real_run(tmp_path):
    inventory_path = tmp_path / "inventory.yaml"
    inventory_path.write_text(yaml.safe_dump({"hosts": {"local": {"transport": "local",
                                                                  "workdir": str(tmp_path / "work")}}}))
    playbooks = tmp_path / "playbooks"
    source = write_playbook(playbooks, "live", "local", {"train": {"steps": 100000, "log_every": 2,
                                                                    "checkpoint_every": 50}},
                            poll_interval=f"{POLL_S}s", expect={"stall_window": f"{STALL_S}s"})
    env = {"DFLASHCTL_STORE": str(tmp_path / "runs.db"), SOCKET_ENV: SOCKET, "COLUMNS": "120", "LINES": "40"}
    started: list[int] = []
    with environ(**env):
        inventory = load_inventory(str(inventory_path))
        store = Store(env["DFLASHCTL_STORE"])
        pb = load_playbook(str(source), inventory=inventory)
        run_id = start_fake_run(store, inventory, "local", pb.trainer.to_dict(), playbook=pb.name,
                                playbook_source=pb.source, socket=SOCKET, step_s=0.1)
        try:
            shell_env = " ".join(f"{k}={v}" for k, v in {**env, "TERM": "xterm-256color"}.items())
            cli = f"exec env {shell_env} {sys.executable} -m dflashctl --inventory {inventory_path} " \
                  f"--playbooks {playbooks}"
            tmux("new-session", "-d", "-s", "watch", "-x", "120", "-y", "40", f"{cli} watch {run_id}")
            supervisor = pane_pid("watch")
            started.append(supervisor)
            tmux("new-session", "-d", "-s", "tui", "-x", "120", "-y", "40", f"{cli} status --interval 0.5")
            tmux("set-option", "-t", "tui", "remain-on-exit", "on")  # a crash stays readable in the pane
            started.append(pane_pid("tui"))

            # The step advances on screen.
            first, _ = wait_pane("tui", lambda t: step_of(t, run_id), 60, "the run's step")
            later, _ = wait_pane("tui", lambda t: (step_of(t, run_id) or 0) > step_of(first, run_id) + 5, 30,
                                 "the step advancing")
            assert "running" in row(later, run_id) and "training" in row(later, run_id)

            # In the detail view `/` `r` `y` is text in the filter box, never a restart.
            restarts = len(store.restarts(run_id))
            tmux("send-keys", "-t", "tui", "Enter")
            wait_pane("tui", lambda t: "o overview · e events" in t and "l log · / filter" in t, 30, "the detail view")
            tmux("send-keys", "-t", "tui", "/", "r", "y")
            wait_pane("tui", lambda t: "ry" in t.splitlines()[1], 10, "the typed text in the filter box")
            time.sleep(2 * POLL_S)
            assert store.get_run(run_id).state == "running" and len(store.restarts(run_id)) == restarts
            assert "Restart run" not in pane("tui")
            tmux("send-keys", "-t", "tui", "Escape")
            tmux("send-keys", "-t", "tui", "Escape")
            wait_pane("tui", lambda t: row(t, run_id) and "/ filter" not in t, 30, "the runs again")

            # Another process holds the store's write lock: the supervisor, alive, cannot
            # tick; the screen says "store busy", never unsupervised.
            import sqlite3

            holder = sqlite3.connect(env["DFLASHCTL_STORE"], timeout=0, isolation_level=None)
            try:
                holder.execute("BEGIN IMMEDIATE")
                busy, _ = wait_pane("tui", lambda t: "store busy" in row(t, run_id), 30, "store busy")
                assert "unsupervised" not in busy and f"dflashctl watch {run_id}" not in busy
            finally:
                holder.close()
            wait_pane("tui", lambda t: "running" in row(t, run_id), 30, "the supervisor writing again")

            # SIGSTOP the trainer: the stall shows within the stall window (plus a poll to see it).
            trainer = read_status(store.get_run(run_id).run_dir).pid
            os.kill(trainer, signal.SIGSTOP)
            try:
                stalled, took = wait_pane("tui", lambda t: "stalled" in row(t, run_id), STALL_S + 4 * POLL_S + 10,
                                          "the stall")
                assert took <= STALL_S + 4 * POLL_S + 2, took
            finally:
                os.kill(trainer, signal.SIGCONT)
            wait_pane("tui", lambda t: "running" in row(t, run_id), 30, "the run training again")

            # kill -9 the supervisor: "unsupervised" within two poll intervals.
            os.kill(supervisor, signal.SIGKILL)
            killed = time.monotonic()
            text, _ = wait_pane("tui", lambda t: "unsupervised" in row(t, run_id), 30, "unsupervised")
            assert time.monotonic() - killed <= 2 * POLL_S + 0.5, time.monotonic() - killed
            assert f"dflashctl watch {run_id}" in text  # the fix, on screen
            assert "stale" in row(text, run_id)  # and no live ETA

            # `w`: asked, then a supervisor, detached in its own tmux session; the run is
            # watched again.
            tmux("send-keys", "-t", "tui", "w")
            asked, _ = wait_pane("tui", lambda t: "Start a supervisor for run" in t, 30, "the question")
            assert "detached" in asked and "y yes" in asked
            tmux("send-keys", "-t", "tui", "y")
            wait_pane("tui", lambda t: "running" in row(t, run_id) and "unsupervised" not in row(t, run_id), 60,
                      "the run supervised again")
            started.append(pane_pid(f"watch-{run_id}"))

            # The log view: PageUp pauses the following (the trainer goes on writing), End follows.
            tmux("send-keys", "-t", "tui", "l")
            wait_pane("tui", lambda t: "End Follow" in t and re.search(r"step \d+/100000 tok/s", t), 30, "the log")
            tmux("send-keys", "-t", "tui", "PageUp")
            paused, _ = wait_pane("tui", lambda t: re.search(r"paused, [1-9][\d,]* new lines?, End to follow", t), 30,
                                  "the log paused with new lines waiting")
            tmux("send-keys", "-t", "tui", "End")
            wait_pane("tui", lambda t: "End to follow" not in t, 30, "the log following again")
            tmux("send-keys", "-t", "tui", "Escape")
            wait_pane("tui", lambda t: row(t, run_id) and "End Follow" not in t, 30, "the runs again")

            # `a` in tmux with no client to show a popup: a split below, attached to the run's session.
            console_pane = tmux("display-message", "-p", "-t", "tui", "#{pane_id}").strip()
            tmux("send-keys", "-t", "tui", "a")
            deadline = time.monotonic() + 30
            while len(tmux("list-panes", "-t", "tui", "-F", "#{pane_id}").split()) < 2:
                assert time.monotonic() < deadline, "no split opened for the attach"
                time.sleep(0.1)
            split = next(p for p in tmux("list-panes", "-t", "tui", "-F", "#{pane_id}").split() if p != console_pane)
            wait_pane(split, lambda t: re.search(r"step \d+/100000 tok/s", t) and run_id[:6] in t, 30,
                      "the run's own session in the split")
            tmux("kill-pane", "-t", split)  # the attached client ends; the run goes on
            assert store.get_run(run_id).state == "running"

            # Outside tmux: `a` hands the console's terminal to the attach; C-b d comes back.
            plain = cli.replace("exec env ", "exec env -u TMUX -u TMUX_PANE ", 1)
            tmux("new-session", "-d", "-s", "tui2", "-x", "120", "-y", "40", f"{plain} status --interval 0.5")
            started.append(pane_pid("tui2"))
            wait_pane("tui2", lambda t: "running" in row(t, run_id), 60, "the second console")
            tmux("send-keys", "-t", "tui2", "a")
            wait_pane("tui2", lambda t: re.search(r"step \d+/100000 tok/s", t) and "dflashctl status" not in t, 30,
                      "the run's session in the console's terminal")
            tmux("send-keys", "-t", "tui2", "C-b", "d")
            wait_pane("tui2", lambda t: "dflashctl status" in t and "running" in row(t, run_id), 30,
                      "the console back after the detach")
        finally:
            for pid in started:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            server = Tmux(inventory.get("local"), inventory, SOCKET).server_pid()
            if server:
                os.kill(server, signal.SIGTERM)
