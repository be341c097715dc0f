"""User text inside Rich markup renders as given, control characters made visible.
(Every command that shows user text, run for real: tests/integration/test_markup.py.)"""

from __future__ import annotations

import io
import re

from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from dflashctl.commands._app import escape, printable
from tests import harness

REPO = harness.REPO


ANSI = "\x1b[31m"


HOSTILE = ["[/x]", "[bold]loud[/bold]", "a]b[c", "/usr/sbin/[pct]", f"{ANSI}red", "back\\[x]", "\\[x", "x\\", ":smile:"]


CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _render(markup: str) -> str:
    console = Console(file=io.StringIO(), width=10**5, emoji=False, color_system=None, highlight=False,
                      soft_wrap=True)
    console.print(markup, end="")
    return console.file.getvalue()


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.text(alphabet=st.characters(blacklist_characters="\t")),
                 st.text(alphabet=st.sampled_from(list("[]/\\ab:#@=\n\x1b\r\x9b\u202e")))))
def test_escaped_text_renders_as_given_with_control_characters_made_visible(text):
    rendered = _render(f"[bold]{escape(text)}[/] tail")  # inside markup of our own
    assert rendered == printable(text) + " tail"
    assert not CONTROL.search(rendered) and "\u202e" not in rendered


def test_printable_keeps_text_and_lines_and_shows_controls():
    assert printable("a [/x] b\n\tc") == "a [/x] b\n\tc"
    assert printable(f"{ANSI}red\x1b[0m\r\x07") == "\\x1b[31mred\\x1b[0m\\x0d\\x07"
    assert printable("\x9b2J \u202egnp.exe") == "\\x9b2J \\u202egnp.exe"
