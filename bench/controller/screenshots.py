"""PNG screenshots of `dflashctl status` for docs/status.md: each layout (80x24, 120x40,
201x60) and a run's detail view, of the healthy scene of the console's tests
(an 8-GPU host with its CPU and memory line, a CPU demo run, a finished run).

    .venv/bin/python -m bench.controller.screenshots                  # writes docs/screenshots/*.png
    .venv/bin/python -m bench.controller.screenshots --out /tmp/shots --keep-svg

Each screen is Textual's own SVG export of the real console (``App.export_screenshot``
in a headless run), converted to PNG by ``rsvg-convert`` (Debian: ``apt-get install
librsvg2-bin``) or, without it, by cairosvg when it and its native library are
installed. The SVG names the Fira Code font; where it is not installed fontconfig
puts a proportional font in its place, so the SVG is given this machine's
monospace font (``--font``, default: what ``fc-match monospace`` names). A PNG over
``--max-kb`` is drawn again smaller. Not run by CI: run it after a change to the
screen, look at the pictures, commit them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from bench.common import REPO
from tests.harness.scenes import add_host_readings
from tests.harness.scenes import NOW, PROD, build, utc

LAYOUTS = [(80, 24), (120, 40), (201, 60)]
DETAIL_SIZE = (120, 40)


async def _shots(store_path: str, playbooks: str) -> dict[str, str]:
    """name -> SVG text of each screen."""
    from dflashctl.tui.app import StatusApp
    from dflashctl.tui.screens import DetailScreen

    def app() -> StatusApp:
        return StatusApp(store_path, interval=600, clock=lambda: NOW, playbooks_dir=playbooks,
                         probe_unsupervised=False)  # the scene's hosts exist only in the store

    async def until(pilot, ready, what: str) -> None:
        for _ in range(600):
            if ready():
                await pilot.pause(0.2)
                return
            await pilot.pause(0.05)
        raise SystemExit(f"the console never showed {what}")

    async def select_prod(pilot, a) -> None:
        await until(pilot, lambda: a.loads, "the store")
        for _ in range(5):  # the cursor to the 8-GPU run (the rows' order is the console's)
            if a.selected == PROD:
                break
            await pilot.press("down")
            await pilot.pause(0.2)

    shots = {}
    for width, height in LAYOUTS:
        a = app()
        async with a.run_test(size=(width, height)) as pilot:
            await select_prod(pilot, a)
            await pilot.pause(0.3)
            shots[f"status-{width}x{height}"] = a.export_screenshot(title="dflashctl status")
    a = app()
    async with a.run_test(size=DETAIL_SIZE) as pilot:
        await select_prod(pilot, a)
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(a.screen, DetailScreen) and a.screen.loads, "the detail view")
        shots[f"detail-{DETAIL_SIZE[0]}x{DETAIL_SIZE[1]}"] = a.export_screenshot(title="dflashctl status: detail")
    return shots


def monospace_font() -> str:
    try:
        out = subprocess.run(["fc-match", "-f", "%{family[0]}", "monospace"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    return out or "DejaVu Sans Mono"


def for_rsvg(svg: str, font: str) -> str:
    """The export with this machine's monospace font, and its non-breaking spaces as
    spaces kept by ``xml:space``: converters that ignore ``textLength`` draw a
    no-break space from a fallback font, narrower, and shift the rest of its run."""
    return svg.replace("Fira Code", font).replace("&#160;", " ").replace("<svg ", '<svg xml:space="preserve" ', 1)


def to_png(svg: Path, png: Path, zoom: float) -> None:
    if shutil.which("rsvg-convert"):
        subprocess.run(["rsvg-convert", "--zoom", f"{zoom:g}", "-o", str(png), str(svg)], check=True)
        return
    try:
        import cairosvg
    except (ImportError, OSError) as e:  # OSError: the package without its native cairo library
        raise SystemExit(f"no SVG converter here ({e}): install one with `apt-get install librsvg2-bin` "
                         "(or `pip install cairosvg` with libcairo2)")
    cairosvg.svg2png(url=str(svg), write_to=str(png), scale=zoom)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(REPO, "docs", "screenshots"), help="where the PNGs go")
    parser.add_argument("--font", default=None, help="monospace font family for the SVG (default: fc-match's)")
    parser.add_argument("--max-kb", type=int, default=300, help="largest PNG; larger is drawn again smaller")
    parser.add_argument("--keep-svg", action="store_true", help="keep the SVG beside each PNG")
    args = parser.parse_args()
    utc()
    font = args.font or monospace_font()
    out = Path(args.out).resolve()  # before the chdir below
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.chdir(root)  # the header names the store as 'runs.db', not a temporary path
        store = build("healthy", root)
        add_host_readings(store, PROD)
        shots = asyncio.run(_shots(store.path, str(root / "playbooks")))
        for name, text in shots.items():
            svg = (out if args.keep_svg else root) / f"{name}.svg"
            svg.write_text(for_rsvg(text, font))
            png = out / f"{name}.png"
            zoom = 1.0
            while True:
                to_png(svg, png, zoom)
                kb = png.stat().st_size / 1024
                if kb <= args.max_kb or zoom < 0.4:
                    break
                zoom *= 0.85
            print(f"{png}  {kb:.0f} KB  (zoom {zoom:.2f})")


if __name__ == "__main__":
    main()
