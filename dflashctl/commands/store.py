"""Commands: `store info`, `store prune` and `store vacuum` (the run store's size and retention).

The store keeps each run's history at full resolution for a recent window and as
rollups beyond it (``dflashctl.store.history``); the supervisor applies each run's
playbook ``retention`` as it records. These commands show what the file holds,
apply the retention to every run now (runs no supervisor watches included), and
give the freed pages back to the file system. This module parses options and prints.
"""

from __future__ import annotations

import json

import typer

from dflashctl.commands._app import G, app, out, printable

store_app = typer.Typer(
    name="store",
    help="The run store: its size per table and run, the retention applied now, the file compacted.",
    no_args_is_help=True,
)
app.add_typer(store_app, name="store")


def _store():
    from dflashctl.core.paths import store_path
    from dflashctl.store import Store

    return Store(store_path())


def _size_lines(before: int, after: int | None = None) -> str:
    from dflashctl.core.units import fmt_bytes

    return fmt_bytes(before) if after is None else f"{fmt_bytes(before)} -> {fmt_bytes(after)}"


@store_app.command("info", epilog="\b\nExamples:\n  dflashctl store info\n  dflashctl store info --json")
def info_command(
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of lines."),
) -> None:
    """The store's file: its size, each table's (with its indexes), and the runs holding the most of it."""
    from dflashctl.core.units import fmt_bytes

    store = _store()
    tables = store.table_bytes()
    runs = store.list_runs(limit=None)
    sizes = store.run_bytes([r.id for r in runs], tables)
    document = {"path": store.path, "file_bytes": store.file_bytes(), "tables": tables,
                "runs": [{"id": r.id, "state": r.state, "store_bytes": sizes.get(r.id, 0)}
                         for r in sorted(runs, key=lambda r: -sizes.get(r.id, 0))]}
    if as_json:
        print(json.dumps(document, indent=2))
        return
    out.print(printable(f"{store.path}: {fmt_bytes(document['file_bytes'])}"), highlight=False)
    for name, n in sorted(tables.items(), key=lambda kv: -kv[1]):
        out.print(printable(f"  {name:<20} {fmt_bytes(n):>7}"), highlight=False)
    for r in document["runs"][:10]:
        out.print(printable(f"  run {r['id']} ({r['state']}): {fmt_bytes(r['store_bytes'])}"), highlight=False)


@store_app.command("prune", epilog="\b\nExamples:\n  dflashctl store prune\n  dflashctl store prune --json")
def prune_command(
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a line."),
) -> None:
    """Apply each run's playbook retention now, to every run and its hosts' readings: samples and readings older
    than `retention.full` before the newest become rollups, one-minute rollups older than `retention.fine` go. A
    supervisor does the same for the runs it watches, every minute. The file keeps its size until `store vacuum`."""
    from dflashctl.config import load_inventory
    from dflashctl.supervise.supervisor import apply_retention, policy_for_run

    store = _store()
    inventory = load_inventory(G.inventory)
    runs = store.list_runs(limit=None)
    deleted = apply_retention(store, [(r, policy_for_run(r, inventory, G.playbooks)[0]) for r in runs])
    if as_json:
        print(json.dumps({"runs": len(runs), "deleted": deleted, "file_bytes": store.file_bytes()}, indent=2))
        return
    rows = ", ".join(f"{n:,} {table}" for table, n in deleted.items() if n) or "nothing"
    out.print(printable(f"pruned {len(runs)} runs: {rows} deleted; `dflashctl store vacuum` gives the space back"),
              highlight=False)


@store_app.command("vacuum", epilog="\b\nExamples:\n  dflashctl store vacuum\n  dflashctl store vacuum --json")
def vacuum_command(
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a line."),
) -> None:
    """Compact the store's file (SQLite VACUUM): the space pruned rows held goes back to the file system. It holds
    the write lock while it runs: supervisors wait (and say `store busy`) until it is done."""
    store = _store()
    before = store.file_bytes()
    store.vacuum()
    after = store.file_bytes()
    if as_json:
        print(json.dumps({"path": store.path, "before_bytes": before, "after_bytes": after}, indent=2))
        return
    out.print(printable(f"{store.path}: {_size_lines(before, after)}"), highlight=False)
