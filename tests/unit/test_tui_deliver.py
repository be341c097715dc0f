"""A worker that finishes after its screen is gone, or while the console quits, draws
nothing and takes nothing down (``widgets.deliver``). The console is a real textual app
run headless; the worker is a real thread held on an event so that the screen goes
before the worker ends, every time."""

from __future__ import annotations

import asyncio
import threading

from textual import work
from textual.app import App, ComposeResult
from textual.screen import Screen
from textual.widgets import Static

from dflashctl.tui.widgets import deliver
from tests.harness.tui import run


class Held(Screen):
    def __init__(self, release: threading.Event) -> None:
        super().__init__()
        self.release, self.drawn, self.finished = release, [], threading.Event()

    def compose(self) -> ComposeResult:
        yield Static(id="body")

    @work(thread=True)
    def read(self) -> None:
        app = self.app  # as the console's workers take it: while the screen is shown
        self.release.wait(30)
        deliver(self, self.draw, "late")
        deliver(app, app.notify, "late")
        self.finished.set()

    def draw(self, text: str) -> None:
        self.query_one("#body", Static).update(text)
        self.drawn.append(text)


class Console(App):
    def __init__(self, release: threading.Event | None = None) -> None:
        super().__init__()
        self.release = release

    def compose(self) -> ComposeResult:
        yield Static("main")

    def on_unmount(self) -> None:
        if self.release is not None:  # the console is quitting: now its held worker ends
            self.release.set()


async def _settle(pilot, event: threading.Event) -> None:
    for _ in range(300):
        if event.is_set():
            return
        await pilot.pause(0.05)
    raise AssertionError("the worker did not finish")


def test_a_worker_that_ends_after_its_screen_was_popped_draws_nothing_and_the_console_lives():
    async def scenario():
        release = threading.Event()
        app = Console()
        async with app.run_test() as pilot:
            held = Held(release)
            await app.push_screen(held)
            held.read()
            await pilot.pause(0.1)
            app.pop_screen()
            await pilot.pause(0.1)
            release.set()
            await _settle(pilot, held.finished)
            await pilot.pause(0.1)
            assert held.drawn == []  # its screen was gone: nothing drawn on it
            assert [n.message for n in app._notifications] == ["late"]  # the app still took its note
            assert app.is_running and app._exception is None
            # A screen still shown gets what its worker delivers.
            shown = Held(threading.Event())
            await app.push_screen(shown)
            shown.release.set()
            shown.read()
            await _settle(pilot, shown.finished)
            await pilot.pause(0.1)
            assert shown.drawn == ["late"]

    run(scenario())


def test_a_worker_that_ends_while_the_console_quits_raises_nothing():
    release = threading.Event()
    held = Held(release)

    async def scenario():
        app = Console(release)
        async with app.run_test() as pilot:  # re-raises what a worker raised as the app shut down
            await app.push_screen(held)
            held.read()
            await pilot.pause(0.1)
        return app

    app = asyncio.run(scenario())
    assert held.finished.wait(30), "the worker raised instead of finishing"
    assert held.drawn == [] and app._exception is None
