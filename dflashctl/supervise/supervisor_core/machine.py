"""The run's state machine as the core moves it: one guarded transition.

Every state change goes through ``_transition``: it writes the ``Transition``, fills in
a missed ``running`` first, and ends the standby of a run that finished.
"""

from __future__ import annotations

from dataclasses import replace

from dflashctl.core.states import FINAL_STATES, RUNNING, TRANSITIONS
from dflashctl.supervise.supervisor_core.state import RunState
from dflashctl.supervise.supervisor_core.writes import EndStandby, Transition, _Out, jsonable


def _transition(s: RunState, out: _Out, to: str, message: str, detail: dict | None = None, **kw) -> bool:
    """Move the run to ``to`` (False when it already is there, or is finished: only an
    operator revives a finished run)."""
    current = s.run.state
    if current == to or current in FINAL_STATES:
        return False
    if to not in TRANSITIONS[current] and to in TRANSITIONS[RUNNING] and RUNNING in TRANSITIONS[current]:
        # e.g. a (re)started process that fails or finishes before it was seen running
        out.writes.append(Transition(RUNNING, "trainer started"))
        current = RUNNING
    if to not in TRANSITIONS[current]:
        return False
    out.writes.append(Transition(to, message, jsonable(detail), **kw))
    s.run = replace(s.run, state=to)
    if to in FINAL_STATES and s.standby_for is not None:
        out.actions.append(EndStandby())
    return True
