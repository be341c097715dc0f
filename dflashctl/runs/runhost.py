"""What happens to a run on its host: start, signal, stop, restart, reap, logs.

A run on its host is a directory (``<workdir>/runs/<run_id>/``: config.json,
run.sh, status.json, metrics.jsonl, trainer.log, exit_code) and a tmux session
named after the run running ``run.sh``. This module writes the run files, starts
the session, waits for the trainer's first status, signals the trainer, stops it,
restarts it in place, reaps a trainer that outlived its session, and reads its
log. ``dflashctl.launch`` (the first start) and ``dflashctl.supervise.supervisor`` (restarts)
both use it.

``run.sh`` is the whole process contract on the host: it exports the environment
(PYTHONPATH = the bundle, TORCHINDUCTOR_CACHE_DIR = the persistent compile cache,
UTF-8 locale, unbuffered output, CUDA_VISIBLE_DEVICES when the run owns GPUs, the
host's and the playbook's env), removes the previous process's status.json and
exit_code, runs ``python -m trainer --config config.json --run-dir DIR --resume
auto`` with its output appended to trainer.log, and writes the exit status to
``exit_code`` when the trainer ends, whatever way it ends. A restart runs the
same script again in the same run directory: the trainer resumes from its last
checkpoint and the compile cache is still warm.

``standby.sh`` is run.sh for the next process, started early (``start_standby``,
session ``<session>-standby``): its trainer imports and waits (trainer/standby.py).
A restart that finds it ready on every host renames its session to the run's and
wakes it, instead of starting run.sh; it clears nothing when it starts and writes
an exit code only once its trainer has taken over.

A multi-host run (``Run.hosts``) is a run directory and session per host
(``Run.parts``: rank 0's session is the run id, rank q's ``<run id>-r<q>``); each
host's run.sh exports that host's python and environment and the rendezvous
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Stop, restart and logs act on every
host; a restart ends every old process before it starts any new one.

When the run owns GPUs, CUDA_VISIBLE_DEVICES is set to exactly those (physical
indices, as nvidia-smi numbers them) and the placement written to config.json is
renumbered to match, so the trainer cannot touch (or create a stray CUDA context
on) another run's GPU. The store records the physical indices (``config["gpus"]``).

The trainer is only ever signalled by the pid in its status.json, and only while
that pid's command line names this run's directory (pids are reused).

This module never decides anything (whether to restart is the policy's, through
the supervisor) and never imports ``dflashctl.launch``, ``dflashctl.supervise.supervisor``
or ``dflashctl.supervise.console``: they import it.
"""

from __future__ import annotations

import copy
import json
import shlex
import sqlite3
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

from dflashctl.core import contract
from dflashctl.core.errors import DflashError, StoreError, TransportError, first_line
from dflashctl.core.logtext import RESTART_MARKER
from dflashctl.core.states import DONE, FAILED, FINAL_STATES, RESTARTING, RUNNING, STOPPED, TRANSITIONS
from dflashctl.hosts import deploy
from dflashctl.hosts.bundle import build_bundle
from dflashctl.hosts.tmux import Tmux, TmuxError, socket_name
from dflashctl.store import Run, Store

if TYPE_CHECKING:
    from dflashctl.config import EvalSettings, Host, Inventory
    from dflashctl.hosts.probe import ProbeResult
    from dflashctl.hosts.transport import Transport

RUN_SCRIPT = "run.sh"
STANDBY_SCRIPT = "standby.sh"
START_TIMEOUT = 120.0  # launch and restart wait this long (at most) for the trainer's first status
STOP_TIMEOUT = 120.0  # a graceful stop waits this long for the checkpoint before killing
POLL_SECONDS = 1.0

Progress = Callable[[str, str], None]


def quiet(step: str, message: str) -> None:
    """The default ``Progress``: says nothing."""


class LaunchError(DflashError):
    """The run could not be started (nothing was left running)."""


# --------------------------------------------------------------------------- run files


def renumber_placement(trainer: dict[str, Any], gpus: list[int]) -> dict[str, Any]:
    """The trainer config as seen under CUDA_VISIBLE_DEVICES=gpus (indices become positions)."""
    out = copy.deepcopy(trainer)
    position = {g: i for i, g in enumerate(gpus)}
    for role in ("target", "drafter"):
        out["placement"][role] = [position[int(g)] for g in out["placement"][role]]
    return out


def _remote_path_expr(path: str) -> str:
    """A shell word for a host path: '~/x' expands to the host's $HOME, the rest is literal."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def run_environment(host: "Host", playbook_env: dict[str, str], bundle_dir: str,
                    gpus: list[int]) -> dict[str, str]:
    """The trainer's environment besides the compile cache (host env, then playbook env, win)."""
    env = {"LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1"}
    env.update(host.env or {})
    env.update(playbook_env or {})
    extra_path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = bundle_dir + (f":{extra_path}" if extra_path else "")
    if gpus and "CUDA_VISIBLE_DEVICES" not in (playbook_env or {}):
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    return env


def render_run_script(run_id: str, run_dir: str, python: str, env: dict[str, str],
                      compile_cache: str | None, session: str, socket: str, rank: int = 0,
                      standby: str | None = None) -> str:
    """run.sh: see the module docstring. ``standby``: standby.sh instead, the trainer
    started with ``--standby TOKEN``, which clears nothing before it takes over and
    whose exit code is written only once it has (trainer/standby.py)."""
    lines = [
        "#!/bin/sh",
        _comment(f"dflashctl run {run_id}: runs in tmux session {session} (tmux -L {socket})."),
        "# Rewritten on every (re)start by dflashctl; edits here are lost.",
        f"cd {shlex.quote(run_dir)} || exit 1",
    ]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    if compile_cache:
        # Persistent and never cleared: a restart must find the compiled kernels.
        lines += [f"export TORCHINDUCTOR_CACHE_DIR={_remote_path_expr(compile_cache)}",
                  'mkdir -p "$TORCHINDUCTOR_CACHE_DIR"']
    trainer = shlex.join([*shlex.split(python), "-m", "trainer", "--config", contract.CONFIG_FILE,
                          "--run-dir", run_dir, "--resume", "auto", *(["--standby", standby] if standby else [])])
    ec, tmp = contract.EXIT_CODE_FILE, contract.EXIT_CODE_FILE + ".tmp"
    lines += [
        # The previous process's answers must not be read as this one's (a standby's
        # are cleared by the restart that wakes it).
        *([] if standby else [f"rm -f {ec} {contract.status_file(rank)}"]),
        "{",
        # Caught here (so the exit code is still written), reset to default for the
        # trainer, which handles SIGINT/SIGTERM itself (checkpoint, exit 4).
        "  trap : INT TERM HUP",
        f"  {trainer} 2>&1",
        f"  echo $? > {tmp} && mv -f {tmp} {ec}" if not standby else
        f"  code=$?; [ -f {shlex.quote(contract.standby_went(standby))} ] && echo $code > {tmp} && mv -f {tmp} {ec}",
        # tee -i: a Ctrl-C for the trainer must not kill the log writer first.
        f"}} | tee -i -a {contract.LOG_FILE}",
        "",
    ]
    return "\n".join(lines)


def _comment(text: str) -> str:
    """A shell comment line of ``text``: a control character in it (a newline would end
    the comment and make the rest a command) is written as its escape."""
    return "# " + "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def distributed_env(dist: dict[str, Any], rank: int) -> dict[str, str]:
    """The variables that make a trainer one process of a multi-host run: what torchrun
    sets for a static rendezvous with one process per host (env:// initialisation)."""
    world = len(dist["hosts"])
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "GROUP_RANK": str(rank), "MASTER_ADDR": dist["address"], "MASTER_PORT": str(dist["port"]),
            contract.HOST_ENV: dist["hosts"][rank]["host"]}


def part_config(config: dict[str, Any], rank: int) -> dict[str, Any]:
    """A run's stored config as the process of ``rank`` is started with: its host's
    python, environment and workdir, and the rendezvous variables (a single-host run:
    the config as it is)."""
    dist = config.get("distributed")
    if not dist:
        return config
    own = dist["hosts"][rank]
    return {**config, "python": own["python"], "workdir": own["workdir"],
            "env": {**own["env"], **distributed_env(dist, rank)}}


def _artifact_generation() -> int:
    from dflashctl.runs.compile_cache import LocalCache

    return LocalCache().generation()


def standby_session(session: str) -> str:
    return f"{session}-standby"


def run_files(run_id: str, run_dir: str, config: dict[str, Any], socket: str,
              serialized_warmup: bool | None = None, rank: int = 0, session: str | None = None,
              standby: str | None = None, rendezvous_key: str | None = None) -> dict[str, str]:
    """config.json and run.sh for a run (for the process of ``rank`` on its own host,
    in tmux session ``session``), from its stored config; for a multi-host run also
    ``rendezvous.key``, this start's secret (``rendezvous_key``, the same on every host;
    written mode 0600, never stored, never on a command line)."""
    config = part_config(config, rank)
    trainer = copy.deepcopy(config["trainer"])
    if serialized_warmup is not None:
        trainer["compile"]["serialized_warmup"] = serialized_warmup
    gpus = config.get("gpus") or []
    if gpus and "CUDA_VISIBLE_DEVICES" in config.get("env", {}) and \
            config["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, gpus)):
        trainer = renumber_placement(trainer, gpus)
    env = {**config.get("env", {}), contract.ARTIFACT_GENERATION_ENV: str(_artifact_generation())}
    script = render_run_script(run_id, run_dir, config["python"], env,
                               config.get("compile_cache"), session or run_id, socket, rank, standby)
    if standby:
        return {STANDBY_SCRIPT: script}
    files = {contract.CONFIG_FILE: deploy.config_json(trainer), RUN_SCRIPT: script}
    if config.get("distributed") and rendezvous_key:
        files[contract.RENDEZVOUS_KEY_FILE] = rendezvous_key + "\n"
    return files


def new_rendezvous_key() -> str:
    """A fresh secret for one start of a multi-host run (a process of an earlier start
    cannot join this one)."""
    import secrets

    return secrets.token_hex(32)


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


def start_command(run_dir: str) -> str:
    return shlex.join(["sh", posixpath_join(run_dir, RUN_SCRIPT)])


def posixpath_join(*parts: str) -> str:
    import posixpath

    return posixpath.join(*parts)


def final_state_for(exit_code: int | None) -> str:
    if exit_code == contract.EXIT_DONE:
        return DONE
    if exit_code == contract.EXIT_STOPPED:
        return STOPPED
    return FAILED


# --------------------------------------------------------------------------- host access


def host_transport(host_name: str, inventory: "Inventory") -> "Transport":
    """The run host's transport (jump hosts, container wrapper), connected."""
    from dflashctl.hosts.transport import connect

    return connect(host_name, inventory)


def local_host() -> "Host":
    """This machine, where supervisor sessions run."""
    from dflashctl.config import Host

    return Host(name="local", transport="local")


def probe_run(transport: "Transport", run: Run, *, offset: int = 0, inode: int | None = None,
              timeout: float | None = None) -> "ProbeResult":
    """One probe round trip for one run (no nvidia-smi)."""
    from dflashctl.hosts.probe import ProbeArgs, ProbeError, parse_probe_host, probe_command

    args = ProbeArgs(run_dir=run.run_dir, session=run.tmux_session, socket=run.tmux_socket or socket_name(),
                     metrics_offset=offset, metrics_inode=inode, nvidia_smi=False, pane_lines=40, rank=run.rank)
    result = transport.run(probe_command(transport.host.python, [args]), timeout=timeout or 30)
    host = parse_probe_host(result.stdout)
    if isinstance(host, ProbeError):
        raise TransportError(transport.host.name, "probe", host.message, stderr_tail=host.output_tail)
    return host.runs[0]


def _started(probe: "ProbeResult") -> bool:
    return probe.status is not None and probe.status.phase in contract.PHASES


def _ended(probe: "ProbeResult") -> bool:
    return probe.exit_code is not None or probe.session_alive is False


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
         keep_standby: bool = False) -> Run:
    """Graceful stop: SIGTERM to the trainer (it checkpoints and exits 4), or Ctrl-C
    in its tmux pane when its pid cannot be signalled; wait up to ``timeout`` for it
    to exit; then kill the session. The run ends in ``stopped`` (``done`` if it
    finished meanwhile; ``failed`` if it had crashed before the stop, unseen).
    ``keep_standby``: its standby is left waiting (a restart follows and wakes it)."""
    say = progress or quiet
    run = store.get_run(run_id)
    parts = _on_hosts(run, inventory)  # a multi-host run: every host's process, rank 0 first
    stop_supervisor(run, inventory)
    if run.state not in FINAL_STATES:
        store.add_event(run.id, "stop_requested", "stop requested by the operator"
                        + (f" (hosts {', '.join(run.host_names)})" if run.hosts else ""), clock())
    probes = [probe_run(transport, part) for part, transport, _ in parts]
    ended_before = _ended(probes[0])  # rank 0's process says how the run ended
    if all(_ended(p) for p in probes):
        say("stop", "the trainer is not running")
    else:
        for (part, transport, tmux), probe in zip(parts, probes):
            if _ended(probe):
                continue
            _signal_stop(part, transport, tmux, f" on {part.host}" if run.hosts else "", say)
        deadline = time.monotonic() + timeout
        while not all(_ended(p) for p in probes) and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
            probes = [p if _ended(p) else probe_run(transport, part) for (part, transport, _), p in zip(parts, probes)]
    killed = False
    for (part, _, tmux), probe in zip(parts, probes):
        if probe.session_alive:
            killed = tmux.kill(part.tmux_session) or killed
        if not keep_standby:
            tmux.kill(standby_session(part.tmux_session))
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
    if state not in TRANSITIONS[run.state]:
        state = STOPPED
    why = "had already ended" if ended_before else "stopped by the operator"
    step = _record_last_steps(store, run, transport, probe, clock)
    at = f" at step {step:,}" if step is not None else ""
    store.transition(run.id, state, f"{why}{at}: {reason}", clock(), {"step": step}, exit_code=code,
                     exit_reason=reason)
    say("stop", f"run {run.id} {state}{at} ({reason})")
    return store.get_run(run.id)


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
                progress: Progress | None = None, *, clock: Callable[[], float] = time.time) -> RestartResult:
    """Start a new trainer process in the run's directory (for the supervisor).

    The previous session is killed if it is still there (a hung trainer). The
    trainer resumes from its last checkpoint (``--resume auto``) with the same
    compile cache; a held compile artifact that fits goes into the run directory
    first when it lacks one (``dflashctl.runs.compile_cache``). ``serialized_warmup`` sets compile.serialized_warmup in
    config.json. The run's state is the caller's business (it does not change here)."""
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
    if redeployed or not standby:
        standby = None  # a standby imported the old bundle: it is not the one to wake
        end_standby(run, inventory)
    wanted = bool(serialized_warmup) or config["trainer"]["compile"].get("serialized_warmup", True)
    key = None
    if config.get("distributed"):  # the previous processes are gone: rank 0's host must be able to listen again
        _wait_port_free(parts[0][0].host, parts[0][1], part_config(config, 0)["python"],
                        int(config["distributed"]["port"]), say)
        key = new_rendezvous_key()
    for part, transport, _ in parts:
        files = run_files(run.id, part.run_dir, config, socket, serialized_warmup=wanted, rank=part.rank,
                          session=part.tmux_session, rendezvous_key=key)
        # The previous process's exit code and status go before the new session starts,
        # so nobody reads them as the new process's (run.sh removes them too).
        deploy.write_run_files(transport, part.run_dir, files,
                               remove=[contract.EXIT_CODE_FILE, contract.status_file(part.rank)])
        _provide_compile_cache(store, part, transport, json.loads(files[contract.CONFIG_FILE]),
                               part_config(config, part.rank), bundle_hash, say, clock)
    for part, transport, tmux in parts:
        if standby:  # its session becomes the run's, then it is told to train
            tmux.rename(standby_session(part.tmux_session), part.tmux_session)
            transport.run(["sh", "-c", _STANDBY_GO, "dflashctl-go", part.run_dir, contract.standby_go(standby)], timeout=30)
        else:
            tmux.start(part.tmux_session, start_command(part.run_dir))
    # The restart is issued from here on: a store that cannot take its record (disk
    # full) must not make the caller believe it was not, and issue a second one.
    message = "trainer started again (resume from the last checkpoint" + (
        ", serialized warm-up" if serialized_warmup else "") + (
        f"; standby {standby} woken, its imports done" if standby else "") + ")" + (
        f" on {', '.join(run.host_names)}" if run.hosts else "")
    try:
        store.add_event(run.id, "process", message, clock(),
                        detail={"serialized_warmup": bool(serialized_warmup), "killed_previous": killed,
                                "standby": standby})
    except (sqlite3.Error, StoreError) as e:
        say("restart", f"{message}; not recorded in the run store: {first_line(e)}")
    say("restart", f"tmux session {run.tmux_session} started again" + (
        f" (and on {', '.join(run.host_names[1:])})" if run.hosts else ""))
    return RestartResult(run.id, run.tmux_session, bundle_hash, bool(serialized_warmup), killed, redeployed)


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


# --------------------------------------------------------------------------- standby

# The standby of a run directory: 'ready PID TOKEN' while the pid standby.json names
# is really that standby (its command line names the run directory and the token:
# standby.json is a file on the host, and pids are reused), else why not.
_STANDBY_STATE = r"""
d=$1; f="$d/standby.json"
[ -f "$f" ] || { echo none; exit 0; }
pid=$(sed -n 's/.*"pid": *\([0-9][0-9]*\).*/\1/p' "$f" | head -n 1)
tok=$(sed -n 's/.*"token": *"\([A-Za-z0-9_-]*\)".*/\1/p' "$f" | head -n 1)
if [ -n "$pid" ] && [ -n "$tok" ] && [ -r "/proc/$pid/cmdline" ] && cmd=$(tr '\0' ' ' < "/proc/$pid/cmdline") \
    && case "$cmd" in *"$d"*"--standby $tok"*|*"--standby $tok"*"$d"*) true;; *) false;; esac; then
  echo "ready $pid $tok"
else
  echo gone
fi
"""
# Wake a standby: its go file, made whole in one rename.
_STANDBY_GO = 'cd "$1" && : > "$2.tmp" && mv -f "$2.tmp" "$2"'


def start_standby(run_id: str, store: Store, inventory: "Inventory", *,
                  clock: Callable[[], float] = time.time) -> str:
    """Start the next process's standby on every host of the run, in tmux sessions
    ``<session>-standby`` (an older one is replaced); returns its token."""
    import secrets

    run = store.get_run(run_id)
    token, socket = secrets.token_hex(4), run.tmux_socket or socket_name()
    for part, transport, tmux in _on_hosts(run, inventory):
        tmux.kill(standby_session(part.tmux_session))
        files = run_files(run.id, part.run_dir, run.config, socket, rank=part.rank, session=part.tmux_session,
                          standby=token)
        deploy.write_run_files(transport, part.run_dir, files)
        tmux.start(standby_session(part.tmux_session), shlex.join(["sh", posixpath_join(part.run_dir, STANDBY_SCRIPT)]))
    store.add_event(run.id, "standby", f"standby {token} started (the next restart's trainer, importing now)"
                    + (f" on {', '.join(run.host_names)}" if run.hosts else ""), clock(), detail={"token": token})
    return token


def end_standby(run: Run, inventory: "Inventory") -> None:
    """Kill the run's standby sessions (every host)."""
    for part in run.parts():
        part_tmux(part, inventory).kill(standby_session(part.tmux_session))


def part_tmux(part: Run, inventory: "Inventory") -> Tmux:
    """The tmux server of a run's process on its host (``Run.parts``)."""
    return Tmux(inventory.get(part.host), inventory, part.tmux_socket or socket_name())


def _on_hosts(run: Run, inventory: "Inventory") -> list[tuple[Run, "Transport", Tmux]]:
    """(part, its host's transport, its tmux) for every process of the run, rank 0 first."""
    return [(p, host_transport(p.host, inventory), part_tmux(p, inventory)) for p in run.parts()]


def _ready_standby(run: Run, parts: list) -> str | None:
    """The token of a standby ready on every host of the run (one token), else None."""
    tokens = set()
    for part, transport, tmux in parts:
        answer = transport.run(["sh", "-c", _STANDBY_STATE, "dflashctl-standby", part.run_dir], timeout=30, check=False)
        words = answer.stdout.split()
        if len(words) != 3 or words[0] != "ready" or not tmux.has_session(standby_session(part.tmux_session)):
            return None
        tokens.add(words[2])
    return tokens.pop() if len(tokens) == 1 else None


def _hold_standby(run: Run, inventory: "Inventory") -> str | None:
    """The token of the run's ready standby, held through the stop that follows
    (``contract.standby_hold`` on every host); None when there is none."""
    parts = _on_hosts(run, inventory)
    token = _ready_standby(run, parts)
    if token:
        for part, transport, _ in parts:
            transport.run(["sh", "-c", _STANDBY_GO, "dflashctl-hold", part.run_dir, contract.standby_hold(token)],
                          timeout=30)
    return token


def _release_standby(run: Run, inventory: "Inventory", token: str) -> None:
    """Remove the hold files (the standby is the trainer now, or the restart failed)."""
    for part, transport, _ in _on_hosts(run, inventory):
        transport.run(["rm", "-f", posixpath_join(part.run_dir, contract.standby_hold(token))], timeout=30,
                      check=False)


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

    last = store.gpu_samples(run.id, 1)
    return compile_cache.gpu_name(last[0].gpu if last and isinstance(last[0].gpu, list) else [],
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
            start_timeout: float = START_TIMEOUT) -> str:
    """Operator restart (``dflashctl restart``): a run still going is first stopped
    gracefully (SIGTERM: it checkpoints), then restarting -> new process -> running."""
    run = store.get_run(run_id)
    if run.state == DONE:
        raise LaunchError(f"run {run.id} is done: it finished all its steps and is not restarted",
                          hint=f"start a new run: dflashctl launch {shlex.quote(run.playbook)}")
    held = None
    if run.state not in FINAL_STATES:
        say = progress or quiet
        say("restart", f"run {run.id} is {run.state}: stopping it first (checkpoint)")
        # A ready standby (its imports done) is held through the stop and woken by the
        # restart, as the supervisor's restart of a crash does; else it would leave
        # with the stopped trainer and the new process pay every import again.
        held = _hold_standby(run, inventory)
        if held:
            say("restart", f"standby {held} is ready: kept through the stop, woken next")
        run = stop(run.id, store, inventory, progress=progress, clock=clock, keep_standby=bool(held))
        if run.state == DONE:
            end_standby(run, inventory)
            return run.state
    store.transition(run.id, RESTARTING, "restart requested by the operator", clock())
    try:
        _mark_restart(run, inventory, clock())
        restart_run(run.id, serialized_warmup, store, inventory, progress, clock=clock)
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


# --------------------------------------------------------------------------- logs


_READ_LOG = r"""
f=$1; off=$2; n=$3; ec=$4
size=$(wc -c < "$f" 2>/dev/null || echo 0); size=$(echo $size)
ended=0; [ -f "$ec" ] && ended=1
if [ "$off" -lt 0 ]; then
  echo "$size $ended"; [ "$size" -gt 0 ] && tail -n "$n" "$f"; exit 0
fi
[ "$size" -lt "$off" ] && off=0
echo "$size $ended"
[ "$size" -gt "$off" ] && tail -c +"$((off + 1))" "$f" | head -c "$((size - off))"
exit 0
"""


def logs(run_id: str, store: Store, inventory: "Inventory", follow: bool = False, n: int = 50,
         poll: float = POLL_SECONDS, host: str | None = None,
         stop: Callable[[], bool] | None = None, since: int | None = None) -> Iterator[str]:
    """The last ``n`` lines of the run's trainer.log; with ``follow``, then what is
    appended, until the trainer has ended, the caller stops iterating, or ``stop()``
    says so (checked at every poll: a log that grows no more never yields, so a
    caller in a thread could not stop it otherwise). A multi-host run: every host's
    log, each line prefixed with ``[host]``, or only ``host``'s (unprefixed).
    ``since``: a byte offset of a one-host log (``log_before``'s ``end``): what
    follows it, instead of the last ``n`` lines."""
    run = store.get_run(run_id)
    parts = run.parts()
    if host is not None:
        parts = [p for p in parts if p.host == host]
        if not parts:
            from dflashctl.core.errors import ConfigError

            raise ConfigError(f"run {run.id} has no process on host '{host}'",
                              hint=f"its hosts: {', '.join(run.host_names)}")
    prefix = len(parts) > 1
    readers = [(p, host_transport(p.host, inventory)) for p in parts]
    offsets, ended = [-1 if since is None else int(since)] * len(readers), [False] * len(readers)
    while True:
        for i, (part, transport) in enumerate(readers):
            if ended[i]:  # (follow only: without it there is one pass)
                continue
            answer = transport.run(["sh", "-c", _READ_LOG, "dflashctl-logs", posixpath_join(part.run_dir, contract.LOG_FILE),
                                    str(offsets[i]), str(int(n)), posixpath_join(part.run_dir, contract.EXIT_CODE_FILE)])
            head, _, text = answer.stdout.partition("\n")
            size, done = (int(x) for x in head.split())
            if text:
                yield "".join(f"[{part.host}] {line}" for line in text.splitlines(keepends=True)) if prefix else text
            # Nothing more will come once the exit code is written and the log has been read.
            ended[i] = bool(done) and offsets[i] == size
            offsets[i] = size
        if not follow or all(ended) or (stop is not None and stop()):
            return
        time.sleep(poll)


# The lines of $1 that end at or before byte $2 (-1: its size), from at most $3
# bytes before it, at most $4 of them; a line cut by the $3 bound is left out (read
# from one byte earlier: a line starting exactly there is kept). First line: the
# size, that end, and how many bytes follow. Seeks: a huge log costs $3, not its size.
_READ_LOG_BEFORE = r"""
f=$1; end=$2; max=$3; n=$4
size=$(wc -c < "$f" 2>/dev/null || echo 0); size=$(echo $size)
if [ "$end" -lt 0 ] || [ "$end" -gt "$size" ]; then end=$size; fi
lo=$((end - max)); [ "$lo" -lt 0 ] && lo=0
part() {
  if [ "$lo" -gt 0 ]; then tail -c +"$lo" "$f" | head -c "$((end - lo + 1))" | sed 1d
  elif [ "$end" -gt 0 ]; then head -c "$end" "$f"; fi | tail -n "$n"
}
echo "$size $end $(part | wc -c)"
part
exit 0
"""


@dataclass(frozen=True)
class LogSlice:
    """Lines of a trainer.log: the bytes ``start``..``end`` of it."""

    start: int
    end: int
    text: str
    cut: bool = False  # a line longer than the bound stopped the read (nothing earlier is read)


def log_before(run_id: str, store: Store, inventory: "Inventory", end: int | None = None, *,
               max_bytes: int = 1 << 20, max_lines: int = 2000) -> LogSlice:
    """The lines of a one-host run's trainer.log before byte ``end`` (None: its end
    now): at most ``max_lines`` of them, from at most ``max_bytes`` back, so a huge
    log costs one bounded read. ``start == 0``: the log's first line is in it."""
    run = store.get_run(run_id)
    if run.hosts:
        from dflashctl.core.errors import ConfigError

        raise ConfigError(f"run {run.id} runs on {len(run.hosts)} hosts: earlier lines are read one host at a time",
                          hint=f"dflashctl logs {run.id} --host HOST -n N")
    answer = host_transport(run.host, inventory).run(
        ["sh", "-c", _READ_LOG_BEFORE, "dflashctl-log-before", posixpath_join(run.run_dir, contract.LOG_FILE),
         str(-1 if end is None else int(end)), str(int(max_bytes)), str(int(max_lines))])
    head, _, text = answer.stdout_bytes.partition(b"\n")
    size, last, count = (int(x) for x in head.split())
    start = last - count
    return LogSlice(start, last, text.decode("utf-8", errors="replace"), cut=count == 0 and start > 0)


# --------------------------------------------------------------------------- evaluation

EVAL_FILE = "eval.json"  # the trainer's report, rewritten after every prompt (complete: false until the last)
EVAL_LOG = "eval.log"  # its progress lines and errors
EVAL_EXIT = "eval.exit"  # its exit status, once it has ended
EVAL_POLL_SECONDS = 2.0


def eval_session(run: Run) -> str:
    return f"{run.tmux_session or run.id}-eval"


def eval_argv(run: Run, settings: "EvalSettings", python: str) -> list[str]:
    """argv running ``python -m trainer eval`` in the run directory on its host, with
    the run's own environment (bundle on PYTHONPATH, its GPUs): the report goes to
    eval.json (after every prompt), progress to eval.log, the exit status to eval.exit."""
    env = [f"{k}={v}" for k, v in (run.config.get("env") or {}).items()]
    trainer = [*shlex.split(python), "-m", "trainer", "eval", run.run_dir, "--json", "--out", EVAL_FILE,
               "--prompts", str(settings.prompts), "--max-new-tokens", str(settings.max_new_tokens),
               "--temperature", repr(float(settings.temperature)),
               # The trainer stops itself in time, with the report of the prompts it measured.
               "--timeout", repr(eval_budget(float(settings.timeout)))]
    if settings.data:
        trainer += ["--data", settings.data]
    if settings.threads:
        trainer += ["--threads", str(settings.threads)]
    script = (f'cd "$1" && shift && rm -f {EVAL_FILE} {EVAL_EXIT} && '
              f'{{ env "$@" > /dev/null 2> {EVAL_LOG}; echo $? > {EVAL_EXIT}.tmp && mv -f {EVAL_EXIT}.tmp {EVAL_EXIT}; }}')
    return ["sh", "-c", script, "dflashctl-eval", run.run_dir, *env, *trainer]


def eval_budget(timeout: float) -> float:
    """The trainer's own budget inside the controller's ``timeout``: room left for its
    last prompt (it begins none past its budget) and for loading the models."""
    return max(1.0, 0.8 * timeout - 5.0)


# One round trip: the exit status (or '-'), then the report so far (or nothing).
_READ_EVAL = f'cd "$1" && {{ cat {EVAL_EXIT} 2>/dev/null || echo -; }} && cat {EVAL_FILE} 2>/dev/null; exit 0'


def _read_eval(transport: "Transport", run: Run) -> tuple[int | None, dict[str, Any] | None]:
    """(the eval's exit status, None while it runs; the report it wrote last, if any)."""
    answer = transport.run(["sh", "-c", _READ_EVAL, "dflashctl-eval", run.run_dir], timeout=30, check=False)
    head, _, text = answer.stdout.partition("\n")
    code = int(head) if head.strip().lstrip("-").isdigit() else None
    return code, _json_report(text)


def _prompt_line(report: dict[str, Any], row: dict[str, Any]) -> str:
    speed = (report.get("speed") or {}).get("speedup")
    return (f"prompt {row.get('index', 0) + 1}/{report.get('prompts_planned')}: tau {_two(row.get('tau'))}, "
            f"{row.get('new_tokens')} tokens in {row.get('target_forwards')} target forwards; so far tau "
            f"{_two(report.get('tau'))}" + (f", {speed:.2f}x greedy" if isinstance(speed, (int, float)) else ""))


def eval_run(run_id: str, store: Store, inventory: "Inventory", settings: "EvalSettings",
             progress: Progress | None = None, *, clock: Callable[[], float] = time.time,
             poll: float = EVAL_POLL_SECONDS) -> dict[str, Any]:
    """Evaluate the run's drafter (its newest checkpoint) with real speculative decoding
    on its host, in a tmux session beside the run's: each prompt is said as it is
    measured and the report so far stored with the run, so a timeout or Ctrl-C keeps
    what was measured. Returns the report (``complete`` false when it ended early)."""
    say = progress or quiet
    run = store.get_run(run_id)
    transport = host_transport(run.host, inventory)
    tmux = part_tmux(run, inventory)
    python = run.config.get("python") or transport.host.python
    session = eval_session(run)
    say("eval", f"speculative decoding with {run.id}'s drafter on {run.host} ({settings.prompts} prompts, "
        f"{settings.max_new_tokens} new tokens each, budget {settings.timeout:.0f}s; tmux session {session})")
    tmux.kill(session)
    tmux.start(session, shlex.join(eval_argv(run, settings, python)))
    deadline = time.monotonic() + float(settings.timeout) + 10.0
    row: int | None = None
    report: dict[str, Any] | None = None
    seen, code, stopped = 0, None, None

    def keep(latest: dict[str, Any] | None, tell: Progress) -> None:
        """Store a newer report, then say its new prompts (stored first: a Ctrl-C may
        come while they are said)."""
        nonlocal row, report, seen
        if not latest or not latest.get("prompts") or latest == report:
            return
        new = (latest.get("per_prompt") or [])[seen:]
        report, seen = latest, int(latest.get("prompts") or 0)
        if row is None:
            row = store.add_eval(run.id, clock(), report=report)
        else:
            store.update_eval(row, clock(), report=report)
        for measured in new:
            tell("eval", _prompt_line(latest, measured))

    try:
        while True:
            code, latest = _read_eval(transport, run)
            keep(latest, say)
            if code is not None:
                break
            if time.monotonic() > deadline:
                stopped = "timeout"
                break
            if not tmux.has_session(session):  # ended without writing its exit status: killed
                code, latest = _read_eval(transport, run)
                keep(latest, say)
                break
            time.sleep(poll)
    except KeyboardInterrupt:
        stopped = "interrupted"
    if code is None:
        tmux.kill(session)
        keep(_read_eval(transport, run)[1], say if stopped != "interrupted" else quiet)  # written since the last look
    if stopped or code is None or code != 0 or not (report or {}).get("complete", False):
        if report and report.get("prompts"):
            report = {**report, "complete": False, "stopped": report.get("stopped") or stopped or f"exit {code}"}
            store.update_eval(row, clock(), report=report)
        else:
            tail = _eval_log_tail(transport, run)
            error = (f"the evaluation {'failed (exit ' + str(code) + ')' if code else stopped or 'ended'} before its "
                     f"first prompt: {tail.splitlines()[-1] if tail else 'no output'}")
            store.add_eval(run.id, clock(), error=error)
            store.add_event(run.id, "eval", error, clock(), "warning", {"stderr_tail": tail})
            if stopped == "interrupted":
                raise KeyboardInterrupt
            raise LaunchError(error, hint=f"its log: {posixpath_join(run.run_dir, EVAL_LOG)} on {run.host}; by hand: "
                              f"cd {shlex.quote(run.run_dir)} && "
                              f"{shlex.join([*shlex.split(python), '-m', 'trainer', 'eval', run.run_dir])}")
    speed = report.get("speed") or {}
    partial = "" if report.get("complete", True) else \
        f" (partial: {report.get('prompts')} of {report.get('prompts_planned')} prompts, {report.get('stopped')})"
    tau, tau_est = report.get("tau"), contract.tau_estimate((report.get("training") or {}).get("accept_len"))
    summary = (f"measured tau {_two(tau)} (τ est {_two(tau_est)}, accept_len + 1) at step {report.get('step')}{partial}"
               + (f", {speed['speedup']:.2f}x greedy decoding" if isinstance(speed.get("speedup"), (int, float))
                  else "")
               + (", output identical to greedy" if report.get("greedy_identical") else ""))
    gap = contract.tau_gap(tau_est, tau if isinstance(tau, (int, float)) else None)
    if gap:
        summary += f"; {gap}"
    store.add_event(run.id, "eval", summary, clock(), "info" if report.get("complete", True) else "warning",
                    {k: report.get(k) for k in ("tau", "step", "tokens_per_target_forward", "greedy_identical",
                                                "prompts", "prompts_planned", "stopped")})
    say("eval", summary)
    if stopped == "interrupted":
        raise KeyboardInterrupt
    return report


def _eval_log_tail(transport: "Transport", run: Run) -> str:
    answer = transport.run(["tail", "-n", "20", posixpath_join(run.run_dir, EVAL_LOG)], timeout=30, check=False)
    return answer.stdout.strip()[-500:]


def _two(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, (int, float)) else "n/a"


def _json_report(text: str) -> dict[str, Any] | None:
    try:
        value = contract.load_json_object(text, "the evaluation report")
    except contract.ContractError:
        return None
    return value


# --------------------------------------------------------------------------- metrics, read on demand

def metrics_tail(run_id: str, store: Store, inventory: "Inventory", n: int = 50) -> list[contract.Metrics]:
    """The run's last ``n`` metrics lines, read on its host now (with every field the
    trainer wrote, which samples in the store do not keep); bad lines skipped."""
    run = store.get_run(run_id)
    transport = host_transport(run.host, inventory)
    path = posixpath_join(run.run_dir, contract.METRICS_FILE)
    # A file not (yet) there is an answer, not tail's error text: the trainer writes it from its first log interval.
    result = transport.run(["sh", "-c", '[ -e "$2" ] || { echo absent; exit 3; }; tail -n "$1" "$2"', "dflashctl-tail",
                            str(int(n)), path], timeout=30, check=False)
    if result.exit_code == 3 and result.stdout.strip() == "absent":
        raise LaunchError(f"run {run.id} has no metrics yet: {path} is not on {run.host}",
                          hint="the trainer writes a line every train.log_every steps once it trains: "
                               f"`dflashctl logs {run.id}` shows how far it got")
    if result.exit_code != 0:
        raise LaunchError(f"cannot read {path} on {run.host}: {(result.stderr or result.stdout).strip()[-200:]}")
    from dflashctl.hosts.parsers import read_metrics_chunk

    return read_metrics_chunk(result.stdout).rows
