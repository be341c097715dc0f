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


def test_command_line_is_one_shell_word_per_argument_after_the_wrapper():
    line = command_line(["printf", "%s", "a b", "$(x)"], wrapper=["pct", "exec", "200", "--"], timeout=5)
    assert shlex.split(line) == ["pct", "exec", "200", "--", "timeout", "-k", f"{KILL_AFTER:g}", "5", "printf", "%s", "a b", "$(x)"]


def test_command_line_passes_env_and_cwd_as_data():
    line = command_line(["ls"], timeout=1.5, env={"K": "v $(x)"}, cwd="~/my dir")
    words = shlex.split(line)
    assert words[:5] == ["timeout", "-k", f"{KILL_AFTER:g}", "1.5", "env"]
    assert words[5] == "K=v $(x)"
    assert words[6:8] == ["sh", "-c"] and words[9:] == ["sh", "~/my dir", "ls"]


def test_command_line_refuses_bad_env_names_and_oversized_commands():
    with pytest.raises(ValueError, match="not a valid name"):
        command_line(["true"], timeout=1, env={"A=B": "x"})
    with pytest.raises(ValueError, match="input="):
        command_line(["echo", "x" * 130_000], timeout=1)
    with pytest.raises(ValueError, match="more than 0"):
        command_line(["true"], timeout=0)  # coreutils `timeout 0` would mean no limit at all
    with pytest.raises(ValueError, match="cannot contain '='"):
        command_line(["A=B", "x"], timeout=1, env={"K": "v"})
