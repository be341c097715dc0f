"""What the console's destructive keys do to a run, said before they do it.

``plan(command, run)`` is the confirmation the operator reads: the question and,
from the run's state, exactly what happens to its trainer (``dflashctl stop``
checkpoints and ends it; ``dflashctl restart`` of a run still going stops it that
way first). A key that would do nothing sensible (stop a run that has ended,
restart a done one) is refused with the reason, never asked. ``readonly_default``
is the ``DFLASHCTL_READONLY`` environment default of ``status --readonly``.

Pure: no UI code, no store, no host.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dflashctl.store import DONE, FINAL_STATES

READONLY_ENV = "DFLASHCTL_READONLY"
COMMANDS = ("stop", "restart")


def readonly_default(environ=None) -> bool:
    """True when ``DFLASHCTL_READONLY`` says so (1, true, yes, on); 0/false/no/off or
    unset: False. Any other value is an error naming the variable (a typo must not
    leave the keys armed by surprise)."""
    value = (os.environ if environ is None else environ).get(READONLY_ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    from dflashctl.errors import ConfigError

    raise ConfigError(f"{READONLY_ENV}={value!r} is neither on nor off",
                      hint=f"set {READONLY_ENV}=1 for a console without stop/restart keys, or unset it")


@dataclass(frozen=True)
class Plan:
    command: str
    run_id: str
    question: str = ""
    detail: str = ""  # what happens to the trainer, in order
    refused: str | None = None  # why the key does nothing here

    @property
    def argv(self) -> list[str]:
        return [self.command, self.run_id]


def _trainer(run) -> str:
    where = f" on {run.host}" if getattr(run, "host", None) else ""
    step = f", step {run.step:,}" if getattr(run, "step", None) is not None else ""
    return f"its trainer ({run.display_state}{step}){where}"


def plan(command: str, run) -> Plan:
    """The confirmation for ``dflashctl COMMAND RUN`` on ``run`` (a ``RunView``)."""
    if command not in COMMANDS:
        raise ValueError(f"unknown run command {command!r}")
    state = run.state
    if command == "stop":
        if state in FINAL_STATES:
            return Plan(command, run.id, refused=f"run {run.id} is {state}: there is no trainer to stop")
        return Plan(command, run.id, f"Stop run {run.id}?",
                    f"{_trainer(run).capitalize()} gets SIGTERM: it writes a checkpoint and exits (it is killed if "
                    "it has not within 2 m: steps since its last checkpoint are then lost). Its tmux session is "
                    "closed and the run is recorded stopped; it can be restarted from that checkpoint. "
                    "(dflashctl stop)")
    if state == DONE:
        return Plan(command, run.id, refused=f"run {run.id} is done: it finished all its steps and is not restarted")
    if state in FINAL_STATES:
        first = f"The run is {state}: no trainer of it is running."
    else:
        first = (f"{_trainer(run).capitalize()} is stopped first: SIGTERM, it writes a checkpoint and exits "
                 "(killed if it has not within 2 m: steps since its last checkpoint are then lost).")
    return Plan(command, run.id, f"Restart run {run.id}?",
                first + " Then a new trainer starts in the same run directory from the last checkpoint, compile "
                "cache kept, and a supervisor watches it. (dflashctl restart)")
