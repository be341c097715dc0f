"""Drift: what changed in a host's package set since the playbook's last good run.

A good run is the newest run of the playbook on that host whose trainer trained
without a restart for at least the playbook's ``restart.healthy_after`` (a run
stopped a second after its start is not one). Its package set is the snapshot
recorded on that host at its launch (the newest at or before its creation), kept
for as long as the run is in the store, however many audits came after it.

Reads the store only (``Store.list_runs``, ``longest_training_stretch``,
``env_snapshot_at``); never writes, never reaches a host.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from dflashctl.supervise.detectors import Finding as Drift
from dflashctl.supervise.detectors import env_drift

if TYPE_CHECKING:
    from dflashctl.store import Run, Store


def last_good_run(store: "Store", playbook: str, host: str, healthy_after: float,
                  exclude_run: str | None = None) -> "Run | None":
    """The newest run of ``playbook`` on ``host`` that trained for ``healthy_after`` seconds."""
    for run in store.list_runs(playbook=playbook, host=host):
        if run.id == exclude_run:
            continue
        stretch = store.longest_training_stretch(run.id)
        if stretch is not None and stretch >= healthy_after:
            return run
    return None


def drift_since_good_run(store: "Store", playbook: str, host: str, current: dict[str, str], healthy_after: float,
                         exclude_run: str | None = None) -> Drift | None:
    """The package set ``current`` (name -> version) against the one the last good
    run was launched with; None without a good run, a snapshot of it, or a change."""
    run = last_good_run(store, playbook, host, healthy_after, exclude_run)
    if run is None:
        return None
    then = store.env_snapshot_at(host, run.created)
    if then is None:
        return None
    found = env_drift(then["data"], current)
    if found is None:
        return None
    return dataclasses.replace(found, message=f"{found.message} (last good run: {run.id})",
                               detail={**found.detail, "since_run": run.id, "snapshot": then["id"]})


def open_existing_store(path: str | None = None) -> "Store | None":
    """The run store when its file exists (a dry run must not create one), else None."""
    from dflashctl.core.paths import store_path
    from dflashctl.store import Store

    path = path or store_path()
    return Store(path) if os.path.exists(os.path.expanduser(path)) else None
