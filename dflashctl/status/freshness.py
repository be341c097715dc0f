"""How much to believe what the store says about a run, now: is a supervisor
watching it, when did its host last answer, how old is its newest sample.

Pure: the run row, the supervisors' heartbeats (``Store.supervisors``), the newest
sample and ``now`` in; a ``Freshness`` out. ``status``, its ``--json`` and the TUI
show runs through it, so a run nobody watches, or whose data is old, is never
shown as live (no ticking ETA on a dead run).

Never here: I/O of any kind, or a clock of its own.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

from dflashctl.core.units import fmt_duration

STALE_AFTER_POLLS = 3  # a supervisor or host silent for this many poll intervals is not live
MIN_INTERVAL_S = 1.0


@dataclass(frozen=True)
class Freshness:
    supervised: bool  # a live supervisor ticks and lists this run
    supervisor_pid: int | None  # the one that does (or did last)
    last_tick: float | None  # that supervisor's last tick (local clock)
    unsupervised_since: float | None  # when the last supervisor of the run stopped ticking (None: supervised)
    host_last_answer: float | None  # when the run's host last answered a probe
    host_down_since: float | None  # its host unreachable since (None: answering, or unknown)
    host_error: str | None
    data_time: float | None  # when the newest sample was received (local clock)
    data_age_s: float | None
    live: bool  # supervised, its host answering recently: what is shown is current
    note: str  # one line for the operator ("" when live)
    fix: str | None  # the command that fixes it
    stale_after_s: float | None = None  # a host answer older than this is not live (None: a finished run)
    # Its supervisor's process is alive (seen on this machine) though it has not ticked
    # for this long; ``store_busy``: because the store's write lock is held by another.
    silent_s: float | None = None
    store_busy: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def freshness(run: Any, heartbeats: Sequence[dict], newest_sample: Any, now: float) -> Freshness:
    """``run``: a store Run; ``heartbeats``: Store.supervisors() rows; ``newest_sample``:
    the run's newest store Sample or None."""
    data_time = None
    if newest_sample is not None:
        data_time = getattr(newest_sample, "observed", None) or newest_sample.time
    data_age = max(0.0, now - data_time) if data_time is not None else None
    if not run.active:
        return Freshness(False, None, None, None, None, None, None, data_time, data_age, False, "", None)
    mine = [h for h in heartbeats if run.id in (h.get("runs") or [])]
    mine.sort(key=lambda h: h.get("last_tick") or 0.0, reverse=True)
    beat = mine[0] if mine else None
    interval = max(MIN_INTERVAL_S, float((beat or {}).get("interval") or MIN_INTERVAL_S))
    window = STALE_AFTER_POLLS * interval
    ticking = beat is not None and not beat.get("stopped") and now - (beat.get("last_tick") or 0.0) <= window
    host = ((beat or {}).get("hosts") or {}).get(run.host) or {}
    last_answer, down_since, error = host.get("last_ok"), host.get("down_since"), host.get("error")
    answering = last_answer is not None and now - last_answer <= window and down_since is None
    fix = None
    if not ticking and beat is not None and beat.get("alive") and not beat.get("stopped"):
        # Alive but silent: watched still, and a second supervisor is not the fix.
        silent = max(0.0, now - (beat.get("last_tick") or now))
        busy = bool(beat.get("store_busy"))
        note = (f"supervisor pid {beat.get('pid')} alive, store busy {fmt_duration(silent)}: another process holds "
                "the store's write lock, so it cannot record what it sees" if busy else
                f"supervisor pid {beat.get('pid')} alive but silent for {fmt_duration(silent)} (stopped? hung?)")
        return Freshness(True, beat.get("pid"), beat.get("last_tick"), None, last_answer, down_since, error,
                         data_time, data_age, False, note, None, window, silent, busy)
    if not ticking:
        since = (beat or {}).get("last_tick") or run.updated or run.created
        note = f"unsupervised since {_ago(now, since)}: nobody watches this run"
        fix = f"dflashctl watch {run.id}"
        return Freshness(False, (beat or {}).get("pid"), (beat or {}).get("last_tick"), since, last_answer,
                         down_since, error, data_time, data_age, False, note, fix, window)
    if down_since is not None:
        note = f"host {run.host} unreachable since {_ago(now, down_since)}" + (f": {error}" if error else "")
    elif not answering:
        note = ("no answer from its host yet" if last_answer is None
                else f"last answer from host {run.host} {_ago(now, last_answer)}")
    else:
        note = ""
    return Freshness(True, beat.get("pid"), beat.get("last_tick"), None, last_answer, down_since, error, data_time,
                     data_age, answering, note, None, window)


def _ago(now: float, then: float) -> str:
    """"5 m ago"; a time ahead of this clock (another machine's, or a bad one) says so."""
    return f"{fmt_duration(now - then)} ago" if then <= now else f"{fmt_duration(then - now)} ahead of this clock (?)"
