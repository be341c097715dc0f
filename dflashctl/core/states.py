"""A run's states and the severities of what happens to it: one home for both.

The store enforces the transitions, the supervisor decides them, the views colour
them; all of them read the names from here.
"""

from __future__ import annotations

from typing import Iterable

# --------------------------------------------------------------------------- run states

LAUNCHING = "launching"
RUNNING = "running"
STALLED = "stalled"
RESTARTING = "restarting"
STOPPED = "stopped"
DONE = "done"
FAILED = "failed"
LOST = "lost"  # the host or the session cannot be seen; the trainer may still be alive

STATES = (LAUNCHING, RUNNING, STALLED, RESTARTING, STOPPED, DONE, FAILED, LOST)
FINAL_STATES = (STOPPED, DONE, FAILED)
# A lost run may still be training on its GPUs, so it counts as holding them.
ACTIVE_STATES = tuple(s for s in STATES if s not in FINAL_STATES)
# States in which the trainer should be alive on its host.
ALIVE_STATES = (LAUNCHING, RUNNING, STALLED)

TRANSITIONS: dict[str, frozenset[str]] = {
    LAUNCHING: frozenset({RUNNING, FAILED, STOPPED, LOST}),
    RUNNING: frozenset({STALLED, RESTARTING, STOPPED, DONE, FAILED, LOST}),
    STALLED: frozenset({RUNNING, RESTARTING, STOPPED, DONE, FAILED, LOST}),
    RESTARTING: frozenset({RUNNING, FAILED, STOPPED, LOST}),
    LOST: frozenset({RUNNING, STALLED, RESTARTING, STOPPED, DONE, FAILED}),
    # An operator may restart a stopped or failed run (``dflashctl restart``); a
    # finished run stays finished.
    STOPPED: frozenset({RESTARTING}),
    FAILED: frozenset({RESTARTING}),
    DONE: frozenset(),
}

# --------------------------------------------------------------------------- severities

SEVERITIES = ("info", "warning", "error", "critical")


def severity_rank(severity: str) -> int:
    """0 for info up to 3 for critical; ValueError for a name that is none of them."""
    return SEVERITIES.index(severity)


def severity_at_least(severity: str, minimum: str) -> bool:
    return severity_rank(severity) >= severity_rank(minimum)


def more_severe(severity: str, than: str) -> bool:
    return severity_rank(severity) > severity_rank(than)


def most_severe(severities: Iterable[str]) -> str:
    return max(severities, key=severity_rank)
