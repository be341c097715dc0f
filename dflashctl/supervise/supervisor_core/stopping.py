"""A stop that could not reach every host: the run lost until nothing runs on any.

A multi-host run is stopped on the hosts that answer; a host that does not is sent
nothing, and the run is ``lost`` with those ranks' stop pending (``RunState.stop_pending``:
set by ``dflashctl stop``'s transition, read back by the shell, or by this core when rank 0
ends stopped or done while another rank's host does not answer). Until every pending rank
is shown gone, nothing else is decided for the run (no crash, no restart): each poll that
reaches a pending rank's host either shows its process gone (written, the rank done) or
still there (``StopParts``: the shell stops it). The last one gone makes the run stopped.
"""

from __future__ import annotations

from dflashctl.core import contract
from dflashctl.core.states import LOST, STOPPED
from dflashctl.supervise.supervisor_core.machine import _transition
from dflashctl.supervise.supervisor_core.observations import Member, Probed, Unreachable
from dflashctl.supervise.supervisor_core.ranks import _gone
from dflashctl.supervise.supervisor_core.state import STOP, RunState
from dflashctl.supervise.supervisor_core.writes import StopParts, _Out


def _pending_stop(s: RunState, obs: Probed | Unreachable, out: _Out) -> None:
    """One poll of a run whose stop is pending on some ranks (see the module docstring)."""
    seen = list(obs.members) + ([Member(0, s.run.host, obs.result)] if isinstance(obs, Probed) else [])
    alive = []
    for m in sorted(seen, key=lambda m: m.rank):
        if m.rank not in s.stop_pending or m.result is None:
            continue
        if _gone(m.result):
            s.stop_pending = s.stop_pending - {m.rank}
            code = m.result.exit_code
            how = contract.describe_exit(code) if code is not None else "its tmux session is gone"
            out.event("stop", "info", f"rank {m.rank} on {m.host} answers again: nothing of this run runs there "
                      f"({how})", {"rank": m.rank, "host": m.host, "exit_code": code})
        else:
            alive.append(m.rank)
    if alive:
        s.job = STOP
        out.event("stop", "warning", "stopping what still runs on the host(s) that answer again: "
                  + ", ".join(f"rank {r}" for r in alive), {"ranks": alive})
        out.actions.append(StopParts(tuple(alive)))
    elif not s.stop_pending:
        _transition(s, out, STOPPED, "stopped on every host: the last one that did not answer shows nothing "
                    "running there", exit_reason="stopped on request")


def _lost_with_stop_pending(s: RunState, out: _Out, ranks: list[int], message: str) -> None:
    """Rank 0 ended stopped (or done) while the hosts of ``ranks`` do not answer: a
    process may still run there, so the run is lost and their stop pending."""
    s.stop_pending = frozenset(ranks)
    _transition(s, out, LOST, message, {"stop_pending": sorted(ranks)}, severity="error")
