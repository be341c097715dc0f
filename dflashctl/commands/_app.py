"""What every command shares: the typer ``app`` they register on, the global
options (``G``), the ``out`` / ``err`` consoles, ``fail`` (an error as users see
it), ``parse_duration_option`` (one duration syntax for every option), and how
user data reaches a terminal: ``escape`` (inside Rich markup) and ``printable``
(printed as plain text).

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
from typing import TYPE_CHECKING, Optional

import typer

from dflashctl.core.errors import DflashError
from dflashctl.core.terminal import printable

if TYPE_CHECKING:
    from rich.console import Console

app = typer.Typer(
    name="dflashctl",
    help=(
        "Deploy, supervise and record DFlash drafter training runs on GPU hosts "
        "reached over SSH (jump hosts and container wrappers included).\n\n"
        "Start with: dflashctl launch demo, then dflashctl status. Every command has -h / --help "
        "with an example. Durations are seconds or a number with s, m, h or d (30s, 5m, 1h30m). "
        "Shell completion: dflashctl --install-completion (docs/commands.md, Shell completion)."
    ),
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion (bash, zsh, fish)
    pretty_exceptions_enable=False,
    # Plain help: Rich help loads Markdown and table rendering (~100 ms at every start).
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 120},
)


def _value_names() -> None:
    """Help names an option's value by its metavar or its own name in capitals
    (``--interval DURATION``, ``--lines LINES``), and arguments by their names
    (``RUN``), as argparse and click do; typer 0.29 prints the Python annotation
    instead (``<bool>``, ``<list[str]>``, ``{run}``). Flags take no value and show none."""
    from typer import core

    def option_value(self, ctx):
        if self.metavar is not None:
            return self.metavar
        desc = self.type_descriptor
        if desc.is_choice and desc.choices:
            return "[" + "|".join(str(getattr(c, "value", c)) for c in desc.choices) + "]"
        return (self.name or "value").upper() + ("..." if self.nargs != 1 or desc.is_list else "")

    def argument_usage(self):
        if self.metavar:  # as written: "[HOST]...", "PLAYBOOK|HOST"
            return self.metavar
        name = (self.name or "arg").upper()
        return (name if self.required else f"[{name}]") + ("..." if self.nargs != 1 else "")

    if hasattr(core.TyperOption, "display_type_rich") and hasattr(core.TyperArgument, "_usage_display_name"):
        core.TyperOption.display_type_rich = option_value
        core.TyperArgument.display_type_rich = lambda self, ctx: None
        core.TyperArgument._usage_display_name = argument_usage
        core.TyperArgument._rich_display_name = lambda self: (self.metavar or self.name or "arg").upper()


_value_names()


def _coerce_on_demand() -> None:
    """typer 0.29 builds a pydantic TypeAdapter for each parameter as it reads it, even
    for an option not given (None) or a plain text value, and importing pydantic is a
    fifth of a command's start-up. Those two cases need no adapter; any other value
    gets typer's own coercion, built on first use."""
    from typer import core

    build = getattr(core, "build_runtime_param", None)
    if build is None:
        return

    class OnDemand:
        def __init__(self, descriptor):
            self.descriptor, self.built = descriptor, None

        def coerce(self, value, param, ctx):
            many = param.multiple or param.nargs == -1
            if value is None:
                return () if many else None
            info = self.descriptor.parameter_info
            if not many and isinstance(value, str) and self.descriptor.annotation is str and info.parser is None \
                    and getattr(info, "click_type", None) is None:
                return value
            if self.built is None:
                self.built = build(self.descriptor)
            return self.built.coerce(value, param, ctx)

    core.build_runtime_param = OnDemand


_coerce_on_demand()


def parse_duration_option(value: str | float, option: str) -> float:
    """A duration given on the command line, in seconds: plain seconds (5, 0.5) or a
    number with s, m, h or d (30s, 5m, 1h30m), the syntax playbooks use."""
    try:
        return float(value)
    except (TypeError, ValueError):
        pass
    from dflashctl.core.errors import ConfigError
    from dflashctl.core.units import DURATION_HELP, parse_duration  # the playbooks' parser, only when a unit is given

    try:
        return parse_duration(value)
    except ValueError:
        raise ConfigError(f"{option}: {value!r} is not a duration", hint=DURATION_HELP) from None


def _console(stderr: bool = False) -> "Console":
    """A console that does not fold long lines at 80 columns when piped to a file or a
    pager: logs and tables stay one line per record (COLUMNS still wins)."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() or os.environ.get("COLUMNS") else 200
    # emoji=False: ':name:' in user text stays text.
    return Console(stderr=stderr, width=width, emoji=False)


class _FirstUse:
    """``out`` / ``err``: the console is made on first use (Rich's console is a fifth
    of the start-up of a command that prints nothing, such as ``--help``)."""

    def __init__(self, stderr: bool) -> None:
        self._stderr = stderr
        self._console: "Console | None" = None

    def __getattr__(self, name: str):
        if self._console is None:
            self._console = _console(self._stderr)
        return getattr(self._console, name)


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


def stream_width(stream=None) -> int | None:
    """The width a stream's records are cut to, so that each stays one line on the
    screen: COLUMNS when set, else the terminal's; None (whole lines) when the
    stream is piped to a file or a program (``grep`` sees every record whole)."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    stream = stream or sys.stdout
    try:
        if stream.isatty():
            return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):
        pass
    return None


err = _FirstUse(stderr=True)
out = _FirstUse(stderr=False)


@dataclass
class Globals:
    inventory: Optional[str] = None
    playbooks: Optional[str] = None


G = Globals()


def _version(value: bool) -> None:
    if value:
        from dflashctl import __version__

        print(f"dflashctl {__version__}")
        raise typer.Exit()


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
    version: bool = typer.Option(False, "--version", "-V", is_eager=True, callback=_version,
                                 help="Print the version and exit."),
) -> None:
    G.inventory = inventory
    G.playbooks = playbooks


def fail(error: DflashError) -> "typer.Exit":
    """Print an error the way users should see it and return the Exit to raise."""
    from rich.text import Text

    err.print(Text.assemble(("error:", "bold red"), " ", printable(error)), highlight=False, soft_wrap=True)
    if getattr(error, "hint", None):
        err.print(Text.assemble(("hint:", "yellow"), " ", printable(error.hint)), highlight=False, soft_wrap=True)
    return typer.Exit(error.exit_code)
