"""The Store: one class over the run store's file, assembled from its parts.

Each part reads and writes its own tables over the shared connection
(``connection.StoreConnection``): runs, samples, supervision, snapshots.
"""

from __future__ import annotations

from dflashctl.store.runs import RunsMixin
from dflashctl.store.samples import SamplesMixin
from dflashctl.store.snapshots import SnapshotsMixin
from dflashctl.store.supervision import SupervisionMixin


class Store(RunsMixin, SamplesMixin, SupervisionMixin, SnapshotsMixin):
    """The run store over one SQLite file. Safe to share between threads (each
    thread gets its own connection) and between processes (WAL + BEGIN IMMEDIATE)."""

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
