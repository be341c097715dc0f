"""The status console's text: pure functions from view models
(``dflashctl.status.model``) to rich ``Text``, shared by the live screen and
``status --once``: notices with their fix, the GPU pane, the highlighted run, a
multi-host run's hosts, a run's detail overview.

Never here: Textual (``status --once`` draws these without a screen), the store,
a host.
"""

from __future__ import annotations

import textwrap

from rich.text import Text

from dflashctl.core.terminal import printable
from dflashctl.core.units import NA, fmt_bytes, fmt_clock, fmt_duration, fmt_tok_s, short_duration, short_rate
from dflashctl.status.charts import ChartView
from dflashctl.status.columns import fit, fit_middle
from dflashctl.status.events import EventView
from dflashctl.status.gpus import HostLoad, HostView
from dflashctl.status.processes import busiest, lineage
from dflashctl.status.runs import DirectProbe, Notice, RunHostView, RunView, eval_source
from dflashctl.status.samples import SMOOTH_WINDOW_S
from dflashctl.status.styles import PHASE_STYLE, SEVERITY_STYLE, STATE_STYLE, bar, spark
from dflashctl.status.views import DetailView
from dflashctl.tui import charts


def notice_text(notices: list[Notice], width: int, lines: int = 2) -> Text:
    """The most urgent notices, one line each, with the command that fixes them."""
    out = Text()
    for i, n in enumerate(notices[:lines]):
        more = len(notices) - lines if i == lines - 1 and len(notices) > lines else 0
        suffix = f" (+{more} more)" if more else ""
        fix = f"  → {n.fix}" if n.fix else ""  # never cut: it is the command to copy
        if i:
            out.append("\n")
        style = "bold red" if n.severity == "error" else "yellow"
        out.append(fit(f"{'✖' if n.severity == 'error' else '▲'} {n.text}", max(10, width - len(fix) - len(suffix))),
                   style=style)
        out.append(fix, style="bold")
        out.append(suffix, style="dim")
    return out


def _age(g, now: float, said_by=None) -> tuple[str, str]:
    """A reading's age and its style: red past three polls (``GpuView.stale``); blank
    where ``said_by`` (the host line above, from the same poll) already says it and
    it is not stale, so a tick of the clock repaints that one line, not every GPU's."""
    age = g.age_s(now)
    if age is None:
        return NA, "dim"
    if said_by is not None and said_by.time == g.time and not g.stale(now):
        return "", "dim"
    return short_duration(age), "bold red" if g.stale(now) else "dim"


def _gpu_row(g, width: int, compact: bool, now: float, said_by=None) -> Text:
    role = {"target": "target", "drafter": "drafter", "target+drafter": "tgt+drf"}.get(g.role or "", "-")
    util = NA if g.utilization_pct is None else f"{g.utilization_pct:3.0f}%"
    temp = NA if g.temperature_c is None else f"{g.temperature_c:.0f}°C"
    age, age_style = _age(g, now, said_by)
    foreign = sum(a.foreign for a in g.apps)
    row = Text()
    if compact:
        row.append(f" {'' if g.index is None else g.index:>2} ")
        row.append(f"{role[0].upper() if g.role else '-'} ", style="bold")
        row.append(bar((g.utilization_pct or 0) / 100 if g.utilization_pct is not None else None, 5), style="green")
        row.append(f" {util:>4} ")
        row.append(bar(g.memory_fraction, 5), style="cyan")
        row.append(f" {g.memory_text():>8} {temp:>5} {g.power_text():>9} ")
        row.append(f"{age:>4} ", style=age_style)
        if foreign:
            row.append(f"⚠{foreign} ", style="bold yellow")
        room = width - row.cell_len - 1
        if room > 8 and g.run_id:
            row.append(fit_middle(g.run_id, min(room, 25)), style="dim")
    else:
        bars = max(6, min(20, (width - 100) // 3 + 7))  # the row is 79 cells besides its bars and history
        hist = max(6, min(24, width - 80 - 2 * bars))
        row.append(f" {'' if g.index is None else g.index:>2} ")
        row.append(f"{role:<8}", style="bold")
        row.append(f"{fit_middle(g.run_id or ('idle' if g.idle else '-'), 16):<16} ", style="dim" if not g.run_id else "")
        row.append("util ")
        row.append(bar((g.utilization_pct or 0) / 100 if g.utilization_pct is not None else None, bars), style="green")
        row.append(f" {util:>4}  mem ")
        row.append(bar(g.memory_fraction, bars), style="cyan")
        row.append(f" {g.memory_text():>8}  {temp:>5}  {g.power_text():>9}  ")
        row.append(f"{age:>5} ", style=age_style)
        row.append(spark(g.utilization_history, hist, high=100.0), style="green")
    if g.clocks is not None and g.clocks.slowdowns:  # why its clocks are held down (the pane clips what has no room)
        for reason in g.clocks.slowdowns:
            row.append(f" {SLOWDOWN_SHORT.get(reason, reason)}", style="bold red" if reason.startswith("hw") else "yellow")
    if g.idle:
        row.stylize("dim")
    return row


# A throttle reason as a GPU row says it (the detail, and `nvidia-smi -q -d PERFORMANCE`, say it whole).
SLOWDOWN_SHORT = {"sw power cap": "pwr-cap", "hw slowdown": "HW-SLOW", "hw thermal slowdown": "HW-HOT",
                  "sw thermal slowdown": "hot", "hw power brake slowdown": "HW-PWR-BRAKE", "sync boost": "sync",
                  "applications clocks setting": "app-clocks", "display clocks setting": "disp-clocks"}


def busiest_text(load: HostLoad, width: int, n: int = 3) -> Text:
    """The host's busiest processes in one line: CPU share, user, command."""
    out = Text("   busiest: ", style="dim")
    for i, p in enumerate(busiest(load.processes, n)):
        if i:
            out.append(" · ", style="dim")
        out.append(f"{p.cpu_pct:.0f}% ", style="bold" if (p.cpu_pct or 0) >= 90 else "")
        out.append(f"{p.user or '?'} ", style="dim")
        out.append(_one_line(fit(p.cmd or f"pid {p.pid}", 40)))
    out.truncate(width, overflow="ellipsis")
    return out


def _host_row(load: HostLoad, width: int, compact: bool, now: float) -> Text:
    """The host's CPU and memory under its header, in the GPU rows' columns: CPU
    busy share (its bar falls back to the load per CPU), memory used of total, the
    1-minute load average over the CPUs, the reading's age (red past three polls,
    as a GPU's). What the host did not tell reads N/A."""
    age, age_style = _age(load, now)
    cpus = f"{load.cpus} CPUs" if load.cpus else ""
    if load.cpu_cgroup is not None:  # a container's quota: the busy share is of it
        cpus = f"{load.cpu_cgroup:g}/{load.cpus or '?'} CPUs"
    if compact:  # " 0 T " then the bars, as _gpu_row
        row = Text("  cpu ")
        bars, mid, tail = 5, " ", f" load {load.load_text():<10} {age:>4}"
    else:
        bars = max(6, min(20, (width - 100) // 3 + 7))
        row = Text(f"    {'host':<8}{cpus:<16} cpu  ", style="")
        # 'cgrp': the memory is the container's cgroup limit and what is left under it
        mid, tail = " cgrp " if load.mem_cgroup else "  ram ", f"  load {load.load_text():<11}  {age:>5}"
    row.append(bar(load.cpu_fraction, bars), style="green")
    row.append(f" {load.busy_text():>4}{mid}")
    row.append(bar(load.memory_fraction, bars), style="cyan")
    row.append(f" {load.memory_text():>8}")
    row.append(tail[:-len(age)])
    row.append(age, style=age_style)
    row.truncate(width, overflow="ellipsis")
    return row


def _app_rows(g, width: int) -> Text:
    """A GPU's compute processes, one line each: pid, memory, name; the run's trainer
    (or standby) named, any other process marked foreign."""
    out = Text()
    for a in g.apps:
        out.append("\n")
        line = Text(f"      pid {a.pid if a.pid is not None else NA:>7}  "
                    f"{NA if a.used_memory_mib is None else f'{a.used_memory_mib / 1024:.1f}G':>6}  ")
        if a.foreign:
            line.append("foreign ", style="bold yellow")
        else:
            line.append(f"{a.role} ", style="bold green")
            if g.run_id:
                line.append(f"of {g.run_id} ", style="dim")
        if a.process is not None:  # who, how much, since when, what: as htop and nvitop show it
            line.append(f"{a.process.figures()}  ")
            line.append(_one_line(a.process.cmd or a.name or ""), style="dim")
        else:
            line.append(_one_line(a.name or ""), style="dim")
        line.truncate(width, overflow="ellipsis")
        out.append_text(line)
    return out


def gpu_text(hosts: list[HostView], width: int, now: float, compact: bool = False) -> Text:
    """Per host a header line (its GPUs and how fresh their readings are), then one
    row per GPU: index, role, the run holding it, utilisation and memory bars,
    temperature, power, the reading's age (where the host line above, from the same
    poll, does not already say it) and the utilisation history."""
    out = Text()
    if not hosts:
        return Text("no host with an active run", style="dim")
    for h in hosts:
        if out:
            out.append("\n")
        stale = h.down_since is not None or not h.supervised
        head = _one_line(f"{h.host} · {len(h.gpus)} GPU(s) · {h.status_text(now)}")  # a host's error is its text
        out.append(fit(head, width), style="bold red" if stale else "bold")
        if h.load is not None:
            out.append("\n")
            out.append_text(_host_row(h.load, width, compact, now))
            if not compact and busiest(h.load.processes):
                out.append("\n")
                out.append_text(busiest_text(h.load, width))
        if not h.gpus:
            out.append("\n  no GPU readings (CPU run, or nvidia-smi not read yet)", style="dim")
        for g in h.gpus:
            out.append("\n")
            out.append_text(_gpu_row(g, width, compact, now, said_by=h.load))
            if not compact:
                out.append_text(_app_rows(g, width))
    return out


def _one_line(text: str) -> str:
    """Text from the store or a host on one line, its control characters shown, not obeyed."""
    return " ".join(printable(text).split())


def run_hosts_text(hosts: list[RunHostView], width: int, indent: str = "  ") -> Text:
    """A multi-host run's hosts, one line each: rank, host, phase (or that its process
    ended, or is gone), step, how old that is (``stale:`` when older than the run's
    freshness window), what could not be read. Lines are cut at ``width``."""
    out = Text()
    if not hosts:
        return out
    rank_width = max(len(str(h.rank)) for h in hosts)
    host_width = min(24, max(len(_one_line(h.host)) for h in hosts))
    for h in hosts:
        if out:
            out.append("\n")
        line = Text(f"{indent}rank {h.rank:<{rank_width}}  {fit(_one_line(h.host), host_width):<{host_width}}  ")
        if h.exit_code is not None or h.alive is False:
            state_style = STATE_STYLE["done" if h.exit_code == 0 else "failed"]
        else:
            state_style = PHASE_STYLE.get(h.phase or "", "")
        if h.seen is not None:  # a host never seen has no state to show
            line.append(f"{_one_line(h.state_text())}  ", style=state_style)
        if h.step is not None:
            line.append(f"step {h.step:,}  ")
        line.append(h.seen_text(), style="yellow" if h.stale or h.seen is None else "dim")
        if h.error:
            line.append(f"  {_one_line(h.error)}", style="red")
        line.truncate(width, overflow="ellipsis")
        out.append_text(line)
    return out


def run_text(run: RunView | None, events: list[EventView], width: int, now: float, event_lines: int = 6,
             probe: DirectProbe | None = None, chart: ChartView | None = None, chart_rows: int = 1,
             chart_count: int = 3, watch_key: bool = False) -> Text:
    """The highlighted run: who watches it, phase, progress, throughput against its
    baseline, ETA and its window, loss and tau, restarts; its history charts
    (``chart``: ``chart_count`` of tok/s, loss, τ est, ``chart_rows`` rows each); then
    its newest events. ``watch_key``: the console's ``w`` can start the supervisor
    an unsupervised run's fix names."""
    if run is None:
        return Text("no run here: `dflashctl launch demo` starts one", style="dim")
    f = run.freshness
    out = Text()
    out.append(run.id, style="bold")
    out.append(f" · {run.playbook} on {run.host} · ")
    out.append(run.display_state, style=STATE_STYLE.get(run.display_state, ""))
    if run.active:
        if f.supervised:
            out.append(f" · supervised (pid {f.supervisor_pid}, tick {fmt_duration(max(0, now - (f.last_tick or now)))} ago)")
        if f.note:
            out.append(f"\n{f.note}", style="bold red" if not f.supervised or f.host_down_since else "yellow")
        if f.fix:
            out.append("  fix: ", style="bold")
            out.append(f.fix, style="bold reverse")
            if watch_key and not f.supervised:
                out.append("  or press w", style="bold")
        if probe is not None and not f.supervised:
            out.append(f"\n{probe.text(now)}", style="cyan")
    elif run.exit_reason and run.exit_reason != run.display_state:  # "done · done" says nothing twice
        out.append(f" · {run.exit_reason}")
    out.append("\n")
    if run.active:
        out.append("phase ")
        out.append(run.phase_text(), style="bold red" if run.phase.over_budget else "bold")
        out.append(" · ")
    out.append(f"step {run.step_text()}" + (f" ({run.progress_text()})" if run.progress_pct is not None else ""))
    if run.active:
        window = fmt_duration(min(run.window_s, SMOOTH_WINDOW_S)) if run.window_s else "1 sample"
        out.append(f" · ETA {run.eta_text()}" + (f" (step rate over {window})" if run.eta_s is not None else ""))
    out.append("\n")
    rate = run.tok_s if run.tok_s is not None else run.tok_s_last
    out.append(f"tok/s {fmt_tok_s(rate) if rate is not None else NA}")
    if run.tok_s is not None and run.window_s:
        out.append(f" (mean over {fmt_duration(run.window_s)})")
    if run.baseline_pct is not None:
        out.append(f" = {run.baseline_pct:.0f}% of baseline {fmt_tok_s(run.baseline_tok_s)}",
                   style="bold red" if run.baseline_pct < 60 else "")
    if run.samples_s is not None:
        out.append(f" · {run.samples_s:.3g} samples/s")
    measured = f" ({100 * run.mfu_measured:.0f}% of the measured matmul rate)" if run.mfu_measured is not None else ""
    out.append(f" · loss {run.cell('loss')} · τ est {run.cell('accept')} · τ {tau_text(run)} · MFU {run.cell('mfu')}"
               f"{measured} · restarts {run.restarts} · data age {run.age_text()}")
    if run.tau_note:
        out.append(f"\n{run.tau_note}", style="yellow")
    if chart is not None:
        out.append("\n")
        out.append_text(history_text(chart, width, chart_rows, chart_count))
    out.append_text(event_lines_text(events, width, event_lines))
    return out


EVENT_FOLD = 3  # lines an event's message may take in the run pane (its end, the fix, is never cut off)


def event_lines_text(events: list[EventView], width: int, lines: int) -> Text:
    """The newest events that fit ``lines`` lines, oldest first, each message folded
    onto up to ``EVENT_FOLD`` indented lines rather than cut: a finding's fix is at
    its end ("resume it with `kill -CONT`")."""
    out = Text()
    body = max(10, width - 17)
    blocks: list[list[str]] = []
    used = 0
    for e in reversed(events):
        if used >= lines:
            break
        folded = textwrap.wrap(f"{_one_line(e.classification or e.kind):<14} {_one_line(e.message)}", body) or [""]
        folded = folded[:min(EVENT_FOLD, max(1, lines - used))]
        if len(folded) == EVENT_FOLD or used + len(folded) >= lines:
            folded[-1] = fit(folded[-1], body)
        blocks.append(folded)
        used += len(folded)
    shown = events[len(events) - len(blocks):] if blocks else []
    for e, folded in zip(shown, reversed(blocks)):
        out.append("\n")
        out.append(f"{fmt_clock(e.time)} ", style="dim")
        out.append(f"{e.severity:<7} ", style=SEVERITY_STYLE.get(e.severity, ""))
        out.append(folded[0])
        for more in folded[1:]:
            out.append(f"\n{'':17}{more}")
    return out


def banner_text(e: EventView, width: int, lines: int = 3) -> Text:
    """The banner over the runs for a new error event: its run, time and message
    (folded, not cut), and the trainer's own first error line."""
    head = f"✖ new {e.severity} {fmt_clock(e.time)} {e.run_id or ''} {e.classification or e.kind}: "
    first = e.first_error
    text = _one_line(head + e.message + (f" · first error: {first}" if first and first not in e.message else ""))
    folded = textwrap.wrap(text, max(10, width)) or [""]
    if len(folded) > lines:
        folded = folded[:lines]
        folded[-1] = fit(folded[-1] + " …", max(10, width - 12)) + "  (Esc hides)"
    return Text("\n".join(folded), style="bold")


def event_text(e: EventView) -> Text:
    """One event in full (the event window): when, what, its whole message, the
    trainer's own first error line, then the signature it matched and its details."""
    out = Text()
    out.append(f"{fmt_clock(e.time)} ", style="dim")
    out.append(e.severity, style=SEVERITY_STYLE.get(e.severity, "") or "bold")
    out.append(f" · {e.classification or e.kind} · run {e.run_id or '-'}\n\n")
    out.append(printable(e.message) + "\n")
    first = e.first_error
    if first:
        out.append("\nfirst error line: ", style="bold")
        out.append(printable(first) + "\n", style="red")
    d = e.detail
    finding = d.get("finding") if isinstance(d.get("finding"), dict) else {}
    signature = d.get("signature") or finding.get("signature")
    if signature:
        out.append("signature: ", style="bold")
        out.append(f"{signature}\n")
    shown = {k: v for k, v in d.items() if k not in ("signature", "matched_line", "exception")}
    for key, value in shown.items():
        if isinstance(value, list):
            value = "; ".join(map(str, value))
        out.append(f"  {key}: ", style="dim")
        out.append(printable(str(value)) + "\n")
    return out


# (title, ChartView.points key, style, y label format, y floor: tok/s from 0, the others from their lowest)
CHARTS = (("tok/s", "tok_s", "green", short_rate, 0.0),
          ("loss", "loss", "yellow", lambda v: f"{v:.3f}", None),
          ("τ est", "tau_est", "cyan", lambda v: f"{v:.2f}", None))
CHART_HEADER_LINES = 5  # the run pane's lines above its charts (id, notes, phase, figures)
MIN_EVENT_LINES = 3


def run_pane_layout(height: int, compact: bool) -> tuple[int, int, int]:
    """How the run pane of ``height`` rows shares them out: (rows per chart, charts,
    event lines). Compact: one-row charts (tok/s only when even those do not fit);
    else as tall as leaves ``MIN_EVENT_LINES`` events (at most 6 rows), the events
    taking every row the charts do not."""
    room = height - CHART_HEADER_LINES - MIN_EVENT_LINES
    if compact:
        rows, count, lines = 1, (3 if room >= 3 else 1), (3 if room >= 3 else 1)
    else:
        rows = max(1, min(6, (room - 2) // len(CHARTS) - 1))
        count = len(CHARTS)
        lines = count * (rows + 1) + 2 if rows > 1 else count
    return rows, count, max(MIN_EVENT_LINES, height - CHART_HEADER_LINES - lines)


HISTORY_KEPT = 8  # drawn charts kept (the main screen's and the detail view's, a few widths)
_history_drawn: dict[tuple, tuple[list, float, Text]] = {}  # key -> (series, t1 drawn at, text)


def history_text(chart: ChartView, width: int, rows: int, count: int = len(CHARTS)) -> Text:
    """``_history_text``, drawn again only when what it draws changed: the series (the
    reader keeps its list until newer data comes), the marks, the size, or the window's
    end by a column's time or more (a live window ends at the clock: drawn again on
    every refresh it would move a column only every so many; the axis says the end
    drawn). A refresh that brings nothing new (most of them: a supervisor polls every
    4-15 s, the screen reads every 2 s) costs a lookup."""
    key = (chart.zoom, chart.t0, chart.first, id(chart.series), len(chart.series), tuple(chart.marks),
           width, rows, count)
    drawn = _history_drawn.get(key)
    if drawn is None or drawn[0] is not chart.series or \
            not 0 <= chart.t1 - drawn[1] < (drawn[1] - chart.t0) / max(1, width):  # a column of the drawn window
        # (an id is only unique while its list lives)
        drawn = _history_drawn[key] = (chart.series, chart.t1, _history_text(chart, width, rows, count))
        while len(_history_drawn) > HISTORY_KEPT:
            _history_drawn.pop(next(iter(_history_drawn)))
    return drawn[2].copy()


def _history_text(chart: ChartView, width: int, rows: int, count: int = len(CHARTS)) -> Text:
    """The run's tok/s, loss and τ est (the first ``count`` of them) from ``chart.t0``
    to ``chart.t1``. ``rows`` 1: a line each (name, cells, the newest value; the zoom
    after the first); taller: per chart a title (newest, lowest and highest value,
    the zoom) and ``rows`` rows with y labels; under them one axis with the restarts
    and stalls marked at their time, and the clock."""
    marks = [(m.time, m.kind) for m in chart.marks]
    shown = [(name, chart.points(key), style, fmt, low) for name, key, style, fmt, low in CHARTS[:count]]
    out = Text()
    if rows <= 1:
        for i, (name, pts, style, fmt, low) in enumerate(shown):
            tail = f" {fmt(pts[-1][1]) if pts else NA}" + (f" · {chart.title()}" if i == 0 else "")
            out.append("\n" if i else "")
            out.append(f"{name:<6}", style="bold")
            out.append_text(charts.chart(pts, chart.t0, chart.t1, max(8, width - 6 - len(tail)), 1, marks,
                                         style=style, low=low))
            out.append(tail, style="dim")
        return out
    labels = max([charts.label_width(pts, fmt, low) for _, pts, _, fmt, low in shown] + [1])
    for i, (name, pts, style, fmt, low) in enumerate(shown):
        out.append("\n" if i else "")
        title = Text(name, style="bold")
        if not pts:
            out.append_text(title.append(f"  {NA} (no samples) · {chart.title()}", style="dim"))
            continue
        values = [v for _, v in pts]
        title.append(f"  now {fmt(values[-1])} · min {fmt(min(values))} · max {fmt(max(values))} · {chart.title()}")
        if i == 0 and marks:
            title.append("  ")
            title.append_text(charts.legend(marks))
        title.truncate(width, overflow="ellipsis")
        out.append_text(title)
        out.append("\n")
        out.append_text(charts.chart(pts, chart.t0, chart.t1, width, rows, marks, style=style, fmt=fmt, low=low,
                                     labels=labels, axis=False))
    plot = max(1, width - labels - 1)
    out.append("\n")
    out.append_text(charts.axis_row(chart.t0, chart.t1, plot, marks, labels))
    out.append("\n" + charts.time_axis(chart.t0, chart.t1, plot, labels + 1), style="dim")
    return out


def detail_chart_rows(height: int | None) -> int:
    """Rows per history chart in a detail view ``height`` rows tall (None: unknown)."""
    if height is None or height >= 50:
        return 6
    return 4 if height >= 30 else 2


def relations_text(run: RunView, host: HostView | None, width: int, now: float) -> Text:
    """How a run's processes hang together: its supervisor (this machine's pid, its
    tmux session), its trainer and standby on the run's host (each with who, how much,
    since when, what) and the trainer's parents there (run.sh, the tmux server), from
    the host's newest reading."""
    from dflashctl.launch import supervisor_session

    out = Text()
    f = run.freshness
    line = Text("  supervisor  ", style="bold")
    if f.supervisor_pid:
        line.append(f"pid {f.supervisor_pid}" + (f", tick {fmt_duration(max(0.0, now - f.last_tick))} ago"
                                                 if f.last_tick else "") + f" · tmux session {supervisor_session(run.id)}")
    else:
        line.append("none", style="bold red")
    out.append_text(line)
    apps = [a for g in (host.gpus if host else []) for a in g.apps
            if a.role and (a.run_id == run.id or (a.run_id is None and g.run_id == run.id))]
    shown: set[int] = set()
    processes = host.load.processes if host and host.load else []
    for role in ("trainer", "standby"):
        for a in apps:
            if a.role != role or a.pid is None or a.pid in shown:
                continue
            shown.add(a.pid)
            out.append("\n")
            row = Text(f"  {role:<10}  ", style="bold")
            row.append(f"pid {a.pid}  " + (a.process.figures() + "  " if a.process else ""))
            row.append(_one_line((a.process.cmd if a.process else None) or a.name or ""), style="dim")
            row.truncate(width, overflow="ellipsis")
            out.append_text(row)
            for depth, parent in enumerate(lineage(processes, a.pid)[1:], 1):
                out.append("\n")
                up = Text(f"  {'':<10}  {'  ' * depth}↑ pid {parent.pid} {parent.user or '?'}  ", style="dim")
                up.append(_one_line(parent.cmd or ""))
                up.truncate(width, overflow="ellipsis")
                out.append_text(up)
    if not shown:
        out.append("\n  trainer     no GPU process of it in the host's newest reading"
                   + (" (a CPU run)" if not run.gpus else ""), style="dim")
    return out


def detail_text(d: DetailView, width: int, now: float, height: int | None = None,
                host: HostView | None = None) -> Text:
    """The overview tab of a run's detail view: the run, its history as charts (at the
    screen's zoom, ``detail_chart_rows(height)`` rows each), its thresholds, its
    environment and restarts."""
    out = run_text(d.run, [], width, now, event_lines=0)
    if d.run.last_event is not None:
        out.append("\nlast event: ", style="bold")
        out.append(d.run.last_event_text(), style=SEVERITY_STYLE.get(d.run.last_event.severity, ""))
    if d.run_dir:
        out.append(f"\nrun directory: {d.run_dir}" + (f" · exit code {d.exit_code}" if d.exit_code is not None else ""))
    if d.store_bytes is not None:
        kept = "every sample kept" if d.history_from is None else \
            f"every sample since {fmt_clock(d.history_from)}, rollups before"
        out.append(f"\nstore: {fmt_bytes(d.store_bytes)} of the run store ({kept})", style="dim")
    if d.run.hosts:
        out.append(f"\n\nhosts ({len(d.run.hosts)})\n", style="bold underline")
        out.append_text(run_hosts_text(d.run.hosts, width))
    if d.run.active:
        out.append(f"\n\nprocesses on {d.run.host}\n", style="bold underline")
        out.append_text(relations_text(d.run, host, width, now))
    span = ""
    if d.series:
        span = f" ({fmt_duration(d.series[-1]['time'] - d.series[0]['time'])} of history, " \
               f"{sum(p['samples'] for p in d.series)} samples)"
    out.append(f"\n\nhistory{span}\n", style="bold underline")
    if d.chart is not None:
        out.append_text(history_text(d.chart, max(20, width - 2), detail_chart_rows(height)))
    else:
        out.append("no samples yet", style="dim")
    out.append("\n\nthresholds (the playbook's)\n", style="bold underline")
    for name, value in d.thresholds.lines():
        out.append(f"  {name:<15}", style="bold")
        out.append(f"{value}\n", style="yellow" if name == "warning" else "")
    out.append("\nenvironment audit\n", style="bold underline")
    for line in d.env.lines():
        out.append(f"  {line}\n")
    out.append(f"\nrestarts ({len(d.restarts)})\n", style="bold underline")
    for r in d.restarts[-10:]:
        out.append(f"  {fmt_clock(r['time'])} {r.get('signature') or '-'}: {r['reason']} "
                   f"[{r.get('outcome') or '-'}]" + (f" downtime {fmt_duration(r['downtime_s'])}"
                                                     if r.get("downtime_s") is not None else "") + "\n")
    if not d.restarts:
        out.append("  none\n", style="dim")
    return out


def tau_text(run) -> str:
    """The measured tau with where it comes from: '7.97 (eval 20261203-171500-a1b2c3 at step 300, 4 prompts,
    256 tokens, τ ±0.12; 5.45x greedy, 4.9-6.1x)', 'n/a (no eval yet)'."""
    if run.tau is None:
        return "n/a (no eval: dflashctl eval RUN)"
    return f"{run.tau:.2f} ({eval_source(run.tau_eval or {})})"
