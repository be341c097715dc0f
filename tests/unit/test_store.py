"""Run ids: sortable, and valid tmux session names. (The store on a real SQLite
file: tests/integration/test_store.py.)"""

from __future__ import annotations

from dflashctl.store import new_run_id

T0 = 1_800_000_000.0


def test_run_ids_are_sortable_and_valid_tmux_names():
    rid = new_run_id("my.play book", 1795941300.0)
    assert rid.startswith("my-play-book-20261129-") and all(c.isalnum() or c in "-_" for c in rid)
