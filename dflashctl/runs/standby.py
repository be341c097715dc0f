"""A run's standby: the next process's trainer, started early, woken by a restart.

``standby.sh`` is run.sh for the next process, started early (``start_standby``,
session ``<session>-standby``): its trainer imports and waits (trainer/standby.py).
A restart that finds it ready on every host renames its session to the run's and
wakes it, instead of starting run.sh; it clears nothing when it starts and writes
an exit code only once its trainer has taken over. An operator's restart holds a
ready standby through the stop that comes first (``_hold_standby``).
"""

from __future__ import annotations

import shlex
import time
from typing import TYPE_CHECKING, Callable

from dflashctl.core import contract
from dflashctl.hosts import deploy
from dflashctl.hosts.tmux import socket_name
from dflashctl.runs.access import _on_hosts, part_tmux
from dflashctl.runs.files import STANDBY_SCRIPT, posixpath_join, run_files
from dflashctl.store import Run, Store

if TYPE_CHECKING:
    from dflashctl.config import Inventory

# The standby of a run directory: 'ready PID TOKEN' while the pid standby.json names
# is really that standby (its command line names the run directory and the token:
# standby.json is a file on the host, and pids are reused) and can run (not stopped,
# traced or a zombie: woken, it would never answer), else why not.
_STANDBY_STATE = r"""
d=$1; f="$d/standby.json"
[ -f "$f" ] || { echo none; exit 0; }
pid=$(sed -n 's/.*"pid": *\([0-9][0-9]*\).*/\1/p' "$f" | head -n 1)
tok=$(sed -n 's/.*"token": *"\([A-Za-z0-9_-]*\)".*/\1/p' "$f" | head -n 1)
if [ -n "$pid" ] && [ -n "$tok" ] && [ -r "/proc/$pid/cmdline" ] && cmd=$(tr '\0' ' ' < "/proc/$pid/cmdline") \
    && case "$cmd" in *"$d"*"--standby $tok"*|*"--standby $tok"*"$d"*) true;; *) false;; esac; then
  st=$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -c1)
  case "$st" in T|t|Z|X) echo "stopped $pid $st" ;; *) echo "ready $pid $tok" ;; esac
else
  echo gone
fi
"""
# Wake a standby: its go file, made whole in one rename.
_STANDBY_GO = 'cd "$1" && : > "$2.tmp" && mv -f "$2.tmp" "$2"'


STANDBY_ANSWER_S = 5.0  # a woken standby takes its go file within this (it looks every 0.1 s), or is replaced
# Whether a woken standby took its go file: 'went' or 'waiting'.
_STANDBY_WENT = '[ -e "$1/$2" ] && echo went || echo waiting'


def wake_standby(parts: list, token: str, *, answer_s: float = STANDBY_ANSWER_S) -> bool:
    """Wake the ready standby ``token`` on every host (its session becomes the run's,
    then its go file); True once every host's took it over within ``answer_s``. False:
    one did not answer (stopped since it was found ready, or hung); every host's is
    then ended and its go file removed, for a fresh start in its place."""
    for part, transport, tmux in parts:
        tmux.rename(standby_session(part.tmux_session), part.tmux_session)
        transport.run(standby_go_argv(part.run_dir, token), timeout=30)
    deadline = time.monotonic() + answer_s
    waiting = list(parts)
    while waiting:
        waiting = [(p, t, x) for p, t, x in waiting
                   if t.run(["sh", "-c", _STANDBY_WENT, "dflashctl-went", p.run_dir, contract.standby_went(token)],
                            timeout=30, check=False).stdout.strip() != "went"]
        if waiting and time.monotonic() > deadline:
            for part, transport, tmux in parts:
                tmux.kill(part.tmux_session)
                transport.run(["rm", "-f", posixpath_join(part.run_dir, contract.standby_go(token))], timeout=30,
                              check=False)
            return False
        if waiting:
            time.sleep(0.1)
    return True


def standby_session(session: str) -> str:
    return f"{session}-standby"


def start_standby(run_id: str, store: Store, inventory: "Inventory", *,
                  clock: Callable[[], float] = time.time) -> str:
    """Start the next process's standby on every host of the run, in tmux sessions
    ``<session>-standby`` (an older one is replaced); returns its token."""
    import secrets

    run = store.get_run(run_id)
    token, socket = secrets.token_hex(4), run.tmux_socket or socket_name()
    for part, transport, tmux in _on_hosts(run, inventory):
        tmux.kill(standby_session(part.tmux_session))
        files = run_files(run.id, part.run_dir, run.config, socket, rank=part.rank, session=part.tmux_session,
                          standby=token)
        deploy.write_run_files(transport, part.run_dir, files)
        tmux.start(standby_session(part.tmux_session), shlex.join(["sh", posixpath_join(part.run_dir, STANDBY_SCRIPT)]))
    store.add_event(run.id, "standby", f"standby {token} started (the next restart's trainer, importing now)"
                    + (f" on {', '.join(run.host_names)}" if run.hosts else ""), clock(), detail={"token": token})
    return token


def end_standby(run: Run, inventory: "Inventory") -> None:
    """Kill the run's standby sessions (every host)."""
    for part in run.parts():
        part_tmux(part, inventory).kill(standby_session(part.tmux_session))


def standby_state_argv(run_dir: str) -> list[str]:
    """The host command saying 'ready PID TOKEN', 'gone' or 'none' of the run directory's standby."""
    return ["sh", "-c", _STANDBY_STATE, "dflashctl-standby", run_dir]


def standby_go_argv(run_dir: str, token: str) -> list[str]:
    """The host command that wakes the standby ``token`` (its go file, made whole in one rename)."""
    return ["sh", "-c", _STANDBY_GO, "dflashctl-go", run_dir, contract.standby_go(token)]


def _ready_standby(run: Run, parts: list) -> str | None:
    """The token of a standby ready on every host of the run (one token), else None."""
    tokens = set()
    for part, transport, tmux in parts:
        answer = transport.run(standby_state_argv(part.run_dir), timeout=30, check=False)
        words = answer.stdout.split()
        if len(words) != 3 or words[0] != "ready" or not tmux.has_session(standby_session(part.tmux_session)):
            return None
        tokens.add(words[2])
    return tokens.pop() if len(tokens) == 1 else None


def _hold_standby(run: Run, inventory: "Inventory") -> str | None:
    """The token of the run's ready standby, held through the stop that follows
    (``contract.standby_hold`` on every host); None when there is none."""
    parts = _on_hosts(run, inventory)
    token = _ready_standby(run, parts)
    if token:
        for part, transport, _ in parts:
            transport.run(["sh", "-c", _STANDBY_GO, "dflashctl-hold", part.run_dir, contract.standby_hold(token)],
                          timeout=30)
    return token


def _release_standby(run: Run, inventory: "Inventory", token: str) -> None:
    """Remove the hold files (the standby is the trainer now, or the restart failed)."""
    for part, transport, _ in _on_hosts(run, inventory):
        transport.run(["rm", "-f", posixpath_join(part.run_dir, contract.standby_hold(token))], timeout=30,
                      check=False)
