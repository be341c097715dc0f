"""tmux session lifecycle on a run host, over the host's kept-open transport.

Each run's trainer lives in a tmux session named after the run, on a dedicated
socket (``-L dflash``; ``DFLASHCTL_TMUX_SOCKET`` overrides it, which tests use so
they never touch a real one), so dflashctl never sees or disturbs a user's own
sessions, and the trainer survives the connection that started it.

One code path for every host: each lifecycle call (create, signal / keys,
rename, kill) is one ``tmux -L SOCKET ...`` argv run by the host's pooled
``Transport`` (``dflashctl.hosts.transport.connect``): a subprocess for the local host,
one exec on the kept-open SSH connection (jump hosts, container wrapper and all)
for a remote one, under a UTF-8 locale. A call that needs two tmux commands (kill
a session that may be gone) is one small ``sh`` script, so one round trip.

Why not libtmux with a forwarding ``tmux_bin``: libtmux runs its ``tmux_bin`` as
a new process per call, so a remote host paid a Python start, a fresh SSH
connection through every jump and the container wrapper for each tmux call: 4-5 s
each through a jump and `pct exec`, against well under a second on the open
connection, and a restart makes several of them (a standby renamed and woken, the
previous session killed). Nothing of libtmux's object model is used here: the
sessions are named by the run, and what they print is read by the probe.

Polling never comes here: the probe reads session liveness and the pane tail
itself, in its one round trip per host.

Output and exit status are not tmux's business: the session runs the run
directory's ``run.sh`` (written by ``dflashctl.runs.files``), which tees the trainer's
output into ``trainer.log`` and writes its exit status to ``exit_code``. A
``pipe-pane`` log would miss whatever the trainer prints before the pipe is
attached, and tmux forgets a pane's exit status once the session closes.

The test container wrapper (tests/harness/bin/pct) enters new UTS, IPC and mount
namespaces per call but deliberately no PID namespace: a tmux server started
through it outlives the call, as it does inside a real long-lived container
entered with ``pct exec``. (With ``unshare --pid`` per call the server would be
killed when the call returns.) The socket lives in /tmp/tmux-UID on the shared
filesystem, so later calls find it.
"""

from __future__ import annotations

import os
import re
import shlex
from typing import TYPE_CHECKING

from dflashctl.core.errors import ConfigError, DflashError, TransportError
from dflashctl.hosts.transport import Result, Transport, connect

if TYPE_CHECKING:
    from dflashctl.config import Host, Inventory

DEFAULT_SOCKET = "dflash"
SOCKET_ENV = "DFLASHCTL_TMUX_SOCKET"
UTF8_ENV = {"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
PANE_SIZE = (200, 50)  # wide enough that tracebacks are not wrapped in capture-pane
CALL_TIMEOUT = 30.0  # one lifecycle call on the host


# A tmux -L name: it names a file in the host's tmux directory and is written into
# run.sh; nothing else is let through (a newline there was shell text on the host).
_SOCKET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


def socket_name() -> str:
    """The tmux socket name: ``$DFLASHCTL_TMUX_SOCKET`` or ``dflash``; a name that is
    not plain is refused (``check_socket``)."""
    value = os.environ.get(SOCKET_ENV)
    return check_socket(value, f"${SOCKET_ENV}") if value else DEFAULT_SOCKET


def check_socket(name: str, source: str = "the tmux socket") -> str:
    """``name`` when it is a plain tmux socket name, else a ConfigError naming it and the fix."""
    if _SOCKET_NAME.fullmatch(name):
        return name
    raise ConfigError(
        f"{source} {name!r} is not a tmux socket name: use 1-100 letters, digits, '.', '_' or '-', starting with a "
        "letter or digit (no control characters, spaces or '/': the name becomes a file name on the run host and "
        "is written into its run.sh)",
        hint=f"unset {SOCKET_ENV} (the default socket is '{DEFAULT_SOCKET}'), or set it to a plain name, e.g. "
        f"`export {SOCKET_ENV}=dflash-test`",
    )


class TmuxError(DflashError):
    """A tmux lifecycle call failed on a run host."""


# Kill session $2 on socket $1 in one round trip: 'absent' (no such session, or no
# server), 'killed', or exit 1 with tmux's message when it is still there.
_KILL = r"""
tmux -L "$1" has-session -t "=$2" 2>/dev/null || { echo absent; exit 0; }
tmux -L "$1" kill-session -t "=$2" 2>/dev/null && { echo killed; exit 0; }
tmux -L "$1" has-session -t "=$2" 2>/dev/null || { echo killed; exit 0; }
tmux -L "$1" kill-session -t "=$2"
"""


class Tmux:
    """The dflash tmux server on one host."""

    def __init__(self, host: "Host", inventory: "Inventory", socket: str | None = None):
        self.host = host
        self.inventory = inventory
        self.socket = check_socket(socket, "the run's tmux socket") if socket else socket_name()

    @property
    def transport(self) -> Transport:
        return connect(self.host, self.inventory)  # pooled: the kept-open connection

    def _run(self, argv: list[str], timeout: float = CALL_TIMEOUT) -> Result:
        return self.transport.run(argv, env=UTF8_ENV, check=False, timeout=timeout)

    def _cmd(self, *args: str) -> Result:
        return self._run(["tmux", "-L", self.socket, *args])

    def _fail(self, what: str, result: Result) -> TmuxError:
        detail = result.stderr.strip() or f"exit {result.exit_code}"
        return TmuxError(f"{self.host.name}: tmux {what} failed on socket '{self.socket}': {detail}")

    def has_session(self, name: str) -> bool:
        """Exact name match (never a prefix). A host that cannot be asked raises: "no
        such session" must not be concluded from "no answer" (a stop would then record
        a run as stopped while its trainer goes on)."""
        result = self._cmd("has-session", "-t", f"={name}")
        if result.exit_code in (0, 1):  # 1: no such session, or no server on the socket
            return result.exit_code == 0
        detail = result.stderr.strip() or f"exit {result.exit_code}"
        raise TransportError(self.host.name, f"tmux -L {self.socket} has-session -t ={name}",
                             f"cannot ask tmux on {self.host.name}: {detail}", result.exit_code)

    def start_argv(self, name: str, command: str, cwd: str | None = None) -> list[str]:
        """The host command ``start`` runs (for a script that runs it among others)."""
        return ["tmux", "-L", self.socket, "new-session", "-d", "-s", name, "-x", str(PANE_SIZE[0]),
                "-y", str(PANE_SIZE[1]), *(["-c", cwd] if cwd else []), command]

    def kill_argv(self, name: str) -> list[str]:
        """The host command ``kill`` runs: prints 'absent' or 'killed'."""
        return ["sh", "-c", _KILL, "dflashctl-tmux-kill", self.socket, name]

    def rename_argv(self, name: str, new: str) -> list[str]:
        return ["tmux", "-L", self.socket, "rename-session", "-t", f"={name}", new]

    def start(self, name: str, command: str, cwd: str | None = None) -> None:
        """A detached session ``name`` whose one window runs ``command`` (a shell line).
        The window closes, and the session with it, when the command ends."""
        result = self._run(self.start_argv(name, command, cwd))
        if result.exit_code == 0:
            return
        if "duplicate session" in result.stderr:
            raise TmuxError(
                f"{self.host.name}: a tmux session named {name} already exists on socket '{self.socket}'",
                hint=f"stop it first: dflashctl stop {shlex.quote(name)}",
            )
        raise TmuxError(f"{self.host.name}: could not start tmux session {name}: "
                        f"{result.stderr.strip() or f'exit {result.exit_code}'}")

    def send_keys(self, name: str, *keys: str) -> None:
        """Keys as tmux names them ('C-c', 'Enter', or literal text)."""
        result = self._cmd("send-keys", "-t", f"={name}:", *keys)
        if result.exit_code:
            raise self._fail(f"send-keys to {name}", result)

    def kill(self, name: str) -> bool:
        """Kill the session (its processes get SIGHUP); False if it did not exist. One
        round trip."""
        result = self._run(self.kill_argv(name))
        if result.exit_code == 0 and result.stdout.strip() in ("absent", "killed"):
            return result.stdout.strip() == "killed"
        raise self._fail(f"kill-session {name}", result)

    def rename(self, name: str, new: str) -> None:
        result = self._run(self.rename_argv(name, new))
        if result.exit_code:
            raise self._fail(f"rename-session {name} {new}", result)

    def capture(self, name: str, lines: int = 50) -> str:
        result = self._cmd("capture-pane", "-p", "-t", f"={name}:", "-S", f"-{lines}")
        if result.exit_code:
            raise self._fail(f"capture-pane {name}", result)
        return result.stdout.rstrip("\n")

    def sessions(self) -> list[str]:
        result = self._cmd("list-sessions", "-F", "#{session_name}")
        return result.stdout.splitlines() if result.exit_code == 0 else []

    def server_pid(self) -> int | None:
        """Pid of this socket's tmux server (as seen on its host), None when none runs."""
        result = self._cmd("display-message", "-p", "#{pid}")
        text = result.stdout.strip()
        if result.exit_code or not text.isdigit():
            return None
        return int(text)

    def kill_server(self) -> None:
        """Stop this socket's server (every session on it). Only for tests and cleanup."""
        self._cmd("kill-server")
