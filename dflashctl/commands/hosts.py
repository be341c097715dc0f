"""Commands: `hosts` (what the inventory says), `check` (what the hosts say) and
`trust` (accept a host's SSH key, fetched through its route).

The facts come from ``dflashctl.hosts.facts``, host keys from ``dflashctl.hosts.transport``;
this module parses options and prints.
It never imports ``dflashctl.cli`` (it registers on ``dflashctl.commands._app``).
"""

from __future__ import annotations

import json
import shlex
from typing import List, Optional

import typer
from rich.text import Text

from dflashctl.commands._app import G, app, err, escape, out, parse_duration_option, printable


def _inventory():
    from dflashctl.config import load_inventory

    return load_inventory(G.inventory)


@app.command("hosts")
def hosts_command(
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """List the inventory's hosts: how each is reached (jumps, container wrapper) and its GPUs."""
    from dflashctl.config import ssh_config_origin
    from dflashctl.hosts.transport import describe_route

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
                **({"ssh_config": dict(zip(("read_by", "options"), ssh_config_origin(host.ssh_config)))}
                   if host.ssh else {}),
            }
        )
    if as_json:
        print(json.dumps({"source": inventory.source, "hosts": rows}, indent=2))
        return
    from dflashctl.status.tables import Col, lines

    columns = (Col("host", "host", 24, 0), Col("transport", "transport", 9, 2), Col("address", "address", 21, 3),
               Col("route", "route", 20, 1, grow=40), Col("wrapper", "wrapper", 16, 4, grow=24),
               Col("gpus", "gpus", 4, 1, "right"))
    cells = [{k: printable(v) for k, v in {
        "host": r["name"], "transport": r["transport"], "address": r["address"] or "-", "route": r["route_text"],
        "wrapper": shlex.join(r["wrapper"]) or "-", "gpus": "-" if r["gpus"] is None else str(r["gpus"])}.items()}
        for r in rows]
    origins = [Text(line) for line in map(_ssh_origin, inventory.hosts.values()) if line]
    _say_lines([Text(f"hosts in {printable(inventory.source)}"), *lines(columns, cells, out.width), *origins])


def _ssh_origin(host) -> str | None:
    """'gpu: from the ssh config for ALIAS (read by ssh -G): hostname ..., port ...': where
    an ``ssh:`` host's options came from (None: the inventory says everything)."""
    from dflashctl.config import ssh_config_origin

    if host is None or not host.ssh:
        return None
    read_by, options = ssh_config_origin(host.ssh_config)
    said = ", ".join(f"{k} {' '.join(v) if isinstance(v, list) else v}" for k, v in options.items())
    return printable(f"{host.name}: from the ssh config for {host.ssh} (read by {read_by}): {said}")


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
    warns when the inventory's `gpus:` differs from what nvidia-smi shows. One line
    per host (the columns that fit), then the package versions it proved on each
    run host (`proved: torch 2.6.0, ...`) and which attention kernels a run gets
    there (`attention: ...`: dense SDPA without a GPU, else flash-attention 4's
    kernels where `compile.flex_kernel: auto` takes them, else flex_attention's
    Triton kernels and why not flash-attention 4's). Each problem is printed
    with its fix.
    Exit code 1 when any host failed."""
    from dflashctl.hosts.facts import check_hosts

    inventory = _inventory()
    checks = check_hosts(inventory, names or None, timeout=parse_duration_option(timeout, "--timeout"))
    if as_json:
        print(json.dumps({"ok": all(c.ok for c in checks), "hosts": [c.to_dict() for c in checks]}, indent=2))
    else:
        _print_checks(checks)
        origins = [Text(line) for line in (_ssh_origin(inventory.hosts.get(c.name)) for c in checks) if line]
        if origins:
            _say_lines(origins)
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
    from dflashctl.core.errors import DflashError, UnreachableError
    from dflashctl.hosts.transport import host_key

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


def _say_lines(lines) -> None:
    for line in lines:
        out.print(line, highlight=False, soft_wrap=True)


def _print_checks(checks) -> None:
    """One line per host (the columns that fit), then per run host the package
    versions it proved and which attention kernels a run gets there, then each
    problem with its fix."""
    from dflashctl.status.tables import Col, lines

    columns = (Col("host", "host", 24, 0), Col("result", "result", 6, 0), Col("route", "route", 20, 3, grow=30),
               Col("hostname", "hostname", 16, 4), Col("system", "system", 24, 5, grow=30),
               Col("python", "python", 7, 2), Col("tmux", "tmux", 7, 2), Col("gpus", "gpus", 16, 1, grow=20),
               Col("disk", "disk free", 10, 1, "right"), Col("time", "time", 6, 2, "right"))
    rows, styles, details = [], [], []
    for c in checks:
        f = c.facts
        result = "ok" if c.ok else "FAIL"
        row = {"host": c.name, "result": result, "route": c.route_text + (" (jump host)" if c.role == "jump" else ""),
               "time": f"{c.seconds:.1f}s"}
        if f is not None:
            row.update(hostname=f.hostname, system=f"{f.os}, kernel {f.kernel}", python=f.python,
                       tmux=f.tmux.replace("tmux ", "") if f.tmux else "missing", gpus=_gpus(f),
                       disk=_bytes(f.disk_free) if f.disk_free is not None else (f.disk_error or "-"))
        rows.append({k: printable(v) for k, v in row.items()})
        styles.append({"host": "green" if c.ok else "red", "result": "green" if c.ok else "red",
                       "tmux": "yellow" if f is not None and not f.tmux else ""})
        proved = _proved(f)
        details.append([(None, printable(f"proved: {proved}"))] * bool(proved)
                       + [(None, printable(f"attention: {c.attention}"))] * bool(c.attention))
    _say_lines(lines(columns, rows, out.width, styles=styles, details=details))
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
    """The host's GPUs in a few words: ``8x NVIDIA H200 140 GiB`` (each kind counted)."""
    if f.nvidia_smi is None:
        return "no nvidia-smi"
    if f.gpu_error:
        return f.gpu_error
    kinds: dict[str, int] = {}
    for g in f.gpus:
        kind = f"{g.name} {(g.memory_total_mib or 0) / 1024:.0f} GiB"
        kinds[kind] = kinds.get(kind, 0) + 1
    return ", ".join(f"{n}x {kind}" for kind, n in kinds.items()) or "none"


def _proved(f) -> str | None:
    """The trainer's packages as the host's python has them (what `check` proved
    against TRAINER_REQUIREMENTS): ``torch 2.6.0, triton 3.2.0, ...``; None for a
    host with no launch checks (a jump host, or one not reached)."""
    if f is None or f.launch is None or not f.launch.versions:
        return None
    from dflashctl.hosts.facts import LAUNCH_PACKAGES

    return ", ".join(f"{name} {f.launch.versions.get(name) or 'missing'}" for name in LAUNCH_PACKAGES) + \
        f" (python {f.python_path})"


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
