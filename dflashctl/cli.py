"""The `dflashctl` command line: thin commands over library functions.

Each command module under ``dflashctl/commands/`` registers its commands on
``app``. A command parses options, calls one library function, and turns a
``DflashError`` into a clean message (tracebacks only with DFLASHCTL_DEBUG=1).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Optional

import typer
from rich.console import Console

from dflashctl.errors import DflashError

app = typer.Typer(
    name="dflashctl",
    help=(
        "Deploy, supervise and record DFlash drafter training runs on GPU hosts "
        "reached over SSH (jump hosts and container wrappers included)."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # help paragraphs are reflowed; `code` renders as code
)

def _console(stderr: bool = False) -> Console:
    """A console that does not fold long lines at 80 columns when piped to a file or a
    pager: logs and tables stay one line per record (COLUMNS still wins)."""
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() or os.environ.get("COLUMNS") else 200
    return Console(stderr=stderr, width=width)


err = _console(stderr=True)
out = _console()


@dataclass
class Globals:
    inventory: Optional[str] = None
    playbooks: Optional[str] = None


G = Globals()


@app.callback()
def _global_options(
    inventory: Optional[str] = typer.Option(
        None,
        "--inventory",
        "-i",
        envvar="DFLASHCTL_INVENTORY",
        help="Inventory file (hosts). Default: ./inventory.yaml, then the per-user config directory.",
    ),
    playbooks: Optional[str] = typer.Option(
        None,
        "--playbooks",
        "-p",
        envvar="DFLASHCTL_PLAYBOOKS",
        help="Directory of playbooks (runs). Default: ./playbooks, then the per-user config directory.",
    ),
) -> None:
    G.inventory = inventory
    G.playbooks = playbooks


def fail(error: DflashError) -> "typer.Exit":
    """Print an error the way users should see it and return the Exit to raise."""
    err.print(f"[bold red]error:[/] {error}", highlight=False, markup=True, soft_wrap=True)
    if getattr(error, "hint", None):
        err.print(f"[yellow]hint:[/] {error.hint}", highlight=False)
    return typer.Exit(error.exit_code)


def _load_commands() -> None:
    from dflashctl import commands  # noqa: F401  (registers every command on `app`)


def main() -> None:
    _load_commands()
    try:
        app()
    except DflashError as e:
        if os.environ.get("DFLASHCTL_DEBUG"):
            raise
        raise SystemExit(fail(e).exit_code) from None
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
