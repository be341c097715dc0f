"""What the console's destructive keys do to a run, said before they do it.

``plan(command, run)`` is the confirmation the operator reads: the question and,
from the run's state, exactly what happens to its trainer (``dflashctl stop``
checkpoints and ends it; ``dflashctl restart`` of a run still going stops it that
way first). A key that would do nothing sensible (stop a run that has ended,
restart a done one) is refused with the reason, never asked. ``readonly_default``
is the ``DFLASHCTL_READONLY`` environment default of ``status --readonly``.

``plan("watch", run)`` is the question before ``w`` starts a supervisor for a run
nobody watches (refused for a watched one: a second supervisor would restart its
trainer twice). ``attach_argv`` is the command that ``a`` runs in a terminal: a
plain ``tmux attach`` for a run on this machine, an interactive ``ssh -t`` through
the host's jump hosts (each hop its own ``ProxyCommand``, with its own key and
known_hosts) into its container wrapper for a remote one; ``in_tmux_argv`` puts it
in a tmux popup or split when the console itself runs in tmux.

Pure: no UI code, no store, no host.
"""

from __future__ import annotations

import getpass
import math
import os
import re
import shlex
from dataclasses import dataclass

from dflashctl.core.states import DONE, FAILED, FINAL_STATES

READONLY_ENV = "DFLASHCTL_READONLY"
COMMANDS = ("stop", "restart", "watch")


def readonly_default(environ=None) -> bool:
    """True when ``DFLASHCTL_READONLY`` says so (1, true, yes, on); 0/false/no/off or
    unset: False. Any other value is an error naming the variable (a typo must not
    leave the keys armed by surprise)."""
    value = (os.environ if environ is None else environ).get(READONLY_ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    from dflashctl.core.errors import ConfigError

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
    if command == "watch":
        return _watch_plan(run)
    if getattr(getattr(run, "freshness", None), "store_busy", False) and state not in FINAL_STATES:
        return Plan(command, run.id, refused=f"run {run.id}: the run store is busy (another process holds its write "
                    f"lock, its supervisor waits on it): a {command} now could not be recorded, so nothing is sent; "
                    "the trainer runs on, supervised; try again once the store is free")
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
        same = same_failure(run)
        if same:
            return Plan(command, run.id, f"Restart run {run.id}? It failed on {same[0]}: a restart would fail the "
                        "same way.", f"{same[1]} {first} Restart only once that is fixed (`dflashctl restart "
                        f"{run.id} --reload` takes an edited playbook). (dflashctl restart)")
    else:
        first = (f"{_trainer(run).capitalize()} is stopped first: SIGTERM, it writes a checkpoint and exits "
                 "(killed if it has not within 2 m: steps since its last checkpoint are then lost).")
    return Plan(command, run.id, f"Restart run {run.id}?",
                first + " Then a new trainer starts in the same run directory from the last checkpoint, compile "
                "cache kept, and a supervisor watches it. (dflashctl restart)")


_FAILED_ON = re.compile(r"^\w+ \(([\w.-]+)\)")  # "crash (cuda_oom): ..." as the supervisor words a stop


def same_failure(run) -> tuple[str, str] | None:
    """``(signature, what to fix)`` when the run failed on a crash that a restart does
    not cure (its signature's action is stop: out of memory, a diverged loss, a
    deterministic kernel assert); None otherwise."""
    from dflashctl.core.signatures import BUILTIN_SIGNATURES, STOP

    event = getattr(run, "last_event", None)
    if run.state != FAILED or event is None:
        return None
    detail = event.detail if isinstance(event.detail, dict) else {}
    found = _FAILED_ON.match(event.message or "")
    name = detail.get("signature") or (found.group(1) if found else None)
    known = next((s for s in BUILTIN_SIGNATURES if s.name == name), None)
    stopped = "not restarting" in (event.message or "")
    if name is None or not (stopped or (known is not None and known.action == STOP)):
        return None
    hint = detail.get("hint") if isinstance(detail.get("hint"), str) else (known.hint if known else None)
    return name, (hint[0].upper() + hint[1:] + "." if hint else f"The supervisor did not restart it ({name}).")


def attach_refusal(run) -> str | None:
    """Why ``a`` cannot attach to ``run`` (a ``RunView``), or None: a finished run's
    tmux session ended with its trainer."""
    if run.state in FINAL_STATES:
        return (f"run {run.id} is {run.state}: its tmux session ended with its trainer; "
                f"`dflashctl logs {run.id}` shows its output")
    return None


def _watch_plan(run) -> Plan:
    from dflashctl.hosts.tmux import socket_name
    from dflashctl.launch import supervisor_session

    if not run.active:
        return Plan("watch", run.id, refused=f"run {run.id} is {run.state}: there is nothing to supervise")
    fresh = run.freshness
    if fresh.supervised:
        who = f"supervisor pid {fresh.supervisor_pid}" if fresh.supervisor_pid else "a supervisor"
        why = " (alive, the store busy: it records again once the lock is free)" if fresh.store_busy else ""
        return Plan("watch", run.id, refused=f"run {run.id} is supervised already by {who}{why}: a second "
                    "supervisor would restart its trainer twice")
    session, socket = supervisor_session(run.id), socket_name()
    return Plan("watch", run.id, f"Start a supervisor for run {run.id}?",
                f"`dflashctl watch {run.id}` starts on this machine, detached, in its own tmux session {session} "
                f"(socket {socket}; `tmux -L {socket} attach -t ={session}` shows it). It polls "
                f"{run.host or 'the run host'}, records what it sees in the store, alerts, and restarts the trainer "
                "per the playbook's policy if it crashes or stalls, until the run ends. The trainer itself is not "
                "touched now. (dflashctl watch)")


# --------------------------------------------------------------------------- attach


def tmux_attach(session: str, socket: str) -> list[str]:
    """``tmux -L SOCKET attach-session -t =SESSION`` (``=``: that session exactly)."""
    return ["tmux", "-L", socket, "attach-session", "-t", f"={session}"]


def _destination(host) -> str:
    return f"{host.user or getpass.getuser()}@{host.address or host.ssh or host.name}"


def _ssh_options(route: list) -> list[str]:
    """OpenSSH options reaching ``route[-1]`` (``route``: outermost jump first), as
    dflashctl's own connections do: its port, key, known_hosts and host-key policy,
    and for a host behind jumps a ``ProxyCommand`` that is the same for the jump
    (``-W %h:%p``). The jump's own options are expanded once more by the ssh that
    runs its ProxyCommand, so their ``%`` are doubled."""
    host = route[-1]
    options = ["-p", str(int(host.port))]
    if host.identity_file:
        options += ["-i", os.path.expanduser(host.identity_file), "-o", "IdentitiesOnly=yes"]
    options += ["-o", f"UserKnownHostsFile={os.path.expanduser(host.known_hosts or '~/.ssh/known_hosts')}",
                "-o", f"StrictHostKeyChecking={'accept-new' if host.trust_on_first_use else 'yes'}",
                "-o", f"ConnectTimeout={max(1, math.ceil(float(host.connect_timeout)))}"]
    if host.keepalive and host.keepalive > 0:
        options += ["-o", f"ServerAliveInterval={max(1, math.ceil(float(host.keepalive)))}"]
    if len(route) > 1:
        jump = [a.replace("%", "%%") for a in ["ssh", *_ssh_options(route[:-1]), _destination(route[-2])]]
        options += ["-o", "ProxyCommand=" + shlex.join([*jump[:-1], "-W", "%h:%p", jump[-1]])]
    return options


def attach_argv(route: list, session: str, socket: str) -> list[str]:
    """The command, run in a terminal, that attaches to tmux session ``session`` on
    socket ``socket`` of the host ``route[-1]`` (``Inventory.route``: outermost jump
    first). Local: ``tmux attach`` with ``$TMUX`` unset (the console may itself run
    in tmux: nesting is what is asked for). Remote: ``ssh -t`` through the jumps,
    then the host's container wrapper, then tmux; the session's own tmux, so detach
    (C-b d) comes back here."""
    host = route[-1]
    tmux = tmux_attach(session, socket)
    if host.is_local:
        return ["env", "-u", "TMUX", *tmux]
    return ["ssh", "-t", *_ssh_options(route), _destination(host), shlex.join([*host.wrapper, *tmux])]


def split_detach_key(outer_prefix: str | None, inner_prefix: str = "C-b") -> str:
    """The keys that detach the run's session attached in a split of the operator's
    own tmux: that tmux reads its prefix first, so where both use the same prefix it
    is pressed twice (tmux's ``send-prefix``) before ``d``; a lone ``C-b d`` would
    detach the operator's outer client instead."""
    outer = (outer_prefix or "C-b").strip() or "C-b"
    return f"{inner_prefix} {inner_prefix} d" if outer == inner_prefix else f"{inner_prefix} d"


def in_tmux_argv(argv: list[str], title: str, popup: bool = True) -> list[str]:
    """``argv`` in a tmux popup over the console (``popup``) or in a split below it,
    closed when ``argv`` ends (a detach)."""
    line = shlex.join(argv)
    if popup:
        return ["tmux", "display-popup", "-E", "-w", "90%", "-h", "90%", "-T", title, line]
    return ["tmux", "split-window", "-v", "-l", "70%", line]
