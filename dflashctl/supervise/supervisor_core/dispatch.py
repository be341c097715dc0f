"""The core's one entry point: ``step(state, observation, now, policy)``.

It copies the state, hands the observation to the module that handles its kind,
and returns (the new state, what to store, what to do).
"""

from __future__ import annotations

from dflashctl.core.states import LOST
from dflashctl.supervise.supervisor_core.answer import _observe
from dflashctl.supervise.supervisor_core.decide import _issue_restart, _restarted
from dflashctl.supervise.supervisor_core.observations import Clock, JobDone, Observation, Probed, Unreachable
from dflashctl.supervise.supervisor_core.reach import _host_back, _unreachable
from dflashctl.supervise.supervisor_core.run_policy import Policy
from dflashctl.supervise.supervisor_core.state import RESTART, STOP, RunState
from dflashctl.supervise.supervisor_core.stopping import _pending_stop
from dflashctl.supervise.supervisor_core.writes import _Out


def step(state: RunState, obs: Observation, now: float, pol: Policy) -> tuple[RunState, list, list]:
    """One observation of one run: (its new state, what to store, what to do)."""
    s, out = state.copy(), _Out()
    if s.stop_pending and isinstance(obs, (Probed, Unreachable)):
        if isinstance(obs, Unreachable):
            _unreachable(s, obs, now, pol, out)
        if pol.act:
            _pending_stop(s, obs, out)
    elif isinstance(obs, Probed):
        if obs.host_back is not None or s.run.state == LOST:
            _host_back(s, obs, now, pol, out)
        _observe(s, obs, now, pol, out)
    elif isinstance(obs, Unreachable):
        _unreachable(s, obs, now, pol, out)
    elif isinstance(obs, JobDone):
        s.job = None
        if obs.kind == RESTART:
            _restarted(s, obs, now, pol, out)
        elif obs.error is not None and obs.kind == STOP:
            out.event("stop", "warning", f"could not stop what runs on the hosts that answered again: {obs.error}; "
                      "trying again at the next poll")
        elif obs.error is not None:
            out.event("stop", "warning", f"could not kill tmux session {s.run.tmux_session}: {obs.error}")
    elif isinstance(obs, Clock):
        if pol.act and s.pending is not None and s.job is None and now >= s.pending.due and obs.host_up:
            _issue_restart(s, now, out)
    else:
        raise TypeError(f"not an observation: {obs!r}")
    return s, out.writes, out.actions
