"""Every `dflashctl ...` command in README.md and docs/*.md runs as shown.

The documents are read as text. Each invocation in a code block or an inline code
span is split into its global options, its subcommand (and a group's command,
`cache ls`) and the options it uses. Each is checked against the real command
line, in process: the subcommand exists and every option appears in its `--help`.
No subprocess, no host, no torch.

Placeholders stay as written (`RUN`, `PLAYBOOK|HOST`); only options are checked,
never their values. In a table a pipe is written `\\|`: it is read as `|`, so
`KEY|--all|--older-than 30d` checks `--all` and `--older-than`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pytest
from typer.testing import CliRunner

# The checkout: the nearest folder above this file with README.md and docs/ (a lane folder moves nothing).
ROOT = next(p for p in Path(__file__).resolve().parents if (p / "README.md").is_file() and (p / "docs").is_dir())
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# The program's name as a word: bare, or at the end of a path (.venv/bin/dflashctl),
# followed by a space; never a module path (dflashctl/core, dflashctl.cli).
INVOCATION = re.compile(r"(?:^|(?<=[\s/(]))dflashctl[ \t]+(?P<rest>[^\n]*)")
FENCE = re.compile(r"^(\s*)(```|~~~)")
INLINE = re.compile(r"(`+)(?P<code>.+?)\1")
OPTION = re.compile(r"^--?[A-Za-z][\w-]*")


@dataclass(frozen=True)
class Invocation:
    where: str  # FILE:LINE
    text: str  # the whole command as written, from `dflashctl` on

    def __str__(self) -> str:
        return f"{self.where}: {self.text}"


def _code_spans(text: str):
    """(line number, code) for every line of a fenced block and every inline code span."""
    fenced = None
    for number, line in enumerate(text.splitlines(), 1):
        fence = FENCE.match(line)
        if fence:
            if fenced is None:
                fenced = fence.group(2)
            elif fence.group(2) == fenced:
                fenced = None
            continue
        if fenced is not None:
            if not line.lstrip().startswith("#"):
                yield number, line.split(" #", 1)[0]  # a shell comment is no part of the command
        else:
            for span in INLINE.finditer(line):
                yield number, span.group("code")


def invocations() -> list[Invocation]:
    found = []
    for path in DOCUMENTS:
        text = path.read_text(encoding="utf-8")
        for number, code in _code_spans(text):
            code = code.replace("\\|", "|")
            for match in INVOCATION.finditer(code):
                if match.group("rest").strip():
                    found.append(Invocation(f"{path.relative_to(ROOT)}:{number}", "dflashctl " + match.group("rest").strip()))
    return found


# ---- the command line as its --help says it is


@lru_cache(maxsize=None)
def _help(path: tuple[str, ...]) -> str | None:
    """The --help text of the command at ``path`` (() for the program), or None
    when there is no such command."""
    from dflashctl import cli
    from dflashctl.commands._app import app

    cli._load_commands()
    result = CliRunner().invoke(app, [*path, "--help"])
    if result.exit_code != 0:
        return None
    return result.output


def _section(help_text: str, title: str) -> list[str]:
    lines, inside = [], False
    for line in help_text.splitlines():
        if line.strip() == title:
            inside = True
        elif inside and line and not line.startswith(" "):
            break  # the next section (Commands:, Examples:, ...)
        elif inside:
            lines.append(line)
    return lines


@lru_cache(maxsize=None)
def options_of(path: tuple[str, ...]) -> dict[str, bool]:
    """Each option of the command at ``path``: whether it takes a value.

    Read from the declaration lines of its help's Options section (two spaces in:
    `-n, --lines N`, `--readonly / --no-readonly`); a wrapped description is
    indented further and is not read."""
    options = {}
    for line in _section(_help(path) or "", "Options:"):
        if not re.match(r"^  -", line):
            continue
        declaration = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        parts = [part.split() for part in declaration.replace(" / ", ", ").split(", ")]
        takes_value = any(len(words) > 1 for words in parts)  # a metavar follows (`-n, --lines N`)
        for words in parts:
            if words and words[0].startswith("-"):
                options[words[0]] = takes_value
    return options


@lru_cache(maxsize=None)
def commands_of(path: tuple[str, ...]) -> frozenset[str]:
    """The commands of a group (the program, `cache`); empty for a command."""
    names = set()
    for line in _section(_help(path) or "", "Commands:"):
        if re.match(r"^  \S", line):
            names.add(line.split()[0])
    return frozenset(names)


# ---- reading one invocation


def _words(text: str) -> list[str]:
    """The invocation's words, alternatives (`a|b`) and brackets split apart."""
    words = []
    for word in text.split():
        for piece in re.split(r"[|\[\]()]", word):
            piece = piece.strip(",;:.'\"`")
            if piece:
                words.append(piece)
    return words


def problems(text: str) -> list[str]:
    """What in ``text`` (`dflashctl ...`) the command line does not have; [] when it runs as shown."""
    words = _words(text)[1:]
    path: tuple[str, ...] = ()
    said = []
    # global options, then the command (and a group's command), then its own options
    while words:
        word = words.pop(0)
        if word.startswith("-"):
            option = OPTION.match(word)
            name = option.group(0) if option else word
            known = options_of(path)
            if name not in known:
                said.append(f"`{' '.join(('dflashctl',) + path)}` has no option {name}")
            elif known[name] and "=" not in word and path == () and words:
                words.pop(0)  # a global option's value: `--inventory other.yaml hosts`
            continue
        group = commands_of(path)
        if not group:
            break  # the command is found; the rest are its arguments and options
        if word not in group:
            said.append(f"`{' '.join(('dflashctl',) + path)}` has no command {word!r} (it has: {', '.join(sorted(group))})")
            return said
        path += (word,)
    if path == () and not said and not any(w.startswith("-") for w in _words(text)[1:]):
        said.append("names no command")
    for word in words:
        option = OPTION.match(word)
        if option and option.group(0) not in options_of(path):
            said.append(f"`{' '.join(('dflashctl',) + path)}` has no option {option.group(0)}")
    return said


# ---- the tests


ALL = invocations()


def test_the_documents_show_commands():
    """The extraction finds the front door's commands (an empty list would pass everything)."""
    texts = " ".join(i.text for i in ALL)
    assert len(ALL) >= 20, [str(i) for i in ALL]
    for expected in ("dflashctl launch demo --foreground", "dflashctl status", "dflashctl env-audit"):
        assert expected in texts


@pytest.mark.parametrize("invocation", ALL, ids=[str(i) for i in ALL])
def test_command_runs_as_shown(invocation: Invocation):
    assert problems(invocation.text) == [], f"{invocation}"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("dflashctl launch demo --foreground", []),
        ("dflashctl cache rm KEY|--all|--older-than 30d", []),
        ("dflashctl --inventory other.yaml hosts", []),
        ("dflashctl logs RUN [-f] [-n N]", []),
        ("dflashctl lunch demo", ["has no command 'lunch'"]),
        ("dflashctl launch demo --foregrund", ["has no option --foregrund"]),
        ("dflashctl cache list", ["has no command 'list'"]),
        ("dflashctl --colour hosts", ["has no option --colour"]),
    ],
)
def test_the_checker_itself(text, expected):
    """A wrong command or option is caught, and a right one is not."""
    said = problems(text)
    assert len(said) == len(expected), said
    for problem, words in zip(said, expected):
        assert words in problem
