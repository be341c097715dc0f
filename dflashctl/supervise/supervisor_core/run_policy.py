"""What a run is held to: its playbook's policy, and how this supervisor acts on it.

``Policy`` is the step's last argument. It holds the only randomness the core
uses: ``Policy.rng``, the backoff's jitter.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dflashctl.config import Alerts, EvalSettings, Expect, Playbook, RestartPolicy, Retention


@dataclass
class RunPolicy:
    """What a run is held to: its playbook's expectations, restart policy, alert hooks
    and signatures, as the playbook file says now."""

    playbook: str
    expect: "Expect"
    restart: "RestartPolicy"
    alerts: "Alerts"
    signatures: list = field(default_factory=list)
    poll_interval: float = 15.0
    eval: "EvalSettings | None" = None  # evaluate the drafter when the run ends done (eval.after_done)
    retention: "Retention | None" = None  # what the store keeps of its history (None: the defaults)

    @classmethod
    def from_playbook(cls, pb: "Playbook") -> "RunPolicy":
        return cls(pb.name, pb.expect, pb.restart, pb.alerts, list(pb.signatures), float(pb.poll_interval),
                   pb.eval, pb.retention)

    @classmethod
    def defaults(cls, playbook: str) -> "RunPolicy":
        from dflashctl.config import Alerts, Expect, RestartPolicy, Retention

        return cls(playbook, Expect(), RestartPolicy(), Alerts(), retention=Retention())


@dataclass
class Policy:
    """The run's playbook policy and how this supervisor acts on it."""

    run: RunPolicy
    act: bool = True  # False: observe only (samples, findings, alerts), never change or restart the run
    interval: float = 15.0  # the supervisor's poll interval: a failed restart is tried again after it
    escalate_after: float = 300.0  # an unreachable host becomes critical after this long
    rng: random.Random = field(default_factory=lambda: random.Random(0))  # the backoff's jitter
