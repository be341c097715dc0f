"""The store's schema: its named migrations, in order, and the version they make.

Migrations are applied under the write lock when a store opens (``connection``), so
two processes opening a fresh file do not race.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sqlite_utils import Database

from dflashctl.store.rows import _SAMPLE_NUMBERS

ROLLUP_WIDTHS = (60, 900)  # seconds: the fine rollups, then the coarse ones kept for good
SAMPLE_METRICS = ("step", "tok_s", "loss", "acc", "accept_len", "mfu")  # a sample's figures rolled up
CHART_METRICS = (*SAMPLE_METRICS, "train_tok_s")  # a run's rollups its history chart reads


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


@migrations(name="0011_eval_attempts")
def _m0011(db: Database) -> None:
    # Each eval is one attempt with its own id (its files on the host are named by it).
    db["evals"].add_column("attempt", str)


@migrations(name="0012_host_readings_rollups")
def _m0012(db: Database) -> None:
    # A host's readings on every poll, whatever its runs wrote (they were stored on each
    # sample, with every metrics line: blind while a run started, compiled or stalled).
    db.execute("CREATE TABLE host_readings (id INTEGER PRIMARY KEY, host TEXT NOT NULL, time REAL NOT NULL, "
               "gpu TEXT, host_reading TEXT)")
    db.execute("CREATE INDEX host_readings_time ON host_readings (host, time)")
    db.execute("CREATE INDEX host_readings_gpu ON host_readings (host, time) WHERE gpu IS NOT NULL")
    db.execute("CREATE INDEX host_readings_host ON host_readings (host, time) WHERE host_reading IS NOT NULL")
    # Min, mean and max per bucket of every metric of a run or a host (store/history.py).
    db.execute("CREATE TABLE rollups (owner TEXT NOT NULL, metric TEXT NOT NULL, width INTEGER NOT NULL, "
               "bucket INTEGER NOT NULL, n INTEGER NOT NULL, min REAL, mean REAL, max REAL, "
               "PRIMARY KEY (owner, metric, width, bucket)) WITHOUT ROWID")
    db["runs"].add_column("history_from", float)  # samples before this time were pruned to rollups
    # What earlier versions stored on samples moves: each run's newest readings to its
    # host, its samples' figures into rollups.
    db.execute("INSERT INTO host_readings (host, time, gpu, host_reading) "
               "SELECT r.host, coalesce(s.observed, s.time), s.gpu, s.host_reading FROM samples s JOIN runs r "
               "ON r.id = s.run_id WHERE s.id IN (SELECT id FROM samples t WHERE t.run_id = s.run_id "
               "AND (t.gpu IS NOT NULL OR t.host_reading IS NOT NULL) ORDER BY t.time DESC LIMIT 32) "
               "ORDER BY coalesce(s.observed, s.time)")
    for width in ROLLUP_WIDTHS:
        for metric, column, where in [*((m, m, "1") for m in SAMPLE_METRICS),
                                      ("train_tok_s", "tok_s", "coalesce(phase, 'training') = 'training'")]:
            db.execute(f"INSERT INTO rollups (owner, metric, width, bucket, n, min, mean, max) "
                       f"SELECT run_id, '{metric}', {width}, CAST(time / {width} AS INTEGER) * {width}, "
                       f"count({column}), min({column}), avg({column}), max({column}) FROM samples "
                       f"WHERE {column} IS NOT NULL AND {where} GROUP BY run_id, CAST(time / {width} AS INTEGER)")
    db.execute("DROP INDEX IF EXISTS samples_host_reading")
    db.execute("UPDATE samples SET gpu = NULL, host_reading = NULL WHERE gpu IS NOT NULL OR host_reading IS NOT NULL")


SCHEMA_VERSION = 12  # the number of migrations above; recorded as PRAGMA user_version
