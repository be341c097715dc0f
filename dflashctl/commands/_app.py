"""What every command shares: the typer ``app`` they register on, the global
options (``G``), the ``out`` / ``err`` consoles, ``fail`` (an error as users see
it), and how user data reaches a terminal: ``escape`` (inside Rich markup) and
``printable`` (printed as plain text).

Everything a command prints that came from a user, a playbook, the store or a
host (names, paths, wrappers, run ids, messages, hints, log lines) goes through
one of the two (``printable`` text in a ``rich.text.Text``, which is never
parsed, where a line has no markup of its own): it is shown as given, never read as Rich markup (``[/x]`` would
crash the print, ``[red]`` would restyle it) and never handed to the terminal as
control characters (an ANSI escape sequence in a trainer's log must not recolour,
retitle or rewrite the operator's screen).

Each command module imports this, never ``dflashctl.cli`` (which imports the
command modules to register them). It holds no command, and must never import a
command module, ``dflashctl.cli``, or anything that reaches a host or the store:
it is the bottom of the command line.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from typing import Optional

import typer
from rich.console import Console
from rich.text import Text

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
    # emoji=False: ':name:' in user text stays text.
    return Console(stderr=stderr, width=width, emoji=False)


def _visible(char: str) -> str:
    return f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"


# C0 and C1 control characters (ESC starts ANSI sequences; 0x9b is a one-byte CSI)
# but newline and tab, and the invisible bidirectional overrides that reorder text.
_CONTROL = {
    code: _visible(chr(code))
    for code in [*range(0x20), *range(0x7F, 0xA0), 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
    if chr(code) not in "\n\t"
}


def printable(text: object) -> str:
    """User data as plain text for a terminal: control characters (ANSI escape
    sequences, carriage returns, bidirectional overrides) shown as ``\\x1b``-style
    escapes instead of being interpreted; newlines and tabs kept."""
    return str(text).translate(_CONTROL)


_BRACKET = re.compile(r"(\\*)\[")
_TAG = re.compile(r"\[[a-z#/@][^[]*?]")  # what Rich reads as a tag (rich.markup.RE_TAGS)
_TRAILING_BACKSLASHES = re.compile(r"\\+\Z")


def escape(text: object) -> str:
    """User data inside a Rich markup string that a tag may follow: ``printable``,
    and every ``[`` escaped so that it and the backslashes before it are shown as
    given. (``rich.markup.escape`` leaves a ``[`` that does not look like a tag, so
    a backslash before it is lost.) Lines without markup of their own are better
    built as ``rich.text.Text``, which is never parsed."""
    text = printable(text)

    def bracket(match: re.Match) -> str:
        n = len(match.group(1))
        # Before a tag Rich reads each pair of backslashes as one and an odd one as the
        # escape; elsewhere it drops the one backslash right before '['.
        return "\\" * (2 * n + 1 if _TAG.match(text, match.end() - 1) else n + 1) + "["

    text = _BRACKET.sub(bracket, text)
    # A tag after the text must stay a tag: its '[' would otherwise be escaped.
    return _TRAILING_BACKSLASHES.sub(lambda m: m.group(0) * 2, text)


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
    err.print(Text.assemble(("error:", "bold red"), " ", printable(error)), highlight=False, soft_wrap=True)
    if getattr(error, "hint", None):
        err.print(Text.assemble(("hint:", "yellow"), " ", printable(error.hint)), highlight=False, soft_wrap=True)
    return typer.Exit(error.exit_code)
