"""A host that does not answer, and its return: the run lost, then watched again.

After ``LOST_AFTER_POLLS`` failed polls in a row the run is lost; when its host
answers again it goes back to the state it had.
"""

from __future__ import annotations

from dflashctl.core.states import LAUNCHING, LOST, RESTARTING, RUNNING, STALLED, TRANSITIONS
from dflashctl.core.units import fmt_duration
from dflashctl.supervise import detectors
from dflashctl.supervise.supervisor_core.limits import LOST_AFTER_POLLS
from dflashctl.supervise.supervisor_core.machine import _transition
from dflashctl.supervise.supervisor_core.observations import Probed, Unreachable
from dflashctl.supervise.supervisor_core.ranks import _host_row, _member_hosts
from dflashctl.supervise.supervisor_core.run_policy import Policy
from dflashctl.supervise.supervisor_core.state import RunState
from dflashctl.supervise.supervisor_core.writes import HostRows, _Out


def _unreachable(s: RunState, obs: Unreachable, local: float, pol: Policy, out: _Out) -> None:
    f = obs.finding
    if s.run.hosts and obs.members:  # the ranks whose hosts answered are shown as seen, rank 0's row ages
        out.writes.append(HostRows((_host_row(0, s.run.host, None, f.detail.get("error") or "not answering"),
                                    *(_host_row(m.rank, m.host, m.result, m.error) for m in obs.members))))
        _member_hosts(s, obs.members, local, pol, out)
    if obs.worse:
        out.event(detectors.UNREACHABLE, f.severity, f.message, f.detail)
        out.alert(detectors.UNREACHABLE, f.severity, f.message, f.detail)
    if pol.act and obs.polls >= LOST_AFTER_POLLS and s.run.state in (LAUNCHING, RUNNING, STALLED, RESTARTING):
        s.state_before_lost = s.run.state
        _transition(s, out, LOST, f"host {obs.host} unreachable for {obs.polls} polls; the trainer may still be "
                    "running there", {"host": obs.host, "since": obs.since})


def _host_back(s: RunState, obs: Probed, now: float, pol: Policy, out: _Out) -> None:
    host = s.run.host
    if obs.host_back is None:
        # Lost under an earlier supervisor (the outage and a restart of ours often coincide).
        if pol.act and s.run.state == LOST:
            _transition(s, out, RUNNING, f"host {host} answers again; watching the run")
        return
    since, polls = obs.host_back
    message = f"host {host} reachable again after {fmt_duration(now - since)} ({polls} failed poll(s))"
    out.event(detectors.UNREACHABLE, "info", message, {"host": host, "down_s": now - since})
    if pol.act and s.run.state == LOST:
        back = s.state_before_lost if s.state_before_lost in TRANSITIONS[LOST] else RUNNING
        _transition(s, out, back, message)
        s.state_before_lost = None
