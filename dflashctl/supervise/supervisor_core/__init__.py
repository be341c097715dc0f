"""The supervisor's decisions for one run, as one pure function.

    step(state, observation, now, policy) -> (state', writes, actions)

``state`` is everything the supervisor knows of a run between two ticks
(``RunState``); ``observation`` is what happened to it since (``Probed``: its
host's probe answer; ``Unreachable``: its host did not answer; ``JobDone``: a
restart or kill issued earlier has finished; ``Clock``: only time passed);
``now`` is the local clock. The result says what to store (``writes``: events,
state transitions, samples, restart rows, all written by the caller in one
transaction) and what to do (``actions``: restart, kill the session, alert,
evaluate, copy compile artifacts back; executed by the caller after the writes).

This package never does I/O, never reads a clock and draws no random number of
its own (the backoff's jitter comes from ``Policy.rng``): the same state and
observation give the same answer, so the supervisor's behaviour is tested as
tables of observations in, writes and actions out (the core's tests in tests/unit).
The shell around it (``dflashctl.supervise.supervisor``) probes, stores and acts.

Clocks: events, restart rows and the restart policy use the local clock; samples,
phase tracking and the detectors the host's (host time - skew = local time).

What ``step`` does, in order, and where each part lives:

1. ``step`` (``dispatch``): copies the state and hands the observation on by its kind.
2. ``Probed`` (``answer``): a host that was unreachable is back (``reach``); the
   probe's errors; the new metrics lines, their timestamps checked, stored as
   samples, the progress, compile cache and phase they show (``metrics``); a
   multi-host run's ranks: each host's row, ended processes (``ranks``); the run
   seen running; the detectors' findings, named after the host they started on
   (``ranks``); then the decision on them (``decide``): write them, restart,
   stop, or wait; last the compile artifacts to copy back and the next standby.
3. ``Unreachable`` (``reach``): the host's event and alert, then the run lost.
   A run whose stop could not reach every host (``stopping``): nothing is decided
   but stopping what still runs where a host answers again.
4. ``JobDone`` (``decide``): a restart issued, retried, or failed for good (a kill
   that failed is an event).
5. ``Clock`` (``decide``): a restart whose backoff is over is issued.

Every state change goes through one guarded transition (``machine``). The rest:
``run_policy`` (``RunPolicy``, ``Policy``), ``state`` (``RunState`` and its parts),
``observations`` (the four kinds), ``writes`` (writes and actions), ``readings``
(a host's readings of one poll, stored by the shell on every answer), ``limits``
(fixed numbers), ``wording`` (text helpers). A restart's cost: see ``decide``.
"""

from dflashctl.supervise import policy
from dflashctl.supervise.supervisor_core.decide import new_attempt
from dflashctl.supervise.supervisor_core.dispatch import step
from dflashctl.supervise.supervisor_core.limits import (
    ATTEMPT_SLACK_S,
    CLOCK_FUTURE_MARGIN_S,
    CLOCK_PAST_MARGIN_S,
    DEFAULT_DISTRIBUTED_TIMEOUT_S,
    LOST_AFTER_POLLS,
    REPEAT_FINDING_S,
    RESTART_MARKER,
    RESTART_TRIES,
    ROW_ERROR_CHARS,
    SETTLE_S,
    WINDOW,
)
from dflashctl.supervise.supervisor_core.readings import host_gpu_rows, host_readings
from dflashctl.supervise.supervisor_core.observations import Clock, JobDone, Member, Observation, Probed, Unreachable
from dflashctl.supervise.supervisor_core.ranks import distributed_timeout
from dflashctl.supervise.supervisor_core.run_policy import Policy, RunPolicy
from dflashctl.supervise.supervisor_core.state import KILL, RESTART, STOP, Latest, Open, Pending, RunState
from dflashctl.supervise.supervisor_core.wording import attempt_output
from dflashctl.supervise.supervisor_core.writes import (
    Action,
    Alert,
    EndStandby,
    Event,
    FetchCompileCache,
    HostRows,
    IssueRestart,
    KillSession,
    RestartRow,
    RestartUpdate,
    Readings,
    RunEval,
    Samples,
    StartStandby,
    StopParts,
    Transition,
    Write,
    jsonable,
)

__all__ = [
    "ATTEMPT_SLACK_S",
    "CLOCK_FUTURE_MARGIN_S",
    "CLOCK_PAST_MARGIN_S",
    "DEFAULT_DISTRIBUTED_TIMEOUT_S",
    "KILL",
    "LOST_AFTER_POLLS",
    "REPEAT_FINDING_S",
    "RESTART",
    "RESTART_MARKER",
    "RESTART_TRIES",
    "STOP",
    "ROW_ERROR_CHARS",
    "SETTLE_S",
    "WINDOW",
    "Action",
    "Alert",
    "Clock",
    "EndStandby",
    "Event",
    "FetchCompileCache",
    "HostRows",
    "IssueRestart",
    "JobDone",
    "KillSession",
    "Latest",
    "Member",
    "Observation",
    "Open",
    "Pending",
    "Policy",
    "Probed",
    "RestartRow",
    "RestartUpdate",
    "RunEval",
    "RunPolicy",
    "RunState",
    "Readings",
    "Samples",
    "StartStandby",
    "StopParts",
    "Transition",
    "Unreachable",
    "Write",
    "attempt_output",
    "distributed_timeout",
    "host_gpu_rows",
    "host_readings",
    "jsonable",
    "new_attempt",
    "policy",
    "step",
]
