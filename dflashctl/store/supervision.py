"""What supervisors record of themselves: their heartbeats and the restarts they issue."""

from __future__ import annotations

from typing import Any

from dflashctl.store.connection import StoreConnection
from dflashctl.store.rows import Restart, _decode, _json, _row_to


class SupervisionMixin(StoreConnection):
    """The store's supervisor heartbeats and restart rows."""

    def heartbeat(self, supervisor_id: str, *, pid: int, host: str, started: float, interval: float, now: float,
                  runs: list[str], hosts: dict[str, Any], stopped: bool = False) -> None:
        """A supervisor's tick: which runs it watches and what each host last answered
        (``{host: {"last_ok": t, "error": text, "down_since": t}}``)."""
        with self._write():
            self.db["supervisors"].upsert(
                {"id": supervisor_id, "pid": pid, "host": host, "started": started, "interval": interval,
                 "last_tick": now, "runs": _json(runs), "hosts": _json(hosts), "stopped": now if stopped else None},
                pk="id")

    def supervisors(self, since: float | None = None) -> list[dict[str, Any]]:
        """Supervisor heartbeats, newest tick first (those ticking after ``since``)."""
        sql, params = "SELECT * FROM supervisors", []
        if since is not None:
            sql += " WHERE last_tick > ?"
            params.append(since)
        return [_decode(r) for r in self._query(sql + " ORDER BY last_tick DESC", params)]

    # ----------------------------------------------------------------- restarts

    def add_restart(
        self,
        run_id: str,
        now: float,
        reason: str,
        signature: str | None = None,
        action: str = "restart",
        detect_delay_s: float | None = None,
        downtime_s: float | None = None,
        step_before: int | None = None,
        outcome: str = "issued",
    ) -> int:
        """A restart row; a supervisor writes it "issuing" before it issues the restart."""
        with self._write() as db:
            cur = db.execute(
                "INSERT INTO restarts (run_id, time, reason, signature, action, detect_delay_s, downtime_s, step_before,"
                " outcome) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [run_id, now, reason, signature, action, detect_delay_s, downtime_s, step_before, outcome],
            )
            return cur.lastrowid

    def update_restart(self, restart_id: int, **values: Any) -> None:
        """Fill in what is known only later: time_to_first_step_s, step_after, downtime_s."""
        allowed = {"downtime_s", "time_to_first_step_s", "step_after", "detect_delay_s", "outcome", "time"}
        if set(values) - allowed:
            raise ValueError(f"update_restart: cannot set {', '.join(sorted(set(values) - allowed))}")
        with self._write() as db:
            db.execute(
                f"UPDATE restarts SET {', '.join(f'{k} = ?' for k in values)} WHERE id = ?",
                [*values.values(), restart_id],
            )

    def update_latest_restart(self, run_id: str, **values: Any) -> None:
        """``update_restart`` on the run's latest restart row."""
        rows = self._query("SELECT max(id) AS id FROM restarts WHERE run_id = ?", [run_id])
        if rows and rows[0]["id"] is not None:
            self.update_restart(rows[0]["id"], **values)

    def restarts(self, run_id: str, since: float | None = None) -> list[Restart]:
        sql, params = "SELECT * FROM restarts WHERE run_id = ?", [run_id]
        if since is not None:
            sql += " AND time > ?"
            params.append(since)
        return [_row_to(Restart, r) for r in self._query(sql + " ORDER BY time, id", params)]
