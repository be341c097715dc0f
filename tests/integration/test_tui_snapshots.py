"""SVG snapshots of the status console (pytest-textual-snapshot): each scene of
tests/harness/scenes.py (healthy, compiling, crashed and restarting, unreachable
host, unsupervised, stale data, no runs) at 80x24, 120x40 and 200x60, compared
with the files under tests/integration/__snapshots__/test_tui_snapshots/.

A change to what the console draws fails here; look at the report pytest writes
(snapshot_report.html), and if the new screen is right, accept it with
``pytest tests/integration/test_tui_snapshots.py --snapshot-update``.
"""

from __future__ import annotations

import pytest

from tests.harness.scenes import NOW, SCENES, build, utc

SIZES = [(80, 24), (120, 40), (200, 60)]


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
@pytest.mark.parametrize("scene", SCENES)
def test_scene(snap_compare, tmp_path, monkeypatch, scene, size):
    from dflashctl.tui.app import StatusApp

    utc()
    monkeypatch.chdir(tmp_path)  # the header names the store: 'runs.db', the same on every machine
    store = build(scene, tmp_path)
    app = StatusApp(store.path, interval=600, clock=lambda: NOW, playbooks_dir=str(tmp_path / "playbooks"),
                    probe_unsupervised=False)  # the scenes' hosts exist only in the store

    async def shown(pilot):
        # The scroll boxes' bars are not drawn here: where a pane overflows (80x24) the
        # thumb's size or place after the first draw was seen to vary with the machine's
        # load (the same text otherwise); the text is what these snapshots hold.
        for box in app.query("#run-box, #gpu-box"):
            box.styles.scrollbar_size_vertical = 0
        for _ in range(400):
            if app.loads:
                break
            await pilot.pause(0.05)
        await pilot.pause()

    assert snap_compare(app, terminal_size=size, run_before=shown)
