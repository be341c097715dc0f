"""History at real volume: hosts' readings on every poll, rollups, retention, sizes.

A run of days writes a sample every few seconds and a reading of its host's GPUs
on every poll. Kept as written, five days of one 8-GPU run weighed 455 MB and a
chart read all of it. So:

- ``host_readings``: a host's GPUs and CPU/memory, one row per poll, whatever its
  runs wrote: on the host's own clock of polls, not the trainer's metrics lines.
- ``rollups``: per owner (a run id, or ``host:NAME``), metric and bucket width, one
  row per bucket: how many values, their min, mean and max. Written as the values
  are (an upsert per metric and width), so every bucket up to the newest is there.
- Retention (``prune``): rows at full resolution for the newest ``full`` seconds
  of each run's samples and ``readings`` seconds of each host's readings;
  one-minute rollups for the newest ``fine`` seconds; the coarse ones for the
  owner's whole life.
- A query for a chart reads at most a few rows per point of the screen: raw rows
  while the buckets asked are finer than a minute, else the coarsest rollups finer
  than them, grouped again in SQL (``rollup_series``).
"""

from __future__ import annotations

import math
import os
import sqlite3
from typing import Any, Iterable

from dflashctl.store.connection import StoreConnection
from dflashctl.store.rows import _decode, _json, _number
from dflashctl.store.schema import CHART_METRICS, ROLLUP_WIDTHS, SAMPLE_METRICS

HOST_OWNER = "host:"  # a host's rollups are owned by "host:NAME"
GPU_FIELDS = {"util": "utilization_pct", "mem": "memory_used_mib", "temp": "temperature_c", "power": "power_draw_w"}
SAMPLE_EXTRAS = ("lr", "grad_norm")  # numbers of a metrics line's extra the charts read


def host_owner(host: str) -> str:
    return HOST_OWNER + host


def reading_values(gpu: Any, host_reading: Any) -> dict[str, float]:
    """What a poll's readings roll up into: ``gpuN.util|mem|temp|power`` per GPU and
    the host's ``load1`` and ``mem_used_kib``; anything not a finite number is left out."""
    values: dict[str, float] = {}
    for g in gpu if isinstance(gpu, list) else []:
        index = g.get("index") if isinstance(g, dict) else None
        if not isinstance(index, int) or isinstance(index, bool):
            continue
        for name, key in GPU_FIELDS.items():
            v = _number(g.get(key))
            if v is not None:
                values[f"gpu{index}.{name}"] = v
    if isinstance(host_reading, dict):
        load1 = _number(host_reading.get("load1"))
        if load1 is not None:
            values["load1"] = load1
        total, free = _number(host_reading.get("mem_total_kib")), _number(host_reading.get("mem_available_kib"))
        if total is not None and free is not None and 0 <= free <= total:
            values["mem_used_kib"] = total - free
    return values


def sample_values(row: dict[str, Any]) -> dict[str, float]:
    """What one stored sample rolls up into (``train_tok_s``: tok/s of training lines only)."""
    values = {k: v for k in SAMPLE_METRICS if (v := _number(row.get(k))) is not None}
    extra = row.get("extra") if isinstance(row.get("extra"), dict) else {}
    values.update({k: v for k in SAMPLE_EXTRAS if (v := _number(row.get(k, extra.get(k)))) is not None})
    if "tok_s" in values and (row.get("phase") or "training") == "training":
        values["train_tok_s"] = values["tok_s"]
    return values


_UPSERT = ("INSERT INTO rollups (owner, metric, width, bucket, n, min, mean, max) VALUES (?, ?, ?, ?, 1, ?, ?, ?) "
           "ON CONFLICT (owner, metric, width, bucket) DO UPDATE SET n = n + 1, min = min(min, excluded.min), "
           "max = max(max, excluded.max), mean = mean + (excluded.mean - mean) / (n + 1)")


class HistoryMixin(StoreConnection):
    """Hosts' readings, rollups of samples and readings, retention and sizes."""

    # ----------------------------------------------------------------- writes

    def _roll(self, owner: str, points: Iterable[tuple[float, dict[str, float]]]) -> None:
        rows = [(owner, metric, width, int(time // width) * width, v, v, v)
                for time, values in points for metric, v in values.items() for width in ROLLUP_WIDTHS]
        if rows:
            self.conn.executemany(_UPSERT, rows)

    def add_readings(self, host: str, time: float, gpu: Any = None, host_reading: Any = None) -> None:
        """One poll's readings of a host (``gpu``: its GPUs with their processes, as
        ``supervisor_core.host_gpu_rows`` makes them; ``host_reading``: its CPU and
        memory), at local time ``time``; rolled up as they are stored."""
        if gpu is None and host_reading is None or _number(time) is None:
            return
        with self._write() as db:
            db.execute("INSERT INTO host_readings (host, time, gpu, host_reading) VALUES (?, ?, ?, ?)",
                       [host, float(time), _json(gpu), _json(host_reading)])
            self._roll(host_owner(host), [(float(time), reading_values(gpu, host_reading))])

    # ----------------------------------------------------------------- reads

    def readings(self, host: str, limit: int, kind: str = "gpu") -> list[dict[str, Any]]:
        """The newest ``limit`` readings of a host that hold ``kind`` (``gpu`` or
        ``host_reading``), oldest first: {time, gpu, host_reading}."""
        if kind not in ("gpu", "host_reading"):
            raise ValueError(f"readings: unknown kind {kind!r}")
        rows = self._query(f"SELECT time, gpu, host_reading FROM host_readings WHERE host = ? AND {kind} IS NOT NULL "
                           "ORDER BY time DESC, id DESC LIMIT ?", [host, int(limit)])
        return [_decode(r) for r in reversed(rows)]

    def newest_reading_time(self, host: str, kind: str = "gpu") -> float | None:
        """The time of the host's newest reading holding ``kind`` (None: none); one index lookup."""
        if kind not in ("gpu", "host_reading"):
            raise ValueError(f"readings: unknown kind {kind!r}")
        return self.conn.execute(f"SELECT max(time) FROM host_readings WHERE host = ? AND {kind} IS NOT NULL",
                                 [host]).fetchone()[0]

    def rollup_series(self, owner: str, metrics: Iterable[str], t0: float, t1: float,
                      points: int) -> list[dict[str, Any]]:
        """``metrics`` of ``owner`` between ``t0`` and ``t1`` in at most ``points``
        buckets of equal time, oldest first, from the coarsest rollups finer than a
        bucket: per bucket its ``start``, ``time`` (its end, at most ``t1``), the
        number of values, and per metric its mean, ``_min`` and ``_max``."""
        points = max(1, int(points))
        return self.rollup_buckets(owner, metrics, t0, max(t1 - t0, 1e-9) / points, points, t0, t1)

    def rollup_buckets(self, owner: str, metrics: Iterable[str], origin: float, width: float, count: int,
                       t0: float, t1: float, first: int = 0) -> list[dict[str, Any]]:
        """``rollup_series`` on a given grid: ``count`` buckets of ``width`` seconds from
        ``origin`` (the last one takes what lies beyond), those from bucket ``first`` on,
        each numbered (``bucket``); what lies before ``t0`` or after ``t1`` is not read."""
        rollup = max([w for w in ROLLUP_WIDTHS if w <= width] or [ROLLUP_WIDTHS[0]])
        names = list(dict.fromkeys(metrics))
        if not names:
            return []
        # A rollup is counted in the bucket where it begins (one begun before ``t0``, in the first).
        low = (">=", origin + first * width) if first else (">", t0 - rollup)
        marks = ", ".join("?" * len(names))
        rows = self._query(
            f"SELECT min(CAST((bucket - ?) / ? AS INTEGER), ?) AS b, metric, min(bucket) AS first, "
            f"max(bucket) AS last, sum(n) AS n, min(min) AS lo, sum(mean * n) / sum(n) AS mean, max(max) AS hi "
            f"FROM rollups WHERE owner = ? AND width = ? AND bucket {low[0]} ? AND bucket <= ? "
            f"AND metric IN ({marks}) GROUP BY b, metric ORDER BY b",
            [origin, width, count - 1, owner, rollup, low[1], t1, *names])
        out: dict[int, dict[str, Any]] = {}
        for r in rows:
            p = out.setdefault(r["b"], {"bucket": r["b"], "start": max(t0, r["first"]),
                                   "time": min(t1, r["last"] + rollup), "samples": 0})
            p["start"], p["time"] = min(p["start"], max(t0, r["first"])), max(p["time"], min(t1, r["last"] + rollup))
            p["samples"] = max(p["samples"], r["n"])
            p[r["metric"]], p[f"{r['metric']}_min"], p[f"{r['metric']}_max"] = r["mean"], r["lo"], r["hi"]
        return [out[b] for b in sorted(out)]

    def rollup_span(self, owner: str) -> tuple[float, float] | None:
        """(start of the first, end of the last) coarse bucket of run ``owner``'s charted
        figures; None without rollups."""
        width = ROLLUP_WIDTHS[-1]
        # A min() or max() over one (owner, metric, width) is one look into the primary
        # key; over every metric of an owner at once it would read all its rollups.
        ends = " UNION ALL ".join(["SELECT (SELECT min(bucket) FROM rollups WHERE owner = ? AND metric = ? AND width = ?) "
                                   "AS a, (SELECT max(bucket) FROM rollups WHERE owner = ? AND metric = ? AND width = ?) "
                                   "AS b"] * len(CHART_METRICS))
        row = self._query(f"SELECT min(a) AS a, max(b) AS b FROM ({ends})",
                          [v for m in CHART_METRICS for v in (owner, m, width) * 2])[0]
        return None if row["a"] is None else (float(row["a"]), float(row["b"]) + width)

    # ----------------------------------------------------------------- retention

    def prune(self, *, runs: Iterable[str] = (), hosts: Iterable[str] = (), full_s: float,
              fine_s: float) -> dict[str, int]:
        """Apply the retention to ``runs`` and ``hosts``: samples and readings older
        than ``full_s`` before the owner's newest, fine rollups older than ``fine_s``
        before it. Returns the rows deleted, by table. A run pruned records from when
        its samples are whole (``runs.history_from``)."""
        deleted = {"samples": 0, "host_readings": 0, "rollups": 0}
        with self._write() as db:
            for run_id in runs:
                newest = db.execute("SELECT max(time) FROM samples WHERE run_id = ?", [run_id]).fetchone()[0]
                if newest is None:
                    continue
                cut = newest - full_s
                n = db.execute("DELETE FROM samples WHERE run_id = ? AND time < ?", [run_id, cut]).rowcount
                if n:
                    deleted["samples"] += n
                    db.execute("UPDATE runs SET history_from = max(coalesce(history_from, 0), ?) WHERE id = ?",
                               [cut, run_id])
                deleted["rollups"] += self._prune_fine(run_id, newest - fine_s)
            for host in hosts:
                newest = db.execute("SELECT max(time) FROM host_readings WHERE host = ?", [host]).fetchone()[0]
                if newest is None:
                    continue
                deleted["host_readings"] += db.execute("DELETE FROM host_readings WHERE host = ? AND time < ?",
                                                       [host, newest - full_s]).rowcount
                deleted["rollups"] += self._prune_fine(host_owner(host), newest - fine_s)
        return deleted

    def _prune_fine(self, owner: str, cut: float) -> int:
        return self.conn.execute("DELETE FROM rollups WHERE owner = ? AND width = ? AND bucket < ?",
                                 [owner, ROLLUP_WIDTHS[0], math.floor(cut)]).rowcount

    def history_from(self, run_id: str) -> float | None:
        """Before this time the run's samples were pruned to rollups (None: all are kept)."""
        rows = self._query("SELECT history_from FROM runs WHERE id = ?", [run_id])
        return rows[0]["history_from"] if rows else None

    # ----------------------------------------------------------------- sizes

    def vacuum(self) -> None:
        """Give the pages of deleted rows back to the file system (VACUUM, then the
        write-ahead log emptied); it waits for the write lock like any writer."""
        try:
            self.conn.execute("VACUUM")
            self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error as e:
            raise self.error(e) from None

    def file_bytes(self) -> int:
        """The store's size on disk: its file and its write-ahead log."""
        return sum(os.path.getsize(p) for p in (self.path, self.path + "-wal") if os.path.exists(p))

    def table_bytes(self) -> dict[str, int]:
        """Bytes of each table with its indexes (SQLite's dbstat; {} where it is missing)."""
        try:
            rows = self.conn.execute("SELECT coalesce(m.tbl_name, d.name) AS t, sum(d.pgsize) FROM dbstat AS d "
                                     "LEFT JOIN sqlite_master AS m ON m.name = d.name GROUP BY t").fetchall()
        except sqlite3.OperationalError:  # an SQLite built without dbstat: sizes unknown, not an error
            return {}
        return {t: int(n) for t, n in rows}

    def run_bytes(self, run_ids: Iterable[str], tables: dict[str, int] | None = None) -> dict[str, int]:
        """Each run's share of the store: its rows of each table times that table's
        bytes per row (``table_bytes``, read once when not given)."""
        ids = list(run_ids)
        if not ids:
            return {}
        tables = self.table_bytes() if tables is None else tables
        out = {r: 0 for r in ids}
        marks = ", ".join("?" * len(ids))
        for table, column in (("samples", "run_id"), ("events", "run_id"), ("restarts", "run_id"),
                              ("evals", "run_id"), ("rollups", "owner")):
            total = self.conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
            if not total or not tables.get(table):
                continue
            per_row = tables[table] / total
            for run_id, n in self.conn.execute(f"SELECT {column}, count(*) FROM {table} WHERE {column} IN ({marks}) "
                                               f"GROUP BY {column}", ids):
                out[run_id] += int(n * per_row)
        return out
