"""The runs table and its neighbours: runs, their hosts, state transitions and events.

A run moves through an explicit state machine (``core.states.TRANSITIONS``); every
transition is validated and written together with its event in one transaction.
"""

from __future__ import annotations

import time
from typing import Any

from dflashctl.core.contract import did_you_mean
from dflashctl.core.errors import ConfigError, DflashError
from dflashctl.core.states import (
    ACTIVE_STATES,
    FAILED,
    FINAL_STATES,
    LAUNCHING,
    LOST,
    RESTARTING,
    RUNNING,
    SEVERITIES,
    STALLED,
    STATES,
    TRANSITIONS,
    severity_rank,
)
from dflashctl.store.connection import StoreConnection
from dflashctl.store.ids import new_run_id
from dflashctl.store.rows import _JSON_COLUMNS, EVENT_STATE, Event, Run, _json, _row_to

# The severity of the event a transition writes unless the caller says otherwise.
_STATE_SEVERITY = {STALLED: "warning", RESTARTING: "warning", LOST: "warning", FAILED: "error"}

_RUN_FIELDS_SETTABLE = {
    "config", "bundle_hash", "run_dir", "tmux_session", "tmux_socket", "supervisor", "host", "exit_code", "exit_reason",
}


class InvalidTransition(DflashError):
    """A state change the run state machine does not allow."""


class GpuConflict(DflashError):
    """GPUs wanted by a new run are held by active runs on the same host."""

    def __init__(self, host: str, taken: dict[int, str]):
        self.host = host
        self.taken = taken
        listed = ", ".join(f"GPU {g} by run {r}" for g, r in sorted(taken.items()))
        super().__init__(
            f"{host}: GPUs already held by active runs: {listed}",
            hint="stop that run first (dflashctl stop RUN), change the playbook's placement, or pass --force",
        )


class RunsMixin(StoreConnection):
    """The store's runs: created, updated, looked up, moved between states, and
    the events that say what happened to them."""

    def create_run(
        self,
        playbook: str,
        host: str,
        config: dict[str, Any],
        now: float,
        *,
        run_id: str | None = None,
        bundle_hash: str | None = None,
        run_dir: str | None = None,
        tmux_session: str | None = None,
        tmux_socket: str | None = None,
        message: str = "launch requested",
        claim_gpus: bool = True,
        hosts: list[dict[str, Any]] | None = None,
    ) -> Run:
        """A new run in state ``launching`` (with its first event).

        ``config["gpus"]`` lists the physical GPUs the run will hold. With
        ``claim_gpus``, a GPU already held by an active run on the same host raises
        GpuConflict; the check and the insert are one transaction, so two launches
        racing for one GPU cannot both win. ``hosts``: a multi-host run's processes
        (``rank``, ``host``, ``run_dir``, ``tmux_session``; rank 0 on ``host``), each
        holding the same GPU indices on its own host.
        """
        config = config or {}
        with self._write() as db:
            if run_id is None:
                run_id = self.unused_run_id(playbook, now)
            elif self._query("SELECT 1 FROM runs WHERE id = ?", [run_id]):
                raise DflashError(f"run id {run_id} is taken already in this store",
                                  hint="launch again: a new id is made for each launch")
            if claim_gpus:
                for name in [h["host"] for h in hosts or ()] or [host]:
                    held = self.gpus_held(name)
                    taken = {g: held[g] for g in config.get("gpus", []) if g in held}
                    if taken:
                        raise GpuConflict(name, taken)
            db["runs"].insert(
                {
                    "id": run_id,
                    "playbook": playbook,
                    "host": host,
                    "config": _json(config),
                    "bundle_hash": bundle_hash,
                    "state": LAUNCHING,
                    "created": now,
                    "run_dir": run_dir,
                    "tmux_session": tmux_session,
                    "tmux_socket": tmux_socket,
                    "metrics_offset": 0,
                    "updated": now,
                }
            )
            if hosts:
                db["run_hosts"].insert_all(
                    [{"run_id": run_id, "rank": int(h["rank"]), "host": h["host"], "run_dir": h["run_dir"],
                      "tmux_session": h["tmux_session"]} for h in hosts], pk=("run_id", "rank"))
            self._insert_event(run_id, EVENT_STATE, message, now, "info", {"from": None, "to": LAUNCHING})
        return self.get_run(run_id)

    def update_run_hosts(self, run_id: str, rows: list[dict[str, Any]], now: float) -> None:
        """What the supervisor saw of each host's process (``rank`` plus any of phase,
        step, pid, alive, exit_code, error); ``seen`` is ``now`` for a host that answered
        (a row with ``answered: False`` keeps its last ``seen``, so its age shows)."""
        with self._write() as db:
            for row in rows:
                values = {k: row[k] for k in ("phase", "step", "pid", "exit_code", "error") if k in row}
                if "alive" in row:
                    values["alive"] = None if row["alive"] is None else int(bool(row["alive"]))
                if row.get("answered", True):
                    values["seen"] = now
                if values:
                    db["run_hosts"].update((run_id, int(row["rank"])), values)

    def _with_hosts(self, runs: list[Run]) -> list[Run]:
        if not runs:
            return runs
        by_run: dict[str, list[dict[str, Any]]] = {}
        for i in range(0, len(runs), 500):  # SQLite's limit on bound parameters
            chunk = [r.id for r in runs[i:i + 500]]
            for row in self._query(f"SELECT * FROM run_hosts WHERE run_id IN ({', '.join('?' for _ in chunk)}) "
                                   "ORDER BY rank", chunk):
                row["alive"] = None if row["alive"] is None else bool(row["alive"])
                by_run.setdefault(row.pop("run_id"), []).append(row)
        for run in runs:
            run.hosts = by_run.get(run.id, [])
        return runs

    def update_run(self, run_id: str, **values: Any) -> Run:
        """Set descriptive fields (run_dir, tmux_session, bundle_hash, config, ...).
        The state changes only through ``transition``."""
        unknown = set(values) - _RUN_FIELDS_SETTABLE
        if unknown:
            raise ValueError(f"update_run: cannot set {', '.join(sorted(unknown))}")
        row = {k: (_json(v) if k in _JSON_COLUMNS else v) for k, v in values.items()}
        with self._write() as db:
            db.execute(
                f"UPDATE runs SET {', '.join(f'{k} = ?' for k in row)}, updated = ? WHERE id = ?",
                [*row.values(), time.time(), run_id],
            )
        return self.get_run(run_id)

    def set_supervisor(self, run_id: str, info: dict[str, Any] | None) -> None:
        """Who supervises the run (pid, host, tmux session, started), or None."""
        self.update_run(run_id, supervisor=info)

    def unused_run_id(self, playbook: str, now: float) -> str:
        """A new run id (``ids.new_run_id``) no run in this store has: two launches of
        one playbook in one second draw their 16-bit suffixes from the same 65,536."""
        for _ in range(64):
            run_id = new_run_id(playbook, now)
            if not self._query("SELECT 1 FROM runs WHERE id = ?", [run_id]):
                return run_id
        raise DflashError(f"no unused run id for playbook {playbook} at this second after 64 draws")

    def get_run(self, ref: str) -> Run:
        """A run by id or by an unambiguous prefix of its id (never the empty one)."""
        if not isinstance(ref, str) or not ref.strip():
            raise ConfigError("no run given: an empty run reference matches nothing",
                              hint="give a run id or its first characters; `dflashctl runs` lists them")
        rows = self._query("SELECT * FROM runs WHERE id = ?", [ref])
        if not rows:
            escaped = ref.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            rows = self._query(
                "SELECT * FROM runs WHERE id LIKE ? ESCAPE '\\' ORDER BY created DESC, id DESC LIMIT 6", [escaped + "%"]
            )
        if len(rows) == 1:
            return self._with_hosts([_row_to(Run, rows[0])])[0]
        if not rows:
            recent = [r["id"] for r in self._query("SELECT id FROM runs ORDER BY created DESC LIMIT 500")]
            raise ConfigError(
                f"no run '{ref}'{did_you_mean(ref, recent)}", hint="`dflashctl runs --all` lists every run"
            )
        shown = ", ".join(r["id"] for r in rows[:5])
        raise ConfigError(f"run '{ref}' is ambiguous: {shown}{', ...' if len(rows) > 5 else ''}",
                          hint="give more characters of the run id")

    def list_runs(
        self,
        playbook: str | None = None,
        active_only: bool = False,
        host: str | None = None,
        limit: int | None = None,
    ) -> list[Run]:
        """Runs, newest first."""
        where, params = [], []
        if playbook is not None:
            where.append("playbook = ?")
            params.append(playbook)
        if host is not None:
            where.append("host = ?")
            params.append(host)
        if active_only:
            where.append(f"state IN ({', '.join('?' for _ in ACTIVE_STATES)})")
            params.extend(ACTIVE_STATES)
        sql = "SELECT * FROM runs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY created DESC, id DESC"
        if limit:
            sql += f" LIMIT {int(limit)}"
        return self._with_hosts([_row_to(Run, r) for r in self._query(sql, params)])

    def active_runs_on_host(self, host: str) -> list[Run]:
        """Active runs with a process on ``host`` (rank 0's host, or any of a multi-host run's)."""
        ids = {r["run_id"] for r in self._query("SELECT run_id FROM run_hosts WHERE host = ?", [host])}
        return [r for r in self.list_runs(active_only=True) if r.host == host or r.id in ids]

    def gpus_held(self, host: str, exclude_run: str | None = None) -> dict[int, str]:
        """GPU index -> id of the active run holding it, on one host."""
        held: dict[int, str] = {}
        for run in self.active_runs_on_host(host):
            if run.id != exclude_run:
                for gpu in run.gpus:
                    held.setdefault(gpu, run.id)
        return held

    # ----------------------------------------------------------------- state machine

    def transition(
        self,
        run_id: str,
        state: str,
        message: str,
        now: float,
        detail: dict[str, Any] | None = None,
        *,
        severity: str | None = None,
        exit_code: int | None = None,
        exit_reason: str | None = None,
    ) -> bool:
        """Move a run to ``state`` and record why, in one transaction.

        Returns False (and writes nothing) when the run is already in ``state``, so a
        caller may repeat a transition; raises InvalidTransition for an edge the
        state machine does not have.
        """
        if state not in STATES:
            raise InvalidTransition(f"unknown run state '{state}'{did_you_mean(state, STATES)}")
        with self._write() as db:
            rows = self._query("SELECT state, started FROM runs WHERE id = ?", [run_id])
            if not rows:
                raise ConfigError(f"no run '{run_id}'")
            current, started = rows[0]["state"], rows[0]["started"]
            if current == state:
                return False
            if state not in TRANSITIONS[current]:
                allowed = ", ".join(sorted(TRANSITIONS[current])) or "none (final)"
                raise InvalidTransition(f"run {run_id}: cannot go from {current} to {state} (allowed: {allowed})")
            sets: dict[str, Any] = {"state": state, "updated": now}
            if state == RUNNING and started is None:
                sets["started"] = now
            if state in FINAL_STATES:
                sets["ended"] = now
            elif current in FINAL_STATES:
                # Revived by an operator restart: it is no longer over.
                sets.update(ended=None, exit_code=None, exit_reason=None)
            if exit_code is not None:
                sets["exit_code"] = exit_code
            if exit_reason is not None:
                sets["exit_reason"] = exit_reason
            db.execute(
                f"UPDATE runs SET {', '.join(f'{k} = ?' for k in sets)} WHERE id = ?", [*sets.values(), run_id]
            )
            self._insert_event(
                run_id,
                EVENT_STATE,
                message,
                now,
                severity or _STATE_SEVERITY.get(state, "info"),
                {"from": current, "to": state, **(detail or {})},
            )
        return True

    # ----------------------------------------------------------------- events

    def _insert_event(self, run_id, kind, message, now, severity, detail) -> int:
        if severity not in SEVERITIES:
            raise ValueError(f"severity '{severity}' is not one of {', '.join(SEVERITIES)}")
        cur = self.conn.execute(
            "INSERT INTO events (run_id, time, kind, severity, message, detail) VALUES (?, ?, ?, ?, ?, ?)",
            [run_id, now, kind, severity, message, _json(detail)],
        )
        return cur.lastrowid

    def add_event(
        self,
        run_id: str | None,
        kind: str,
        message: str,
        now: float,
        severity: str = "info",
        detail: dict[str, Any] | None = None,
    ) -> int:
        with self._write():
            return self._insert_event(run_id, kind, message, now, severity, detail)

    def events(
        self,
        run_id: str | None = None,
        since: float | None = None,
        min_severity: str | None = None,
        kind: str | None = None,
        limit: int | None = None,
    ) -> list[Event]:
        """Events in time order (the last ``limit`` of them when given)."""
        where, params = [], []
        if run_id is not None:
            where.append("run_id = ?")
            params.append(run_id)
        if since is not None:
            where.append("time > ?")
            params.append(since)
        if kind is not None:
            where.append("kind = ?")
            params.append(kind)
        if min_severity is not None:
            wanted = SEVERITIES[severity_rank(min_severity):]
            where.append(f"severity IN ({', '.join('?' for _ in wanted)})")
            params.extend(wanted)
        sql = "SELECT * FROM events" + (" WHERE " + " AND ".join(where) if where else "")
        sql += " ORDER BY time DESC, id DESC"
        if limit:
            sql += f" LIMIT {int(limit)}"
        return [_row_to(Event, r) for r in reversed(self._query(sql, params))]
