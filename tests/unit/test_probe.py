"""The probe's source and answer as values: Python 3.8 stdlib only, a malformed
answer is a value, a banner before the answer is skipped, the command's shape.
(The probe run for real: tests/integration/test_probe.py.)"""

from __future__ import annotations

import ast
import json
import sys

import pytest

from dflashctl.hosts.probe import (
    PROBE_SOURCE,
    ProbeArgs,
    ProbeError,
    parse_probe_output,
    probe_command,
)
from tests import harness

SMI = harness.FIXTURES / "nvidia-smi"
LOAD_UUID = "GPU-8a7820b2-30e1-7367-326a-a5d3dfe3b0fd"


# --------------------------------------------------------------------------- fixtures


def test_probe_source_is_python38_and_stdlib_only() -> None:
    tree = ast.parse(PROBE_SOURCE, feature_version=(3, 8))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported <= set(sys.stdlib_module_names)
    assert not any(isinstance(n, ast.ImportFrom) for n in ast.walk(tree))


@pytest.mark.parametrize(
    "stdout",
    ["", "bash: python3: command not found\n", '{"probe": 99, "runs": []}\n', '{"probe": 1, "runs": [{"x": 1}], "host_time": 1}\n',
     '{"probe": 1, "runs": [], "host_ti'],
    ids=["empty", "no-python", "other-version", "bad-run", "cut-short"],
)  # fmt: skip
def test_malformed_output_is_a_value(stdout: str) -> None:
    result = parse_probe_output(stdout)
    assert isinstance(result, ProbeError)
    assert result.message


def test_banner_before_the_result_is_ignored() -> None:
    out = json.dumps({"probe": 1, "runs": [{"run_dir": "/r", "errors": []}], "host_time": 5.0, "errors": []})
    [r] = parse_probe_output("Welcome to gpu1!\n{not the result}\n" + out + "\n")
    assert r.run_dir == "/r" and r.host_time == 5.0 and r.metrics_offset is None
    prev = ProbeArgs(run_dir="/r", metrics_offset=123)
    assert r.next_args(prev) == prev  # metrics unread this time: keep the offset


def test_probe_command_shape() -> None:
    # The inventory's `python` is split as the launcher splits it: a path with a space is quoted there.
    argv = probe_command("'/opt/py 3/bin/python3' -X utf8", [ProbeArgs(run_dir="~/dflash/runs/x", session="x")])
    assert argv[:6] == ["/opt/py 3/bin/python3", "-X", "utf8", "-I", "-S", "-c"] and argv[6] == PROBE_SOURCE
    assert json.loads(argv[7])[0]["run_dir"] == "~/dflash/runs/x"
