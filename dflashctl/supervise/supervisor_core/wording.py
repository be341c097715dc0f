"""How the core words things: a process's output, a finding's shape, durations.

Small text helpers shared by the decision, the ranks and the metrics modules.
"""

from __future__ import annotations

import re

from dflashctl.core import logtext
from dflashctl.core.units import fmt_duration
from dflashctl.hosts.probe import ProbeResult
from dflashctl.supervise import policy
from dflashctl.supervise.detectors import Finding


def attempt_output(pr: ProbeResult) -> str:
    """The current process's output: trainer.log after the last restart marker, else
    the pane (which holds only this process's output, but is gone once it ended)."""
    log = logtext.this_attempt(pr.log_tail)
    return log if log.strip() else (pr.pane_tail or "")


def _shape(message: str) -> str:
    """A finding's wording without its numbers: a new shape is news ("ETA 9 d > 7 d"
    becoming "4.3 Ktok/s = 34% of baseline ...; ETA ..."), new numbers are not."""
    return re.sub(r"\d+(\.\d+)?", "N", message)


def _stop_why(trigger: Finding, decision: policy.Action) -> str:
    """The reason a run was not restarted, for the runs table: its signature, what
    failed in the trainer's own words (numbers kept), and why no restart."""
    what = f"{trigger.kind} ({decision.signature}): {trigger.message}; "
    why = decision.reason[len(what) :] if decision.reason.startswith(what) else decision.reason
    return f"{decision.signature or trigger.kind}: {trigger.message}; {why}"[:STOP_WHY_CHARS]


STOP_WHY_CHARS = 1200
"""The most of a stop's reason kept as the run's exit reason (the trainer's words, at
most ``detectors.ERROR_SHOWN_CHARS``, then the advice)."""


def _seconds(value: float) -> str:
    return f"{value:.1f} s" if value < 60 else fmt_duration(value)
