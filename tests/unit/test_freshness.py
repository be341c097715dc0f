"""Freshness as a table: (run, heartbeats, newest sample, now) -> supervised? live? the note and the fix."""

from __future__ import annotations

import pytest

from dflashctl.status.freshness import freshness
from dflashctl.store import Run, Sample

NOW = 1_800_000_000.0


def run(state: str = "running") -> Run:
    return Run(id="r1", playbook="pb", host="gpu1", state=state, created=NOW - 3600, updated=NOW - 600)


def beat(last_tick: float, *, runs=("r1",), last_ok: float | None = None, down_since: float | None = None,
         stopped: float | None = None, interval: float = 15.0, error: str | None = None) -> dict:
    return {"id": "x", "pid": 4242, "host": "here", "interval": interval, "last_tick": last_tick, "runs": list(runs),
            "stopped": stopped,
            "hosts": {"gpu1": {"last_ok": last_ok, "down_since": down_since, "error": error}}}


SAMPLE = Sample(id=1, run_id="r1", time=NOW - 30, step=10, observed=NOW - 20)

CASES = [
    # id, run state, heartbeats, supervised, live, note starts with, fix
    ("live", "running", [beat(NOW - 5, last_ok=NOW - 5)], True, True, "", None),
    ("no-supervisor-ever", "running", [], False, False, "unsupervised since 10 m ago", "dflashctl watch r1"),
    ("supervisor-killed", "running", [beat(NOW - 300, last_ok=NOW - 300)], False, False,
     "unsupervised since 5 m ago", "dflashctl watch r1"),
    ("supervisor-stopped", "running", [beat(NOW - 5, last_ok=NOW - 5, stopped=NOW - 5)], False, False,
     "unsupervised since", "dflashctl watch r1"),
    ("watches-others", "running", [beat(NOW - 5, runs=("r2",), last_ok=NOW - 5)], False, False, "unsupervised", None),
    ("host-down", "running", [beat(NOW - 5, last_ok=NOW - 200, down_since=NOW - 120, error="connection refused")],
     True, False, "host gpu1 unreachable since 2 m ago: connection refused", None),
    ("host-silent", "running", [beat(NOW - 5, last_ok=NOW - 100)], True, False, "last answer from host gpu1", None),
    ("not-yet-answered", "launching", [beat(NOW - 5)], True, False, "no answer from its host yet", None),
    ("finished", "done", [], False, False, "", None),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_freshness(case):
    _, state, beats, supervised, live, note, fix = case
    f = freshness(run(state), beats, SAMPLE, NOW)
    assert (f.supervised, f.live) == (supervised, live)
    assert f.note.startswith(note)
    if fix is not None or not supervised and state != "done":
        assert f.fix == (fix or "dflashctl watch r1")
    assert f.data_time == NOW - 20 and f.data_age_s == 20.0


def test_the_newest_of_several_supervisors_counts():
    old, new = beat(NOW - 900, last_ok=NOW - 900), beat(NOW - 2, last_ok=NOW - 2)
    assert freshness(run(), [old, new], None, NOW).live
    assert freshness(run(), [new, old], None, NOW).live
    assert freshness(run(), [old], None, NOW).data_age_s is None


def test_a_time_ahead_of_this_clock_is_said_so_never_negative():
    f = freshness(run(), [beat(NOW + 3600, last_ok=NOW + 3600, stopped=NOW + 3600)], None, NOW)
    assert "ahead of this clock" in f.note and "-" not in f.note.split("since")[1].split("ahead")[0]
