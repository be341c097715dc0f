"""A run's progress: its samples (metrics lines), series, baselines, evaluations and outcomes."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, fields
from typing import Any, Iterable, Sequence

from dflashctl.core.contract import PHASE_TRAINING, Metrics
from dflashctl.core.states import DONE, FINAL_STATES, STOPPED
from dflashctl.store.history import HistoryMixin, sample_values
from dflashctl.store.rows import (
    _SAMPLE_COLUMNS,
    _SAMPLE_EXTRAS,
    _SAMPLE_NUMBERS,
    EVENT_REGRESSION,
    EVENT_STATE,
    Sample,
    _decode,
    _int64,
    _json,
    _number,
    _row_to,
)
from dflashctl.store.schema import CHART_METRICS, ROLLUP_WIDTHS


def _series_widths() -> tuple[int, ...]:
    """Bucket widths of a history's charts, seconds: at most 2x apart,
    whole minutes from a minute on and whole quarter-hours from a quarter-hour on, so a
    bucket holds whole rollups of the width it reads (``ROLLUP_WIDTHS``)."""
    out = set()
    for e in range(8):
        for m in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8):
            w = m * 10**e
            unit = ROLLUP_WIDTHS[1] if w >= ROLLUP_WIDTHS[1] else ROLLUP_WIDTHS[0] if w >= ROLLUP_WIDTHS[0] else 1
            out.add(max(unit, round(w / unit) * unit))
    return tuple(sorted(out))


SERIES_WIDTHS = _series_widths()


@dataclass(frozen=True)
class SeriesGrid:
    """The buckets of a run's history chart: ``count`` of ``width`` seconds from
    ``origin``, over the history between ``t0`` and ``t1``; ``raw``: read from the
    samples (else the rollups)."""

    origin: float
    width: float
    count: int
    t0: float
    t1: float
    raw: bool


def series_grid(t0: float, t1: float, points: int) -> tuple[float, float, int]:
    """(origin, width, count) of at most ``points`` buckets over ``t0``..``t1``: the
    finest width of the ladder that fits, the origin a multiple of it. Edges fixed in
    absolute time: a new sample changes only the newest bucket (a live chart reads
    that one again, not the run), and the span's growth only adds buckets."""
    points = max(1, int(points))
    for width in SERIES_WIDTHS:
        origin = math.floor(t0 / width) * width
        count = int((t1 - origin) // width) + 1
        if count <= points:
            return origin, float(width), count
    width = float(SERIES_WIDTHS[-1])
    return math.floor(t0 / width) * width, width, points


def eval_figures(row: dict[str, Any]) -> dict[str, Any]:
    """An eval row in the terms the views show: which attempt, its size (prompts,
    tokens), whether it ran to the end, tau and speed-up with their spread over its
    prompts (``tau_sd``: the standard deviation of the prompts' tau; ``speedup_range``:
    the slowest and fastest prompt's speed-up). A speed-up of one prompt of 8 tokens
    is noise: the size says so."""
    report = row.get("report") if isinstance(row.get("report"), dict) else {}
    taus = [v for v in report.get("tau_per_prompt") or [] if isinstance(v, (int, float)) and math.isfinite(v)]
    per = [p for p in report.get("per_prompt") or [] if isinstance(p, dict)]
    speedups = [p["greedy_seconds"] / p["seconds"] for p in per
                if isinstance(p.get("greedy_seconds"), (int, float)) and isinstance(p.get("seconds"), (int, float))
                and p["seconds"] > 0]
    prompts, tokens = report.get("prompts"), report.get("new_tokens")
    return {"id": row.get("id"), "attempt": row.get("attempt"), "time": row.get("time"), "step": row.get("step"),
            "tau": row.get("tau"), "speedup": row.get("speedup"),
            "prompts": prompts if isinstance(prompts, int) else None,
            "new_tokens": tokens if isinstance(tokens, int) else None,
            "complete": bool(report.get("complete", True)),
            "tau_sd": statistics.stdev(taus) if len(taus) >= 2 else None,
            "speedup_range": [min(speedups), max(speedups)] if len(speedups) >= 2 else None}


def preferred_eval(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The eval whose tau a run shows, from its eval rows (oldest first): the largest
    complete one (most tokens, then prompts; the newest of equals), else the largest
    partial one; None without a measured tau. Its ``eval_figures``, and
    ``evals``: how many evals measured a tau, ``newer``: how many of them are newer
    than the one chosen (a later, smaller eval does not replace a larger one's tau,
    and the views say so)."""
    measured = [r for r in rows if r.get("error") is None and r.get("tau") is not None]
    if not measured:
        return None
    figures = [eval_figures(r) for r in measured]
    best = max(range(len(figures)), key=lambda i: (figures[i]["complete"], figures[i]["new_tokens"] or 0,
                                                   figures[i]["prompts"] or 0, i))
    return {**figures[best], "report": measured[best].get("report"), "evals": len(measured),
            "newer": len(measured) - 1 - best}


BASELINE_MIN_RUNS = 3
"""Earlier healthy runs a learned throughput baseline needs: one run (a busy
machine's, a shorter one's) is an anecdote, and regressions judged by it flap."""


class SamplesMixin(HistoryMixin):
    """The store's samples and evaluations: written as the supervisor reads them,
    read back as histories, chart series, throughput baselines and outcomes."""

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
        """Store metrics lines as samples, rolled up as they are stored; with
        ``metrics_offset`` (and the file's inode), advance the run's read position in
        the same transaction, so a crash between the two never stores a line twice or
        skips one. ``gpu`` and ``host_reading`` (the host's CPU and memory), when
        given, are a poll's readings of the run's host (``add_readings``, at
        ``observed``)."""
        rows, rolled = [], []
        for s in samples:
            d = asdict(s) if isinstance(s, Metrics) else dict(s)
            extra = d.get("extra") if isinstance(d.get("extra"), dict) else {}
            d["mfu"] = d.get("mfu", extra.get("mfu"))
            for c in _SAMPLE_EXTRAS:
                d[c] = d.get(c, extra.get(c))
            time_, step = _number(d.get("time")), _int64(d.get("step"))
            if time_ is None or step is None:
                continue  # no time or step: not a sample (the contract rejects such lines first)
            phase = d.get("phase") if isinstance(d.get("phase"), str) else None
            rows.append([run_id, time_, step, *(_number(d.get(c)) for c in _SAMPLE_NUMBERS[:5]), phase,
                         None, _number(d.get("mfu")), _number(observed),
                         *(_number(d.get(c)) for c in _SAMPLE_EXTRAS), None])
            rolled.append((time_, sample_values({**d, "phase": phase})))
        with self._write() as db:
            db.conn.executemany(
                f"INSERT INTO samples ({', '.join(_SAMPLE_COLUMNS)}) VALUES ({', '.join('?' * len(_SAMPLE_COLUMNS))})",
                rows,
            )
            self._roll(run_id, rolled)
            if metrics_offset is not None:
                db.execute(
                    "UPDATE runs SET metrics_offset = ?, metrics_inode = ? WHERE id = ?",
                    [metrics_offset, metrics_inode, run_id],
                )
            if gpu is not None or host_reading is not None:
                host = db.execute("SELECT host FROM runs WHERE id = ?", [run_id]).fetchone()
                at = observed if observed is not None else (rows[-1][1] if rows else None)
                if host is not None and at is not None:
                    self.add_readings(host[0], at, gpu, host_reading)
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

    def sample_series(self, run_id: str, points: int = 240, since: float | None = None) -> list[dict[str, Any]]:
        """The run's whole history (from ``since`` on, when given) in at most ``points``
        buckets of equal time on the grid ``series_grid`` chooses, oldest first: per
        bucket its number (``bucket``), last time (``start``: its first) and step, the
        mean tok/s, loss, accuracy and acceptance length (and each one's ``_min`` and
        ``_max``), and how many samples it holds. Read from the samples while a bucket
        is under a minute and they are all kept, else from the rollups: a chart over
        days reads a few rows per point, never every sample."""
        grid = self.series_grid(run_id, points, since)
        return self.sample_buckets(run_id, grid) if grid is not None else []

    def series_grid(self, run_id: str, points: int = 240, since: float | None = None) -> SeriesGrid | None:
        """The buckets ``sample_series`` reads for the run's history from ``since`` on
        (three index lookups; None: no history there)."""
        raw = self._query("SELECT min(time) AS t0, max(time) AS t1 FROM samples WHERE run_id = ?", [run_id])[0]
        pruned = self.history_from(run_id) is not None
        rolled = self.rollup_span(run_id) if pruned or raw["t0"] is None else None
        firsts = [t for t in (raw["t0"], rolled[0] if rolled else None) if t is not None]
        if not firsts:
            return None
        t1 = raw["t1"] if raw["t1"] is not None else rolled[1]  # type: ignore[index]
        t0 = max(min(firsts), float("-inf") if since is None else float(since))
        if t0 > t1:
            return None
        origin, width, count = series_grid(t0, t1, points)
        return SeriesGrid(origin, width, count, t0, t1,
                          raw["t0"] is not None and raw["t0"] <= t0 and width < ROLLUP_WIDTHS[0])

    def sample_buckets(self, run_id: str, grid: SeriesGrid, first: int = 0) -> list[dict[str, Any]]:
        """The buckets of ``grid`` (``series_grid``) from bucket ``first`` on, as
        ``sample_series`` gives them."""
        if grid.raw:
            return self._raw_series(run_id, grid, first)
        series = self.rollup_buckets(run_id, CHART_METRICS, grid.origin, grid.width, grid.count,
                                     grid.t0, grid.t1, first)
        for p in series:
            p["step"] = p.get("step_max")
        return [p for p in series if p["step"] is not None]

    def newest_sample_time(self, run_id: str) -> float | None:
        """The time of the run's newest sample (None: it has none); one index lookup."""
        return self.conn.execute("SELECT max(time) FROM samples WHERE run_id = ?", [run_id]).fetchone()[0]

    def _raw_series(self, run_id: str, grid: SeriesGrid, first: int) -> list[dict[str, Any]]:
        figures = ", ".join(f"avg({c}) AS {c}, min({c}) AS {c}_min, max({c}) AS {c}_max"
                            for c in ("tok_s", "loss", "acc", "accept_len", "mfu"))
        return self._query(
            "SELECT min(CAST((time - ?) / ? AS INTEGER), ?) AS bucket, max(time) AS time, min(time) AS start, "
            f"max(step) AS step, {figures}, count(*) AS samples "
            "FROM samples WHERE run_id = ? AND time >= ? GROUP BY bucket ORDER BY bucket",
            [grid.origin, grid.width, grid.count - 1, run_id, max(grid.t0, grid.origin + first * grid.width)])

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
            if self.history_from(row["id"]) is None:  # every sample kept: their median
                values = [r["tok_s"] for r in self._query(
                    "SELECT tok_s FROM samples WHERE run_id = ? AND phase = ? AND tok_s IS NOT NULL",
                    [row["id"], PHASE_TRAINING])]
            else:  # pruned: the median of its coarse buckets' means
                values = [r["mean"] for r in self._query(
                    "SELECT mean FROM rollups WHERE owner = ? AND metric = 'train_tok_s' AND width = ?",
                    [row["id"], ROLLUP_WIDTHS[-1]])]
            if values:
                history.append(float(statistics.median(values)))
            if len(history) >= limit:
                break
        return history

    def baseline_tok_s(self, playbook: str, exclude_run: str | None = None,
                       min_runs: int = BASELINE_MIN_RUNS) -> float | None:
        """The learned baseline: the median over ``healthy_tok_s_history``; None with
        fewer than ``min_runs`` healthy runs (a regression is then judged only against
        the playbook's ``expect.baseline_tok_s``)."""
        history = self.healthy_tok_s_history(playbook, exclude_run=exclude_run)
        return float(statistics.median(history)) if history and len(history) >= min_runs else None

    # ----------------------------------------------------------------- evaluations

    def add_eval(self, run_id: str, now: float, report: dict[str, Any] | None = None, error: str | None = None,
                 attempt: str | None = None) -> int:
        """An evaluation of the run's drafter (one attempt, ``attempt`` its id): the
        trainer's JSON report, or why there is none."""
        report = report if isinstance(report, dict) else None
        speed = (report or {}).get("speed") if isinstance((report or {}).get("speed"), dict) else {}
        with self._write() as db:
            cur = db.execute(
                "INSERT INTO evals (run_id, time, step, tau, speedup, report, error, attempt) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [run_id, now, _int64((report or {}).get("step")), _number((report or {}).get("tau")),
                 _number(speed.get("speedup")), _json(report), error, attempt])
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

    def preferred_evals(self, run_ids: Iterable[str] | None = None) -> dict[str, dict[str, Any]]:
        """Each run's eval whose tau is shown (``preferred_eval``), with its figures."""
        by_run: dict[str, list[dict[str, Any]]] = {}
        ids = None if run_ids is None else list(run_ids)
        if ids == []:
            return {}
        sql, params = "SELECT * FROM evals", []
        if ids is not None:
            sql, params = sql + f" WHERE run_id IN ({', '.join('?' for _ in ids)})", ids
        for row in self._query(sql + " ORDER BY time, id", params):
            by_run.setdefault(row["run_id"], []).append(_decode(row))
        chosen = {run: preferred_eval(rows) for run, rows in by_run.items()}
        return {run: row for run, row in chosen.items() if row is not None}

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
        # A run that ended: the step it ended at (status.json's, named by its final state's
        # event) when past its newest metrics line (one every log_every steps).
        rows = self._query(f"SELECT run_id, detail FROM events WHERE id IN (SELECT max(id) FROM events "
                           f"WHERE run_id IN ({marks}) AND kind = ? GROUP BY run_id)", [*ids, EVENT_STATE])
        for r in rows:
            detail = _decode(dict(r)).get("detail")
            step = detail.get("step") if isinstance(detail, dict) and detail.get("to") in FINAL_STATES else None
            if isinstance(step, int) and not isinstance(step, bool) and step > (result[r["run_id"]]["step"] or -1):
                result[r["run_id"]]["step"] = step
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
