"""Environment snapshots of hosts, and the run stretches that drift checks compare them by."""

from __future__ import annotations

from typing import Any

from dflashctl.core.contract import PHASE_TRAINING
from dflashctl.store.connection import StoreConnection
from dflashctl.store.rows import _decode, _json


class SnapshotsMixin(StoreConnection):
    """The store's environment snapshots (package sets, library lists) per host."""

    def add_env_snapshot(self, host: str, now: float, data: Any, kind: str = "packages", run_id: str | None = None) -> int:
        with self._write() as db:
            cur = db.execute(
                "INSERT INTO env_snapshots (host, run_id, time, kind, data) VALUES (?, ?, ?, ?, ?)",
                [host, run_id, now, kind, _json(data)],
            )
            return cur.lastrowid

    def env_snapshots(self, host: str, kind: str = "packages", limit: int = 10) -> list[dict[str, Any]]:
        """Snapshots of one host, newest first, ``data`` decoded."""
        rows = self._query(
            "SELECT * FROM env_snapshots WHERE host = ? AND kind = ? ORDER BY time DESC, id DESC LIMIT ?",
            [host, kind, limit],
        )
        return [_decode(r) for r in rows]

    def env_snapshot_at(self, host: str, time: float, kind: str = "packages") -> dict[str, Any] | None:
        """The newest snapshot of a host taken at or before ``time`` (``data`` decoded), or None."""
        rows = self._query(
            "SELECT * FROM env_snapshots WHERE host = ? AND kind = ? AND time <= ? ORDER BY time DESC, id DESC LIMIT 1",
            [host, kind, time],
        )
        return _decode(rows[0]) if rows else None

    def longest_training_stretch(self, run_id: str) -> float | None:
        """Seconds from the first to the last ``training`` sample of the run's
        longest-lived trainer process (samples between two restarts); None without
        training samples. A run whose stretch reached the playbook's
        ``restart.healthy_after`` counts as a good run for drift checks."""
        rows = self._query(
            """
            SELECT max(stretch) AS stretch FROM (
              SELECT max(s.time) - min(s.time) AS stretch FROM samples s
              WHERE s.run_id = ? AND s.phase = ?
              GROUP BY (SELECT count(*) FROM restarts r WHERE r.run_id = s.run_id AND r.time <= s.time))
            """,
            [run_id, PHASE_TRAINING],
        )
        return rows[0]["stretch"] if rows else None
