"""Operator values checked before anything runs: run.sh's comment lines never carry
a newline, a host value with a control character is refused naming it. (Through
the sshd harness: tests/integration/test_operator_values.py.)"""

from __future__ import annotations

import pytest
import yaml

from dflashctl.config import load_inventory
from dflashctl.core.errors import ConfigError
from dflashctl.runs.runhost import render_run_script


def test_run_sh_comment_lines_never_carry_a_newline():
    script = render_run_script("r1\nid", "/runs/r1", "python3", {}, None, "r1\ntouch /tmp/x", "dflash")
    assert "touch /tmp/x" not in [line.strip() for line in script.splitlines()]
    assert script.splitlines()[1] == "# dflashctl run r1\\nid: runs in tmux session r1\\ntouch /tmp/x (tmux -L dflash)."


@pytest.mark.parametrize("key, value", [
    ("workdir", "/data/work\nrest"),
    ("workdir", "~/work\tx"),
    ("python", "/usr/bin/python3\n"),
    ("wrapper", ["pct", "exec", "200\n", "--"]),
])
def test_a_host_value_with_a_control_character_is_refused_naming_it(tmp_path, key, value):
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump({"hosts": {"gpu1": {"address": "127.0.0.1", key: value}}}))
    with pytest.raises(ConfigError) as caught:
        load_inventory(str(path))
    text = str(caught.value)
    assert f"hosts.gpu1.{key}" in text and "contains a control character" in text, text
    assert "remove it" in text
