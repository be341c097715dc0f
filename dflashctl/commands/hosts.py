"""Commands: `hosts` (what the inventory says), `check` (what the hosts say) and
`trust` (accept a host's SSH key, fetched through its route).

The facts come from ``dflashctl.facts``, host keys from ``dflashctl.transport``;
this module parses options and prints.
It never imports ``dflashctl.cli`` (it registers on ``dflashctl.commands._app``).
"""

from __future__ import annotations

import json
import shlex
from typing import List, Optional

import typer
from rich.table import Table

from dflashctl.commands._app import G, app, err, escape, out, parse_duration_option


def _inventory():
    from dflashctl.config import load_inventory

    return load_inventory(G.inventory)


@app.command("hosts")
def hosts_command(
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """List the inventory's hosts: how each is reached (jumps, container wrapper) and its GPUs."""
    from dflashctl.transport import describe_route

    inventory = _inventory()
    rows = []
    for name, host in inventory.hosts.items():
        route = inventory.route(name)
        rows.append(
            {
                "name": name,
                "transport": host.transport,
                "address": None if host.is_local else f"{host.address}:{host.port}",
                "user": host.user,
                "ssh": host.ssh,
                "route": [h.name for h in route],
                "route_text": describe_route(route, wrapper=False),
                "wrapper": list(host.wrapper),
                "workdir": host.workdir,
                "gpus": host.gpus,
            }
        )
    if as_json:
        print(json.dumps({"source": inventory.source, "hosts": rows}, indent=2))
        return
    table = Table(title=f"hosts in {escape(inventory.source)}", title_justify="left")
    for column in ("host", "transport", "address", "route", "wrapper", "gpus"):
        table.add_column(column, overflow="fold")
    for r in rows:
        cells = (r["name"], r["transport"], r["address"] or "-", r["route_text"], shlex.join(r["wrapper"]) or "-")
        table.add_row(*map(escape, cells), "-" if r["gpus"] is None else str(r["gpus"]))
    out.print(table)


@app.command("check")
def check_command(
    names: Optional[List[str]] = typer.Argument(None, metavar="[HOST]...", help="Hosts to check (default: all)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    timeout: str = typer.Option("30s", "--timeout", help="How long the facts command may take per host (30, 30s, 1m; connecting is bounded by each host's connect_timeout)."),
) -> None:
    """Reach every host and report its route and facts, and prove what `launch` needs.

    Hosts are reached concurrently; reported: the route taken, OS, kernel, python,
    tmux, GPUs, free disk in the work directory (created if missing). On a run host
    (not one that only serves as a jump) it also proves what a launch needs: a
    detached process and a tmux session started through the wrapper outlive the
    call (started, then looked at again), the work directory takes a file, python
    has torch, triton, transformers and safetensors at the versions the trainer needs; and it
    warns when the inventory's `gpus:` differs from what nvidia-smi shows. Each
    problem is printed with its fix. Exit code 1 when any host failed."""
    from dflashctl.facts import check_hosts

    checks = check_hosts(_inventory(), names or None, timeout=parse_duration_option(timeout, "--timeout"))
    if as_json:
        print(json.dumps({"ok": all(c.ok for c in checks), "hosts": [c.to_dict() for c in checks]}, indent=2))
    else:
        _print_checks(checks)
    if not all(c.ok for c in checks):
        raise typer.Exit(1)


@app.command("trust")
def trust_command(
    name: str = typer.Argument(..., metavar="HOST", help="The host whose SSH host key to trust (its jump hosts' first)."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Add unknown keys without asking."),
) -> None:
    """Fetch HOST's SSH host key through its route and add it to its known_hosts.

    Each host on the way (jump hosts first, then HOST) is asked for its key through
    the hosts before it, and its fingerprint is shown; an unknown key is appended to
    that host's `known_hosts` file once you confirm (or with `--yes`). A key that
    differs from the one on file is refused. Compare each fingerprint with the
    host's own (`ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub`, run there)
    before you confirm."""
    from dflashctl.errors import DflashError, UnreachableError
    from dflashctl.transport import host_key

    inventory = _inventory()
    route = inventory.route(name)
    if route[-1].is_local:
        raise DflashError(f"{name} is a local host: it is reached without SSH, so it has no host key to trust")
    added = 0
    for hop in route:
        found = host_key(hop, inventory)
        shown = f"{found.host} ({found.route}): {found.key_type} {found.fingerprint} at {found.key_name}"
        if found.status == "trusted":
            out.print(f"{escape(shown)}: already trusted in {escape(found.known_hosts)}", highlight=False,
                      soft_wrap=True)
            continue
        if found.status == "changed":
            raise UnreachableError(
                found.host, f"trust {found.host}",
                f"host key CHANGED: {found.key_type} {found.fingerprint} at {found.key_name} does not match "
                f"{found.known_hosts}; this may be an attack, or the host was reinstalled; not trusted",
                hint=f"if the change is expected: `{shlex.join(['ssh-keygen', '-f', found.known_hosts, '-R', found.key_name])}`, "
                "then run this command again",
            )
        out.print(f"{escape(shown)}: [yellow]not in {escape(found.known_hosts)}[/]", highlight=False, soft_wrap=True)
        if not yes and not typer.confirm(f"Trust this key for {found.host} and add it to {found.known_hosts}?",
                                         default=False, err=True):
            raise DflashError(f"{found.host}: key not trusted; nothing written",
                              hint="compare the fingerprint with the host's own before you trust it")
        found.trust()
        added += 1
        out.print(f"{escape(found.host)}: added to {escape(found.known_hosts)}", highlight=False, soft_wrap=True)
    out.print(f"{escape(name)}: every host key on the route is trusted" + (f" ({added} added)" if added else ""),
              highlight=False)


def _print_checks(checks) -> None:
    table = Table(title_justify="left")
    for column in ("host", "route", "hostname", "system", "gpus", "disk free", "time"):
        table.add_column(column, overflow="fold", no_wrap=column in ("host", "disk free", "time"))
    for c in checks:
        f = c.facts
        if f is None:
            table.add_row(f"[red]{escape(c.name)}[/]", escape(c.route_text), "[red]FAIL[/]", "-", "-", "-", f"{c.seconds:.1f}s")
            continue
        tmux = escape(f.tmux.replace("tmux ", "")) if f.tmux else "[yellow]missing[/]"
        table.add_row(
            f"[{'green' if c.ok else 'red'}]{escape(c.name)}[/]",
            escape(c.route_text) + ("\n(jump host)" if c.role == "jump" else ""),
            escape(f.hostname),
            f"{escape(f.os)}\nkernel {escape(f.kernel)}\npython {escape(f.python)}, tmux {tmux}",
            _gpus(f),
            _bytes(f.disk_free) if f.disk_free is not None else f"[red]{escape(f.disk_error or '')}[/]",
            f"{c.seconds:.1f}s",
        )
    out.print(table)
    for c in checks:
        if c.error:
            err.print(f"[bold red]error:[/] {escape(c.error)}", highlight=False, soft_wrap=True)
            if c.hint:
                err.print(f"[yellow]hint:[/] {escape(c.hint)}", highlight=False, soft_wrap=True)
        for p in c.problems:
            label = "[bold red]error:[/]" if p.severity == "error" else "[yellow]warning:[/]"
            err.print(f"{label} {escape(c.name)}: {escape(p.message)}", highlight=False, soft_wrap=True)
            err.print(f"[yellow]fix:[/] {escape(p.fix)}", highlight=False, soft_wrap=True)


def _gpus(f) -> str:
    if f.nvidia_smi is None:
        return "no nvidia-smi"
    if f.gpu_error:
        return f"[red]{escape(f.gpu_error)}[/]"
    return escape("\n".join(f"{g.index}: {g.name} {(g.memory_total_mib or 0) / 1024:.0f} GiB" for g in f.gpus)) or "none"


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
