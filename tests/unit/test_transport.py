"""The command line a transport sends a host, built in process: one shell word per
argument after the wrapper, environment and working directory passed as data,
bad names and oversized commands refused. (Against real sshd hosts:
tests/integration/test_transport.py.)"""

from __future__ import annotations

import shlex

import pytest

from dflashctl.hosts.transport import (
    KILL_AFTER,
    command_line,
)
from dflashctl.hosts.transport.command import env_input


def test_command_line_is_one_shell_word_per_argument_after_the_wrapper():
    line = command_line(["printf", "%s", "a b", "$(x)"], wrapper=["pct", "exec", "200", "--"], timeout=5)
    assert shlex.split(line) == ["pct", "exec", "200", "--", "timeout", "-k", f"{KILL_AFTER:g}", "5", "printf", "%s", "a b", "$(x)"]


def test_command_line_passes_env_on_stdin_and_cwd_as_data():
    line = command_line(["ls"], timeout=1.5, env={"K": "v $(x)"}, cwd="~/my dir")
    words = shlex.split(line)
    assert words[:6] == ["timeout", "-k", f"{KILL_AFTER:g}", "1.5", "sh", "-c"] and words[7] == "sh"
    assert words[8:10] == ["sh", "-c"] and words[11:] == ["sh", "~/my dir", "ls"]
    assert "v $(x)" not in line  # the value goes on stdin: a host's ps shows every argument to every user
    assert env_input({"K": "v $(x)"}) == b"K=v $(x)\n\n"


def test_env_values_with_a_newline_or_backslash_are_escaped_and_a_nul_refused():
    assert env_input({"A": "x\ny", "B": "a\\b", "C": "ü"}) == b"b A=x\\0012y\nb B=a\\0134b\nC=\xc3\xbc\n\n"
    assert env_input({}) == b""
    with pytest.raises(ValueError, match="NUL"):
        command_line(["true"], timeout=1, env={"K": "a\0b"})


def test_command_line_refuses_bad_env_names_and_oversized_commands():
    with pytest.raises(ValueError, match="not a valid name"):
        command_line(["true"], timeout=1, env={"A=B": "x"})
    with pytest.raises(ValueError, match="input="):
        command_line(["echo", "x" * 130_000], timeout=1)
    with pytest.raises(ValueError, match="more than 0"):
        command_line(["true"], timeout=0)  # coreutils `timeout 0` would mean no limit at all
    # A command named A=B is just a command: env(1), which took it for a variable, is gone.
    assert shlex.split(command_line(["A=B", "x"], timeout=1, env={"K": "v"}))[-2:] == ["A=B", "x"]
