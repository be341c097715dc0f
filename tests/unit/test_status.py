"""`status`'s pure parts: the spark, smoothing, columns by width, one duration
syntax, and every command's help page (in process: tests/harness/cli.py). (The
views over real stores: tests/integration/test_status.py; the start-up imports of
the command as a process: tests/e2e/test_status.py.)"""

from __future__ import annotations

import re
import subprocess

import pytest

from dflashctl.core.errors import ConfigError
from dflashctl.status.model import (
    current_process,
    select_columns,
    smooth,
    spark,
)
from dflashctl.store import Sample
from tests.harness import cli as dflashctl
from tests.harness.scenes import NOW


def _sample(t: float, step: int, tok_s: float = 1000.0, eta: float | None = None) -> Sample:
    return Sample(id=0, run_id="r", time=t, step=step, tok_s=tok_s, eta_s=eta, phase="training", observed=t)


def _dflashctl(*args: str, **env: str) -> subprocess.CompletedProcess:
    """The command in this process, at 120 columns (tests/harness/cli.py)."""
    return dflashctl.invoke(*args, env=env, columns=120)


def test_spark_is_scaled_from_zero():
    """Defect: sparklines scaled per run exaggerated noise (12.0 vs 12.7 Ktok/s drawn
    as an empty and a full bar)."""
    assert spark([]) == "" and spark([5.0, 5.0]) == "██"
    assert spark([12000.0, 12700.0]) == "██"
    assert spark([0.0, 6.0, 12.0]) == "▁▅█"
    assert spark([12000.0, 12700.0], low=None) == "▁█"  # what per-run scaling drew
    assert spark([6000.0], high=12000.0) == "▅"  # half the baseline: half a bar
    assert spark(list(range(30)), width=4) == "▇███"


def test_eta_and_tok_s_are_smoothed():
    """Defect: the ETA jumped 2.7 m <-> 7.6 m within 5 s (the trainer's per-window
    estimate); it now comes from the step rate over the newest 5 minutes."""
    samples = [_sample(NOW - 300 + 5 * i, 100 + 10 * i, 1000.0 + (300 if i % 2 else -300),
                       eta=162 if i % 2 else 456) for i in range(61)]
    s = smooth(samples)
    assert s.steps_per_s == pytest.approx(2.0) and s.tok_s == pytest.approx(1000.0, rel=0.02)
    assert s.window_s == 300.0
    # After a restart (the step goes back to a checkpoint) only the new process counts.
    resumed = samples + [_sample(NOW + 5, 400), _sample(NOW + 10, 420)]
    assert [x.step for x in current_process(resumed)] == [400, 420]
    assert smooth(resumed).steps_per_s == pytest.approx(4.0)


def test_columns_are_chosen_by_width():
    for width in (60, 80, 100, 120, 160, 200, 300):
        columns = select_columns(width, gap=1)
        assert sum(c.width + 1 for c in columns) <= width, width
        assert [c.key for c in columns][:2] == ["run", "state"]
    keys80 = [c.key for c in select_columns(80, gap=1)]
    assert {"phase", "progress", "eta", "tok_s"} <= set(keys80)
    assert "last_event" in [c.key for c in select_columns(200)]
    assert select_columns(300)[-1].width == 60  # the last event never makes the table 312 columns wide


def test_help_pages_have_no_type_tags_and_an_example_each():
    """Defect: help pages showed Python type tags (`<bool>`, `<list[str]>`) and no example."""
    from dflashctl.cli import _load_commands
    from dflashctl.commands._app import app

    _load_commands()
    commands = sorted(c.name for c in app.registered_commands)
    assert len(commands) >= 12
    for command in commands:
        done = _dflashctl(command, "-h")
        assert done.returncode == 0, done.stderr
        text = done.stdout
        assert "Usage:" in text and "Examples:" in text and f"dflashctl {command}" in text, command
        assert not re.search(r"<(str|int|float|bool|list|path)[^>]*>|\{\w+\}", text), (command, text)
    status = _dflashctl("status", "--help").stdout
    assert "--interval DURATION" in status and "--json-schema" in status and "dflashctl status --once" in status
    top = _dflashctl("--help").stdout
    assert "-V, --version" in top and "--install-completion" in top and "30s, 5m" in top
    assert _dflashctl("--version").stdout.strip().startswith("dflashctl 0.")


def test_one_duration_syntax():
    from dflashctl.commands._app import parse_duration_option

    assert [parse_duration_option(v, "--x") for v in ("2", "0.5", "30s", "5m", "1h30m", 7)] == [2, 0.5, 30, 300, 5400, 7]
    with pytest.raises(ConfigError, match="--x: 'soon' is not a duration"):
        parse_duration_option("soon", "--x")
