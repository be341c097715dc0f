"""Launch, stop, restart and follow runs.

``launch`` does, in order (each step reported through ``progress``):

    preflight   env-audit findings; errors block unless force
    bundle      build the trainer bundle (content hash)
    connect     the run host's transport (jump hosts, container wrapper)
    gpus        which physical GPUs the run needs; refuse ones that nvidia-smi shows
                busy (memory in use or compute processes) unless force
    deploy      the bundle into <workdir>/bundles/<hash>/ (one check round trip;
                nothing sent if it is there); also resolves the workdir
    record      the run in the store, state ``launching``; the GPU claim against
                other active runs on the host is checked in the same transaction
    configure   <workdir>/runs/<run_id>/ with config.json and run.sh
    start       tmux session <run_id> running run.sh
    wait        status.json shows the trainer started -> state ``running``

``dry_run`` prints every step and remote command instead of doing it (it builds
the bundle locally to show its hash, and touches neither the host nor the store).

``run.sh`` is the whole process contract on the host: it exports the environment
(PYTHONPATH = the bundle, TORCHINDUCTOR_CACHE_DIR = the persistent compile cache,
UTF-8 locale, unbuffered output, CUDA_VISIBLE_DEVICES when the run owns GPUs, the
host's and the playbook's env), removes the previous process's status.json and
exit_code, runs ``python -m trainer --config config.json --run-dir DIR --resume
auto`` with its output appended to trainer.log, and writes the exit status to
``exit_code`` when the trainer ends, whatever way it ends. A restart runs the
same script again in the same run directory: the trainer resumes from its last
checkpoint and the compile cache is still warm.

Placement GPU indices in a playbook are physical (as nvidia-smi numbers them).
When the run owns GPUs, CUDA_VISIBLE_DEVICES is set to exactly those and the
placement written to config.json is renumbered to match, so the trainer cannot
touch (or create a stray CUDA context on) another run's GPU. The store records
the physical indices (``config["gpus"]``).
"""

from __future__ import annotations

import copy
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

from dflashctl import contract, deploy
from dflashctl.bundle import Bundle, build_bundle
from dflashctl.detectors import fmt_duration, fmt_tok_s
from dflashctl.errors import DflashError, TransportError, first_line
from dflashctl.store import (
    DONE, FAILED, FINAL_STATES, LAUNCHING, RESTARTING, RUNNING, STOPPED, TRANSITIONS, Run, Store, new_run_id,
)
from dflashctl.tmux import Tmux, socket_name

if TYPE_CHECKING:
    from dflashctl.config import Host, Inventory, Playbook
    from dflashctl.detectors import Finding
    from dflashctl.probe import HostProbe, ProbeResult
    from dflashctl.transport import Transport

RUN_SCRIPT = "run.sh"
# A GPU with more memory in use than this is busy (an idle H200 shows 0 MiB; a bare
# CUDA context takes ~500 MiB).
BUSY_MEMORY_MIB = 256
START_TIMEOUT = 120.0  # launch waits this long (at most) for the trainer's first status
STOP_TIMEOUT = 120.0  # a graceful stop waits this long for the checkpoint before killing
POLL_SECONDS = 1.0

Progress = Callable[[str, str], None]


def _quiet(step: str, message: str) -> None:
    pass


class LaunchError(DflashError):
    """The run could not be started (nothing was left running)."""


# --------------------------------------------------------------------------- preflight


def environment_drift(store: Store, run: Run) -> "Finding | None":
    """The host's package set now (the preflight's snapshot) against the one recorded
    when the last good run of the same playbook on the same host was launched."""
    from dflashctl.detectors import env_drift

    snapshots = store.env_snapshots(run.host, limit=50)
    if not snapshots:
        return None
    good = next((r for r in store.list_runs(playbook=run.playbook, host=run.host, limit=20)
                 if r.id != run.id and r.state in (DONE, STOPPED, RUNNING)), None)
    if good is None:
        return None
    # The snapshot its launch took: the newest one not after it was recorded.
    before = next((s for s in snapshots if s["time"] <= good.created), None)
    if before is None or before["id"] == snapshots[0]["id"]:
        return None
    return env_drift(before["data"], snapshots[0]["data"])


class LaunchInterrupted(DflashError):
    """Ctrl-C after the run was started: it goes on; the message says how to reach it."""

    exit_code = 130


def preflight(playbook: "Playbook", inventory: "Inventory", store: Store | None = None) -> list[Any]:
    """Environment audit of the run host before a launch: a list of findings, each
    with a ``severity`` ('info' | 'warning' | 'error' | 'critical') and a
    ``message``. Errors block the launch unless forced. With a store, the host's
    package set is recorded for drift checks (see dflashctl.envaudit)."""
    from dflashctl.envaudit import preflight as audit_preflight

    return audit_preflight(playbook, inventory, store)


def _field(finding: Any, name: str, default: Any = None) -> Any:
    return finding.get(name, default) if isinstance(finding, dict) else getattr(finding, name, default)


def blocking_findings(findings: list[Any]) -> list[Any]:
    return [f for f in findings if _field(f, "severity") in ("error", "critical")]


# --------------------------------------------------------------------------- pure helpers


def wanted_gpus(trainer: dict[str, Any]) -> list[int]:
    """Physical GPU indices a trainer config asks for (none on CPU)."""
    placement = trainer.get("placement", {})
    if placement.get("device") == "cpu":
        return []
    return sorted({int(g) for g in [*placement.get("target", []), *placement.get("drafter", [])]})


def renumber_placement(trainer: dict[str, Any], gpus: list[int]) -> dict[str, Any]:
    """The trainer config as seen under CUDA_VISIBLE_DEVICES=gpus (indices become positions)."""
    out = copy.deepcopy(trainer)
    position = {g: i for i, g in enumerate(gpus)}
    for role in ("target", "drafter"):
        out["placement"][role] = [position[int(g)] for g in out["placement"][role]]
    return out


def busy_gpus(probe: "HostProbe", gpus: list[int]) -> dict[int, str]:
    """GPU index -> why it is busy, for the wanted GPUs that nvidia-smi shows in use
    or does not show at all."""
    readings = {r.index: r for r in probe.gpus or []}
    apps_by_uuid: dict[str, list] = {}
    for app in probe.compute_apps or []:
        apps_by_uuid.setdefault(app.gpu_uuid, []).append(app)
    busy = {}
    for gpu in gpus:
        reading = readings.get(gpu)
        if reading is None:
            busy[gpu] = f"not present (nvidia-smi shows {len(readings)} GPU(s))"
            continue
        apps = apps_by_uuid.get(reading.uuid, [])
        if apps:
            listed = ", ".join(f"pid {a.pid} {a.process_name or '?'} {a.used_memory_mib or 0:.0f} MiB" for a in apps)
            busy[gpu] = f"compute processes: {listed}"
        elif (reading.memory_used_mib or 0) > BUSY_MEMORY_MIB:
            busy[gpu] = f"{reading.memory_used_mib:.0f} MiB in use"
    return busy


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
                      compile_cache: str | None, session: str, socket: str) -> str:
    """run.sh: see the module docstring."""
    lines = [
        "#!/bin/sh",
        f"# dflashctl run {run_id}: runs in tmux session {session} (tmux -L {socket}).",
        "# Rewritten on every (re)start by dflashctl; edits here are lost.",
        f"cd {shlex.quote(run_dir)} || exit 1",
    ]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    if compile_cache:
        # Persistent and never cleared: a restart must find the compiled kernels.
        lines += [f"export TORCHINDUCTOR_CACHE_DIR={_remote_path_expr(compile_cache)}",
                  'mkdir -p "$TORCHINDUCTOR_CACHE_DIR"']
    trainer = shlex.join([*shlex.split(python), "-m", "trainer", "--config", contract.CONFIG_FILE,
                          "--run-dir", run_dir, "--resume", "auto"])
    ec, tmp = contract.EXIT_CODE_FILE, contract.EXIT_CODE_FILE + ".tmp"
    lines += [
        # The previous process's answers must not be read as this one's.
        f"rm -f {ec} {contract.STATUS_FILE}",
        "{",
        # Caught here (so the exit code is still written), reset to default for the
        # trainer, which handles SIGINT/SIGTERM itself (checkpoint, exit 4).
        "  trap : INT TERM HUP",
        f"  {trainer} 2>&1",
        f"  echo $? > {tmp} && mv -f {tmp} {ec}",
        # tee -i: a Ctrl-C for the trainer must not kill the log writer first.
        f"}} | tee -i -a {contract.LOG_FILE}",
        "",
    ]
    return "\n".join(lines)


def format_metrics(m: contract.Metrics) -> str:
    parts = [f"step {m.step}/{m.total_steps}", m.phase]
    if m.tok_s is not None:
        parts.append(fmt_tok_s(m.tok_s))
    if m.loss is not None:
        parts.append(f"loss {m.loss:.4f}")
    if m.acc is not None:
        parts.append(f"acc {m.acc:.3f}")
    if m.accept_len is not None:
        parts.append(f"accept {m.accept_len:.2f}")
    if m.eta_s is not None:
        parts.append(f"ETA {fmt_duration(m.eta_s)}")
    return "  ".join(parts)


def final_state_for(exit_code: int | None) -> str:
    if exit_code == contract.EXIT_DONE:
        return DONE
    if exit_code == contract.EXIT_STOPPED:
        return STOPPED
    return FAILED


def _show(argv: list[str], stdin_bytes: int | None = None) -> str:
    text = shlex.join(argv)
    return text + (f"  < {stdin_bytes} bytes on stdin" if stdin_bytes else "")


# --------------------------------------------------------------------------- host access


def _transport(host_name: str, inventory: "Inventory") -> "Transport":
    from dflashctl.transport import connect

    return connect(host_name, inventory)


def probe_run(transport: "Transport", run: Run, *, offset: int = 0, inode: int | None = None,
              timeout: float | None = None) -> "ProbeResult":
    """One probe round trip for one run (no nvidia-smi)."""
    from dflashctl.probe import ProbeArgs, ProbeError, parse_probe_host, probe_command

    args = ProbeArgs(run_dir=run.run_dir, session=run.tmux_session, socket=run.tmux_socket or socket_name(),
                     metrics_offset=offset, metrics_inode=inode, nvidia_smi=False, pane_lines=40)
    result = transport.run(probe_command(transport.host.python, [args]), timeout=timeout or 30)
    host = parse_probe_host(result.stdout)
    if isinstance(host, ProbeError):
        raise TransportError(transport.host.name, "probe", host.message, stderr_tail=host.output_tail)
    return host.runs[0]


def gpu_probe_argv(python: str) -> list[str]:
    """The probe asked for nvidia-smi only (no runs)."""
    from dflashctl.probe import probe_command

    return probe_command(python, [], nvidia_smi=True)


def probe_gpus(transport: "Transport") -> "HostProbe":
    from dflashctl.probe import ProbeError, parse_probe_host

    result = transport.run(gpu_probe_argv(transport.host.python), timeout=60)
    host = parse_probe_host(result.stdout)
    if isinstance(host, ProbeError):
        raise TransportError(transport.host.name, "nvidia-smi probe", host.message, stderr_tail=host.output_tail)
    return host


def _started(probe: "ProbeResult") -> bool:
    return probe.status is not None and probe.status.phase in contract.PHASES


def _ended(probe: "ProbeResult") -> bool:
    return probe.exit_code is not None or probe.session_alive is False


# --------------------------------------------------------------------------- launch


@dataclass
class LaunchResult:
    run_id: str
    state: str
    host: str
    run_dir: str | None
    session: str
    deploy: dict[str, Any] | None = None
    findings: list[Any] = field(default_factory=list)
    dry_run: bool = False


class _Launcher:
    def __init__(self, playbook, inventory, store, force, dry_run, progress, clock, start_timeout, bundle):
        self.bundle = bundle
        self.playbook = playbook
        self.inventory = inventory
        self.store = store
        self.force = force
        self.dry_run = dry_run
        self.say = progress or _quiet
        self.clock = clock
        self.host = inventory.get(playbook.host)
        self.socket = socket_name()
        self.start_timeout = start_timeout
        self.transport: Transport | None = None

    def show_remote(self, step: str, argv: list[str], input: bytes | None = None) -> None:
        """In a dry run: say exactly what would run on the host."""
        self.say(step, f"would run on {self.host.name}: {_show(argv, len(input) if input else None)}")

    def _preflight_verdict(self, findings: list) -> None:
        blocking = blocking_findings(findings)
        for f in findings:
            self.say("preflight", f"{_field(f, 'severity')}: {_field(f, 'message', f)}")
        if blocking and not self.force:
            raise LaunchError(
                f"env-audit found {len(blocking)} error(s) on {self.host.name}; not launching",
                hint=f"see `dflashctl env-audit {self.playbook.name}`; fix them, or pass --force to launch anyway",
            )
        self.say("preflight", f"{len(findings)} finding(s)" + (" (forced past errors)" if blocking else ""))

    def run(self) -> LaunchResult:
        pb, host = self.playbook, self.host
        if self.dry_run:  # the audit is a remote command too: shown, not run
            from dflashctl.envaudit import audit_command

            argv = audit_command(host)
            self.say("preflight", f"would run on {host.name}: {_show(argv[:-1])} '<env-audit script, "
                                  f"{len(argv[-1])} bytes>'")
            self.say("preflight", f"not run (dry run): `dflashctl env-audit {pb.name}` shows what it finds")
            findings = []
        else:
            findings = preflight(pb, self.inventory, self.store)
            self._preflight_verdict(findings)

        bundle = self.bundle or build_bundle()
        self.say("bundle", f"trainer bundle {bundle.short} ({bundle.size} bytes, {len(bundle.files)} files)")

        if not self.dry_run:
            self.transport = _transport(host.name, self.inventory)
        self.say("connect", f"{host.name} via {_route(host.name, self.inventory)}")

        trainer = pb.trainer.to_dict()
        gpus = self._check_gpus(wanted_gpus(trainer))

        now = self.clock()
        run_id = new_run_id(pb.name, now)
        if self.dry_run:
            workdir = host.workdir  # '~' is expanded on the host
            self.show_remote("deploy", deploy.check_argv(workdir, bundle.hash))
            self.show_remote("deploy", deploy.receive_argv(workdir, bundle), bundle.data)
            self.say("deploy", "(the upload is skipped when the bundle is already complete on the host)")
        else:
            # First, so a cut connection leaves no run behind; the check also resolves the workdir.
            result = deploy.deploy_bundle(self.transport, bundle, host.workdir)
            workdir = result.workdir
            self.say("deploy", f"bundle {bundle.short} {result.status} ({result.bytes_sent} bytes sent)"
                     + (f"; removed {result.cleaned_temp_dirs} stale upload(s)" if result.cleaned_temp_dirs else ""))
        run_dir = deploy.run_dir(workdir, run_id)
        env = run_environment(host, pb.env, deploy.bundle_dir(workdir, bundle.hash), gpus)
        config = self._run_config(trainer, gpus, run_dir, workdir, env)

        if self.dry_run:
            self.say("record", f"would record run {run_id} (state launching, GPUs {gpus or 'none'})")
            self._configure(run_id, run_dir, config)
            self._start(run_id, run_dir)
            return LaunchResult(run_id, "dry-run", host.name, run_dir, run_id, dry_run=True, findings=findings)

        run = self.store.create_run(
            pb.name, host.name, config, now, run_id=run_id, bundle_hash=bundle.hash, run_dir=run_dir,
            tmux_session=run_id, tmux_socket=self.socket, claim_gpus=not self.force,
            message=f"launch of playbook {pb.name} on {host.name}" + (" (forced)" if self.force else ""),
        )
        self.store.add_event(run_id, "deploy", f"bundle {bundle.short} {result.status}", self.clock(),
                             detail=result.to_dict())
        self.say("record", f"run {run.id} (GPUs {', '.join(map(str, gpus)) or 'none'})")
        drift = environment_drift(self.store, run)
        if drift is not None:
            self.store.add_event(run.id, drift.kind, drift.message, self.clock(), severity=drift.severity,
                                 detail=drift.detail)
            self.say("preflight", f"warning: {drift.message}")
        try:
            self._configure(run_id, run_dir, config)
            self._start(run_id, run_dir)
        except BaseException as e:
            self.store.transition(run_id, FAILED, f"launch failed: {first_line(e)}", self.clock(),
                                  exit_reason="launch failed")
            raise
        try:
            state = wait_started(self.store, self.store.get_run(run_id), self.transport, self.start_timeout,
                                 self.clock, self.say)
        except KeyboardInterrupt:
            self.store.add_event(run_id, "startup", "launch interrupted while waiting for the trainer to start",
                                 self.clock(), severity="warning")
            raise LaunchInterrupted(
                f"interrupted: run {run_id} was started on {host.name} and goes on, unsupervised",
                hint=f"`dflashctl watch {run_id}` supervises it; `dflashctl stop {run_id}` stops it",
            ) from None
        except DflashError as e:
            # The session is started; whether the trainer came up is the supervisor's to see.
            self.store.add_event(run_id, "startup", f"could not confirm the start: {first_line(e)}",
                                 self.clock(), severity="warning")
            self.say("wait", f"warning: could not confirm the start ({first_line(e)})")
            state = LAUNCHING
        return LaunchResult(run_id, state, host.name, run_dir, run_id, deploy=result.to_dict(), findings=findings)

    def _check_gpus(self, wanted: list[int]) -> list[int]:
        device = self.playbook.trainer.placement.device
        if not wanted:
            self.say("gpus", "none needed (CPU run)")
            return []
        if self.dry_run:
            argv = gpu_probe_argv(self.host.python)
            self.say("gpus", f"would check GPUs {wanted} with nvidia-smi through the probe: "
                     f"{_show(argv[:3])} <probe script> {argv[-1]}")
            return wanted
        probe = probe_gpus(self.transport)
        if probe.gpus is None:
            smi_error = next((e for e in probe.errors if "nvidia-smi" in e), "nvidia-smi gave no answer")
            if device == "auto" and not self.host.gpus and "not found" in smi_error:
                self.say("gpus", "no nvidia-smi on the host: the trainer will run on CPU")
                return []
            if not self.force:
                raise LaunchError(f"{self.host.name}: cannot check GPUs {wanted}: {smi_error}",
                                  hint="fix nvidia-smi on the host, or pass --force to launch without the check")
            self.say("gpus", f"warning: cannot check GPUs ({smi_error}); forced")
            return wanted
        busy = busy_gpus(probe, wanted)
        if busy and not self.force:
            listed = "; ".join(f"GPU {g}: {why}" for g, why in sorted(busy.items()))
            raise LaunchError(f"{self.host.name}: GPUs busy: {listed}",
                              hint="wait for them, change trainer.placement, or pass --force")
        self.say("gpus", f"GPUs {wanted} free" if not busy else f"GPUs {sorted(busy)} busy; forced")
        return wanted

    def _run_config(self, trainer, gpus, run_dir, workdir, env) -> dict[str, Any]:
        pb = self.playbook
        trainer = copy.deepcopy(trainer)
        trainer["run_dir"] = run_dir
        if pb.compile_cache and not trainer["compile"].get("cache_dir"):
            trainer["compile"]["cache_dir"] = pb.compile_cache
        return {
            "trainer": trainer,  # as in the playbook (physical GPU indices)
            "gpus": gpus,
            "env": env,
            "compile_cache": pb.compile_cache,
            "python": self.host.python,
            "workdir": workdir,
            "playbook_source": pb.source,
            "forced": self.force,
        }

    def _configure(self, run_id: str, run_dir: str, config: dict[str, Any]) -> None:
        files = run_files(run_id, run_dir, config, self.socket)
        if self.dry_run:
            self.show_remote("configure", deploy.run_files_argv(run_dir), deploy.tar_of(files))
            self.say("configure", f"{RUN_SCRIPT}:\n" + files[RUN_SCRIPT])
            return
        deploy.write_run_files(self.transport, run_dir, files)
        self.say("configure", f"{run_dir}: {', '.join(sorted(files))}")

    def _start(self, run_id: str, run_dir: str) -> None:
        command = start_command(run_dir)
        if self.dry_run:
            self.say("start", f"would start tmux session {run_id} on {self.host.name} (tmux -L {self.socket}) "
                     f"running: {command}")
            return
        Tmux(self.host, self.inventory, self.socket).start(run_id, command)
        self.say("start", f"tmux session {run_id} (tmux -L {self.socket})")


def _route(host_name: str, inventory: "Inventory") -> str:
    from dflashctl.transport import describe_route

    return describe_route(inventory.route(host_name))


def run_files(run_id: str, run_dir: str, config: dict[str, Any], socket: str,
              serialized_warmup: bool | None = None) -> dict[str, str]:
    """config.json and run.sh for a run, from its stored config."""
    trainer = copy.deepcopy(config["trainer"])
    if serialized_warmup is not None:
        trainer["compile"]["serialized_warmup"] = serialized_warmup
    gpus = config.get("gpus") or []
    if gpus and "CUDA_VISIBLE_DEVICES" in config.get("env", {}) and \
            config["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, gpus)):
        trainer = renumber_placement(trainer, gpus)
    script = render_run_script(run_id, run_dir, config["python"], config.get("env", {}),
                               config.get("compile_cache"), run_id, socket)
    return {contract.CONFIG_FILE: deploy.config_json(trainer), RUN_SCRIPT: script}


def start_command(run_dir: str) -> str:
    return shlex.join(["sh", posixpath_join(run_dir, RUN_SCRIPT)])


def posixpath_join(*parts: str) -> str:
    import posixpath

    return posixpath.join(*parts)


def wait_started(store: Store, run: Run, transport: "Transport", timeout: float,
                 clock: Callable[[], float] = time.time, progress: Progress | None = None) -> str:
    """Wait until status.json shows the trainer started (-> ``running``), or it ended
    (-> ``failed`` / ``done`` / ``stopped``), at most ``timeout`` seconds. Still
    nothing: the run stays in its state and the supervisor takes over."""
    say = progress or _quiet
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


def launch(playbook: "Playbook", inventory: "Inventory", store: Store, force: bool = False,
           dry_run: bool = False, progress: Progress | None = None, *, clock: Callable[[], float] = time.time,
           start_timeout: float | None = None, bundle: Bundle | None = None) -> str:
    """Launch a playbook's run; returns the run id (see the module docstring)."""
    return launch_run(playbook, inventory, store, force, dry_run, progress, clock=clock,
                      start_timeout=start_timeout, bundle=bundle).run_id


def launch_run(playbook: "Playbook", inventory: "Inventory", store: Store, force: bool = False,
               dry_run: bool = False, progress: Progress | None = None, *, clock: Callable[[], float] = time.time,
               start_timeout: float | None = None, bundle: Bundle | None = None) -> LaunchResult:
    """``launch`` with the details (state reached, deploy result, findings). ``bundle``:
    a bundle already built (default: built now from this checkout)."""
    timeout = start_timeout if start_timeout is not None else min(START_TIMEOUT, playbook.expect.startup_budget)
    return _Launcher(playbook, inventory, store, force, dry_run, progress, clock, timeout, bundle).run()


# --------------------------------------------------------------------------- stop


# The trainer named in status.json, but only while that pid really is this run's
# trainer (pids are reused): `ours` is true while it lives.
_TRAINER_PID = r"""
d=$1
pid=$(sed -n 's/.*"pid": *\([0-9][0-9]*\).*/\1/p' "$d/status.json" 2>/dev/null | head -n 1)
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


def signal_trainer_argv(run_dir: str, signal_name: str = "TERM") -> list[str]:
    return ["sh", "-c", _SIGNAL_TRAINER, "dflashctl-signal", run_dir, signal_name]


def stop_supervisor(run: Run, inventory: "Inventory") -> None:
    """End the run's supervisor session (so it does not restart what is being stopped)."""
    info = run.supervisor or {}
    if info.get("kind") != "tmux" or not info.get("session"):
        return
    try:
        Tmux(_local_host(), inventory, info.get("socket")).kill(info["session"])
    except DflashError:
        pass  # already gone


def _local_host() -> "Host":
    from dflashctl.config import Host

    return Host(name="local", transport="local")


def stop(run_id: str, store: Store, inventory: "Inventory", timeout: float = STOP_TIMEOUT,
         progress: Progress | None = None, *, clock: Callable[[], float] = time.time) -> Run:
    """Graceful stop: SIGTERM to the trainer (it checkpoints and exits 4), or Ctrl-C
    in its tmux pane when its pid cannot be signalled; wait up to ``timeout`` for it
    to exit; then kill the session. The run ends in ``stopped`` (``done`` if it
    finished meanwhile; ``failed`` if it had crashed before the stop, unseen)."""
    say = progress or _quiet
    run = store.get_run(run_id)
    host = inventory.get(run.host)
    transport = _transport(host.name, inventory)
    tmux = Tmux(host, inventory, run.tmux_socket or socket_name())
    stop_supervisor(run, inventory)
    if run.state not in FINAL_STATES:
        store.add_event(run.id, "stop_requested", "stop requested by the operator", clock())
    probe = probe_run(transport, run)
    ended_before = _ended(probe)
    if ended_before:
        say("stop", "the trainer is not running")
    else:
        answer = transport.run(signal_trainer_argv(run.run_dir), check=False)
        if answer.stdout.startswith("signalled"):
            say("stop", f"sent SIGTERM to the trainer ({answer.stdout.split()[-1]}); waiting for its checkpoint")
        else:
            tmux.send_keys(run.tmux_session, "C-c")
            say("stop", "sent Ctrl-C to the trainer's tmux pane; waiting for its checkpoint")
        deadline = time.monotonic() + timeout
        while not _ended(probe) and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
            probe = probe_run(transport, run)
    killed = False
    if probe.session_alive:
        killed = tmux.kill(run.tmux_session)
    run = store.get_run(run.id)
    if run.state in FINAL_STATES:
        say("stop", f"run {run.id} was already {run.state}")
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
    store.transition(run.id, state, f"{why}: {reason}", clock(), exit_code=code, exit_reason=reason)
    say("stop", f"run {run.id} {state} ({reason})")
    return store.get_run(run.id)


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
    compile cache. ``serialized_warmup`` sets compile.serialized_warmup in
    config.json. The run's state is the caller's business (it does not change here)."""
    say = progress or _quiet
    run = store.get_run(run_id)
    host = inventory.get(run.host)
    transport = _transport(host.name, inventory)
    socket = run.tmux_socket or socket_name()
    tmux = Tmux(host, inventory, socket)
    killed = tmux.kill(run.tmux_session)
    if killed:
        say("restart", f"killed the previous tmux session {run.tmux_session}")
    reaped = transport.run(["sh", "-c", _REAP_TRAINER, "dflashctl-reap", run.run_dir], timeout=30, check=False)
    if not reaped.ok:
        raise LaunchError(f"the previous trainer of {run.id} on {host.name} does not die "
                          f"({reaped.stdout.strip() or reaped.stderr.strip()}); not starting a second one",
                          hint="look at the process on the host (uninterruptible I/O? a stuck GPU driver?)")
    if reaped.stdout.startswith("killed"):
        say("restart", f"the previous trainer outlived its session: {reaped.stdout.strip()}")
    state = deploy.check(transport, run.config.get("workdir") or host.workdir, run.bundle_hash or "")
    redeployed = False
    config = run.config
    if state["bundle"] != "present":
        # The bundle directory was removed on the host: the current bundle replaces it.
        bundle = build_bundle()
        result = deploy.deploy_bundle(transport, bundle, state["workdir"])
        config = copy.deepcopy(run.config)
        bundle_dir = result.bundle_dir
        config["env"]["PYTHONPATH"] = ":".join([bundle_dir, *config["env"]["PYTHONPATH"].split(":")[1:]])
        store.update_run(run.id, bundle_hash=bundle.hash, config=config)
        store.add_event(run.id, "deploy", f"bundle {run.bundle_hash and run.bundle_hash[:12]} missing on the host; "
                        f"deployed {bundle.short}", clock(), severity="warning", detail=result.to_dict())
        redeployed = True
    wanted = bool(serialized_warmup) or config["trainer"]["compile"].get("serialized_warmup", True)
    files = run_files(run.id, run.run_dir, config, socket, serialized_warmup=wanted)
    # The previous process's exit code and status go before the new session starts,
    # so nobody reads them as the new process's (run.sh removes them too).
    deploy.write_run_files(transport, run.run_dir, files, remove=[contract.EXIT_CODE_FILE, contract.STATUS_FILE])
    tmux.start(run.tmux_session, start_command(run.run_dir))
    store.add_event(run.id, "process", "trainer started again (resume from the last checkpoint"
                    + (", serialized warm-up)" if serialized_warmup else ")"), clock(),
                    detail={"serialized_warmup": bool(serialized_warmup), "killed_previous": killed})
    say("restart", f"tmux session {run.tmux_session} started again")
    return RestartResult(run.id, run.tmux_session, store.get_run(run.id).bundle_hash, bool(serialized_warmup),
                         killed, redeployed)


def restart(run_id: str, store: Store, inventory: "Inventory", serialized_warmup: bool = False,
            progress: Progress | None = None, *, clock: Callable[[], float] = time.time,
            start_timeout: float = START_TIMEOUT) -> str:
    """Operator restart (``dflashctl restart``): a run still going is first stopped
    gracefully (SIGTERM: it checkpoints), then restarting -> new process -> running."""
    run = store.get_run(run_id)
    if run.state == DONE:
        raise LaunchError(f"run {run.id} is done: it finished all its steps and is not restarted",
                          hint=f"start a new run: dflashctl launch {run.playbook}")
    if run.state not in FINAL_STATES:
        (progress or _quiet)("restart", f"run {run.id} is {run.state}: stopping it first (checkpoint)")
        run = stop(run.id, store, inventory, progress=progress, clock=clock)
        if run.state == DONE:
            return run.state
    store.transition(run.id, RESTARTING, "restart requested by the operator", clock())
    try:
        restart_run(run.id, serialized_warmup, store, inventory, progress, clock=clock)
    except BaseException as e:
        store.transition(run.id, FAILED, f"restart failed: {first_line(e)}", clock(), exit_reason="restart failed")
        raise
    transport = _transport(run.host, inventory)
    return wait_started(store, store.get_run(run.id), transport, start_timeout, clock, progress)


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
         poll: float = POLL_SECONDS) -> Iterator[str]:
    """The last ``n`` lines of the run's trainer.log; with ``follow``, then what is
    appended, until the trainer has ended (or the caller stops iterating)."""
    run = store.get_run(run_id)
    transport = _transport(run.host, inventory)
    log_path = posixpath_join(run.run_dir, contract.LOG_FILE)
    ec_path = posixpath_join(run.run_dir, contract.EXIT_CODE_FILE)
    offset = -1
    while True:
        answer = transport.run(["sh", "-c", _READ_LOG, "dflashctl-logs", log_path, str(offset), str(int(n)),
                                ec_path])
        head, _, text = answer.stdout.partition("\n")
        size, ended = (int(x) for x in head.split())
        if text:
            yield text
        if not follow:
            return
        # Nothing more will come once the exit code is written and the log has been read.
        if ended and offset == size:
            return
        offset = size
        time.sleep(poll)


# --------------------------------------------------------------------------- supervision


_FORWARDED_ENV = ("DFLASHCTL_HOME", "DFLASHCTL_STORE", "DFLASHCTL_TMUX_SOCKET", "DFLASHCTL_INVENTORY",
                  "DFLASHCTL_PLAYBOOKS", "DFLASHCTL_DEBUG")


def supervisor_session(run_id: str) -> str:
    return f"watch-{run_id}"


def start_supervisor(run_id: str, foreground: bool, store: Store, inventory: "Inventory",
                     progress: Progress | None = None, *, inventory_path: str | None = None,
                     playbooks_dir: str | None = None, emit: Callable[[str], None] | None = None,
                     clock: Callable[[], float] = time.time) -> str | None:
    """Supervise a launched run.

    Background (default): ``dflashctl watch RUN`` in a local tmux session
    ``watch-<run_id>`` on the dflash socket; returns the session name.
    Foreground: the supervisor in this process until the run ends, printing its
    events and metrics lines; returns the final state."""
    say = progress or _quiet
    if foreground:
        from dflashctl.supervisor import follow

        return follow(run_id, store, inventory, emit or print, playbooks_dir=playbooks_dir)
    argv = [sys.executable, "-m", "dflashctl"]
    if inventory_path:
        argv += ["--inventory", os.path.abspath(inventory_path)]
    if playbooks_dir:
        argv += ["--playbooks", os.path.abspath(playbooks_dir)]
    argv += ["watch", run_id]
    env = [f"{k}={os.environ[k]}" for k in _FORWARDED_ENV if os.environ.get(k)]
    # The local tmux server may have been started by another process, with another
    # environment and directory: pass what the supervisor needs explicitly.
    command = shlex.join(["env", *env, *argv]) if env else shlex.join(argv)
    session = supervisor_session(run_id)
    socket = socket_name()
    tmux = Tmux(_local_host(), inventory, socket)
    tmux.kill(session)
    tmux.start(session, f"cd {shlex.quote(os.getcwd())} && exec {command}")
    store.set_supervisor(run_id, {"kind": "tmux", "host": "local", "session": session, "socket": socket,
                                  "started": clock()})
    say("supervise", f"supervisor running in local tmux session {session} (tmux -L {socket} attach -t ={session})")
    return session
