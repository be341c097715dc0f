"""The command line as tests run it.

``invoke`` runs ``dflashctl ARGS`` in this process: ``dflashctl.cli.main`` inside
click's ``CliRunner`` isolation (stdin, stdout and stderr captured apart and not a
terminal, as when piped; the environment and the working directory the call
names). It is what a test of a command's output or exit code uses: the same
messages, tables and exit codes as a process, without an interpreter start-up
per call. ``run`` and ``popen`` start a real ``python -m dflashctl`` process, for
what only a process shows: signals, a terminal, the imports a command's start
pays, the exit status the interpreter returns.

Both return a ``subprocess.CompletedProcess`` (``returncode``, ``stdout``,
``stderr``: text). ``env`` adds variables to this process's environment (a value
of None removes one); ``columns`` sets COLUMNS (None: removed, as a pipe has none).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping

REPO = Path(__file__).resolve().parents[2]
PROG = "dflashctl"
_UNSET = object()


def _changes(env: Mapping[str, str | None] | None, columns) -> dict[str, str | None]:
    changes = dict(env or {})
    if columns is not _UNSET:
        changes["COLUMNS"] = None if columns is None else str(columns)
    return changes


def environment(env: Mapping[str, str | None] | None = None, columns=_UNSET) -> dict[str, str]:
    """This process's environment with ``env`` (and COLUMNS) applied: a child's."""
    full = dict(os.environ)
    for name, value in _changes(env, columns).items():
        if value is None:
            full.pop(name, None)
        else:
            full[name] = value
    return full


def argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "dflashctl", *map(str, args)]


def run(*args: str, env: Mapping[str, str | None] | None = None, columns=_UNSET, cwd=REPO, timeout: float = 120,
        input: str | None = None) -> subprocess.CompletedProcess:
    """``python -m dflashctl ARGS`` as a real process, its output captured."""
    return subprocess.run(argv(*args), capture_output=True, text=True, env=environment(env, columns), cwd=str(cwd),
                          timeout=timeout, input=input)


def popen(*args: str, env: Mapping[str, str | None] | None = None, columns=_UNSET, cwd=REPO,
          **kwargs) -> subprocess.Popen:
    """``python -m dflashctl ARGS`` started as a real process (the caller ends it)."""
    return subprocess.Popen(argv(*args), env=environment(env, columns), cwd=str(cwd), **kwargs)


@contextlib.contextmanager
def _own_pool():
    """The command's ssh connections in a pool of its own, closed when it returns, as
    its process would close them at exit; the test's own connections are not touched."""
    from dflashctl.hosts.transport import pooled, ssh

    pool, saved = ssh.Pool(), (ssh.default_pool, pooled.default_pool)
    ssh.default_pool = pooled.default_pool = pool
    try:
        yield
    finally:
        ssh.default_pool, pooled.default_pool = saved
        pool.close()


@contextlib.contextmanager
def _chdir(path):
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


class _Called:
    """The app, called with these arguments and the installed command's name."""

    def __init__(self, app, args: list[str]):
        self._app, self._args = app, args

    def __call__(self):
        return self._app(args=self._args, prog_name=PROG)

    def __getattr__(self, name: str):
        return getattr(self._app, name)


def _help_width(changes: Mapping[str, str | None]) -> int:
    """The width click folds help at in a process whose output is piped (its terminal
    size is COLUMNS, else 80), within the app's max_content_width."""
    columns = changes.get("COLUMNS", os.environ.get("COLUMNS"))
    terminal = int(columns) if columns and columns.isdigit() and int(columns) > 0 else 80
    return max(min(terminal, 120) - 2, 50)


def invoke(*args: str, env: Mapping[str, str | None] | None = None, columns=_UNSET, cwd=None,
           input: str | None = None) -> subprocess.CompletedProcess:
    """``dflashctl ARGS`` in this process (see the module docstring)."""
    from click import formatting
    from click.testing import CliRunner

    from dflashctl import cli
    from dflashctl.commands import _app

    changes = _changes(env, columns)
    app = cli.app
    code: int = 0
    with contextlib.ExitStack() as stack:
        out, err, _ = stack.enter_context(CliRunner().isolation(input=input, env=changes))
        stack.enter_context(_own_pool())
        if cwd is not None:
            stack.enter_context(_chdir(cwd))
        if "TZ" in changes:  # a process reads TZ at its start; this one is told now, and again after
            stack.callback(time.tzset)
            time.tzset()
        formatting.FORCED_WIDTH = _help_width(changes)  # the isolation forces 80; a piped process computes it
        # The consoles are made on first use with the width and terminal of that moment:
        # a process makes them afresh, and so does each call here.
        _app.out._console = _app.err._console = None
        # main() calls app() with the process's argv; here the arguments and the name
        # the command line has when installed are passed to the same app.
        cli.app = _Called(app, [str(a) for a in args])
        try:
            cli.main()
        except SystemExit as e:
            if isinstance(e.code, str):
                sys.stderr.write(e.code + "\n")
                code = 1
            else:
                code = e.code or 0
        finally:
            cli.app = app
            _app.out._console = _app.err._console = None
            sys.stdout.flush()
            sys.stderr.flush()
        stdout, stderr = out.getvalue(), err.getvalue()
    return subprocess.CompletedProcess([PROG, *map(str, args)], code, stdout.decode("utf-8", "replace"),
                                       stderr.decode("utf-8", "replace"))


def status(store_path: str, *args: str, columns: int | None = 220, tz: str = "UTC") -> subprocess.CompletedProcess:
    """``dflashctl status ARGS`` over the store at ``store_path``, in this process, at
    ``columns`` wide, clock times in zone ``tz``."""
    return invoke("status", *args, env={"DFLASHCTL_STORE": str(store_path), "TZ": tz}, columns=columns)
