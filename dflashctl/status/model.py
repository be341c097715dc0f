"""The status views' public API: the names scripts and tests import, from the modules holding them.

They are the view models of the status console: pure data read from the store, never drawing.

``StatusReader(store).load(now, ...)`` (or ``load_status``) returns a
``StatusView``: every run worth showing (active runs first, then the most recent
ones), each with

- its freshness (``dflashctl.status.freshness``): supervised or not, data age, host
  unreachable; a run whose data is not live never shows an ETA, and one nobody
  watches comes with the command that fixes it (``notices``);
- its phase (starting, compiling, training, checkpointing, restarting, ...) with
  the time spent in it against the playbook's budget ("compiling 12 m / 30 m");
- progress, tok/s averaged over ``SMOOTH_WINDOW_S`` and as a share of the
  baseline, an ETA from the step rate over the same window, loss, acceptance
  tau (the estimate, accept_len + 1, and the measured one of the newest eval), restarts, the event that matters last;
- for a run on several hosts, each host's process as the supervisor last saw it
  (``RunHostView``), with how old that is;

the GPUs of every host with an active run (one row per GPU: role, the run that
holds it, readings and a short history), and the selected run's recent events.
``StatusReader.detail`` reads one run in full (every event, the whole history as
a chart series, thresholds, the environment audit). ``select_columns`` picks the
run columns that fit a width, for the screen and for ``status --once``.

Everything here comes from the store (the supervisor writes it) and the run's
playbook file (its thresholds); nothing touches a host. A missing reading is a
value (``None``, shown as ``N/A``), never an exception. The package never imports
UI code (Textual): ``status --once`` / ``--json`` use it without a screen.

The modules, bottom up: ``styles`` (style names, sparklines, bars), ``thresholds``
(the playbook's), ``samples`` (their clock, smoothing), ``phase``, ``events``,
``gpus`` (GPU and host line views), ``runs`` (run views, their columns, sorting,
attention, notices), ``charts`` (zooms, windows, marks), ``views`` (the status and
detail views), ``heartbeats`` (the supervisors'), ``reader`` (``StatusReader``,
``load_status``) and ``schema`` (the ``--json`` document's). Code of the package and
of ``dflashctl`` imports from those modules; this one gathers their names.
"""

from dflashctl.core.units import NA
from dflashctl.status.charts import ZOOMS, ZOOM_SPAN_S, ChartView, Mark, chart_window, marks_of, next_zoom
from dflashctl.status.events import EventView, classify, filter_events, matching
from dflashctl.status.gpus import (
    AppView,
    GpuView,
    HostLoad,
    HostView,
    gpu_readings,
    reading_age,
    reading_stale,
    stored_host_reading,
)
from dflashctl.status.heartbeats import heartbeats_now, store_write_busy
from dflashctl.status.phase import PROGRESSING, PhaseView, derive_phase
from dflashctl.status.reader import (
    BASELINE_TTL_S,
    DETAIL_EVENTS,
    ERRORS,
    EVENTS,
    FINISHED_HISTORY,
    GPU_HISTORY,
    HISTORY,
    RECENT_RUNS,
    SERIES_POINTS,
    StatusReader,
    load_status,
    measured_tau,
    roles_of,
    select_runs,
)
from dflashctl.status.runs import (
    ATTENTION,
    COLUMN,
    COLUMNS,
    COMPACT_RUN_WIDTH,
    CRASH_LOOP_RESTARTS,
    FAILED_RECENT_S,
    LAST_EVENT_MAX,
    SORTS,
    DirectProbe,
    Notice,
    RunHostView,
    RunView,
    attention_of,
    attention_rank,
    filter_runs,
    notices_of,
    select_columns,
    sort_runs,
)
from dflashctl.status.samples import SMOOTH_WINDOW_S, Smoothed, current_process, smooth
from dflashctl.status.schema import JSON_SCHEMA, SCHEMA
from dflashctl.status.styles import PHASE_STYLE, SEVERITY_STYLE, STATE_STYLE, bar, spark
from dflashctl.status.thresholds import Thresholds
from dflashctl.status.views import DetailView, EnvSummary, StatusView

__all__ = [
    "ATTENTION",
    "AppView",
    "BASELINE_TTL_S",
    "COLUMN",
    "COLUMNS",
    "COMPACT_RUN_WIDTH",
    "CRASH_LOOP_RESTARTS",
    "ChartView",
    "DETAIL_EVENTS",
    "DetailView",
    "DirectProbe",
    "ERRORS",
    "EVENTS",
    "EnvSummary",
    "EventView",
    "FAILED_RECENT_S",
    "FINISHED_HISTORY",
    "GPU_HISTORY",
    "GpuView",
    "HISTORY",
    "HostLoad",
    "HostView",
    "JSON_SCHEMA",
    "LAST_EVENT_MAX",
    "Mark",
    "NA",
    "Notice",
    "PHASE_STYLE",
    "PROGRESSING",
    "PhaseView",
    "RECENT_RUNS",
    "RunHostView",
    "RunView",
    "SCHEMA",
    "SERIES_POINTS",
    "SEVERITY_STYLE",
    "SMOOTH_WINDOW_S",
    "SORTS",
    "STATE_STYLE",
    "Smoothed",
    "StatusReader",
    "StatusView",
    "Thresholds",
    "ZOOMS",
    "ZOOM_SPAN_S",
    "attention_of",
    "attention_rank",
    "bar",
    "chart_window",
    "classify",
    "current_process",
    "derive_phase",
    "filter_events",
    "filter_runs",
    "gpu_readings",
    "heartbeats_now",
    "load_status",
    "marks_of",
    "matching",
    "measured_tau",
    "next_zoom",
    "notices_of",
    "reading_age",
    "reading_stale",
    "roles_of",
    "select_columns",
    "select_runs",
    "smooth",
    "sort_runs",
    "spark",
    "store_write_busy",
    "stored_host_reading",
]
