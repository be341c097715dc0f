"""The run store: runs, events, samples, restarts and environment snapshots in SQLite.

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
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shlex
import sqlite3
import statistics
import threading
import time
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Iterable, Iterator

if TYPE_CHECKING:
    from sqlite_utils import Database

from dflashctl.core.contract import PHASE_TRAINING, Metrics, did_you_mean
from dflashctl.core.errors import ConfigError, DflashError, StoreError
from dflashctl.core.states import (
    ACTIVE_STATES,
    DONE,
    FAILED,
    FINAL_STATES,
    LAUNCHING,
    LOST,
    RESTARTING,
    RUNNING,
    SEVERITIES,
    STALLED,
    STATES,
    STOPPED,
    TRANSITIONS,
    severity_rank,
)

# The severity of the event a transition writes unless the caller says otherwise.
_STATE_SEVERITY = {STALLED: "warning", RESTARTING: "warning", LOST: "warning", FAILED: "error"}

# Event kinds the store itself reads (the supervisor writes them).
EVENT_STATE = "state"
EVENT_REGRESSION = "regression"  # a throughput regression: the run is not a healthy baseline

_JSON_COLUMNS = {"config", "supervisor", "detail", "gpu", "data", "runs", "hosts", "report", "host_reading"}

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


# --------------------------------------------------------------------------- rows


@dataclass
class Run:
    id: str
    playbook: str
    host: str
    state: str
    created: float
    config: dict[str, Any] = field(default_factory=dict)
    bundle_hash: str | None = None
    started: float | None = None
    ended: float | None = None
    exit_code: int | None = None
    exit_reason: str | None = None
    run_dir: str | None = None
    tmux_session: str | None = None
    tmux_socket: str | None = None
    supervisor: dict[str, Any] | None = None
    metrics_offset: int = 0
    metrics_inode: int | None = None
    updated: float | None = None
    hosts: list[dict[str, Any]] = field(default_factory=list)  # a multi-host run's rows (run_hosts), by rank

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    def parts(self) -> list["Run"]:
        """The run as each of its hosts holds it, rank 0 first: the same run with that
        host's ``host``, ``run_dir`` and ``tmux_session`` (a single-host run: itself)."""
        if not self.hosts:
            return [self]
        return [replace(self, host=h["host"], run_dir=h["run_dir"], tmux_session=h["tmux_session"], hosts=[],
                        config={**self.config, "rank": h["rank"]})
                for h in sorted(self.hosts, key=lambda h: h["rank"])]

    @property
    def rank(self) -> int:
        """Which process of the run this view is (``parts``); 0 for the run itself."""
        return int((self.config or {}).get("rank", 0))

    @property
    def host_names(self) -> list[str]:
        return [h["host"] for h in sorted(self.hosts, key=lambda h: h["rank"])] or [self.host]

    @property
    def gpus(self) -> list[int]:
        """Physical GPU indices this run holds on its host (recorded at launch)."""
        return [int(g) for g in (self.config or {}).get("gpus", [])]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Event:
    id: int
    run_id: str | None
    time: float
    kind: str
    severity: str
    message: str
    detail: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Sample:
    id: int
    run_id: str
    time: float
    step: int
    tok_s: float | None = None
    loss: float | None = None
    acc: float | None = None
    accept_len: float | None = None
    eta_s: float | None = None
    phase: str | None = None
    gpu: Any = None
    mfu: float | None = None
    observed: float | None = None  # local time the supervisor received it (None: stored before this was kept)
    host_reading: Any = None  # its host's CPU and memory at that poll (parsers.HostReading as a dict)
    samples_s: float | None = None  # training samples (sequences) per second
    anchors_s: float | None = None  # anchor blocks per second
    mfu_measured: float | None = None  # MFU against the rate a large matmul reaches on the GPU (mfu: the nominal peak)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Restart:
    id: int
    run_id: str
    time: float
    reason: str
    signature: str | None = None
    action: str | None = None
    detect_delay_s: float | None = None
    downtime_s: float | None = None
    time_to_first_step_s: float | None = None
    step_before: int | None = None
    step_after: int | None = None
    outcome: str | None = None  # issuing | issued | not issued: why | cancelled: why

    @property
    def counts(self) -> bool:
        """Whether a process was (or may have been) started by it: the restart
        policy counts it. A restart never issued started nothing."""
        return not (self.outcome or "").startswith(("not issued", "cancelled"))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _decode(row: dict[str, Any]) -> dict[str, Any]:
    out = dict(row)
    for key in _JSON_COLUMNS & out.keys():
        if isinstance(out[key], str):
            out[key] = json.loads(out[key])
    return out


def _row_to(cls, row: dict[str, Any]):
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in _decode(row).items() if k in names})


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True, separators=(",", ":"))


# --------------------------------------------------------------------------- migrations

class _Schema:
    """The named migrations, in order. sqlite-utils' ``Migrations`` is built when a
    store first opens, not when this module loads: importing sqlite-utils brings
    numpy, a tenth of a second of every command's start."""

    name = "dflashctl"

    def __init__(self) -> None:
        self.steps: list[tuple[str, Any]] = []
        self._built = None

    def __call__(self, name: str):
        def add(fn):
            self.steps.append((name, fn))
            return fn
        return add

    @property
    def migrations(self):
        if self._built is None:
            from sqlite_utils.migrations import Migrations

            built = Migrations(self.name)
            for name, fn in self.steps:
                built(name=name)(fn)
            self._built = built
        return self._built

    @property
    def _migrations(self) -> list:
        return self.migrations._migrations

    def pending(self, db: "Database") -> list:
        return self.migrations.pending(db)

    def apply(self, db: "Database") -> None:
        self.migrations.apply(db)


migrations = _Schema()


@migrations(name="0001_core_tables")
def _m0001(db: Database) -> None:
    db["runs"].create(
        {
            "id": str,
            "playbook": str,
            "host": str,
            "config": str,  # JSON: trainer config, placement, GPUs held, launch options
            "bundle_hash": str,
            "state": str,
            "created": float,
            "started": float,
            "ended": float,
            "exit_code": int,
            "exit_reason": str,
            "run_dir": str,
            "tmux_session": str,
            "tmux_socket": str,  # tmux -L name on the run host
            "supervisor": str,  # JSON: pid, tmux session, host of the supervising process
            "metrics_offset": int,  # bytes of metrics.jsonl already stored as samples
            "metrics_inode": int,  # of the metrics.jsonl that offset belongs to
            "updated": float,
        },
        pk="id",
        not_null={"playbook", "host", "state", "created"},
        defaults={"metrics_offset": 0},
    )
    db["runs"].create_index(["playbook", "created"])
    db["runs"].create_index(["host", "state"])
    db["events"].create(
        {"id": int, "run_id": str, "time": float, "kind": str, "severity": str, "message": str, "detail": str},
        pk="id",
        foreign_keys=[("run_id", "runs", "id")],
    )
    db["events"].create_index(["run_id", "time"])
    db["samples"].create(
        {
            "id": int,
            "run_id": str,
            "time": float,
            "step": int,
            "tok_s": float,
            "loss": float,
            "acc": float,
            "accept_len": float,
            "eta_s": float,
            "phase": str,
            "gpu": str,  # JSON: per-GPU readings at sample time
        },
        pk="id",
        foreign_keys=[("run_id", "runs", "id")],
    )
    db["samples"].create_index(["run_id", "time"])
    db["restarts"].create(
        {
            "id": int,
            "run_id": str,
            "time": float,
            "reason": str,
            "signature": str,
            "action": str,
            "detect_delay_s": float,
            "downtime_s": float,
            "time_to_first_step_s": float,
            "step_before": int,
            "step_after": int,
        },
        pk="id",
        foreign_keys=[("run_id", "runs", "id")],
    )
    db["restarts"].create_index(["run_id", "time"])


@migrations(name="0002_env_snapshots")
def _m0002(db: Database) -> None:
    # Package sets and library lists seen on a host, to spot drift between runs.
    db["env_snapshots"].create(
        {"id": int, "host": str, "run_id": str, "time": float, "kind": str, "data": str},
        pk="id",
    )
    db["env_snapshots"].create_index(["host", "time"])


@migrations(name="0003_sample_mfu")
def _m0003(db: Database) -> None:
    # The trainer's MFU estimate per metrics line (whole run: target and drafter FLOPs).
    db["samples"].add_column("mfu", float)


@migrations(name="0004_restart_outcome_numeric_samples")
def _m0004(db: Database) -> None:
    # A restart row is written before the restart is issued ("issuing"), then says
    # "issued" or why not: a supervisor killed in between still leaves the row.
    db["restarts"].add_column("outcome", str)
    db.execute("UPDATE restarts SET outcome = 'issued'")
    # Stores from before samples were validated may hold text in numeric columns.
    for column in _SAMPLE_NUMBERS:
        db.execute(f"UPDATE samples SET {column} = NULL WHERE typeof({column}) NOT IN ('integer', 'real', 'null')")


@migrations(name="0005_supervisor_heartbeats")
def _m0005(db: Database) -> None:
    # Freshness is data: each supervisor's last tick and each host's last answer, and
    # when each sample was received (its own time is the trainer's, on the host clock).
    db["supervisors"].create(
        {"id": str, "pid": int, "host": str, "started": float, "interval": float, "last_tick": float,
         "runs": str, "hosts": str, "stopped": float},
        pk="id",
    )
    db["samples"].add_column("observed", float)


@migrations(name="0006_evals")
def _m0006(db: Database) -> None:
    # Speculative-decoding evaluations of a run's drafter (trainer/eval.py's JSON report).
    db["evals"].create({"id": int, "run_id": str, "time": float, "step": int, "tau": float, "speedup": float,
                        "report": str, "error": str}, pk="id", foreign_keys=[("run_id", "runs", "id")])
    db["evals"].create_index(["run_id", "time"])


@migrations(name="0007_run_hosts")
def _m0007(db: Database) -> None:
    # A run on several hosts (torch.distributed): a row per host and rank, with what
    # the supervisor last saw of that host's process (``seen``: local time of the answer).
    db["run_hosts"].create(
        {"run_id": str, "rank": int, "host": str, "run_dir": str, "tmux_session": str, "seen": float,
         "phase": str, "step": int, "pid": int, "alive": int, "exit_code": int, "error": str},
        pk=("run_id", "rank"), foreign_keys=[("run_id", "runs", "id")],
    )
    db["run_hosts"].create_index(["host"])


@migrations(name="0008_sample_host_reading")
def _m0008(db: Database) -> None:
    # The run host's CPU and memory, read in the same poll as the GPU readings.
    db["samples"].add_column("host_reading", str)
    # The console reads a run's newest readings on every refresh: found at once, even
    # in a history where no sample (or none lately) carries one.
    db.execute("CREATE INDEX IF NOT EXISTS samples_host_reading ON samples (run_id, time) "
               "WHERE host_reading IS NOT NULL")


@migrations(name="0009_sample_rates")
def _m0009(db: Database) -> None:
    # The units public trainers quote beside tok/s: samples and anchor blocks per second.
    db["samples"].add_column("samples_s", float)
    db["samples"].add_column("anchors_s", float)


@migrations(name="0010_sample_mfu_measured")
def _m0010(db: Database) -> None:
    # MFU against the measured matmul rate, shown beside the headline (against the nominal peak).
    db["samples"].add_column("mfu_measured", float)


_SAMPLE_NUMBERS = ("tok_s", "loss", "acc", "accept_len", "eta_s", "mfu")
_SAMPLE_EXTRAS = ("samples_s", "anchors_s", "mfu_measured")  # from a metrics line's extra
# An inserted sample row, in order (Store.add_samples builds its rows in this order).
_SAMPLE_COLUMNS = ("run_id", "time", "step", *_SAMPLE_NUMBERS[:5], "phase", "gpu", "mfu", "observed",
                   *_SAMPLE_EXTRAS, "host_reading")
SCHEMA_VERSION = 10  # the number of migrations above; recorded as PRAGMA user_version


def _number(value: Any) -> float | None:
    """A finite float, or None: a sample's numeric column never holds anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def _int64(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not -(2**63) <= value < 2**63:
        return None
    return value


# --------------------------------------------------------------------------- ids

_SLUG = re.compile(r"[^A-Za-z0-9_-]+")


def _free_mib(directory: str) -> int | None:
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize // (1024 * 1024)


def new_run_id(playbook: str, now: float) -> str:
    """``<playbook>-YYYYMMDD-HHMMSS-xxxx`` (UTC): sortable, and a valid tmux session name."""
    slug = _SLUG.sub("-", playbook).strip("-") or "run"
    return f"{slug}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(now))}-{secrets.token_hex(2)}"


# --------------------------------------------------------------------------- store


class Store:
    """The run store over one SQLite file. Safe to share between threads (each
    thread gets its own connection) and between processes (WAL + BEGIN IMMEDIATE)."""

    def __init__(self, path: str, timeout: float = 30.0):
        self.path = os.path.abspath(os.path.expanduser(path))
        self.timeout = timeout
        self.write_transactions = 0  # opened by this object (all threads): one per supervisor tick
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._local = threading.local()
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._open()
                return
            except sqlite3.OperationalError as e:
                # Another process creating the same new file at this moment: its
                # schema is being written. Look again once it is done.
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise self.error(e) from None
                self.close()
                time.sleep(0.05)
            except sqlite3.DatabaseError as e:
                raise self.error(e) from None

    def _open(self) -> None:
        if self._check_version() != SCHEMA_VERSION:  # a store this version wrote needs no look at migrations
            db = self.db
            if migrations.pending(db):
                with self._write():
                    migrations.apply(db)
                    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _check_version(self) -> int:
        """The store's schema version; refuses one newer than this dflashctl's."""
        conn = self.conn
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        known = {name for name, _ in migrations.steps}
        if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = '_sqlite_migrations'").fetchone():
            applied = {r[0] for r in conn.execute(
                "SELECT name FROM _sqlite_migrations WHERE migration_set = ?", [migrations.name]).fetchall()}
            if applied - known:  # names this version does not know: a newer dflashctl's
                version = max(version, SCHEMA_VERSION + len(applied - known))
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"run store {self.path} has schema version {version}; this dflashctl knows up to {SCHEMA_VERSION}",
                hint="a newer dflashctl wrote it: upgrade this one (pip install -U dflashctl), or use another store "
                "for this version (DFLASHCTL_STORE=/path/other.db)",
            )
        return version

    def error(self, e: BaseException) -> StoreError:
        """A clean StoreError for an sqlite3 error on this file, saying what to do."""
        text = str(e)
        if isinstance(e, StoreError):
            return e
        if "disk is full" in text or "disk I/O error" in text:
            free = _free_mib(os.path.dirname(self.path))
            return StoreError(f"run store {self.path}: cannot write: {text}"
                              + (f" ({free} MiB free on its file system)" if free is not None else ""),
                              hint=f"free space on the file system of {os.path.dirname(self.path)}")
        if isinstance(e, sqlite3.DatabaseError) and ("malformed" in text or "not a database" in text):
            return StoreError(f"run store {self.path} is corrupted: {text}", hint=self._corrupt_hint())
        if isinstance(e, sqlite3.OperationalError) and "no such column" in text:
            return StoreError(f"run store {self.path} does not have the schema this dflashctl expects: {text}",
                              hint="it was changed outside dflashctl or by another version; use another store "
                              "(DFLASHCTL_STORE=/path/other.db)")
        return StoreError(f"run store {self.path}: {type(e).__name__}: {text}")

    def quick_check(self) -> None:
        """``PRAGMA quick_check``; raises StoreError naming the first problems."""
        try:
            rows = [r[0] for r in self.conn.execute("PRAGMA quick_check").fetchall()]
        except sqlite3.DatabaseError as e:
            raise self.error(e) from None
        if rows != ["ok"]:
            raise StoreError(f"run store {self.path} is corrupted: integrity check: {'; '.join(rows[:3])}",
                             hint=self._corrupt_hint())

    def _corrupt_hint(self) -> str:
        here, aside = shlex.quote(self.path), shlex.quote(self.path + ".corrupt")
        return (f"move it aside (mv {here} {aside}) and start a new one; `sqlite3 {aside} .recover` may save "
                "its rows")

    # ----------------------------------------------------------------- connections

    @property
    def conn(self) -> sqlite3.Connection:
        """This thread's connection (reads go through it directly)."""
        conn = getattr(self._local, "conn", None)
        if conn is None or self._local.pid != os.getpid():
            conn = sqlite3.connect(self.path, timeout=self.timeout)
            # Transactions are ours to open (BEGIN IMMEDIATE in _write); no implicit ones.
            conn.isolation_level = None
            self._wal(conn)
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
            self._local.conn, self._local.db, self._local.pid = conn, None, os.getpid()
        return conn

    def _wal(self, conn: sqlite3.Connection) -> None:
        """Switch a new file to WAL. Two processes opening it at once both try; the
        switch needs the file to itself and SQLite answers "locked" at once rather
        than waiting, so it is tried again within the busy timeout."""
        deadline = time.monotonic() + self.timeout
        delay = 0.005
        while conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
            try:
                conn.execute("PRAGMA journal_mode=wal")
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(delay)
                delay = min(0.1, delay * 2)

    @property
    def db(self) -> "Database":
        """sqlite-utils over this thread's connection, for writes and migrations
        (imported on first use: read-only commands never pay for it)."""
        conn = self.conn
        db = getattr(self._local, "db", None)
        if db is None:
            from sqlite_utils import Database

            db = self._local.db = Database(conn)
        return db

    def close(self) -> None:
        """Close this thread's connection (others close with their threads)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None and self._local.pid == os.getpid():
            conn.close()
        self._local.conn = self._local.db = None

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def batch(self) -> AbstractContextManager[Database]:
        """One write transaction around several writes: every write method called
        inside it joins it (all stored, or none)."""
        return self._write()

    @contextmanager
    def _write(self) -> Iterator[Database]:
        """One write transaction; nested calls join the outer one."""
        db = self.db
        if db.conn.in_transaction:
            yield db
            return
        db.conn.execute("BEGIN IMMEDIATE")
        self.write_transactions += 1
        try:
            yield db
        except BaseException:
            if db.conn.in_transaction:
                db.conn.execute("ROLLBACK")
            raise
        db.conn.execute("COMMIT")

    def _query(self, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
        cursor = self.conn.execute(sql, list(params))
        names = [d[0] for d in cursor.description or ()]
        return [dict(zip(names, row)) for row in cursor]

    # ----------------------------------------------------------------- runs

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
        run_id = run_id or new_run_id(playbook, now)
        config = config or {}
        with self._write() as db:
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

    # ----------------------------------------------------------------- samples

    def add_sample(self, run_id: str, sample: Metrics | dict[str, Any], gpu: Any = None) -> None:
        self.add_samples(run_id, [sample], gpu=gpu)

    def add_samples(
        self,
        run_id: str,
        samples: Iterable[Metrics | dict[str, Any]],
        gpu: Any = None,
        metrics_offset: int | None = None,
        metrics_inode: int | None = None,
        observed: float | None = None,
        host_reading: Any = None,
    ) -> int:
        """Store metrics lines as samples; with ``metrics_offset`` (and the file's
        inode), advance the run's read position in the same transaction, so a crash
        between the two never stores a line twice or skips one. ``gpu`` and
        ``host_reading`` (the host's CPU and memory) are the poll's readings."""
        rows = []
        for s in samples:
            d = asdict(s) if isinstance(s, Metrics) else dict(s)
            d.setdefault("host_reading", None)
            extra = d.get("extra") if isinstance(d.get("extra"), dict) else {}
            d["mfu"] = d.get("mfu", extra.get("mfu"))
            for c in _SAMPLE_EXTRAS:
                d[c] = d.get(c, extra.get(c))
            time_, step = _number(d.get("time")), _int64(d.get("step"))
            if time_ is None or step is None:
                continue  # no time or step: not a sample (the contract rejects such lines first)
            phase = d.get("phase") if isinstance(d.get("phase"), str) else None
            rows.append([run_id, time_, step, *(_number(d.get(c)) for c in _SAMPLE_NUMBERS[:5]), phase,
                         _json(d.get("gpu", gpu)), _number(d.get("mfu")), _number(observed),
                         *(_number(d.get(c)) for c in _SAMPLE_EXTRAS), _json(d["host_reading"])])
        if rows and rows[-1][-1] is None:
            rows[-1][-1] = _json(host_reading)  # one reading per poll: on its newest line, not on each
        with self._write() as db:
            db.conn.executemany(
                f"INSERT INTO samples ({', '.join(_SAMPLE_COLUMNS)}) VALUES ({', '.join('?' * len(_SAMPLE_COLUMNS))})",
                rows,
            )
            if metrics_offset is not None:
                db.execute(
                    "UPDATE runs SET metrics_offset = ?, metrics_inode = ? WHERE id = ?",
                    [metrics_offset, metrics_inode, run_id],
                )
        return len(rows)

    def samples(self, run_id: str, since: float | None = None, limit: int | None = None) -> list[Sample]:
        """Samples in time order (the last ``limit`` of them when given)."""
        sql = "SELECT * FROM samples WHERE run_id = ?"
        params: list[Any] = [run_id]
        if since is not None:
            sql += " AND time > ?"
            params.append(since)
        sql += " ORDER BY time DESC, id DESC"
        if limit:
            sql += f" LIMIT {int(limit)}"
        return [_row_to(Sample, r) for r in reversed(self._query(sql, params))]

    def recent_samples(self, run_id: str, limit: int) -> list[Sample]:
        """The newest ``limit`` samples in time order, without their GPU readings
        (``gpu`` is None): what a view of many runs reads on every refresh."""
        names = [f.name for f in fields(Sample) if f.name not in ("gpu", "host_reading")]
        cursor = self.conn.execute(f"SELECT {', '.join(names)} FROM samples WHERE run_id = ? "
                                 "ORDER BY time DESC, id DESC LIMIT ?", [run_id, int(limit)])
        return [Sample(**dict(zip(names, row))) for row in reversed(cursor.fetchall())]

    def gpu_samples(self, run_id: str, limit: int) -> list[Sample]:
        """The newest ``limit`` samples that carry GPU readings, in time order."""
        rows = self._query("SELECT * FROM samples WHERE run_id = ? AND gpu IS NOT NULL AND gpu != 'null' "
                           "ORDER BY time DESC, id DESC LIMIT ?", [run_id, int(limit)])
        return [_row_to(Sample, r) for r in reversed(rows)]

    def host_samples(self, run_id: str, limit: int = 2) -> list[Sample]:
        """The newest ``limit`` samples that carry their host's CPU and memory
        reading, in time order (two give the CPU's busy share between them)."""
        rows = self._query("SELECT * FROM samples WHERE run_id = ? AND host_reading IS NOT NULL "
                           "AND host_reading != 'null' ORDER BY time DESC, id DESC LIMIT ?", [run_id, int(limit)])
        return [_row_to(Sample, r) for r in reversed(rows)]

    def sample_series(self, run_id: str, points: int = 240, since: float | None = None) -> list[dict[str, Any]]:
        """The run's whole history (its samples from ``since`` on, when given) in at
        most ``points`` buckets of equal time, oldest first: per bucket its last time
        (``start``: its first) and step, the mean tok/s, loss, accuracy and
        acceptance length, and how many samples it holds. A chart over days of
        samples reads one row per bucket, never every sample."""
        since = float("-inf") if since is None else float(since)
        span = self._query("SELECT min(time) AS t0, max(time) AS t1 FROM samples WHERE run_id = ? AND time >= ?",
                           [run_id, since])[0]
        if span["t0"] is None:
            return []
        width = max((span["t1"] - span["t0"]) / max(1, int(points)), 1e-9)
        return self._query(
            "SELECT min(CAST((time - ?) / ? AS INTEGER), ?) AS bucket, max(time) AS time, min(time) AS start, "
            "max(step) AS step, avg(tok_s) AS tok_s, avg(loss) AS loss, avg(acc) AS acc, "
            "avg(accept_len) AS accept_len, count(*) AS samples "
            "FROM samples WHERE run_id = ? AND time >= ? GROUP BY bucket ORDER BY bucket",
            [span["t0"], width, max(1, int(points)) - 1, run_id, since])

    def metrics_position(self, run_id: str) -> tuple[int, int | None]:
        """(byte offset, inode) of metrics.jsonl up to which samples are stored."""
        rows = self._query("SELECT metrics_offset, metrics_inode FROM runs WHERE id = ?", [run_id])
        if not rows:
            return 0, None
        return int(rows[0]["metrics_offset"] or 0), rows[0]["metrics_inode"]

    def metrics_offset(self, run_id: str) -> int:
        return self.metrics_position(run_id)[0]

    def set_metrics_offset(self, run_id: str, offset: int, inode: int | None = None) -> None:
        with self._write() as db:
            db.execute("UPDATE runs SET metrics_offset = ?, metrics_inode = ? WHERE id = ?", [offset, inode, run_id])

    def healthy_tok_s_history(self, playbook: str, exclude_run: str | None = None, limit: int = 10) -> list[float]:
        """Median training tok/s of each earlier healthy run of a playbook, newest first.

        Healthy: the run ended ``done`` or ``stopped`` (not failed), and no throughput
        regression (event kind ``regression``) was recorded for it. Only samples in
        phase ``training`` count, so compile warm-up does not drag the median down.
        """
        rows = self._query(
            """
            SELECT r.id, r.created FROM runs r
            WHERE r.playbook = ? AND r.state IN (?, ?) AND r.id != ?
              AND NOT EXISTS (SELECT 1 FROM events e WHERE e.run_id = r.id AND e.kind = ?)
            ORDER BY r.created DESC
            """,
            [playbook, DONE, STOPPED, exclude_run or "", EVENT_REGRESSION],
        )
        history = []
        for row in rows:
            values = [
                r["tok_s"]
                for r in self._query(
                    "SELECT tok_s FROM samples WHERE run_id = ? AND phase = ? AND tok_s IS NOT NULL",
                    [row["id"], PHASE_TRAINING],
                )
            ]
            if values:
                history.append(float(statistics.median(values)))
            if len(history) >= limit:
                break
        return history

    def baseline_tok_s(self, playbook: str, exclude_run: str | None = None) -> float | None:
        """The learned baseline: the median over ``healthy_tok_s_history``; None without history."""
        history = self.healthy_tok_s_history(playbook, exclude_run=exclude_run)
        return float(statistics.median(history)) if history else None

    # ----------------------------------------------------------------- evaluations

    def add_eval(self, run_id: str, now: float, report: dict[str, Any] | None = None, error: str | None = None) -> int:
        """An evaluation of the run's drafter: the trainer's JSON report, or why there is none."""
        report = report if isinstance(report, dict) else None
        speed = (report or {}).get("speed") if isinstance((report or {}).get("speed"), dict) else {}
        with self._write() as db:
            cur = db.execute(
                "INSERT INTO evals (run_id, time, step, tau, speedup, report, error) VALUES (?, ?, ?, ?, ?, ?, ?)",
                [run_id, now, _int64((report or {}).get("step")), _number((report or {}).get("tau")),
                 _number(speed.get("speedup")), _json(report), error])
            return cur.lastrowid

    def update_eval(self, eval_id: int, now: float, report: dict[str, Any]) -> None:
        """Replace an evaluation's report with a newer one (eval reports as it goes)."""
        speed = report.get("speed") if isinstance(report.get("speed"), dict) else {}
        with self._write() as db:
            db.execute("UPDATE evals SET time = ?, step = ?, tau = ?, speedup = ?, report = ? WHERE id = ?",
                       [now, _int64(report.get("step")), _number(report.get("tau")), _number(speed.get("speedup")),
                        _json(report), eval_id])

    def evals(self, run_id: str | None = None) -> list[dict[str, Any]]:
        """Evaluations, oldest first (of one run, or of all)."""
        sql, params = "SELECT * FROM evals", []
        if run_id is not None:
            sql, params = sql + " WHERE run_id = ?", [run_id]
        return [_decode(r) for r in self._query(sql + " ORDER BY time, id", params)]

    def latest_evals(self) -> dict[str, dict[str, Any]]:
        """Each run's newest evaluation that produced a report."""
        rows = self._query("SELECT * FROM evals WHERE error IS NULL ORDER BY time, id")
        return {r["run_id"]: _decode(r) for r in rows}

    def run_outcomes(self, run_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """What each run achieved, from its samples and restarts: the newest step and
        its sample time, the newest loss and acceptance length recorded, and the
        restarts that started a process (``Restart.counts``). One query per kind for
        every run asked, never one per run."""
        ids = list(run_ids)
        result: dict[str, dict[str, Any]] = {
            r: {"step": None, "sample_time": None, "loss": None, "accept_len": None, "restarts": 0} for r in ids}
        if not ids:
            return result
        marks = ", ".join("?" for _ in ids)
        rows = self._query(f"SELECT run_id, step, time FROM samples WHERE id IN (SELECT max(id) FROM samples "
                           f"WHERE run_id IN ({marks}) GROUP BY run_id)", ids)
        for r in rows:
            result[r["run_id"]].update(step=r["step"], sample_time=r["time"])
        for column in ("loss", "accept_len"):
            rows = self._query(f"SELECT run_id, {column} FROM samples WHERE id IN (SELECT max(id) FROM samples "
                               f"WHERE run_id IN ({marks}) AND {column} IS NOT NULL GROUP BY run_id)", ids)
            for r in rows:
                result[r["run_id"]][column] = r[column]
        rows = self._query(f"SELECT run_id, count(*) AS n FROM restarts WHERE run_id IN ({marks}) AND (outcome IS NULL "
                           "OR (outcome NOT LIKE 'not issued%' AND outcome NOT LIKE 'cancelled%')) GROUP BY run_id", ids)
        for r in rows:
            result[r["run_id"]]["restarts"] = r["n"]
        return result

    # ----------------------------------------------------------------- supervisors

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

    # ----------------------------------------------------------------- environment snapshots

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
