"""The status console driven headless (Textual's Pilot) over real SQLite stores
(tests/harness/scenes.py): an app at the scenes' fixed clock, waits on what it has
drawn (never a fixed sleep), and the text of its screen."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from dflashctl.core import contract
from dflashctl.store import Store
from tests.harness.scenes import DEMO, NOW
from tests.harness.waiting import time_scale


def app_for(store: Store, root: Path, **kw):
    from dflashctl.tui.app import StatusApp

    kw.setdefault("interval", 600)  # refreshes are driven by the tests
    kw.setdefault("clock", lambda: NOW)
    kw.setdefault("probe_unsupervised", False)  # the scenes' hosts exist only in the store
    return StatusApp(store.path, playbooks_dir=str(root / "playbooks"), **kw)


async def until(pilot, predicate, what: str, timeout: float = 20.0):
    """Let the app run until ``predicate()`` holds; ``timeout`` is the deadline on an
    idle machine, stretched by the load (tests/harness/waiting.py)."""
    start = time.monotonic()
    while not predicate():
        waited = time.monotonic() - start
        if waited > timeout and waited > timeout * time_scale():
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.05)


async def loaded(pilot, app, after: int = 0) -> None:
    """Wait until the app has shown a store read newer than ``after``."""
    try:
        await until(pilot, lambda: app.loads > after, "the status app to show the store")
    except AssertionError:
        raise AssertionError("the status app never showed the store") from None
    await pilot.pause()


async def detail_loaded(pilot, app) -> None:
    """Until the run's detail screen is up with its first load drawn."""
    from dflashctl.tui.screens import DetailScreen

    await until(pilot, lambda: isinstance(app.screen, DetailScreen) and app.screen.loads, "the detail")


async def log_open(pilot, app, lines: int) -> None:
    """`l` on the loaded screen, until the log tab shows ``lines`` lines."""
    from dflashctl.tui.screens import DetailScreen

    await loaded(pilot, app)
    await pilot.press("l")
    await until(pilot, lambda: isinstance(app.screen, DetailScreen) and app.screen.log_lines >= lines, "the log")


def screen_text(app) -> str:
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


def run(coro) -> None:
    asyncio.run(coro)


def cell(app, run_id: str, key: str) -> str:
    return str(app.query_one("#runs").get_cell(run_id, key))


def run_with_log(tmp_path: Path, lines: list[str]) -> tuple[Store, Path]:
    """A store with one run on this machine whose trainer log holds ``lines``."""
    store = Store(str(tmp_path / "runs.db"))
    run_dir = tmp_path / "work" / "runs" / DEMO
    run_dir.mkdir(parents=True)
    (run_dir / contract.LOG_FILE).write_text("".join(f"{line}\n" for line in lines))
    store.create_run("demo", "local", {}, NOW - 60, run_id=DEMO, run_dir=str(run_dir))
    return store, run_dir
