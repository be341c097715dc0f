"""The one command line a host runs, and routes and failures in inventory terms.

The command line is built in exactly one place, ``command_line``:

    [wrapper...] timeout -k K T [sh -c ENV_PRELUDE sh] [sh -c CD_PRELUDE sh DIR] argv...

joined with ``shlex.join`` for the remote login shell (sshd runs the command
string through the user's shell). The wrapper (``pct exec 200 --``) executes the
rest as an argv, without a second shell, so one level of quoting is right. Every
layer after the wrapper is an argv-executing program (``timeout``, a ``sh -c``
whose script is constant and whose data travels as positional parameters or on
stdin), so nothing in ``argv``, ``env`` or ``cwd`` is ever interpreted by a shell.

Environment values never travel on the command line: every user of a host sees
every process's arguments in ``ps`` (the login shell's ``-c`` string too). They
go first on stdin (``env_input``), one ``NAME=value`` line each and an empty line;
the prelude exports them and execs the argv with the rest of stdin.
"""

from __future__ import annotations

import re
import shlex
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from dflashctl.config import Host

# `timeout -k`: seconds between SIGTERM and SIGKILL on the host.
KILL_AFTER = 2.0
# Linux caps one argv string at 128 KiB, and sshd hands the whole command line to
# the login shell as one `-c` argument.
MAX_COMMAND_BYTES = 120_000

# Enter the working directory, then exec the argv. "~" and "~/..." expand against
# the run host's $HOME; the directory itself is data ($1), never shell text.
_CD_PRELUDE = (
    'd=$1; shift; case $d in "~") d=$HOME ;; "~/"*) d=$HOME/${d#"~/"} ;; esac; '
    'cd -- "$d" || exit 125; exec "$@"'
)


# Read NAME=value lines up to an empty one from stdin and export them, then exec
# the argv with the rest of stdin: `read` takes a pipe one byte at a time, so
# nothing past the empty line is consumed. A line "b NAME=..." carries a value
# with a newline or a backslash as printf %b octal escapes (the x keeps a
# trailing newline from the command substitution).
_ENV_PRELUDE = (
    'while IFS= read -r l && [ -n "$l" ]; do case $l in "b "*) l=${l#b }; v=$(printf %bx "${l#*=}"); '
    'l=${l%%=*}=${v%x} ;; esac; export "$l" || exit 125; done; exec "$@"'
)
_PLAIN = re.compile(r"[^\n\\]*")


def env_input(env: dict[str, str] | None) -> bytes:
    """What goes on stdin before the command's own input so that ``command_line``'s
    prelude exports ``env`` (empty without env)."""
    if not env:
        return b""
    lines = []
    for key, value in env.items():
        if "\0" in value:
            raise ValueError(f"environment variable {key}'s value holds a NUL byte, which no environment can")
        if _PLAIN.fullmatch(value):
            lines.append(f"{key}={value}\n".encode())
        else:
            escaped = "".join(chr(b) if chr(b).isascii() and chr(b).isalnum() else f"\\0{b:03o}" for b in value.encode())
            lines.append(f"b {key}={escaped}\n".encode())
    return b"".join(lines) + b"\n"


def command_line(
    argv: list[str],
    *,
    wrapper: Iterable[str] = (),
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> str:
    """The one place a command string is built (see the module docstring)."""
    if not argv:
        raise ValueError("argv is empty")
    if not timeout > 0:
        raise ValueError(f"timeout must be more than 0 seconds, got {timeout!r}")  # `timeout 0` means none
    inner = [str(a) for a in argv]
    if cwd is not None:
        inner = ["sh", "-c", _CD_PRELUDE, "sh", str(cwd), *inner]
    if env:
        for key in env:
            if not key.isidentifier() or not key.isascii():
                raise ValueError(f"environment variable name {key!r} is not a valid name")
        env_input(env)  # a value no environment can hold is refused here, before anything runs
        inner = ["sh", "-c", _ENV_PRELUDE, "sh", *inner]  # the values come on stdin (env_input)
    inner = ["timeout", "-k", f"{KILL_AFTER:g}", f"{timeout:g}", *inner]
    line = shlex.join([*wrapper, *inner])
    if len(line.encode("utf-8")) > MAX_COMMAND_BYTES:
        raise ValueError(
            f"command line is {len(line.encode('utf-8'))} bytes, over {MAX_COMMAND_BYTES}: "
            "send large data as input= (stdin) instead"
        )
    return line


def describe_route(route: list["Host"], wrapper: bool = True) -> str:
    """'jump -> jump2 -> target [pct exec 200 --]', 'direct' or 'local'."""
    target = route[-1]
    if target.is_local:
        text = "local"
    else:
        text = " -> ".join(h.name for h in route) if len(route) > 1 else "direct"
    if wrapper and target.wrapper:
        text += f" [{shlex.join(target.wrapper)}]"
    return text


def not_found_hint(host: "Host", argv: list[str], stderr: str) -> str | None:
    """Why a command exited 126/127 (not found / not executable), in inventory terms:
    the container wrapper, the host's python, or the command itself."""
    text = stderr.strip()
    if not text:
        return None
    where = f"host '{host.name}'"
    if host.wrapper and host.wrapper[0] in text and ("not found" in text or "No such file" in text):
        return (f"the container wrapper `{shlex.join(host.wrapper)}` does not run on the host: check `wrapper:` "
                f"for {where} (is the container tool installed, the container running?)")
    command = str(argv[0]) if argv else ""
    if command and command == host.python and command in text:
        return (f"python `{command}` is not found inside {where}'s "
                f"{'container' if host.wrapper else 'login'}: set `python:` for {where} to an interpreter "
                "that exists there (the one with torch)")
    if command and command in text:
        return f"`{command}` is not installed on {where} (or not on the PATH of its {'container' if host.wrapper else 'login shell'})"
    return None
