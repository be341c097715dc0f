"""Commands: `cache ls` and `cache rm` (the compile artifacts this controller holds).

The store is ``dflashctl.runs.compile_cache.LocalCache`` (under the controller's data
directory); this module parses options and prints. Every field shown came from a
trainer's manifest and is escaped. It never imports ``dflashctl.cli`` (it registers
on ``dflashctl.commands._app``) and never reaches a host.
"""

from __future__ import annotations

import datetime
import json
from typing import Optional

import typer

from dflashctl.commands._app import app, escape, out, parse_duration_option, printable

cache_app = typer.Typer(
    name="cache",
    help="The compile artifacts held for later starts (copied back from runs, uploaded at launch and restart).",
    no_args_is_help=True,
)
app.add_typer(cache_app, name="cache")


def _when(t: Optional[float]) -> str:
    try:
        return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M") if t else "-"
    except (OverflowError, OSError, ValueError):  # a date no clock of this controller wrote
        return "?"


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


@cache_app.command("ls", epilog="\b\nExamples:\n  dflashctl cache ls\n  dflashctl cache ls --json")
def ls_command(
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """List the held compile artifacts: key, the trust domain it came from (its group or host; --json: also the
    inventory and the domain's id), what it was compiled for, size, when this controller received it, last used."""
    from dflashctl.runs.compile_cache import LocalCache

    cache = LocalCache()
    entries = cache.entries()
    if as_json:
        print(json.dumps([e.to_dict() for e in entries], indent=2, sort_keys=True))
        return
    if not entries:
        out.print(f"no compile artifacts held in {escape(cache.root)}", highlight=False)
        return
    from rich.text import Text

    from dflashctl.status.tables import Col, lines

    columns = (Col("key", "key", 32, 0), Col("from", "from", 12, 2), Col("torch", "torch", 14, 1), Col("triton", "triton", 8, 3),
               Col("cuda", "cuda", 6, 3), Col("gpu", "gpu", 16, 2), Col("bundle", "bundle", 12, 4),
               Col("config", "config", 16, 5), Col("size", "size", 10, 1, "right"),
               Col("bytecode", "bytecode", 10, 5, "right"), Col("received", "received", 16, 4),
               Col("last_used", "last used", 16, 2))
    rows = []
    for e in entries:
        f = e.fields
        cells = {"key": e.key, "from": e.domain_name or ("unrecorded (never provided)" if e.domain is None else e.domain), "torch": f.get("torch"), "triton": f.get("triton"), "cuda": f.get("cuda"),
                 "gpu": f.get("gpu"), "bundle": str(f.get("bundle") or "")[:12] or None, "config": f.get("config"),
                 "size": _size(e.bytes), "bytecode": _size(e.bytecode_bytes) if e.bytecode_bytes else None,
                 "received": _when(e.created), "last_used": _when(e.last_used)}
        rows.append({k: printable("-" if v is None else v) for k, v in cells.items()})
    for line in [Text(f"compile artifacts in {printable(cache.root)}"), *lines(columns, rows, out.width)]:
        out.print(line, highlight=False, soft_wrap=True)


@cache_app.command("rm", epilog="\b\nExamples:\n  dflashctl cache rm 3f2a9c0d1e4b5a67\n"
                                "  dflashctl cache rm --older-than 30d\n  dflashctl cache rm --all")
def rm_command(
    key: Optional[str] = typer.Argument(None, metavar="[KEY]", help="The key of the artifact to remove (cache ls)."),
    all_: bool = typer.Option(False, "--all", help="Remove every held artifact."),
    older_than: Optional[str] = typer.Option(None, "--older-than", metavar="DURATION",
                                             help="Remove those neither used nor created within this long (30d)."),
) -> None:
    """Remove held compile artifacts: one by key (in every trust domain), those older than a duration, or all."""
    from dflashctl.runs.compile_cache import LocalCache

    if sum(x is not None and x is not False for x in (key, all_ or None, older_than)) != 1:
        raise typer.BadParameter("give exactly one of KEY, --all or --older-than DURATION")
    cache = LocalCache()
    if key is not None:
        if not cache.remove(key, every_domain=True):
            from dflashctl.core.errors import DflashError

            raise DflashError(f"no compile artifact {key} held", hint="`dflashctl cache ls` lists what is held")
        removed = [key]
    elif all_:
        removed = cache.clear()
    else:
        removed = cache.prune(parse_duration_option(older_than, "--older-than"))
    if key is not None or all_:
        # The next start on every host drops the bytecode it unpacked from artifacts.
        cache.bump_generation()
    for k in removed:
        out.print(f"removed {escape(k)}", highlight=False)
    if not removed:
        out.print("nothing removed", highlight=False)
