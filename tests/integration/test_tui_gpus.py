"""The GPU pane as nvitop shows a host: every GPU of each host the runs use (idle
ones dimmed, not only those a run holds), each GPU's compute processes with the
run's trainer named and any other process marked foreign, and the age of each
reading, red past three polls. Over real SQLite stores and real nvidia-smi
captures (tests/fixtures/nvidia-smi)."""

from __future__ import annotations

import pytest

from dflashctl.status.model import load_status
from dflashctl.tui.text import gpu_text
from tests import harness
from tests.harness.scenes import INTERVAL, NOW, PROD, host_store, utc
from tests.harness.tui import app_for, loaded, run, screen_text

CAPTURES = harness.FIXTURES / "nvidia-smi"


@pytest.fixture(autouse=True)
def _utc():
    utc()


def test_every_gpu_of_the_host_with_its_processes_idle_ones_dimmed(tmp_path):
    store = host_store(tmp_path, observed_ago=5.0)
    (host,) = load_status(store, NOW).hosts
    assert [g.index for g in host.gpus] == list(range(8))
    assert [g.index for g in host.gpus if g.idle] == [2, 3, 4, 6, 7]
    text = gpu_text(load_status(store, NOW).hosts, 160, NOW)
    lines = text.plain.splitlines()
    assert any("pid    4343" in line and f"trainer of {PROD}" in line for line in lines)
    assert any("pid     777" in line and "foreign" in line for line in lines)
    idle_row = next(line for line in lines if line.startswith("  3 "))
    start = text.plain.index(idle_row)
    assert any("dim" in str(span.style) and span.start <= start < span.end for span in text.spans)

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(200, 60)) as pilot:
            await loaded(pilot, app)
            shown = screen_text(app)
            assert "foreign" in shown and "trainer of" in shown and "idle" in shown

    run(scenario())


def test_a_reading_older_than_three_polls_is_red_with_its_age(tmp_path):
    for ago, red in ((5.0, False), (3 * INTERVAL + 5, True)):
        store = host_store(tmp_path / str(ago), observed_ago=ago)
        text = gpu_text(load_status(store, NOW).hosts, 160, NOW)
        row = next(line for line in text.plain.splitlines() if line.startswith("  0 "))
        age = "5s" if not red else "50s"
        at = text.plain.index(row) + row.index(f" {age} ") + 1
        styles = [str(s.style) for s in text.spans if s.start <= at < s.end]
        assert any("red" in s for s in styles) == red, (age, styles)
