"""What happens to a run on its hosts: start, signal, stop, restart, reap.

This module waits for the trainer's first status, signals the trainer, stops it,
restarts it in place, and reaps a trainer that outlived its session.
``dflashctl.launch`` (the first start) and ``dflashctl.supervise.supervisor``
(restarts) both use it. A restart runs the run's same run.sh again in its run
directory (``files``), or wakes its standby when one is ready on every host
(``standby``).

Its siblings hold the rest of a run's life on its hosts: ``files`` (config.json,
run.sh), ``access`` (transport, tmux, probe), ``standby``, ``logs`` (trainer.log,
metrics.jsonl) and ``evaluate``. Their entry points are importable from here too
(``__all__``): one import reaches all that can happen to a run on its hosts.

A multi-host run (``Run.hosts``) is a run directory and session per host
(``Run.parts``: rank 0's session is the run id, rank q's ``<run id>-r<q>``). Stop
and restart act on every host; a restart ends every old process before it starts
any new one, and rank 0's rendezvous port must be free before it starts.

The trainer is only ever signalled by the pid in its status.json, and only while
that pid's command line names this run's directory (pids are reused).

This module and its siblings never decide anything (whether to restart is the
policy's, through the supervisor) and never import ``dflashctl.launch``,
``dflashctl.supervise.supervisor`` or ``dflashctl.supervise.console``: they import them.
"""

from __future__ import annotations

import copy
import json
import shlex
import sqlite3
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from dflashctl.core import contract
from dflashctl.core.errors import DflashError, StoreBusy, StoreError, first_line
from dflashctl.core.logtext import RESTART_MARKER
from dflashctl.core.states import DONE, FAILED, FINAL_STATES, LOST, RESTARTING, RUNNING, STOPPED, TRANSITIONS
from dflashctl.hosts import deploy
from dflashctl.hosts.bundle import build_bundle
from dflashctl.hosts.tmux import UTF8_ENV, Tmux, TmuxError, socket_name
from dflashctl.runs.access import (
    POLL_SECONDS,
    LaunchError,
    NotEveryHost,
    Progress,
    _ended,
    _on_hosts,
    _started,
    host_transport,
    local_host,
    part_tmux,
    probe_run,
    quiet,
)
from dflashctl.runs.evaluate import eval_run, eval_session
from dflashctl.runs.files import (
    RUN_SCRIPT,
    SECRETS_FILE,
    STANDBY_SCRIPT,
    new_rendezvous_key,
    part_config,
    posixpath_join,
    render_run_script,
    renumber_placement,
    run_environment,
    run_files,
    start_command,
)
from dflashctl.runs.logs import log_before, logs, metrics_tail
from dflashctl.runs.standby import (
    STANDBY_ANSWER_S,
    _hold_standby,
    _ready_standby,
    _release_standby,
    end_standby,
    standby_go_argv,
    standby_session,
    standby_state_argv,
    start_standby,
    wake_standby,
)
from dflashctl.store import Run, Store

if TYPE_CHECKING:
    from dflashctl.config import Inventory
    from dflashctl.hosts.probe import ProbeResult
    from dflashctl.hosts.transport import Transport

__all__ = [
    # this module: start, signal and reap, stop, restart
    "START_TIMEOUT", "STOP_TIMEOUT", "final_state_for", "port_check_argv", "rendezvous_port_problem",
    "port_in_use_error", "wait_started", "signal_trainer_argv", "reap_trainer_argv", "stop_supervisor", "stop",
    "stop_parts", "RestartResult", "restart_run", "artifact_inputs", "restart",
    # access: reaching a run's hosts
    "LaunchError", "NotEveryHost", "Progress", "quiet", "host_transport", "local_host", "probe_run", "part_tmux",
    # files: a run's files on its host
    "RUN_SCRIPT", "STANDBY_SCRIPT", "new_rendezvous_key", "part_config", "render_run_script",
    "renumber_placement", "run_environment", "run_files", "start_command",
    # standby, logs, evaluate
    "standby_session", "start_standby", "end_standby", "log_before", "logs", "metrics_tail", "eval_run",
    "eval_session",
]

START_TIMEOUT = 120.0  # launch and restart wait this long (at most) for the trainer's first status
STOP_TIMEOUT = 120.0  # a graceful stop waits this long for the checkpoint before killing
STOP_STORE_WAIT_S = 5.0  # a stop waits this long for the store's write lock before it does anything


# --------------------------------------------------------------------------- start


def wait_started(store: Store, run: Run, transport: "Transport", timeout: float,
                 clock: Callable[[], float] = time.time, progress: Progress | None = None) -> str:
    """Wait until status.json shows the trainer started (-> ``running``), or it ended
    (-> ``failed`` / ``done`` / ``stopped``), at most ``timeout`` seconds. Still
    nothing: the run stays in its state and the supervisor takes over."""
    say = progress or quiet
    deadline = time.monotonic() + timeout
    while True:
        probe = probe_run(transport, run)
        if _started(probe) and probe.exit_code is None:
            store.transition(run.id, RUNNING, f"trainer started (pid {probe.status.pid}, phase {probe.status.phase})",
                             clock(), detail={"pid": probe.status.pid, "phase": probe.status.phase})
            say("wait", f"trainer running (phase {probe.status.phase}, pid {probe.status.pid})")
            return RUNNING
        if _ended(probe):
            return _record_end(store, run, probe, clock, say, "the trainer ended during start-up")
        if time.monotonic() >= deadline:
            store.add_event(run.id, "startup", f"no trainer status after {timeout:g}s; still waiting",
                            clock(), severity="warning")
            say("wait", f"no status after {timeout:g}s; the supervisor will keep watching")
            return store.get_run(run.id).state
        time.sleep(POLL_SECONDS)


def _record_end(store: Store, run: Run, probe: "ProbeResult", clock, say, why: str) -> str:
    code = probe.exit_code
    state = final_state_for(code)
    tail = (probe.log_tail or probe.pane_tail or "").strip().splitlines()[-15:]
    reason = contract.describe_exit(code) if code is not None else "tmux session gone without an exit code"
    store.transition(run.id, state, f"{why}: {reason}", clock(), detail={"log_tail": tail},
                     exit_code=code, exit_reason=reason)
    say("wait", f"{why}: {reason}" + ("\n  " + "\n  ".join(tail) if tail and state == FAILED else ""))
    return state


def final_state_for(exit_code: int | None) -> str:
    if exit_code == contract.EXIT_DONE:
        return DONE
    if exit_code == contract.EXIT_STOPPED:
        return STOPPED
    return FAILED


# --------------------------------------------------------------------------- the rendezvous port

# Exit 0 when the port can be bound as torch's TCPStore binds it: SO_REUSEADDR, so
# connections of an earlier start lingering in TIME_WAIT do not count as in use; on
# the IPv6 wildcard (dual-stack) where the host has IPv6, as torch tries first, and
# on the IPv4 one. Else the errno's name and text.
_PORT_FREE = """
import errno, socket, sys
port = int(sys.argv[1])
for family, addr in ((socket.AF_INET6, "::"), (socket.AF_INET, "")):
    try:
        s = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
        continue
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((addr, port))
        s.listen(1)
    except OSError as e:
        if family == socket.AF_INET6 and e.errno == errno.EADDRNOTAVAIL:
            continue
        print(errno.errorcode.get(e.errno, "?"), e.strerror or e)
        sys.exit(1)
    finally:
        s.close()
"""


def port_check_argv(python: str, port: int) -> list[str]:
    return [*shlex.split(python), "-I", "-S", "-c", _PORT_FREE, str(port)]


def rendezvous_port_problem(transport: "Transport", python: str, port: int) -> str | None:
    """Why rank 0's host cannot listen on the rendezvous ``port`` now
    ("EADDRINUSE Address already in use"), or None when it can."""
    answer = transport.run(port_check_argv(python, port), timeout=30, check=False)
    if answer.exit_code == 0:
        return None
    return answer.stdout.strip()[:200] or answer.stderr.strip()[-200:] or f"exit {answer.exit_code}"


def port_in_use_error(host: str, port: int, problem: str) -> "LaunchError":
    hint = (f"another process holds it: `ss -ltnp 'sport = :{port}'` on {host} shows which; stop it, or set "
            "rendezvous.port in the playbook to a free port") if "EADDRINUSE" in problem else (
        "set rendezvous.port in the playbook to a port rank 0's host can listen on")
    return LaunchError(f"{host}: rendezvous port {port} is not free ({problem})", hint=hint)


# --------------------------------------------------------------------------- signal and reap


# The trainer named in status.json, but only while that pid really is this run's
# trainer (pids are reused): `ours` is true while it lives.
_TRAINER_PID = r"""
d=$1; st=${3:-status.json}
pid=$(sed -n 's/.*"pid": *\([0-9][0-9]*\).*/\1/p' "$d/$st" 2>/dev/null | head -n 1)
ours() { [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] && tr '\0' ' ' < "/proc/$pid/cmdline" | grep -qF -- "$d"; }
"""

# Send a signal to the run's trainer. Prints 'signalled PID' or 'no-process'.
_SIGNAL_TRAINER = _TRAINER_PID + r"""
if ours; then kill -s "$2" "$pid" && { echo "signalled $pid"; exit 0; }; fi
echo no-process
"""

# Before a restart: the previous trainer must be gone. A hung process can outlive its
# tmux session; it would hold its GPUs, and run.sh would write its exit code after
# the new process started. Prints 'gone', 'killed PID' or 'still-alive PID' (exit 1).
_REAP_TRAINER = _TRAINER_PID + r"""
ours || { echo gone; exit 0; }
kill -KILL "$pid" 2>/dev/null
i=0; while ours && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
ours && { echo "still-alive $pid"; exit 1; }
sleep 0.5  # run.sh writes the exit code of the process it ran
echo "killed $pid"
"""


def signal_trainer_argv(run_dir: str, signal_name: str = "TERM", rank: int = 0) -> list[str]:
    """The host command sending ``signal_name`` to the run's trainer (see _SIGNAL_TRAINER);
    ``rank``: which process of a multi-host run (its status file names its pid)."""
    return ["sh", "-c", _SIGNAL_TRAINER, "dflashctl-signal", run_dir, signal_name, contract.status_file(rank)]


def reap_trainer_argv(run_dir: str, rank: int = 0) -> list[str]:
    """The host command killing a trainer that outlived its session (see _REAP_TRAINER)."""
    return ["sh", "-c", _REAP_TRAINER, "dflashctl-reap", run_dir, "", contract.status_file(rank)]


# --------------------------------------------------------------------------- stop


def stop_supervisor(run: Run, inventory: "Inventory") -> None:
    """End the run's supervisor session (so it does not restart what is being stopped)."""
    info = run.supervisor or {}
    if info.get("kind") != "tmux" or not info.get("session"):
        return
    try:
        Tmux(local_host(), inventory, info.get("socket")).kill(info["session"])
    except DflashError:
        pass  # already gone


def stop(run_id: str, store: Store, inventory: "Inventory", timeout: float = STOP_TIMEOUT,
         progress: Progress | None = None, *, clock: Callable[[], float] = time.time,
         keep_standby: bool = False, restarting: bool = False) -> Run:
    """Graceful stop: SIGTERM to the trainer (it checkpoints and exits 4), or Ctrl-C
    in its tmux pane when its pid cannot be signalled; wait up to ``timeout`` for it
    to exit; then kill the session. The run ends in ``stopped`` (``done`` if it
    finished meanwhile; ``failed`` if it had crashed before the stop, unseen).
    ``keep_standby``: its standby is left waiting (a restart follows and wakes it).
    ``restarting``: the stop of an operator's restart: the run stays ``restarting``
    (the stop is an event), unless it finished meanwhile.

    A multi-host run is stopped on every host that answers, each said. A host that
    does not answer is sent nothing: the run is then ``lost`` (a trainer may still run
    there), its supervisor is left watching, and it stops that host's process once the
    host answers (``stop_pending`` in the transition's detail). No host answering:
    nothing is recorded or sent, and the error says so."""
    say = progress or quiet
    run = store.get_run(run_id)
    reached, unreached = _reach(run, inventory)  # a multi-host run: every host's process, rank 0 first
    if not reached:
        raise LaunchError(f"run {run.id} not stopped, nothing was sent: no host of it answers ("
                          + "; ".join(f"{p.host}: {why}" for p, why in unreached) + ")",
                          hint="its supervisor still watches it; `dflashctl stop` again once a host answers")
    parts = [(part, transport, tmux) for part, transport, tmux, _ in reached]
    probes = [probe for *_, probe in reached]
    if run.state not in FINAL_STATES:
        # Recorded before anything is done: a stop the store cannot record is not made
        # (its supervisor is left watching, its trainer is sent nothing).
        try:
            with store.batch(wait=STOP_STORE_WAIT_S):
                store.add_event(run.id, "stop_requested", "stop requested by the operator"
                                + (f" (hosts {', '.join(run.host_names)})" if run.hosts else "")
                                + _not_reached(unreached, "; not sent to "), clock(),
                                detail={"unreached": {str(p.rank): p.host for p, _ in unreached}} if unreached else None)
        except StoreBusy as e:
            raise StoreBusy(f"run {run.id} not stopped, nothing was sent: {e}",
                            hint=f"its trainer runs on and its supervisor still watches it; {e.hint}") from None
    if not unreached:
        stop_supervisor(run, inventory)  # else it stays, to stop what runs where this could not
    ended_before = parts[0][0].rank == 0 and _ended(probes[0])  # rank 0's process says how the run ended
    on_host = False  # a run on one host is stopped by one host script (``_stop_on_host``)
    if all(_ended(p) for p in probes):
        say("stop", "the trainer is not running" + (" on the hosts that answer" if unreached else ""))
    elif not run.hosts and parts[0][0].tmux_session:
        part, transport, tmux = parts[0]
        on_host = True
        killed_on_host = _stop_on_host(part, transport, tmux, timeout, keep_standby, say)
        probes[0] = probe_run(transport, part)
    else:
        for (part, transport, tmux), probe in zip(parts, probes):
            if _ended(probe):
                continue
            try:
                _signal_stop(part, transport, tmux, f" on {part.host}" if run.hosts else "", say)
            except DflashError as e:  # the host went away since it answered
                unreached.append((part, first_line(e)))
                say("stop", f"{part.host}: not stopped: {first_line(e)}")
        deadline = time.monotonic() + timeout
        gone = {id(p) for p, _ in unreached}
        while not all(_ended(p) or id(part) in gone for (part, _, _), p in zip(parts, probes)) \
                and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
            for i, ((part, transport, _), p) in enumerate(zip(parts, probes)):
                if _ended(p) or id(part) in gone:
                    continue
                try:
                    probes[i] = probe_run(transport, part)
                except DflashError as e:
                    unreached.append((part, first_line(e)))
                    gone.add(id(part))
    killed = on_host and killed_on_host
    for (part, _, tmux), probe in zip(parts, probes):
        if on_host:
            break  # its session (and standby) ended on the host already
        try:
            if probe.session_alive:
                killed = tmux.kill(part.tmux_session) or killed
            if not keep_standby:
                tmux.kill(standby_session(part.tmux_session))
        except DflashError as e:
            say("stop", f"{part.host}: tmux session not ended: {first_line(e)}")
    if run.hosts:
        for (part, _, _), probe in zip(parts, probes):
            if all(part is not p for p, _ in unreached):
                say("stop", f"{part.host} (rank {part.rank}): {_part_outcome(probe, killed)}")
        for part, why in unreached:
            say("stop", f"{part.host} (rank {part.rank}): not stopped, it does not answer ({why}); "
                "its supervisor keeps trying")
    probe, transport = probes[0], parts[0][1]
    was_final = run.state in FINAL_STATES
    run = store.get_run(run.id)
    if run.state in FINAL_STATES:
        # Its supervisor (a `watch`, a `launch --foreground`) may have seen the exit this
        # stop caused and recorded it first: then the stop did it, and says so.
        say("stop", f"run {run.id} was already {run.state}" if was_final or ended_before else
            f"run {run.id} {run.state} (its supervisor recorded the exit first)")
        return run
    code = probe.exit_code
    if code is None and killed:
        reason = f"did not stop within {timeout:g}s; tmux session killed"
    else:
        reason = contract.describe_exit(code) if code is not None else "stopped"
    state = DONE if code == contract.EXIT_DONE else STOPPED
    if ended_before and code is not None:
        state = final_state_for(code)  # it had ended by itself: say how (a crash stays a failure)
    why = "had already ended" if ended_before else "stopped by the operator"
    if unreached:  # a trainer may still run there: lost, not stopped, until its supervisor shows otherwise
        stopped = [p.host for p, _, _ in parts if all(p is not q for q, _ in unreached)]
        state, why = LOST, f"stopped on {', '.join(stopped) or 'no host'}"
        reason += _not_reached(unreached, "; not stopped: ") + "; its supervisor stops it there once it answers"
    if state not in TRANSITIONS[run.state] and not (state == DONE and RUNNING in TRANSITIONS[run.state]):
        state = STOPPED if state != LOST else run.state
    try:
        step = _record_last_steps(store, run, transport, probe, clock) if parts[0][0].rank == 0 else None
        at = f" at step {step:,}" if step is not None else ""
        if unreached:
            detail = {"step": step, "stop_pending": sorted(p.rank for p, _ in unreached)}
            if state == run.state:  # already lost
                store.add_event(run.id, "stop", f"{why}{at}: {reason}", clock(), "error", detail)
            else:
                store.transition(run.id, state, f"{why}{at}: {reason}", clock(), detail, severity="error")
        elif restarting and state != DONE:
            store.add_event(run.id, "stop", f"{why} for the restart{at}: {reason}", clock(), "info", {"step": step})
            state = run.state
        else:
            if state not in TRANSITIONS[run.state] and RUNNING in TRANSITIONS[run.state]:
                store.transition(run.id, RUNNING, "trainer running (seen by the stop)", clock())
            store.transition(run.id, state, f"{why}{at}: {reason}", clock(), {"step": step}, exit_code=code,
                             exit_reason=reason)
    except StoreBusy as e:
        raise StoreBusy(f"run {run.id}: the trainer was stopped ({reason}) but the store could not record it: {e}",
                        hint=f"`dflashctl stop {run.id}` again records it; {e.hint}") from None
    say("stop", f"run {run.id} {state}{at} ({reason})")
    return store.get_run(run.id)


def stop_parts(run: Run, ranks: tuple[int, ...], inventory: "Inventory", timeout: float = STOP_TIMEOUT,
               progress: Progress | None = None) -> None:
    """Stop the processes of ``ranks`` (SIGTERM, up to ``timeout`` for their checkpoint,
    then their sessions killed and a trainer that outlived its session reaped): what a
    stop could not reach before, once the host answers. Raises when it does not."""
    say = progress or quiet
    for part in run.parts():
        if part.rank not in ranks:
            continue
        transport, tmux = host_transport(part.host, inventory), part_tmux(part, inventory)
        _signal_stop(part, transport, tmux, f" on {part.host}", say)
        deadline = time.monotonic() + timeout
        while not _ended(probe_run(transport, part)) and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
        tmux.kill(part.tmux_session)
        tmux.kill(standby_session(part.tmux_session))
        transport.run(reap_trainer_argv(part.run_dir, part.rank), timeout=30, check=False)


def _reach(run: Run, inventory: "Inventory") -> tuple[list[tuple[Run, "Transport", Tmux, "ProbeResult"]],
                                                      list[tuple[Run, str]]]:
    """Every process of the run, rank 0 first, as (part, transport, tmux, its first
    probe) where its host answers, or (part, why) where it does not."""
    reached, unreached = [], []
    for part in run.parts():
        try:
            transport = host_transport(part.host, inventory)
            reached.append((part, transport, part_tmux(part, inventory), probe_run(transport, part)))
        except DflashError as e:
            unreached.append((part, first_line(e)))
    return reached, unreached


def _not_reached(unreached: list[tuple[Run, str]], lead: str) -> str:
    return (lead + "; ".join(f"rank {p.rank} on {p.host} (it does not answer: {why})" for p, why in unreached)
            if unreached else "")


def _part_outcome(probe: "ProbeResult", killed: bool) -> str:
    if probe.exit_code is not None:
        return f"ended: {contract.describe_exit(probe.exit_code)}"
    return "tmux session killed" if killed else "ended"


def _stop_script(part: Run, tmux: Tmux, timeout: float, keep_standby: bool) -> str:
    """One host's stop as one script: SIGTERM to the trainer (else Ctrl-C in its pane),
    a wait on the host for its end (its exit code, or its session gone) up to
    ``timeout``, then its session killed if still there, and its standby's unless kept;
    a line per step, as ``_STEP`` writes them."""
    q = shlex.join
    utf8 = ["env", *(f"{k}={v}" for k, v in UTF8_ENV.items())]
    has = q(utf8 + ["tmux", "-L", tmux.socket, "has-session", "-t", "=" + part.tmux_session])
    return "\n".join([
        _STEP, f"d={shlex.quote(part.run_dir)}",
        f"step signal {q(signal_trainer_argv(part.run_dir, rank=part.rank))} </dev/null",
        'case "$o" in signalled*) ;; *) ' + f"step ctrlc {q(utf8 + ['tmux', '-L', tmux.socket, 'send-keys', '-t', '=' + part.tmux_session + ':', 'C-c'])} </dev/null ;; esac",
        f"i=0; while [ ! -e \"$d/{contract.EXIT_CODE_FILE}\" ] && {has} 2>/dev/null </dev/null "
        f"&& [ $i -lt {int(timeout * 10)} ]; do sleep 0.1; i=$((i + 1)); done",
        # Its exit code written: run.sh's tee ends its session within moments (the log's last lines).
        f"j=0; while [ -e \"$d/{contract.EXIT_CODE_FILE}\" ] && {has} 2>/dev/null </dev/null && [ $j -lt 20 ]; "
        "do sleep 0.1; j=$((j + 1)); done",
        f"step kill {q(tmux.kill_argv(part.tmux_session))} </dev/null",
        *([] if keep_standby else [f"step standby {q(tmux.kill_argv(standby_session(part.tmux_session)))} </dev/null"]),
    ]) + "\n"


def _step_answers(stdout: str) -> dict[str, tuple[int, str]]:
    """A host script's answer (``_STEP``'s lines): step -> (its exit status, its output)."""
    steps = {}
    for line in stdout.splitlines():
        name, _, rest = line.partition("\t")
        code, _, text = rest.partition("\t")
        if code.lstrip("-").isdigit():
            steps[name] = (int(code), text.strip())
    return steps


def _stop_on_host(part: Run, transport: "Transport", tmux: Tmux, timeout: float, keep_standby: bool,
                  say: Progress) -> bool:
    """Stop the one host's trainer in one round trip (``_stop_script``); True when its
    session had to be killed (it did not end within ``timeout``)."""
    answer = transport.run(["sh", "-c", _stop_script(part, tmux, timeout, keep_standby), "dflashctl-stop"],
                           timeout=timeout + 60, check=False)
    steps = _step_answers(answer.stdout)
    if "kill" not in steps or steps["kill"][0] != 0:
        raise TmuxError(f"{part.host}: the stop gave no answer (exit {answer.exit_code}): "
                        f"{(answer.stderr.strip() or answer.stdout.strip())[-300:]}")
    signal_text = steps.get("signal", (0, ""))[1]
    if signal_text.startswith("signalled"):
        say("stop", f"sent SIGTERM to the trainer ({signal_text.split()[-1]}); waited for its checkpoint")
    elif "ctrlc" in steps and steps["ctrlc"][0] == 0:
        say("stop", "sent Ctrl-C to the trainer's tmux pane; waited for its checkpoint")
    else:
        say("stop", "the trainer had already ended (its tmux session is gone)")
    return steps["kill"][1] == "killed"


def _signal_stop(part: Run, transport: "Transport", tmux: Tmux, where: str, say: Progress) -> None:
    """SIGTERM to the part's trainer, else Ctrl-C in its pane. A process that ended
    since it was looked at (the other ranks of a multi-host run stop with rank 0,
    often before a slow host's turn comes), its session or its whole tmux server
    gone with it, is stopped there: success, not an error."""
    answer = transport.run(signal_trainer_argv(part.run_dir, rank=part.rank), check=False)
    if answer.stdout.startswith("signalled"):
        say("stop", f"sent SIGTERM to the trainer{where} ({answer.stdout.split()[-1]}); waiting for its checkpoint")
        return
    try:
        tmux.send_keys(part.tmux_session, "C-c")
    except TmuxError:
        if tmux.has_session(part.tmux_session):  # raises when tmux cannot be asked: "gone" is never a guess
            raise
        say("stop", f"the trainer{where} had already ended (its tmux session is gone)")
        return
    say("stop", f"sent Ctrl-C to the trainer's tmux pane{where}; waiting for its checkpoint")


def _record_last_steps(store: Store, run: Run, transport: "Transport", probe: "ProbeResult",
                       clock: Callable[[], float]) -> int | None:
    """Store the metrics lines written since the supervisor last read them (those up
    to the trainer's final checkpoint: its supervisor is gone by now) and return the
    step the trainer reached, from them or its status.json."""
    from dflashctl.hosts.parsers import parse_metrics_chunk

    offset, inode = store.metrics_position(run.id)
    steps = [probe.status.step] if probe.status is not None and probe.status.step else []
    for _ in range(50):  # one bounded chunk per probe
        try:
            answer = probe_run(transport, run, offset=offset, inode=inode)
        except DflashError:
            break
        if answer.metrics_offset is None or answer.metrics_reset:
            break  # unreadable, or rewritten from the start: what is stored stays as it is
        lines, _ = parse_metrics_chunk(answer.metrics_chunk)
        if answer.metrics_offset != offset:
            store.add_samples(run.id, lines, metrics_offset=answer.metrics_offset, metrics_inode=answer.metrics_inode,
                              observed=clock())
        steps += [m.step for m in lines] + ([answer.status.step] if answer.status and answer.status.step else [])
        offset, inode = answer.metrics_offset, answer.metrics_inode
        if not answer.metrics_more:
            break
    return max(steps) if steps else None


# --------------------------------------------------------------------------- restart


@dataclass
class RestartResult:
    run_id: str
    session: str
    bundle_hash: str
    serialized_warmup: bool
    killed_previous: bool
    redeployed: bool


def restart_run(run_id: str, serialized_warmup: bool, store: Store, inventory: "Inventory",
                progress: Progress | None = None, *, clock: Callable[[], float] = time.time,
                marker: str | None = None, hung: bool = False,
                secrets: dict[str, str] | None = None) -> RestartResult:
    """Start a new trainer process in the run's directory (for the supervisor).

    The previous session is killed if it is still there (a hung trainer). The
    trainer resumes from its last checkpoint (``--resume auto``) with the same
    compile cache; a held compile artifact that fits goes into the run directory
    first when it lacks one (``dflashctl.runs.compile_cache``). ``serialized_warmup`` sets compile.serialized_warmup in
    config.json. The run's state is the caller's business (it does not change here).
    ``marker``: a line for trainer.log before the new process starts; ``hung``: the
    old process's stacks are asked for first (SIGUSR1, then ``STACK_DUMP_WAIT_S``).
    ``secrets`` (``restart --reload``): the playbook's secrets read again, written as
    the run's secrets.env (removed when there are none); a standby, whose environment
    holds the old ones, is ended and not woken.

    A run on one host whose bundle is in place restarts in one round trip: one host
    script does the whole sequence (``_restart_on_host``) and answers once. A run on
    several hosts (every old process gone before any new one starts, rank 0's port
    free) or one whose bundle must be deployed again goes step by step."""
    say = progress or quiet
    run = store.get_run(run_id)
    if not run.hosts and secrets is None:  # new secrets go step by step (their file may have to go)
        done = _restart_on_host(run, serialized_warmup, store, inventory, say, clock, marker, hung)
        if done is not None:
            return done
        marker, hung = None, False  # done on the host already
    _before_restart(_on_hosts(run, inventory), marker, hung)
    say = progress or quiet
    run = store.get_run(run_id)
    socket = run.tmux_socket or socket_name()
    parts = _on_hosts(run, inventory)  # a multi-host run: every host's process, rank 0 first
    standby = _ready_standby(run, parts)
    killed = False
    for part, transport, tmux in parts:  # every previous process is gone before any new one starts
        killed = _end_previous(run, part, transport, tmux, say) or killed
    config, bundle_hash, redeployed = run.config, run.bundle_hash, False
    for part, transport, _ in parts:
        config, bundle_hash, again = _bundle_in_place(store, run, part, transport, config, bundle_hash, clock)
        redeployed = redeployed or again
    if redeployed or not standby or secrets is not None:
        standby = None  # a standby imported the old bundle or holds the old secrets: it is not the one to wake
        end_standby(run, inventory)
    wanted = bool(serialized_warmup) or config["trainer"]["compile"].get("serialized_warmup", True)
    key = None
    if config.get("distributed"):  # the previous processes are gone: rank 0's host must be able to listen again
        _wait_port_free(parts[0][0].host, parts[0][1], part_config(config, 0)["python"],
                        int(config["distributed"]["port"]), say)
        key = new_rendezvous_key()
    for part, transport, _ in parts:
        files = run_files(run.id, part.run_dir, config, socket, serialized_warmup=wanted, rank=part.rank,
                          session=part.tmux_session, rendezvous_key=key, secrets=secrets)
        # The previous process's exit code and status go before the new session starts,
        # so nobody reads them as the new process's (run.sh removes them too).
        deploy.write_run_files(transport, part.run_dir, files,
                               remove=[contract.EXIT_CODE_FILE, contract.status_file(part.rank),
                                       *([SECRETS_FILE] if secrets == {} else [])])
        _provide_compile_cache(store, part, transport, json.loads(files[contract.CONFIG_FILE]),
                               part_config(config, part.rank), bundle_hash, say, clock)
    unanswered = None
    if standby and not wake_standby(parts, standby):  # its session becomes the run's, then it is told to train
        unanswered, standby = standby, None  # stopped or hung since it was found ready: started afresh instead
        say("restart", f"standby {unanswered} did not take over within {STANDBY_ANSWER_S:g} s: ended, a fresh "
                       "start in its place")
        _end_woken(run, parts, say)
    if not standby:
        for part, transport, tmux in parts:
            tmux.start(part.tmux_session, start_command(part.run_dir))
    _record_restart(store, run, say, clock, serialized_warmup, killed, standby, unanswered)
    return RestartResult(run.id, run.tmux_session, bundle_hash, bool(serialized_warmup), killed, redeployed)


def _record_restart(store: Store, run: Run, say: Progress, clock: Callable[[], float], serialized_warmup: bool,
                    killed: bool, standby: str | None, unanswered: str | None) -> None:
    # The restart is issued from here on: a store that cannot take its record (disk
    # full) must not make the caller believe it was not, and issue a second one.
    message = "trainer started again (resume from the last checkpoint" + (
        ", serialized warm-up" if serialized_warmup else "") + (
        f"; standby {standby} woken, its imports done" if standby else
        f"; standby {unanswered} did not answer within {STANDBY_ANSWER_S:g} s, replaced" if unanswered else "") + ")" + (
        f" on {', '.join(run.host_names)}" if run.hosts else "")
    try:
        store.add_event(run.id, "process", message, clock(),
                        detail={"serialized_warmup": bool(serialized_warmup), "killed_previous": killed,
                                "standby": standby})
    except (sqlite3.Error, StoreError) as e:
        say("restart", f"{message}; not recorded in the run store: {first_line(e)}")
    say("restart", f"tmux session {run.tmux_session} started again" + (
        f" (and on {', '.join(run.host_names[1:])})" if run.hosts else ""))


STACK_DUMP_WAIT_S = 2.0  # faulthandler writes within milliseconds; the log may be on a shared disk
_APPEND_LINE = 'cd "$1" && printf "%s\\n" "$2" >> "$3"'  # trainer.log's restart marker


def _before_restart(parts: list, marker: str | None, hung: bool) -> None:
    """Step by step: a hung process's stacks asked for (SIGUSR1: they go into trainer.log,
    where it hung is the diagnosis), then the restart's marker appended to trainer.log."""
    if hung:
        for part, transport, _ in parts:
            transport.run(signal_trainer_argv(part.run_dir, "USR1", part.rank), timeout=15, check=False)
        time.sleep(STACK_DUMP_WAIT_S)
    if marker:
        for part, transport, _ in parts:
            transport.run(["sh", "-c", _APPEND_LINE, "dflashctl-mark", part.run_dir, marker, contract.LOG_FILE],
                          timeout=30, check=False)


# One host's whole restart as one script, each step the host command the step-by-step
# path runs: one line per step, "STEP<TAB>EXIT<TAB>its output on one line". It stops
# after a step that fails, or when the bundle is not in place (the controller then goes
# on step by step, deploying it). $1: the tar of the run files arrives on stdin.
_STEP = r"""
step() { n=$1; shift; o=$("$@" 2>&1); r=$?
  printf '%s\t%s\t%s\n' "$n" "$r" "$(printf %s "$o" | tr '\t\n' '  ' | cut -c1-400)"; return $r; }
"""


def _restart_script(part: Run, tmux: Tmux, marker: str | None, hung: bool, workdir: str, bundle_hash: str) -> str:
    q, go, went = shlex.join, contract.standby_go("@TOKEN@"), contract.standby_went("@TOKEN@")
    utf8 = ["env", *(f"{k}={v}" for k, v in UTF8_ENV.items())]
    standby = standby_session(part.tmux_session)
    lines = [_STEP, f"d={shlex.quote(part.run_dir)}"]
    if hung:
        lines += [f"step usr1 {q(signal_trainer_argv(part.run_dir, 'USR1', part.rank))} </dev/null",
                  f"sleep {STACK_DUMP_WAIT_S:g}"]
    if marker:
        lines.append(f"step mark {q(['sh', '-c', _APPEND_LINE, 'dflashctl-mark', part.run_dir, marker, contract.LOG_FILE])}"
                     " </dev/null")
    lines += [
        # A standby ready to take over: its pid really that standby, its session there.
        f"sb=$({q(standby_state_argv(part.run_dir))} </dev/null 2>&1); set -- $sb; tok=",
        f'if [ "$1" = ready ] && {q(utf8 + ["tmux", "-L", tmux.socket, "has-session", "-t", "=" + standby])} '
        '2>/dev/null </dev/null; then tok=$3; fi',
        r"""printf 'standby\t0\t%s\n' "${tok:-none}" """,
        f"step kill {q(tmux.kill_argv(part.tmux_session))} </dev/null || exit 0",
        f"step reap {q(reap_trainer_argv(part.run_dir, part.rank))} </dev/null || exit 0",
        f"step check {q(deploy.check_argv(workdir, bundle_hash))} </dev/null || exit 0",
        'case "$o" in *bundle=present*) ;; *) exit 0 ;; esac',
        f'[ -n "$tok" ] || step endstandby {q(tmux.kill_argv(standby))} </dev/null',
        f"step files {q(deploy.run_files_argv(part.run_dir, [contract.EXIT_CODE_FILE, contract.status_file(part.rank)]))}"
        " || exit 0",
        'if [ -n "$tok" ]; then',
        f'  step rename {q(utf8 + tmux.rename_argv(standby, part.tmux_session))} </dev/null || exit 0',
        f'  g=$(printf %s {shlex.quote(go)} | sed "s/@TOKEN@/$tok/"); w=$(printf %s {shlex.quote(went)} | sed "s/@TOKEN@/$tok/")',
        f'  step go {q(standby_go_argv(part.run_dir, go)[:4])} "$d" "$g" </dev/null || exit 0',
        f'  i=0; while [ ! -e "$d/$w" ] && [ $i -lt {int(STANDBY_ANSWER_S * 10)} ]; do sleep 0.1; i=$((i + 1)); done',
        r"""  if [ -e "$d/$w" ]; then printf 'woke\t0\t%s\n' "$tok"; exit 0; fi""",
        r"""  printf 'woke\t1\t%s\n' "$tok" """,
        f"""  {q(tmux.kill_argv(part.tmux_session))} >/dev/null 2>&1 </dev/null; rm -f "$d/$g" """,
        "fi",
        f"step start {q(utf8 + tmux.start_argv(part.tmux_session, start_command(part.run_dir)))} </dev/null",
    ]
    return "\n".join(lines) + "\n"


def _restart_on_host(run: Run, serialized_warmup: bool, store: Store, inventory: "Inventory", say: Progress,
                     clock: Callable[[], float], marker: str | None, hung: bool) -> RestartResult | None:
    """``restart_run`` of a run on one host in one round trip (see ``_restart_script``);
    None when its bundle is gone from the host (after the old process was ended):
    the caller then goes step by step, deploying it."""
    [(part, transport, tmux)] = _on_hosts(run, inventory)
    config, socket = run.config, run.tmux_socket or socket_name()
    wanted = bool(serialized_warmup) or config["trainer"]["compile"].get("serialized_warmup", True)
    files = run_files(run.id, part.run_dir, config, socket, serialized_warmup=wanted, rank=part.rank,
                      session=part.tmux_session)
    # A held compile artifact that fits goes in first (a look at the host only when one is held).
    _provide_compile_cache(store, part, transport, json.loads(files[contract.CONFIG_FILE]), part_config(config, 0),
                           run.bundle_hash, say, clock)
    script = _restart_script(part, tmux, marker, hung, part_config(config, 0).get("workdir") or transport.host.workdir,
                             run.bundle_hash or "")
    answer = transport.run(["sh", "-c", script, "dflashctl-restart"], input=deploy.tar_of(files), timeout=60,
                           check=False)
    steps = _step_answers(answer.stdout)
    for name in ("kill", "reap", "check", "files", "rename", "go", "start"):
        code, text = steps.get(name, (0, ""))
        if code != 0:
            if name == "reap":
                raise LaunchError(f"the previous trainer of {run.id} on {part.host} does not die ({text}); not "
                                  "starting a second one",
                                  hint="look at the process on the host (uninterruptible I/O? a stuck GPU driver?)")
            raise LaunchError(f"{part.host}: the restart's step {name} failed (exit {code}): {text or answer.stderr[-300:]}")
    if "kill" not in steps:
        raise LaunchError(f"{part.host}: the restart script gave no answer (exit {answer.exit_code}): "
                          f"{(answer.stderr.strip() or answer.stdout.strip())[-300:]}")
    killed = steps["kill"][1] == "killed"
    if killed:
        say("restart", f"killed the previous tmux session {part.tmux_session}")
    if steps.get("reap", (0, ""))[1].startswith("killed"):
        say("restart", f"the previous trainer on {part.host} outlived its session: {steps['reap'][1]}")
    if "files" not in steps:
        return None  # the bundle is gone: deployed step by step
    token = steps["standby"][1] if steps.get("standby", (0, "none"))[1] != "none" else None
    woke = steps.get("woke")
    standby = token if woke is not None and woke[0] == 0 else None
    unanswered = token if woke is not None and woke[0] != 0 else None
    if unanswered:
        say("restart", f"standby {unanswered} did not take over within {STANDBY_ANSWER_S:g} s: ended, a fresh "
                       "start in its place")
    _record_restart(store, run, say, clock, serialized_warmup, killed, standby, unanswered)
    return RestartResult(run.id, run.tmux_session, run.bundle_hash, bool(serialized_warmup), killed, False)


PORT_RELEASE_S = 5.0  # a killed rank 0's listening socket is closed when its process is reaped


def _wait_port_free(host: str, transport: "Transport", python: str, port: int, say: Progress) -> None:
    deadline = time.monotonic() + PORT_RELEASE_S
    while True:
        problem = rendezvous_port_problem(transport, python, port)
        if problem is None:
            return
        if time.monotonic() > deadline:
            raise port_in_use_error(host, port, problem)
        say("restart", f"rendezvous port {port} on {host} not free yet ({problem}); checking again")
        time.sleep(0.5)


def _end_woken(run: Run, parts: list, say: Progress) -> None:
    """After a standby that did not take over on every host: one that took its go file
    on a host began there as the trainer (its status names its pid). Each is gone, and
    its status and exit code removed, before the fresh start: else the supervisor reads
    them, between the restart and the new process's own, as that process's end."""
    for part, transport, tmux in parts:
        _end_previous(run, part, transport, tmux, say)
        transport.run(["rm", "-f", *(posixpath_join(part.run_dir, name) for name in
                                     (contract.EXIT_CODE_FILE, contract.status_file(part.rank)))], timeout=30)


def _end_previous(run: Run, part: Run, transport: "Transport", tmux: Tmux, say: Progress) -> bool:
    """Kill the part's previous session and any trainer that outlived it; True if a session was killed."""
    killed = tmux.kill(part.tmux_session)
    if killed:
        say("restart", f"killed the previous tmux session {part.tmux_session}" + (f" on {part.host}" if run.hosts else ""))
    reaped = transport.run(reap_trainer_argv(part.run_dir, part.rank), timeout=30, check=False)
    if not reaped.ok:
        raise LaunchError(f"the previous trainer of {run.id} on {part.host} does not die "
                          f"({reaped.stdout.strip() or reaped.stderr.strip()}); not starting a second one",
                          hint="look at the process on the host (uninterruptible I/O? a stuck GPU driver?)")
    if reaped.stdout.startswith("killed"):
        say("restart", f"the previous trainer on {part.host} outlived its session: {reaped.stdout.strip()}")
    return killed


def _bundle_in_place(store: Store, run: Run, part: Run, transport: "Transport", config: dict[str, Any],
                     bundle_hash: str | None, clock: Callable[[], float]) -> tuple[dict[str, Any], str | None, bool]:
    """The run's bundle on the part's host: (config, bundle hash, redeployed). A bundle
    removed from the host is replaced by this checkout's; every host of a multi-host run
    must run the same code, so there only the very same bundle may replace it."""
    host = transport.host
    own = part_config(config, part.rank)
    state = deploy.check(transport, own.get("workdir") or host.workdir, bundle_hash or "")
    if state["bundle"] == "present":
        return config, bundle_hash, False
    bundle = build_bundle()
    if run.hosts and bundle.hash != bundle_hash:
        raise LaunchError(f"the bundle of run {run.id} ({(bundle_hash or '?')[:12]}) is gone from {part.host}, and "
                          f"this checkout builds another ({bundle.short}); the hosts of one run must run the same code",
                          hint=f"launch a new run: dflashctl launch {shlex.quote(run.playbook)}")
    result = deploy.deploy_bundle(transport, bundle, state["workdir"])
    config = copy.deepcopy(config)
    env = config["distributed"]["hosts"][part.rank]["env"] if run.hosts else config["env"]
    env["PYTHONPATH"] = ":".join([result.bundle_dir, *env["PYTHONPATH"].split(":")[1:]])
    store.update_run(run.id, bundle_hash=bundle.hash, config=config)
    store.add_event(run.id, "deploy", f"bundle {bundle_hash and bundle_hash[:12]} missing on {part.host}; "
                    f"deployed {bundle.short}", clock(), severity="warning", detail=result.to_dict())
    return config, bundle.hash, True


def _provide_compile_cache(store: Store, run: Run, transport: "Transport", trainer: dict[str, Any],
                           config: dict[str, Any], bundle_hash: str | None, say: Progress,
                           clock: Callable[[], float]) -> None:
    """Before the new process starts: a held compile artifact that fits the run goes
    into its run directory when the directory lacks one (a wiped or moved host),
    said and recorded. Never in the way of the restart."""
    from dflashctl.runs import compile_cache

    try:
        gpu = _seen_gpu_name(store, run, config)
        compile_cache.provide_for_run(
            transport, run.run_dir, trainer, compile_cache.bundle_of(config.get("env"), bundle_hash), gpu,
            lambda message: say("restart", message),
            lambda o: store.add_event(run.id, compile_cache.EVENT_KIND, o.message, clock(), o.severity,
                                      o.event_detail()))
    except (sqlite3.Error, DflashError, OSError) as e:
        say("restart", f"compile artifacts not provided: {first_line(e)}")


def _seen_gpu_name(store: Store, run: Run, config: dict[str, Any]) -> str | None:
    """The key's ``gpu`` field for the run's GPUs, from nvidia-smi's names as the
    supervisor last stored them (None: not known)."""
    from dflashctl.runs import compile_cache

    last = store.readings(run.host, 1)
    return compile_cache.gpu_name(last[0]["gpu"] if last and isinstance(last[0]["gpu"], list) else [],
                                  config.get("gpus") or [])


def artifact_inputs(store: Store, run: Run) -> tuple[dict[str, Any], str, str | None]:
    """What the run's compile artifact must have been made for, from the controller's
    own records: the trainer configuration its config.json holds, the bundle deployed,
    the GPU name seen (``compile_cache.copy_back``'s trainer, bundle, gpu)."""
    from dflashctl.runs import compile_cache

    config = run.config
    files = run_files(run.id, run.run_dir, config, run.tmux_socket or "dflash", rank=0,
                      session=run.tmux_session)
    return (json.loads(files[contract.CONFIG_FILE]),
            compile_cache.bundle_of(part_config(config, 0).get("env"), run.bundle_hash),
            _seen_gpu_name(store, run, part_config(config, 0)))


def restart(run_id: str, store: Store, inventory: "Inventory", serialized_warmup: bool = False,
            progress: Progress | None = None, *, clock: Callable[[], float] = time.time,
            start_timeout: float = START_TIMEOUT, secrets: dict[str, str] | None = None) -> str:
    """Operator restart (``dflashctl restart``): a run still going is first stopped
    gracefully (SIGTERM: it checkpoints), then restarting -> new process -> running.
    ``secrets``: read again by ``restart --reload`` (``restart_run``)."""
    run = store.get_run(run_id)
    if run.state == DONE:
        raise LaunchError(f"run {run.id} is done: it finished all its steps and is not restarted",
                          hint=f"start a new run: dflashctl launch {shlex.quote(run.playbook)}")
    held = None
    if run.state not in FINAL_STATES:
        say = progress or quiet
        say("restart", f"run {run.id} is {run.state}: stopping it first (checkpoint)")
        # Restarting from here on, never stopped on the way: a supervisor watching it (a
        # foreground `watch`) takes the stop's exit for the restart's, not the run's end,
        # so it neither ends the standby nor stops watching.
        if RESTARTING in TRANSITIONS[run.state]:
            store.transition(run.id, RESTARTING, "restart requested by the operator: stopping it first (checkpoint)",
                             clock())
        # A ready standby (its imports done) is held through the stop and woken by the
        # restart, as the supervisor's restart of a crash does; else it would leave
        # with the stopped trainer and the new process pay every import again.
        held = _hold_standby(run, inventory) if secrets is None else None  # new secrets: a fresh process
        if held:
            say("restart", f"standby {held} is ready: kept through the stop, woken next")
        run = stop(run.id, store, inventory, progress=progress, clock=clock, keep_standby=bool(held),
                   restarting=store.get_run(run.id).state == RESTARTING)
        if run.state == DONE:
            end_standby(run, inventory)
            return run.state
        if run.state == LOST:  # a host did not answer: its process may still run, a new one cannot start
            raise NotEveryHost(f"run {run.id} not restarted: stopped on the hosts that answer; the others are "
                               "sent nothing and may still run it (its supervisor stops them once they answer)",
                               hint=f"`dflashctl restart {run.id}` again once every host answers "
                               f"(`dflashctl status {run.id}` shows each host)")
    if run.state != RESTARTING:
        store.transition(run.id, RESTARTING, "restart requested by the operator", clock())
    try:
        _mark_restart(run, inventory, clock())
        restart_run(run.id, serialized_warmup, store, inventory, progress, clock=clock, secrets=secrets)
    except BaseException as e:
        store.transition(run.id, FAILED, f"restart failed: {first_line(e)}", clock(), exit_reason="restart failed")
        raise
    finally:
        if held:
            _release_standby(run, inventory, held)
    transport = host_transport(run.host, inventory)
    return wait_started(store, store.get_run(run.id), transport, start_timeout, clock, progress)


# trainer.log is appended to by every process of the run: the marker says where the
# next one's output begins (logtext.this_attempt), as the supervisor's restarts do.
_APPEND_MARKER = 'cd "$1" && printf "%s\\n" "$2" >> "$3"'


def _mark_restart(run: Run, inventory: "Inventory", now: float) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
    marker = f"{RESTART_MARKER} restart by the operator at {stamp} ---"
    for part, transport, _ in _on_hosts(run, inventory):
        transport.run(["sh", "-c", _APPEND_MARKER, "dflashctl-mark", part.run_dir, marker, contract.LOG_FILE],
                      timeout=30, check=False)
