"""The run store: runs, events, samples, hosts' readings, restarts and environment snapshots in SQLite.

One file (``paths.store_path()``) shared by every dflashctl process on the
operator's machine: the CLI, each run's supervisor, the TUI. So:

- WAL journal: readers never block the writer and the writer never blocks readers.
- Every write is one ``BEGIN IMMEDIATE`` transaction. A deferred ``BEGIN`` takes
  the write lock only at the first write, and two processes upgrading their read
  locks at once fail with "database is locked" whatever the busy timeout; an
  immediate one waits its turn on the busy timeout instead.
- One connection per thread (and per process: a forked child opens its own).
- Schema changes are named migrations (sqlite-utils ``Migrations``), applied under
  the write lock so two processes opening a fresh file do not race.
- Free-form data (configs, event details, GPU readings) are JSON columns; never pickles.

A run moves through an explicit state machine (``TRANSITIONS``); every transition is
validated and written together with an event in the same transaction.

The modules: ``rows`` (the row dataclasses, their JSON columns), ``schema`` (the
migrations), ``ids`` (run ids), ``connection`` (the file, connections and write
transactions), the parts of the Store by what they store (``runs``: runs, transitions
and events; ``samples``: samples, series, evaluations; ``history``: hosts' readings
on every poll, rollups, retention and sizes; ``supervision``: heartbeats and
restarts; ``snapshots``: environment snapshots), and ``store`` (the Store they make).
"""

from dflashctl.store.ids import new_run_id
from dflashctl.store.rows import EVENT_REGRESSION, EVENT_STATE, Event, Restart, Run, Sample
from dflashctl.store.runs import GpuConflict, InvalidTransition
from dflashctl.store.samples import SeriesGrid, eval_figures, preferred_eval
from dflashctl.store.schema import SCHEMA_VERSION, migrations
from dflashctl.store.store import Store

__all__ = [
    "EVENT_REGRESSION",
    "EVENT_STATE",
    "SCHEMA_VERSION",
    "Event",
    "GpuConflict",
    "InvalidTransition",
    "Restart",
    "Run",
    "Sample",
    "SeriesGrid",
    "Store",
    "eval_figures",
    "migrations",
    "new_run_id",
    "preferred_eval",
]
