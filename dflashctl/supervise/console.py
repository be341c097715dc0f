"""What the operator sees of the supervisor's stream, line by line.

The supervisor emits ``(kind, payload)`` pairs (an event, or a run's new metrics
record); this module turns them into one text line each (``format_line``) and runs
the supervisor in the foreground for one run, printing those lines (``follow``:
``dflashctl launch --foreground``). ``dflashctl watch`` prints with the same lines.

The lines carry what runs and hosts wrote as it is (messages, log excerpts): a
printer makes them safe for its terminal (``dflashctl.commands._app.printable``).

It imports the supervisor and never the reverse: the supervisor emits data and
never formats it for a person. It never decides, stores or reaches a host itself.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable

from dflashctl.core import contract
from dflashctl.core.terminal import one_line
from dflashctl.core.units import fmt_clock, fmt_duration, fmt_tok_s
from dflashctl.supervise.supervisor import Supervisor

if TYPE_CHECKING:
    from dflashctl.config import Inventory
    from dflashctl.store import Store


def metrics_parts(m: contract.Metrics) -> list[tuple[str, str]]:
    """One metrics record's figures, named: step, phase, tok/s, loss, accuracy, τ est, ETA."""
    parts = [("step", f"step {m.step}/{m.total_steps}"), ("phase", m.phase or "?")]
    if m.tok_s is not None:
        parts.append(("tok_s", fmt_tok_s(m.tok_s)))
    if m.loss is not None:
        parts.append(("loss", f"loss {m.loss:.4f}" if m.loss == 0 or abs(m.loss) >= 1e-3 else f"loss {m.loss:.2e}"))  # 4e-7 is not 0
    if m.acc is not None:
        parts.append(("acc", f"acc {m.acc:.3f}"))
    if m.accept_len is not None:
        parts.append(("tau_est", f"τ est {contract.tau_estimate(m.accept_len):.2f}"))  # accept_len + 1, as eval's τ
    if m.eta_s is not None:
        parts.append(("eta", f"ETA {fmt_duration(m.eta_s)}"))
    return parts


def format_metrics(m: contract.Metrics) -> str:
    """One metrics record on one line: step, phase, tok/s, loss, accuracy, acceptance, ETA."""
    return "  ".join(text for _, text in metrics_parts(m))


# What a narrow line gives up first, so that its key figures (step, loss, τ est) stay:
# the phase when it is plain training, the run id's head (its random tail stays), the
# accuracy, the ETA, the throughput.
_DROPPED_FIRST = ("training", "run", "acc", "eta", "tok_s", "phase", "loss")


WHOLE_EVENTS = ("eval",)
"""Events never cut: a result the operator came for (the eval's measured tau)."""


def format_line(kind: str, payload: Any, width: int | None = None) -> str:
    """One line per event (clock time, run, severity, kind, message) or metrics line,
    safe for a terminal: a message's line breaks shown as ⏎, cut to ``width`` when
    given. A metrics line too long for ``width`` gives up its least telling figures
    first (``_DROPPED_FIRST``), never its step or τ est; an event too long gives up
    its run id's head; a result (``WHOLE_EVENTS``) is never cut."""
    if kind == "metrics" and width is not None:
        return one_line(_fit_metrics(*payload, width), width)
    line = one_line(_line(kind, payload))
    if kind == "event" and payload.kind in WHOLE_EVENTS:
        return line  # a result: whole, folded by the terminal if need be
    if kind == "event" and width is not None and len(line) > width and payload.run_id:
        # A narrow terminal: the run id's random tail names the run; the message keeps the room.
        line = one_line(_line(kind, replace(payload, run_id=_short_id(payload.run_id))))
    return one_line(line, width)


def _short_id(run_id: str) -> str:
    return "…" + run_id.rsplit("-", 1)[-1]


def _fit_metrics(run_id: str, m: contract.Metrics, width: int) -> str:
    parts = [("clock", fmt_clock(m.time)), ("run", run_id), *metrics_parts(m)]
    line = "  ".join(text for _, text in parts)
    for drop in _DROPPED_FIRST:
        if len(line) <= width:
            break
        if drop == "training":
            parts = [p for p in parts if p != ("phase", contract.PHASE_TRAINING)]
        elif drop == "run":
            parts = [("run", _short_id(run_id)) if k == "run" else (k, t) for k, t in parts]
        else:
            parts = [p for p in parts if p[0] != drop]
        line = "  ".join(text for _, text in parts)
    return line


def _line(kind: str, payload: Any) -> str:
    if kind == "event":
        e = payload
        return f"{fmt_clock(e.time)}  {e.run_id}  {e.severity:<8} {e.kind:<11} {e.message}"
    if kind == "metrics":
        run_id, m = payload
        return f"{fmt_clock(m.time)}  {run_id}  {format_metrics(m)}"
    return str(payload)


def format_observation(o: dict[str, Any], width: int | None = None) -> str:
    """One line for what `watch --once` saw of a run: state, phase, step, speed,
    how old the newest sample is; then one line per finding (each line cut to
    ``width`` when given)."""
    step = f"step {o['step']}" + (f"/{o['total_steps']}" if o.get("total_steps") else "") if o.get("step") else "no step yet"
    speed = f", {fmt_tok_s(o['tok_s'])}" if o.get("tok_s") else ""
    age = f", newest sample {fmt_clock(o['sample_time'])}" if o.get("sample_time") else ""
    host = f"; host unreachable: {o['host_error']}" if o.get("host_error") else ""
    line = f"{o['run_id']}  {o['state']}" + (f" ({o['phase']})" if o.get("phase") else "") + f"  {step}{speed}{age}{host}"
    findings = (f"  {f['severity']:<8} {f['kind']:<11} {f['message']}" for f in o.get("findings", []))
    return "\n".join(one_line(text, width) for text in [line, *findings])


def follow(run_id: str, store: "Store", inventory: "Inventory", emit_line: Callable[[str], None], *,
           interval: float | None = None, playbooks_dir: str | None = None,
           stop: threading.Event | None = None, width: int | None = None) -> str:
    """Supervise one run in the foreground until it ends (``launch --foreground``),
    printing its events and metrics lines (fitted to ``width``: ``format_line``);
    returns its state then (final, unless
    ``stop`` was set: then the tick in progress finishes and the run is let go)."""
    sup = Supervisor(store, inventory, interval=interval, playbooks_dir=playbooks_dir, metrics=True,
                     emit=lambda kind, payload: emit_line(format_line(kind, payload, width)))
    try:
        sup.attach(run_id)
    except BaseException:
        sup.close()
        raise
    sup.run(stop)
    return store.get_run(run_id).state
