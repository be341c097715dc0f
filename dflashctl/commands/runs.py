"""Commands: `launch`, `stop`, `restart`, `logs`, `eval`, `runs`, `events` (runs and their history).

The work is done by ``dflashctl.launch`` (the launch flow), ``dflashctl.runs.runhost``
(stop, restart), ``dflashctl.runs.logs`` (logs) and ``dflashctl.runs.evaluate`` (eval) on
the run's hosts, and ``dflashctl.runs.recorded`` (what ``restart --reload`` may take);
this module parses options and prints. It never imports ``dflashctl.cli`` (it registers on
``dflashctl.commands._app``).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import shlex
import sys
from typing import Optional

import typer
from rich.text import Text

from dflashctl.commands._app import G, app, err, out, parse_duration_option, printable, stream_width


def _inventory():
    from dflashctl.config import load_inventory

    return load_inventory(G.inventory)


def _store():
    from dflashctl.core.paths import store_path
    from dflashctl.store import Store

    return Store(store_path())


def _when(t: float | None, short: bool = False) -> str:
    if not t:
        return "-"
    return datetime.datetime.fromtimestamp(t).strftime("%m-%d %H:%M" if short else "%Y-%m-%d %H:%M:%S")


def _say(console, text: str, **options) -> None:
    """Print one line of user data as given; a terminal that is gone (the ssh
    connection closed under ``launch --foreground``) silences it, never the command."""
    try:
        console.print(printable(text), highlight=False, markup=False, **options)
    except OSError:
        pass


def _say_record(line: str) -> None:
    """One record of a stream (an event, a metrics line), fitted to the terminal's
    width already (``console.format_line``), whole when piped (``stream_width``)."""
    _say_text(Text(line))


def _progress(as_json: bool):
    """Step-by-step progress lines on stderr (stdout stays clean for --json)."""

    def show(step: str, message: str) -> None:
        if as_json:
            return
        first, *rest = message.split("\n")
        try:
            err.print(Text.assemble((f"{step:>10}", "bold cyan"), "  ", printable(first)), highlight=False,
                      soft_wrap=True)
        except OSError:
            return
        for line in rest:
            _say(err, f"            {line}", soft_wrap=True)

    return show


@app.command("launch")
def launch_command(
    playbook: str = typer.Argument(..., help="Playbook name (see playbooks/) or path to a playbook YAML."),
    foreground: bool = typer.Option(False, "--foreground", help="Supervise here, printing events and metrics until the run ends; exit code 1 if it fails. Ctrl-C, SIGTERM and SIGHUP (terminal closed) hand it to a background supervisor: exit code 130."),
    no_watch: bool = typer.Option(False, "--no-watch", help="Do not start a supervisor for the run."),
    force: bool = typer.Option(False, "--force", help="Launch despite env-audit errors or busy / claimed GPUs."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print every step and remote command; change nothing. "
                                 "Exit code 1 when the launch would stop (env-audit or input errors)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Audit the host, deploy the trainer, start the run in tmux, record and supervise it.

    The supervisor runs in a local tmux session; --foreground stays attached instead.
    A playbook with `hosts: [a, b]` starts one torch.distributed process on each host
    (rank 0 on the first) and records them as one run (docs/multi-host.md)."""
    from dflashctl.config import load_playbook
    from dflashctl.core.states import FAILED, FINAL_STATES
    from dflashctl.launch import HandOverSignals, launch_run, start_supervisor, supervise_here

    if foreground and no_watch:
        raise typer.BadParameter("--foreground and --no-watch exclude each other")
    inventory = _inventory()
    pb = load_playbook(playbook, G.playbooks, inventory)
    store = None if dry_run else _store()
    show = _progress(as_json)
    # From the start: a terminal closed while the run is being started still leaves it supervised.
    with HandOverSignals() if foreground and not dry_run else contextlib.nullcontext() as signals:
        result = launch_run(pb, inventory, store, force=force, dry_run=dry_run, progress=show)
        supervisor, final, handed_over = None, result.state, False
        if not dry_run and not no_watch and result.state not in FINAL_STATES:
            if foreground:
                _say(err, f"following {result.run_id} (Ctrl-C detaches; the run keeps going)")
                supervised = supervise_here(result.run_id, store, inventory, signals, show,
                                            emit=_say_record, inventory_path=G.inventory,
                                            playbooks_dir=G.playbooks, width=stream_width(sys.stdout))
                supervisor, final = supervised.session or supervised.state, supervised.state
                handed_over = supervised.session is not None
                if supervised.session:
                    run = shlex.quote(result.run_id)
                    _say(err, f"detached ({supervised.signal}); the run goes on, supervised in local tmux session "
                              f"{supervised.session}: dflashctl status {run}, dflashctl logs {run} -f")
            else:
                supervisor = start_supervisor(result.run_id, False, store, inventory, show,
                                              inventory_path=G.inventory, playbooks_dir=G.playbooks)
    if as_json:
        print(json.dumps({**result.__dict__, "supervisor": supervisor}, indent=2, default=str))
    elif not dry_run:
        _say(out, result.run_id)
    if FAILED in (result.state, final):  # failed to start, or (followed to its end) failed
        raise typer.Exit(1)
    if handed_over:  # Ctrl-C (or SIGTERM, SIGHUP) ended the follow: interrupted, the run goes on
        raise typer.Exit(130)
    if dry_run and result.blocked:  # a gate: a playbook that cannot launch fails its dry run
        _say(err, f"dry run: a launch would stop at {result.blocked} error(s) (exit 1)")
        raise typer.Exit(1)


@app.command("stop")
def stop_command(
    run: str = typer.Argument(..., help="Run id (or an unambiguous prefix)."),
    timeout: str = typer.Option("2m", "--timeout", help="How long to wait for the checkpoint before killing (120, 2m)."),
) -> None:
    """Stop a run gracefully: the trainer checkpoints and exits; then its session is closed.

    A run on several hosts is stopped on every host that answers, each said. A host
    that does not is sent nothing: the run is then `lost`, its supervisor keeps trying
    that host and stops what runs there once it answers (exit 3). No host answering:
    nothing is sent or recorded (exit 1)."""
    from dflashctl.runs.runhost import stop

    result = stop(run, _store(), _inventory(), timeout=parse_duration_option(timeout, "--timeout"),
                  progress=_progress(False))
    _say(out, f"{result.id} {result.state}")
    if result.state == "lost":  # stopped where the hosts answered; its supervisor stops the rest
        raise typer.Exit(3)


@app.command("restart")
def restart_command(
    run: str = typer.Argument(..., help="Run id (or an unambiguous prefix)."),
    serialized_warmup: bool = typer.Option(False, "--serialized-warmup", help="Warm up compiled kernels one at a time."),
    no_watch: bool = typer.Option(False, "--no-watch", help="Do not start a supervisor for the run."),
    reload: bool = typer.Option(False, "--reload", help="Take the playbook's trainer section and secrets again "
                                "(validated; refused when the model shapes or the placement differ from the run's)."),
) -> None:
    """Start a run's trainer again, resuming from its last checkpoint.

    A running run is stopped first (it checkpoints); its ready standby, when it has
    one, is kept through the stop and becomes the new process (no import paid). The
    trainer starts in the same run directory (compile cache kept) with the config
    recorded at launch: a playbook changed since is said, and `--reload` takes its
    trainer section (steps, learning rate, data, ...) and its secrets (a rotated
    token) again; the new process is then a fresh one, not the standby. Then a local tmux
    session supervises it, as after `launch`."""
    import time

    from dflashctl.launch import start_supervisor
    from dflashctl.runs.recorded import prepare
    from dflashctl.runs.runhost import restart
    from dflashctl.supervise.supervisor import live_supervisor

    store, inventory, show = _store(), _inventory(), _progress(False)
    record = store.get_run(run)
    secrets = prepare(record, store, inventory, G.playbooks, reload, show, time.time())
    state = restart(record.id, store, inventory, serialized_warmup=serialized_warmup, progress=show, secrets=secrets)
    watching = live_supervisor(store.get_run(run).supervisor)
    if state == "running" and watching is not None:  # a foreground `watch`: it watches the new process too
        show("supervise", f"run {record.id} is supervised by pid {watching['pid']}: no second supervisor")
    elif state == "running" and not no_watch:
        start_supervisor(store.get_run(run).id, False, store, inventory, show,
                         inventory_path=G.inventory, playbooks_dir=G.playbooks)
    _say(out, state)
    if state == "failed":
        raise typer.Exit(1)


@app.command("logs")
def logs_command(
    run: str = typer.Argument(..., help="Run id (or an unambiguous prefix)."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new output until the trainer ends."),
    n: int = typer.Option(50, "-n", "--lines", min=0, help="Lines of the log to show first."),
    host: Optional[str] = typer.Option(None, "--host", help="A multi-host run: only this host's log "
                                       "(default: every host's, each line prefixed with [host])."),
) -> None:
    """Print the run's trainer log (stdout and stderr of every process of the run).

    Control characters in it (ANSI colours, carriage returns) are shown as escapes
    (\\x1b), never sent to the terminal as they are."""
    from dflashctl.runs.logs import logs

    try:
        for chunk in logs(run, _store(), _inventory(), follow=follow, n=n, host=host):
            sys.stdout.write(printable(chunk))
            sys.stdout.flush()
    except KeyboardInterrupt:
        pass


@app.command("eval")
def eval_command(
    run: str = typer.Argument(..., help="Run id (or an unambiguous prefix)."),
    prompts: Optional[int] = typer.Option(None, "--prompts", min=1, help="Prompts to decode (default: the playbook's)."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", min=1, help="Tokens per prompt."),
    timeout: Optional[str] = typer.Option(None, "--timeout", help="Budget (30s, 5m, ...): the trainer begins no new "
                                          "prompt past it and the prompts measured are kept (default: the playbook's)."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="CPU threads of a CPU eval (1 is fastest "
                                          "for tiny models on a busy machine)."),
    as_json: bool = typer.Option(False, "--json", help="Print the trainer's JSON report."),
) -> None:
    """Measure the run's drafter with real speculative decoding on its host.

    Runs `python -m trainer eval` on the run's newest checkpoint, with the run's
    environment and GPUs, in a tmux session beside the run's, on the run's held-out
    prompts (data.holdout) when it has some: the measured tau (accepted draft tokens
    + 1 per target forward), said per prompt as it comes, tokens per target forward,
    and the speed-up over plain greedy decoding. The report is stored with the run
    as it grows (`dflashctl runs` and `status` show it as τ beside τ est): a timeout
    or Ctrl-C keeps the prompts measured. A playbook's `eval: {after_done: true}`
    runs it by itself when a run ends done.

    Example: dflashctl eval demo-20261130-203528-9854 --prompts 4 --timeout 2m --threads 1"""
    from dflashctl.config import EvalSettings
    from dflashctl.runs.evaluate import eval_run
    from dflashctl.supervise.supervisor import policy_for_run

    store, inventory = _store(), _inventory()
    record = store.get_run(run)
    settings = policy_for_run(record, inventory, G.playbooks)[0].eval or EvalSettings()
    budget = None if timeout is None else parse_duration_option(timeout, "--timeout")
    changes = {k: v for k, v in (("prompts", prompts), ("max_new_tokens", max_new_tokens), ("timeout", budget),
                                 ("threads", threads)) if v is not None}
    try:
        report = eval_run(record.id, store, inventory, settings.model_copy(update=changes), progress=_progress(as_json))
    except KeyboardInterrupt:
        raise typer.Exit(130) from None  # what was measured is stored (eval_run said so)
    if as_json:
        print(json.dumps(report, indent=2))


def _eval_summary(row: dict | None) -> dict | None:
    """The eval a run's τ came from (``store.preferred_eval``): which attempt, its size,
    its spread, and how many newer evals were passed over."""
    if not row:
        return None
    report = row.get("report") or {}
    return {**{k: v for k, v in row.items() if k != "report"},
            "tokens_per_target_forward": report.get("tokens_per_target_forward"),
            "greedy_identical": report.get("greedy_identical")}


def _run_columns():
    from dflashctl.status.tables import Col

    return (
        Col("run", "run", 64, 0),  # ids are copied into other commands: whole, never cut
        Col("state", "state", 10, 0),
        Col("step", "step", 15, 1, "right"),
        Col("loss", "loss", 6, 1, "right"),
        Col("tau_est", "τ est", 5, 2, "right"),
        Col("tau", "τ", 6, 2, "right"),
        Col("speedup", "speedup", 7, 4, "right"),
        Col("eval", "eval", 10, 5, "right"),
        Col("restarts", "rst", 3, 2, "right"),
        Col("duration", "took", 7, 3, "right"),
        Col("host", "host", 12, 3),
        Col("created", "created", 11, 4),
        Col("store", "store", 9, 5, "right"),
        Col("exit", "exit", 12, 5, grow=48),
        Col("gpus", "GPUs", 7, 6),
    )


def _run_summary(r, outcome: dict, evaluation: dict | None, now: float, store_bytes: int | None = None) -> dict:
    """What ``runs --json`` adds to a run's record: what it achieved, and what it holds
    of the store (``store_bytes``: its rows' share of the file)."""
    from dflashctl.core.contract import tau_estimate
    from dflashctl.status.reader import total_steps

    start = r.started or r.created
    return {"step": outcome["step"], "total_steps": total_steps(r), "loss": outcome["loss"],
            "accept_len": outcome["accept_len"], "tau_est": tau_estimate(outcome["accept_len"]),
            "tau": (evaluation or {}).get("tau"),
            "restarts": outcome["restarts"], "duration_s": max(0.0, (r.ended or now) - start) if start else None,
            "store_bytes": store_bytes}


def _run_cells(r, s: dict) -> dict:
    from dflashctl.core.units import fmt_bytes, fmt_duration

    step = "-" if s["step"] is None else f"{s['step']:,}" + (f"/{s['total_steps']:,}" if s["total_steps"] else "")
    return {
        "run": r.id, "state": r.state, "step": step,
        "loss": "-" if s["loss"] is None else f"{s['loss']:.3f}",
        "tau_est": "-" if s["tau_est"] is None else f"{s['tau_est']:.2f}",
        "tau": _tau(s["eval"]),
        "speedup": _speedup(s["eval"]),
        "eval": _eval_size(s["eval"]),
        "restarts": str(s["restarts"]),
        "duration": "-" if s["duration_s"] is None else fmt_duration(s["duration_s"]).replace(" ", ""),
        "host": ",".join(r.host_names),  # a multi-host run: every host, rank 0 first
        "created": _when(r.created, short=True),
        "store": "-" if s.get("store_bytes") is None else fmt_bytes(s["store_bytes"]),
        "exit": r.exit_reason or ("-" if r.exit_code is None else str(r.exit_code)),
        "gpus": ",".join(map(str, r.gpus)) or "-",
    }


def _tau(row: dict | None) -> str:
    if not row or row.get("tau") is None:
        return "-"
    partial = "" if row.get("complete", True) else "*"
    return f"{row['tau']:.2f}{partial}"


def _speedup(row: dict | None) -> str:
    """'5.45x', with '~' when its prompts' speed-ups spread over more than a fifth of it."""
    if not row or not row.get("speedup"):
        return "-"
    spread = row.get("speedup_range")
    noisy = spread is None or (spread[1] - spread[0]) > 0.2 * row["speedup"]
    return f"{'~' if noisy else ''}{row['speedup']:.2f}x"


def _eval_size(row: dict | None) -> str:
    """The eval's size, 'prompts x tokens', '+N' when N newer (smaller) evals were passed over."""
    if not row or row.get("prompts") is None:
        return "-"
    tokens = row.get("new_tokens")
    size = f"{row['prompts']}p" + (f"/{tokens}t" if tokens is not None else "")
    return size + (f"+{row['newer']}" if row.get("newer") else "")


@app.command("runs")
def runs_command(
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    all_runs: bool = typer.Option(False, "--all", help="Include every run, not only the last 20."),
    playbook: Optional[str] = typer.Option(None, "--playbook", help="Only runs of this playbook."),
) -> None:
    """List runs, newest first: state, what each achieved, how it ended.

    Per run: its step of its total (where it stopped, for a run that ended), the
    newest loss, τ est (accept_len + 1, the trainer's estimate), τ measured by
    `dflashctl eval` (* when the eval stopped early) and its speed-up (~ when its
    prompts' speed-ups spread over a fifth of it), which eval that was (eval:
    prompts/tokens; the largest complete eval is shown, +N says N newer, smaller ones
    were passed over), restarts, how long it ran, host, when it was created, how it
    ended; a line under the table names a τ that parts from τ est, and why.
    The columns that fit the terminal are shown, each cell cut to its column (never
    folded); a failed run's whole exit reason is on the line below it; `--json` has
    every field (`summary`: step, total_steps, loss, accept_len, tau_est, tau, restarts,
    duration_s, store_bytes; `tau_note`; `eval`: id, attempt, prompts, new_tokens, complete, tau_sd,
    speedup_range, evals, newer). `store`: the run's share of the run store
    (`dflashctl store info` has the file's)."""
    import time

    from dflashctl.status.tables import lines

    store = _store()
    runs = store.list_runs(playbook=playbook, limit=None if all_runs else 20)
    from dflashctl.core.contract import tau_gap

    evals = {run: _eval_summary(row) for run, row in store.preferred_evals([r.id for r in runs]).items()}
    outcomes = store.run_outcomes([r.id for r in runs])
    now = time.time()
    sizes = store.run_bytes([r.id for r in runs])
    summaries = [_run_summary(r, outcomes[r.id], evals.get(r.id), now, sizes.get(r.id)) for r in runs]
    if as_json:
        print(json.dumps([{**r.to_dict(), "summary": s, "tau_est": s["tau_est"], "tau": s["tau"],
                           "tau_note": tau_gap(s["tau_est"], s["tau"]), "eval": evals.get(r.id)}
                          for r, s in zip(runs, summaries)], indent=2))
        return
    if not runs:
        out.print("no runs yet: dflashctl launch demo", highlight=False)
        return
    colors = {"running": "green", "failed": "red", "lost": "yellow", "stalled": "yellow", "restarting": "yellow"}
    rows = [{k: printable(v) for k, v in _run_cells(r, {**s, "eval": evals.get(r.id)}).items()}
            for r, s in zip(runs, summaries)]
    # A failed run's exit reason that its cell cuts (or that has no column) is on the line below.
    details = [("exit", printable(f"exit: {r.exit_reason}")) if r.state in ("failed", "lost") and r.exit_reason
               else None for r in runs]
    for line in lines(_run_columns(), rows, out.width, styles=[{"state": colors.get(r.state, "")} for r in runs],
                      details=details):
        out.print(line, highlight=False)
    # Below the table, each on one line cut to the width: the legend, then each run whose τ parts from τ est.
    out.print(Text(printable("τ est: accept_len + 1 in training; τ: measured by dflashctl eval (accepted draft "
                             "tokens + 1 per target forward; * stopped early), of its largest complete eval "
                             "(eval: prompts/tokens, +N newer smaller evals passed over); ~: speed-up varies over "
                             "20% by prompt"), style="dim"),
              highlight=False, no_wrap=True, overflow="ellipsis")
    for r, s in zip(runs, summaries):
        note = tau_gap(s["tau_est"], s["tau"])
        if note:
            out.print(Text(printable(f"τ of {r.id}: {note}"), style="yellow"), highlight=False, no_wrap=True,
                      overflow="ellipsis")


@app.command("events")
def events_command(
    run: str = typer.Argument(..., help="Run id (or an unambiguous prefix)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of lines."),
) -> None:
    """A run's events in time order: state changes, deploys, restarts, findings.

    One line per event, at any width and when piped (`grep crash` sees each whole):
    a message's line breaks are shown as ⏎; on a terminal (or with COLUMNS set) a
    line is cut to the width, and `--json` has every event whole (id, run_id, time,
    kind, severity, message, detail)."""
    from dflashctl.core.terminal import one_line

    store = _store()
    found = store.get_run(run)
    events = store.events(found.id)
    if as_json:
        print(json.dumps([e.to_dict() for e in events], indent=2))
        return
    colors = {"warning": "yellow", "error": "red", "critical": "bold red"}
    width = stream_width(sys.stdout)
    for e in events:
        head = f"{_when(e.time)}  "
        line = Text(one_line(f"{head}{e.severity:<8} {e.kind:<14} {e.message}", width))
        line.stylize(colors.get(e.severity, ""), len(head), len(head) + len(e.severity))
        _say_text(line)


def _say_text(line: Text) -> None:
    """One record as one line, never folded by the console (it is cut already, or
    whole for a pipe)."""
    try:
        out.print(line, highlight=False, soft_wrap=True)
    except OSError:
        pass
