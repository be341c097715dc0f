"""Command: `watch` (the supervisor loop in the foreground).

The loop is ``dflashctl.supervise.supervisor``, its lines ``dflashctl.supervise.console``; this
module parses options and prints. It never imports ``dflashctl.cli`` (it
registers on ``dflashctl.commands._app``).
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from typing import List, Optional

import typer

from dflashctl.commands._app import G, app, err, printable, stream_width
from dflashctl.core.states import SEVERITIES


@app.command("watch")
def watch_command(
    targets: List[str] = typer.Argument(
        ..., metavar="PLAYBOOK|RUN...", help="Run ids (or unambiguous prefixes) and/or playbook names (their active runs)."
    ),
    once: bool = typer.Option(False, "--once", help="Poll once, record and print what is found, and exit "
                              "(observes only: never restarts or stops a run). Exit code 1 on errors."),
    interval: Optional[str] = typer.Option(None, "--interval", help="Time between polls (5, 30s, 2m). "
                                           "Default: the smallest poll_interval of the runs' playbooks."),
    as_json: bool = typer.Option(False, "--json", help="Print each event as one JSON object per line."),
    metrics: bool = typer.Option(False, "--metrics", help="Also print each new metrics line."),
) -> None:
    """Supervise runs in the foreground.

    Polls their hosts (one round trip per host), detects crashes, stalls,
    slowdowns and unreachable hosts, restarts per the playbook's policy, alerts,
    and records everything in the store. One line per event, in time order, at any
    width (cut to a terminal's, whole when piped; `--json`: one JSON object per
    line). Ctrl-C (or SIGTERM, SIGHUP) stops watching, exit code 130; the runs go on.
    Exit code 2 for a target that is no run or playbook."""
    from dflashctl.config import load_inventory
    from dflashctl.core.errors import ConfigError
    from dflashctl.core.paths import store_path
    from dflashctl.core.states import DONE, STOPPED
    from dflashctl.core.units import parse_duration
    from dflashctl.store import Store
    from dflashctl.supervise.console import format_line, format_observation
    from dflashctl.supervise.supervisor import watch

    seconds = None
    if interval is not None:
        try:
            seconds = parse_duration(interval)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"--interval: {e}", hint="give seconds (5, 0.5) or a duration (30s, 2m)") from None
        if seconds <= 0:
            raise ConfigError(f"--interval: {interval} is not a positive duration")

    def emit(kind: str, payload) -> None:
        try:
            show(kind, payload)
        except OSError:
            pass  # the terminal is gone (its tmux session was killed): the store has it all

    def show(kind: str, payload) -> None:
        if kind == "info":
            err.print(printable(payload), highlight=False, markup=False, soft_wrap=True)
        elif kind == "observation":
            print(json.dumps(payload) if as_json else format_observation(payload, width), flush=True)
        elif as_json and kind == "event":
            print(json.dumps(payload.to_dict(), default=str), flush=True)
        elif as_json:
            run_id, m = payload
            print(json.dumps({"kind": "metrics", "run_id": run_id, "metrics": json.loads(m.to_line())}), flush=True)
        else:
            print(format_line(kind, payload, width), flush=True)

    width = stream_width(sys.stdout)  # one line per record: cut on a terminal, whole when piped
    stop = threading.Event()
    _stop_on_signals(stop)
    sup = watch(targets, Store(store_path()), load_inventory(G.inventory), interval=seconds, once=once,
                metrics=metrics, playbooks_dir=G.playbooks, emit=emit, stop=stop)
    if once:
        report = sup.last_report
        bad = report is None or any(not isinstance(v, float) for v in report.hosts.values()) or any(
            SEVERITIES.index(f.severity) >= SEVERITIES.index("error") for fs in report.findings.values() for f in fs
        )
        raise typer.Exit(1 if bad else 0)
    if stop.is_set():  # Ctrl-C, SIGTERM or SIGHUP: interrupted (130); the runs go on
        emit("info", "stopped watching; the runs go on")
        raise typer.Exit(130)
    states = {w.id: w.run.state for w in sup.runs.values()}
    emit("info", "nothing left to watch: " + ", ".join(f"{r} {s}" for r, s in states.items()))
    raise typer.Exit(0 if all(s in (DONE, STOPPED) for s in states.values()) else 1)


def _stop_on_signals(stop: threading.Event) -> None:
    """SIGINT, SIGTERM and SIGHUP (its tmux session killed) end the loop after the
    tick in progress; a second SIGINT interrupts at once."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handle(signum, _frame):
        if stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handle)
