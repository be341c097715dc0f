"""StatusReader: reads the status and detail views from the store, keeping what changes slowly.

Everything comes from the store (the supervisor writes it) and the run's playbook
file (its thresholds); nothing touches a host. ``load_status`` is one read.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from dflashctl.core.states import RUNNING
from dflashctl.status.charts import ChartView, chart_window, marks_of
from dflashctl.status.events import EventView
from dflashctl.status.freshness import freshness
from dflashctl.status.gpus import AppView, GpuView, HostLoad, HostView, _float, gpu_readings
from dflashctl.status.heartbeats import heartbeats_now
from dflashctl.status.phase import derive_phase
from dflashctl.status.processes import Clocks
from dflashctl.status.runs import RunHostView, RunView, attention_of, notices_of, sort_runs
from dflashctl.status.samples import current_process, smooth
from dflashctl.status.thresholds import Thresholds, _thresholds_of
from dflashctl.status.views import DetailView, EnvSummary, StatusView
from dflashctl.store import Run, SeriesGrid, Store, preferred_eval

HISTORY = 60  # newest samples per active run read on each refresh (smoothing, sparkline)
FINISHED_HISTORY = 12  # of a finished run
GPU_HISTORY = 16  # GPU readings per GPU in its history
EVENTS = 40  # recent events of the selected run
ERRORS = 20  # newest error events of every run read on each refresh (the console's banner and bell)
DETAIL_EVENTS = 500  # events in a run's detail view
RECENT_RUNS = 20  # finished runs shown besides the active ones
SERIES_POINTS = 240  # buckets of a run's whole history in its charts
BASELINE_TTL_S = 60.0  # a learned baseline is read again after this long
SIZE_TTL_S = 60.0  # a run's share of the store is read again after this long
DEFAULT_POLL_S = 15.0  # a host's readings are stale after three of these when nothing says its poll interval


def total_steps(run: Run) -> int | None:
    try:
        return int(run.config["trainer"]["train"]["steps"])
    except (KeyError, TypeError, ValueError):
        return None


def roles_of(run: Run) -> dict[int, str]:
    """Physical GPU index -> its role in the run (target, drafter, target+drafter)."""
    try:
        placement = run.config["trainer"]["placement"]
    except (KeyError, TypeError):
        return {}
    if not isinstance(placement, dict) or placement.get("device") == "cpu":
        return {}
    roles: dict[int, str] = {}
    for role in ("target", "drafter"):
        for g in placement.get(role) or []:
            try:
                g = int(g)
            except (TypeError, ValueError):
                continue
            roles[g] = f"{roles[g]}+{role}" if g in roles else role
    return roles


def select_runs(store: Store, run: str | None = None, recent: int = RECENT_RUNS) -> list[Run]:
    """One run (by id or prefix), or the active runs and then the most recent others."""
    if run is not None:
        return [store.get_run(run)]
    active = store.list_runs(active_only=True)
    seen = {r.id for r in active}
    return active + [r for r in store.list_runs(limit=recent) if r.id not in seen]


class StatusReader:
    """Reads status and detail views from a store, keeping what changes slowly
    (playbook thresholds, learned baselines) between refreshes. Used from one
    worker thread at a time (the store gives each thread its own connection)."""

    def __init__(self, store: Store, playbooks_dir: str | None = None):
        self.store = store
        self.playbooks_dir = playbooks_dir
        self._thresholds: dict[tuple, Thresholds] = {}
        self._baselines: dict[str, tuple[float, float | None]] = {}
        self._sizes: dict[str, tuple[float, int | None]] = {}
        self._series: dict[tuple, tuple[float | None, SeriesGrid | None, list[dict[str, Any]]]] = {}
        self._readings: dict[tuple, tuple[float | None, list[dict[str, Any]]]] = {}
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- slow-changing inputs

    def thresholds(self, run: Run) -> Thresholds:
        source = (run.config or {}).get("playbook_source") or run.playbook
        try:
            mtime = os.stat(source).st_mtime
        except (OSError, TypeError, ValueError):
            mtime = None
        key = (run.playbook, source, mtime)
        with self._lock:
            cached = self._thresholds.get(key)
        if cached is None:
            cached = _thresholds_of(run, self.playbooks_dir)
            with self._lock:
                self._thresholds[key] = cached
        return cached

    def baseline(self, run: Run, now: float) -> float | None:
        own = self.thresholds(run).baseline_tok_s
        if own:
            return own
        with self._lock:
            cached = self._baselines.get(run.playbook)
        if cached is None or now - cached[0] > BASELINE_TTL_S:
            cached = (now, self.store.baseline_tok_s(run.playbook, exclude_run=run.id))
            with self._lock:
                self._baselines[run.playbook] = cached
        return cached[1]

    # ----------------------------------------------------------------- one run

    def run_view(self, run: Run, heartbeats: list[dict], now: float, history: int = HISTORY) -> RunView:
        store = self.store
        # A finished run needs its newest figures and a short history only.
        samples = store.recent_samples(run.id, history if run.active else min(history, FINISHED_HISTORY))
        newest = samples[-1] if samples else None
        fresh = freshness(run, heartbeats, newest, now)
        state_events = store.events(run.id, kind="state")
        restarts = store.restarts(run.id)
        # A finished run's last word is how it ended; what was written after (a
        # supervisor looking at it once more) must not hide the cause.
        if run.active:
            last = store.events(run.id, limit=1)
            last_event = EventView.from_event(last[-1]) if last else None
        else:
            last_event = EventView.from_event(state_events[-1]) if state_events else None
        # The clock of a run whose data is not live stops at its newest data.
        as_of = now if fresh.live or not run.active else max(
            [t for t in (fresh.data_time, fresh.host_last_answer, fresh.last_tick) if t] or [run.updated or run.created])
        phase = derive_phase(run, samples, state_events, restarts, lambda: self.thresholds(run), as_of)
        smoothed = smooth(samples)
        total = total_steps(run)
        view = RunView(
            id=run.id, playbook=run.playbook, host=run.host, state=run.state, created=run.created,
            freshness=fresh, phase=phase, total_steps=total,
            restarts=sum(1 for r in restarts if r.counts), last_event=last_event, exit_reason=run.exit_reason,
            gpus=run.gpus, roles=roles_of(run),
            hosts=[RunHostView.from_row(h, now, fresh.stale_after_s) for h in run.hosts],
        )
        regression = store.events(run.id, kind="regression", limit=1) if run.active else []
        view.attention = attention_of(run, view.display_state, restarts, regression[-1] if regression else None, now,
                                      self.thresholds(run).restart_window_s if restarts else 0.0)
        process = current_process(samples)
        view.tok_s_history = [s.tok_s for s in process if s.tok_s is not None]
        view.loss_history = [s.loss for s in process if s.loss is not None]
        view.accept_history = [s.accept_len for s in process if s.accept_len is not None]
        view.tau, view.tau_eval = measured_tau(store.evals(run.id))
        if newest is not None:
            view.step, view.tok_s_last, view.loss = newest.step, newest.tok_s, newest.loss
            view.acc, view.accept_len, view.mfu, view.sample_time = newest.acc, newest.accept_len, newest.mfu, newest.time
            view.samples_s, view.mfu_measured = newest.samples_s, newest.mfu_measured
            view.tok_s, view.window_s = smoothed.tok_s, smoothed.window_s
        if run.active and view.tok_s is not None and phase.name == "training":
            view.baseline_tok_s = self.baseline(run, now)
            if view.baseline_tok_s:
                view.baseline_pct = 100.0 * view.tok_s / view.baseline_tok_s
        # A stalled run makes no steps: no step rate says when it ends (no ETA).
        if run.active and fresh.live and newest is not None and run.state == RUNNING \
                and phase.name in ("training", "checkpointing"):
            if smoothed.steps_per_s and total:
                view.eta_s = max(0.0, total - newest.step) / smoothed.steps_per_s
            elif newest.eta_s is not None:
                view.eta_s = newest.eta_s
        return view

    # ----------------------------------------------------------------- GPUs

    def hosts(self, runs: list[Run], heartbeats: list[dict], now: float, polled: bool = True) -> list[HostView]:
        """Every host with an active run and (``polled``) every host a live supervisor
        polls: its GPUs and its CPU and memory from its newest polls (``Store.readings``)."""
        by_host: dict[str, list[Run]] = {}
        for r in runs:
            by_host.setdefault(r.host, []).append(r)
        live = [b for b in heartbeats if not b.get("stopped")
                and now - (b.get("last_tick") or 0) <= 3 * max(1.0, b.get("interval") or 1)]
        for b in live if polled else []:
            for host in sorted(b.get("hosts") or {}):
                by_host.setdefault(host, [])
        views = []
        for host, host_runs in by_host.items():
            beat = next((b for b in heartbeats if host in (b.get("hosts") or {})), None)
            info = ((beat or {}).get("hosts") or {}).get(host) or {}
            ticking = [b for b in live if host in (b.get("hosts") or {})
                       or set(b.get("runs") or []) & {r.id for r in host_runs}]
            hv = HostView(host, [r.id for r in host_runs], info.get("last_ok"), info.get("down_since"),
                          info.get("error"), bool(ticking))
            stale_after = 3 * (self.thresholds(host_runs[0]).poll_interval_s if host_runs
                               else max([b.get("interval") or 0 for b in ticking] or [DEFAULT_POLL_S]))
            hv.gpus = self.gpu_views(host, host_runs, stale_after)
            hv.load = self.host_load(host, stale_after)
            hv.join_processes()
            views.append(hv)
        return views

    def gpu_views(self, host: str, host_runs: list[Run], stale_after: float) -> list[GpuView]:
        """Each GPU of the host from its newest poll, with its history; the GPUs its
        runs hold but no poll has read yet, as unknown."""
        readings = self.readings(host, GPU_HISTORY, "gpu")
        holders: dict[int, tuple[str, str | None]] = {}
        for r in host_runs:
            roles = roles_of(r)
            for g in r.gpus:
                holders.setdefault(g, (r.id, roles.get(g)))
        if not readings:
            return [GpuView(host, index, role=role, run_id=holder) for index, (holder, role) in sorted(holders.items())]
        history: dict[Any, list[dict]] = {}
        for reading in readings:
            for g in gpu_readings(reading["gpu"]):
                history.setdefault(g.get("index"), []).append(g)
        newest = readings[-1]
        views = []
        for g in gpu_readings(newest["gpu"]):
            index = g.get("index") if isinstance(g.get("index"), int) else None
            holder, role = holders.get(index, (None, None))
            past = history.get(g.get("index"), [])
            apps = g.get("apps") if isinstance(g.get("apps"), list) else None
            views.append(GpuView(
                host, index, g.get("name") if isinstance(g.get("name"), str) else None, role, holder,
                newest["time"], _float(g.get("utilization_pct")), _float(g.get("memory_used_mib")),
                _float(g.get("memory_total_mib")), _float(g.get("temperature_c")),
                _float(g.get("power_draw_w")), _float(g.get("power_limit_w")),
                [v for v in (_float(p.get("utilization_pct")) for p in past) if v is not None],
                [u / t for u, t in ((_float(p.get("memory_used_mib")), _float(p.get("memory_total_mib")))
                                    for p in past) if u is not None and t],
                [AppView.from_row(a) for a in apps or [] if isinstance(a, dict)], apps is not None,
                stale_after, Clocks.from_row(g)))
        return views

    def readings(self, host: str, limit: int, kind: str) -> list[dict[str, Any]]:
        """``Store.readings``, decoded again only when the host has a newer poll."""
        newest = self.store.newest_reading_time(host, kind)
        key = (host, limit, kind)
        with self._lock:
            cached = self._readings.get(key)
        if cached is None or cached[0] != newest:
            cached = (newest, self.store.readings(host, limit, kind))
            with self._lock:
                self._readings[key] = cached
        return cached[1]

    def host_load(self, host: str, stale_after: float) -> HostLoad | None:
        """The host's newest CPU and memory reading (None: no poll has read it)."""
        readings = self.readings(host, 2, "host_reading")
        if not readings:
            return None
        return HostLoad.from_readings(readings[-1], readings[-2] if len(readings) > 1 else None, stale_after)

    # ----------------------------------------------------------------- everything

    def load(self, now: float, run: str | None = None, selected: str | None = None, *,
             history: int = HISTORY, events: int = EVENTS, zoom: str | None = None) -> StatusView:
        """Everything the status screen shows, read from the store at ``now``; with
        ``zoom`` (``ZOOMS``) the selected run's history charts too."""
        store = self.store
        rows = select_runs(store, run)
        heartbeats = heartbeats_now(store, now)
        runs = sort_runs([self.run_view(r, heartbeats, now, history) for r in rows], "default")
        if selected not in {r.id for r in runs}:
            selected = runs[0].id if runs else None
        shown = [r for r in rows if r.active]
        hosts = self.hosts(shown, heartbeats, now, polled=run is None)
        recent = [EventView.from_event(e) for e in store.events(selected, limit=events)] if selected else []
        ticking = sum(1 for b in heartbeats if not b.get("stopped")
                      and now - (b.get("last_tick") or 0) <= 3 * max(1.0, b.get("interval") or 1))
        blocked = [now - (b.get("last_tick") or now) for b in heartbeats if b.get("store_busy")]
        errors = [EventView.from_event(e) for e in store.events(min_severity="error", limit=ERRORS)]
        chart = None
        if zoom is not None and selected is not None:
            chart = self.chart(next(r for r in rows if r.id == selected), now, zoom)
        return StatusView(now, store.path, runs, selected, recent, hosts, notices_of(runs, now), ticking,
                          len(blocked), max(blocked, default=0.0), errors, chart)

    def chart(self, run: Run, now: float, zoom: str = "all",
              whole: list[dict[str, Any]] | None = None) -> ChartView | None:
        """The run's history at ``zoom``: its samples in ``SERIES_POINTS`` buckets over the
        zoom's span (``whole``: the whole run's, already read), its restarts and stalls
        in that span. None without samples."""
        series = whole if whole is not None else self.series(run.id)
        if not series:
            return None
        first = series[0].get("start", series[0]["time"])  # a bucket's time is its newest sample's
        t0, t1 = chart_window(first, series[-1]["time"], now, run.active, zoom)
        if t0 > first:  # zoomed in: the span's own buckets, as fine as the whole run's
            series = self.series(run.id, since=t0)
        marks = marks_of(self.store.restarts(run.id), self.store.events(run.id, kind="state"), t0, t1)
        return ChartView(zoom, t0, t1, series, marks, first)

    def detail(self, run_ref: str, now: float, zoom: str = "all") -> DetailView:
        """One run in full: every event (the newest ``DETAIL_EVENTS``), its whole history
        as a chart series (and its charts at ``zoom``), its thresholds, the environment
        audit, its restarts."""
        store = self.store
        run = store.get_run(run_ref)
        view = self.run_view(run, heartbeats_now(store, now), now)
        events = [EventView.from_event(e) for e in store.events(run.id, limit=DETAIL_EVENTS)]
        snapshot = store.env_snapshot_at(run.host, run.created + 60.0)
        env = EnvSummary(findings=[e for e in events if e.kind in ("drift", "conflict", "preflight", "env-audit")])
        if snapshot is not None:
            data = snapshot.get("data")
            env.snapshot_time = snapshot.get("time")
            env.packages = len(data) if isinstance(data, (dict, list)) else None
            if isinstance(data, dict):
                torch = data.get("torch")
                env.torch = torch if isinstance(torch, str) else None
        series = self.series(run.id)
        share, whole = self.store_size(run.id)
        return DetailView(view, events, series, self.thresholds(run), env,
                          [r.to_dict() for r in store.restarts(run.id)], run.run_dir, run.exit_code,
                          self.chart(run, now, zoom, whole=series), share, whole, store.history_from(run.id))

    def series(self, run_id: str, since: float | None = None) -> list[dict[str, Any]]:
        """``Store.sample_series`` in ``SERIES_POINTS`` buckets, read again only when the
        run has a newer sample (a refresh of a run whose data did not move reads one
        row), and then, while the grid is the same, only from its newest bucket on."""
        newest = self.store.newest_sample_time(run_id)
        key = (run_id, since)
        with self._lock:
            cached = self._series.get(key)
        if cached is not None and cached[0] == newest:
            return cached[2]
        grid = self.store.series_grid(run_id, SERIES_POINTS, since)
        if grid is None:
            points = []
        elif cached is not None and cached[2] and _same_grid(cached[1], grid):  # points read: a grid too
            newest_bucket = cached[2][-1]["bucket"]  # it may have grown since: read again with what came after
            points = [p for p in cached[2] if p["bucket"] < newest_bucket] + \
                self.store.sample_buckets(run_id, grid, newest_bucket)
        else:
            points = self.store.sample_buckets(run_id, grid)
        with self._lock:
            if len(self._series) > 64:  # runs and zooms looked at lately; never more
                self._series.clear()
            self._series[key] = (newest, grid, points)
        return points

    def store_size(self, run_id: str) -> tuple[int | None, int]:
        """(the run's share of the store, the file's size); the share read again after
        ``SIZE_TTL_S`` (it walks the file's pages)."""
        now = time.monotonic()
        with self._lock:
            cached = self._sizes.get(run_id)
        if cached is None or now - cached[0] > SIZE_TTL_S:
            cached = (now, self.store.run_bytes([run_id]).get(run_id))
            with self._lock:
                self._sizes[run_id] = cached
        return cached[1], self.store.file_bytes()


def _same_grid(a: SeriesGrid, b: SeriesGrid) -> bool:
    """Whether ``b`` is ``a``'s grid grown by newer samples: the same buckets from the
    same start (a bucket's figures before the newest one read stay what they were)."""
    return (a.origin, a.width, a.t0, a.raw) == (b.origin, b.width, b.t0, b.raw) and b.count >= a.count


CURVE_POINTS = 240  # points per extra curve of the charts tab


def more_curves(store: Store, run: Run, t0: float, t1: float,
                points: int = CURVE_POINTS) -> dict[str, list[tuple[float, float]]]:
    """The charts tab's curves beyond the run's series, between ``t0`` and ``t1``, each
    at most ``points`` long, as (time, value): ``lr`` and ``grad_norm`` (the run's
    rollups of its metrics lines), ``gpu_mem`` (GiB: the most any of the run's GPUs
    used, the host's rollups), ``tau`` (measured by each eval)."""
    from dflashctl.store.history import host_owner

    rows = store.rollup_series(run.id, ("lr", "grad_norm"), t0, t1, points)
    out = {key: [(p["time"], float(p[key])) for p in rows if p.get(key) is not None] for key in ("lr", "grad_norm")}
    names = [f"gpu{i}.mem" for i in run.gpus]
    mem = store.rollup_series(host_owner(run.host), names, t0, t1, points) if names else []
    out["gpu_mem"] = [(p["time"], max(p[n] for n in names if p.get(n) is not None) / 1024) for p in mem
                      if any(p.get(n) is not None for n in names)]
    out["tau"] = [(float(e["time"]), float(e["tau"])) for e in store.evals(run.id)
                  if isinstance(e.get("tau"), (int, float)) and isinstance(e.get("time"), (int, float))
                  and t0 <= e["time"] <= t1]
    return out


def measured_tau(evals: list[dict[str, Any]]) -> tuple[float | None, dict[str, Any] | None]:
    """The tau a run shows, from its evaluations (``Store.evals``, oldest first): the
    largest complete eval's (``store.preferred_eval``), with its figures (attempt,
    step, speed-up and spreads, prompts, tokens, complete, how many newer evals were
    passed over), or (None, None)."""
    chosen = preferred_eval(evals)
    if chosen is None:
        return None, None
    return chosen["tau"], {k: v for k, v in chosen.items() if k != "report"}


def load_status(store: Store, now: float, run: str | None = None, selected: str | None = None, *,
                history: int = HISTORY, events: int = EVENTS, playbooks_dir: str | None = None) -> StatusView:
    """``StatusReader(store).load(...)`` for one read."""
    return StatusReader(store, playbooks_dir).load(now, run, selected, history=history, events=events)
