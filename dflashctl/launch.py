"""The launch flow: a playbook becomes a run started on its hosts, recorded, supervised.

``launch`` does, in order, on every host of the run (rank 0 first; most runs have
one), each step reported through ``progress``:

    preflight   env-audit findings; errors block unless force
    inputs      the data shards, model directory and free disk on the run host, in
                one read-only round trip; errors block unless force (nothing deployed)
    bundle      build the trainer bundle (content hash)
    connect     the run host's transport (jump hosts, container wrapper)
    gpus        which physical GPUs the run needs; refuse ones that nvidia-smi shows
                busy (memory in use or compute processes) unless force
    deploy      the bundle into <workdir>/bundles/<hash>/ (one check round trip;
                nothing sent if it is there); also resolves the workdir
    record      the run in the store, state ``launching``; the GPU claim against
                other active runs on the host is checked in the same transaction
    configure   <workdir>/runs/<run_id>/ with config.json and run.sh, and a held
                compile artifact that fits the run (dflashctl.runs.compile_cache)
    start       tmux session <run_id> running run.sh
    wait        status.json shows the trainer started -> state ``running``

then ``start_supervisor`` hands the run to the supervisor (a local tmux session,
or the foreground through ``dflashctl.supervise.console.follow``). A run supervised in the
foreground (``supervise_here``) is never left unsupervised by the process's end:
Ctrl-C, SIGTERM and SIGHUP (the terminal or the ssh connection closed) hand it to
a background supervisor (``HandOverSignals``).

``dry_run`` walks the same steps and prints every remote command instead of running
it: it builds the bundle locally to show its hash, only reads the hosts (the env-audit
and the inputs, read-only) and writes neither the hosts nor the store.

Placement GPU indices in a playbook are physical (as nvidia-smi numbers them);
the run files (config.json, run.sh) are ``dflashctl.runs.files``', the wait for the
trainer's first status ``dflashctl.runs.runhost``'s. What later happens to the run on
its hosts is the other run modules': stop and restart ``dflashctl.runs.runhost``, logs
``dflashctl.runs.logs``, eval ``dflashctl.runs.evaluate``.

This module never restarts, stops or signals a run (``dflashctl.runs.runhost`` does), and
the supervisor never imports it: it only starts the supervisor.
"""

from __future__ import annotations

import copy
import json
import os
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from dflashctl.core import contract
from dflashctl.core.errors import DflashError, TransportError, first_line
from dflashctl.core.states import FAILED, FINAL_STATES, LAUNCHING
from dflashctl.hosts import deploy
from dflashctl.hosts.bundle import Bundle, build_bundle
from dflashctl.hosts.facts import gpu_count_problem
from dflashctl.hosts.tmux import Tmux, socket_name
from dflashctl.runs.access import LaunchError, Progress, host_transport, local_host, quiet
from dflashctl.runs.files import RUN_SCRIPT, SECRETS_FILE, new_rendezvous_key, part_config, run_environment, run_files, start_command
from dflashctl.runs.recorded import thresholds_of
from dflashctl.runs.runhost import (
    START_TIMEOUT,
    port_check_argv,
    port_in_use_error,
    rendezvous_port_problem,
    wait_started,
)
from dflashctl.store import Run, Store, new_run_id

if TYPE_CHECKING:
    from dflashctl.config import Host, Inventory, Playbook
    from dflashctl.hosts.probe import HostProbe
    from dflashctl.hosts.transport import Transport
    from dflashctl.supervise.detectors import Finding

# A GPU with more memory in use than this is busy (an idle H200 shows 0 MiB; a bare
# CUDA context takes ~500 MiB).
BUSY_MEMORY_MIB = 256


# --------------------------------------------------------------------------- preflight


def environment_drift(store: Store, run: Run, healthy_after: float) -> "Finding | None":
    """The host's package set now (the preflight's snapshot) against the one recorded
    when the last good run of the same playbook on the same host was launched (one
    that trained for ``healthy_after`` seconds; see dflashctl.envaudit.drift)."""
    from dflashctl.envaudit import drift_since_good_run

    snapshots = store.env_snapshots(run.host, limit=1)
    if not snapshots:
        return None
    return drift_since_good_run(store, run.playbook, run.host, snapshots[0]["data"], healthy_after,
                                exclude_run=run.id)


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


def _show(argv: list[str], stdin_bytes: int | None = None) -> str:
    text = shlex.join(argv)
    return text + (f"  < {stdin_bytes} bytes on stdin" if stdin_bytes else "")


# --------------------------------------------------------------------------- GPU check


def gpu_probe_argv(python: str) -> list[str]:
    """The probe asked for nvidia-smi only (no runs)."""
    from dflashctl.hosts.probe import probe_command

    return probe_command(python, [], nvidia_smi=True)


def probe_gpus(transport: "Transport") -> "HostProbe":
    from dflashctl.hosts.probe import ProbeError, parse_probe_host
    from dflashctl.hosts.transport import limits

    result = transport.run(gpu_probe_argv(transport.host.python), timeout=60, limit=limits.probe([]))
    host = parse_probe_host(result.stdout)
    if isinstance(host, ProbeError):
        raise TransportError(transport.host.name, "nvidia-smi probe", host.message, stderr_tail=host.output_tail)
    return host


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
    blocked: int = 0  # a dry run: the errors a launch would stop at (the preflight's and the inputs')


@dataclass
class Site:
    """One host of the run, and what the launch learns of it step by step (rank 0
    first; a run on one host has one site)."""

    rank: int
    host: "Host"
    transport: "Transport | None" = None  # None in a dry run: nothing reaches the host
    gpu_readings: list = field(default_factory=list)  # nvidia-smi's answer (the compile cache's GPU name)
    deployed: Any = None  # deploy.DeployResult
    workdir: str = ""
    run_dir: str = ""
    session: str = ""
    env: dict[str, str] = field(default_factory=dict)

    def part(self) -> dict[str, Any]:
        """This process as the run config lists it (``distributed.hosts``)."""
        return {"rank": self.rank, "host": self.host.name, "python": self.host.python, "workdir": self.workdir,
                "env": self.env}


class _Launcher:
    """One launch flow for a run on N hosts (N = 1 the usual case). A dry run goes
    through the same steps and says what each would do on its host."""

    def __init__(self, playbook, inventory, store, force, dry_run, progress, clock, start_timeout, bundle):
        self.bundle = bundle
        self.playbook = playbook
        self.inventory = inventory
        self.store = store
        self.force = force
        self.dry_run = dry_run
        self.say = progress or quiet
        self.clock = clock
        self.socket = socket_name()
        self.start_timeout = start_timeout
        self.blocked = 0  # a dry run: errors a launch would stop at

    def show_remote(self, step: str, site: Site, argv: list[str], input: bytes | None = None) -> None:
        """In a dry run: say exactly what would run on the host."""
        self.say(step, f"would run on {site.host.name}: {_show(argv, len(input) if input else None)}")

    def run(self) -> LaunchResult:
        pb = self.playbook
        self.secrets = pb.secret_values()  # read first: a secret that cannot be read stops the launch here
        sites = [Site(rank, self.inventory.get(name)) for rank, name in enumerate(pb.host_names(self.inventory))]
        several = len(sites) > 1
        if not self.dry_run:
            self._refuse_second_run()
        findings: list[Any] = []
        for site in sites:  # every host is audited: one bad environment fails the whole run
            findings += self._preflight(site, pb.model_copy(update={"host": site.host.name, "hosts": []})
                                        if several else pb)
        trainer = pb.trainer.to_dict()
        for site in sites:  # the data and the model are read on every host
            self._check_inputs(site.host, trainer)

        bundle = self.bundle or build_bundle()
        self.say("bundle", f"trainer bundle {bundle.short} ({bundle.size} bytes, {len(bundle.files)} files)")
        for site in sites:
            site.transport = None if self.dry_run else host_transport(site.host.name, self.inventory)
            self.say("connect", f"{site.host.name} via {_route(site.host.name, self.inventory)}")
            self._prove_host(site)
        wanted, gpus = wanted_gpus(trainer), []
        for site in sites if wanted else sites[:1]:
            gpus = self._check_gpus(site, wanted)  # the same indices on every host

        run_id = (self.store.unused_run_id(pb.name, self.clock()) if self.store is not None  # a dry run has none
                  else new_run_id(pb.name, self.clock()))
        for site in sites:
            self._deploy(site, bundle, several)
            site.run_dir, site.session = deploy.run_dir(site.workdir, run_id), run_session(run_id, site.rank)
            site.env = run_environment(site.host, pb.env, deploy.bundle_dir(site.workdir, bundle.hash), gpus)
        config = self._run_config(sites[0], trainer, gpus)
        key = self._rendezvous(sites, config) if several else None
        names = ", ".join(s.host.name for s in sites)

        if self.dry_run:
            if not several:
                self.say("record", f"would record run {run_id} (state launching, GPUs {gpus or 'none'})")
            for site in sites:
                files = self._configure(site, run_id, config, key)
                self._provide_compile_cache(site, run_id, files, config, bundle.hash, gpus)
            for site in sites:
                self._start(site, run_id)
            return LaunchResult(run_id, "dry-run", sites[0].host.name, sites[0].run_dir, run_id, dry_run=True,
                                findings=findings, blocked=self.blocked)

        run = self._record(sites, run_id, config, bundle, gpus, names)
        started: list[Site] = []
        try:
            for site in sites:
                files = self._configure(site, run_id, config, key)
                self._provide_compile_cache(site, run_id, files, config, bundle.hash, gpus)
            for site in sites:  # all started before any is waited for: they meet at the rendezvous
                self._start(site, run_id)
                started.append(site)
        except BaseException as e:
            if several:
                self._end_started(started)
            self.store.transition(run_id, FAILED, f"launch failed: {first_line(e)}", self.clock(),
                                  exit_reason="launch failed")
            raise
        state = self._wait_started(sites[0], run_id, run.parts()[0], names)
        deployed = sites[-1].deployed
        return LaunchResult(run_id, state, sites[0].host.name, sites[0].run_dir, run_id,
                            deploy=deployed.to_dict() if deployed else None, findings=findings)

    # ----------------------------------------------------------------- the steps

    def _preflight(self, site: Site, pb: "Playbook") -> list[Any]:
        if self.dry_run:  # the audit only reads the host: it runs, shows the drift, and never blocks
            from dflashctl.envaudit import preflight as audit_preflight

            self.say("preflight", f"env-audit of {site.host.name} (read-only; nothing recorded in a dry run)")
            findings = audit_preflight(pb, self.inventory, self.store, dry_run=True)
        else:
            findings = preflight(pb, self.inventory, self.store)
        self._preflight_verdict(site.host, findings)
        return findings

    def _preflight_verdict(self, host: "Host", findings: list) -> None:
        blocking = blocking_findings(findings)
        for f in findings:
            self.say("preflight", f"{_field(f, 'severity')}: {_field(f, 'message', f)}")
            if _field(f, "fix"):
                self.say("preflight", f"  fix: {_field(f, 'fix')}")
            for command in _field(f, "commands") or []:
                self.say("preflight", f"    {command}")
        if blocking and self.dry_run and not self.force:
            self.blocked += len(blocking)
            self.say("preflight", f"a launch would stop here: {len(blocking)} error(s) (--force goes past them)")
        elif blocking and not self.force:
            raise LaunchError(
                f"env-audit found {len(blocking)} error(s) on {host.name}; not launching",
                hint=f"see `dflashctl env-audit {shlex.quote(self.playbook.name)}`; fix them, or pass --force "
                     "to launch anyway",
            )
        forced = " (forced past errors)" if blocking and self.force else ""
        self.say("preflight", f"{len(findings)} finding(s){forced}")

    def _check_inputs(self, host: "Host", trainer: dict[str, Any]) -> None:
        """The run's data shards, model directory and free disk on ``host``, in one
        read-only round trip before anything is deployed: an error stops the launch
        (unless forced) with its fix, which is in the playbook and needs a new launch."""
        from dflashctl.hosts.facts import check_inputs, input_problems

        data, model = trainer.get("data") or {}, trainer.get("model") or {}
        asked = [w for w, v in (("data shards", data.get("shards")), ("model", model.get("path"))) if v]
        try:
            found = check_inputs(host_transport(host.name, self.inventory), trainer, host.workdir)
        except DflashError as e:
            if not self.dry_run:
                raise
            self.say("inputs", f"warning: cannot check the inputs on {host.name}: {first_line(e)}")
            return
        problems = input_problems(found, trainer, host.name, self.playbook.source or f"playbook {self.playbook.name}")
        for p in problems:
            self.say("inputs", f"{p.severity}: {p.message}")
            self.say("inputs", f"  fix: {p.fix}")
        errors = [p for p in problems if p.severity == "error"]
        if errors and self.dry_run and not self.force:
            self.blocked += len(errors)
            self.say("inputs", f"a launch would stop here: {len(errors)} error(s) (--force goes past them)")
        elif errors and not self.force:
            raise LaunchError(f"{errors[0].message}; not launching (nothing was deployed)"
                              + (f"; and {len(errors) - 1} more" if len(errors) > 1 else ""), hint=errors[0].fix)
        s = found.shards
        self.say("inputs", f"{host.name}: " + "; ".join(
            [*([f"{s['count']} shard(s) in {s['path']}"] if s and s["count"] else []),
             *([f"model {found.model['path']}"] if found.model and found.model["config"] else []),
             *([f"{found.disk_free / 2**30:.1f} GiB free"] if found.disk_free is not None else [])])
            + ("" if asked else " (synthetic data, preset model)"))

    def _refuse_second_run(self) -> None:
        """A playbook has one active run unless forced: two `launch demo` typed at once
        must not both start (a CPU run claims no GPU that would stop the second)."""
        if self.force or self.store is None:
            return
        active = self.store.list_runs(playbook=self.playbook.name, active_only=True)
        if active:
            other = active[0]
            raise LaunchError(
                f"playbook {self.playbook.name} already has an active run: {other.id} ({other.state} on {other.host})",
                hint=f"`dflashctl status {other.id}` shows it, `dflashctl stop {other.id}` stops it; "
                     "--force launches another run anyway")

    def _deploy(self, site: Site, bundle: Bundle, several: bool) -> None:
        """The bundle into the host's workdir (first, so a cut connection leaves no run
        behind; the check also resolves the workdir)."""
        if self.dry_run:
            site.workdir = site.host.workdir  # '~' is expanded on the host
            self.show_remote("deploy", site, deploy.check_argv(site.workdir, bundle.hash))
            self.show_remote("deploy", site, deploy.receive_argv(site.workdir, bundle), bundle.data)
            self.say("deploy", "(the upload is skipped when the bundle is already complete on the host)")
            return
        result = site.deployed = deploy.deploy_bundle(site.transport, bundle, site.host.workdir)
        site.workdir = result.workdir
        where = f"{site.host.name}: " if several else ""
        self.say("deploy", f"{where}bundle {bundle.short} {result.status} ({result.bytes_sent} bytes sent)"
                 + (f"; removed {result.cleaned_temp_dirs} stale upload(s)" if result.cleaned_temp_dirs else ""))

    def _rendezvous(self, sites: list[Site], config: dict[str, Any]) -> str:
        """Several hosts: rank 0's host listens on the rendezvous port; every process
        gets the others' places and this start's secret (returned)."""
        pb, first = self.playbook, sites[0]
        address = pb.rendezvous.address or ("127.0.0.1" if first.host.is_local else first.host.address)
        self._check_port(first, pb.rendezvous.port)
        config["distributed"] = {"address": address, "port": pb.rendezvous.port, "hosts": [s.part() for s in sites]}
        self.say("record", f"rendezvous at {address}:{pb.rendezvous.port} (rank 0 on {first.host.name}); "
                 f"{len(sites)} processes, one per host")
        return new_rendezvous_key()

    def _record(self, sites: list[Site], run_id: str, config: dict[str, Any], bundle: Bundle, gpus: list[int],
                names: str) -> Run:
        pb, first, several = self.playbook, sites[0], len(sites) > 1
        with self.store.batch():  # checked again with the record: a launch racing this one cannot also pass
            self._refuse_second_run()
            run = self.store.create_run(
                pb.name, first.host.name, config, self.clock(), run_id=run_id, bundle_hash=bundle.hash,
                run_dir=first.run_dir, tmux_session=run_id, tmux_socket=self.socket, claim_gpus=not self.force,
                message=f"launch of playbook {pb.name} on {names}" + (" (forced)" if self.force else ""),
                **({"hosts": [{"rank": s.rank, "host": s.host.name, "run_dir": s.run_dir, "tmux_session": s.session}
                              for s in sites]} if several else {}))
        for site in sites:
            where = f" on {site.host.name}" if several else ""
            self.store.add_event(run_id, "deploy", f"bundle {bundle.short} {site.deployed.status}{where}", self.clock(),
                                 detail=site.deployed.to_dict())
        on_each = " on each" if several else ""
        self.say("record", f"run {run_id}{' on ' + names if several else ''} "
                           f"(GPUs {', '.join(map(str, gpus)) or 'none'}{on_each})")
        drift = environment_drift(self.store, run, pb.restart.healthy_after)
        if drift is not None:
            self.store.add_event(run.id, drift.kind, drift.message, self.clock(), severity=drift.severity,
                                 detail=drift.detail)
            self.say("preflight", f"warning: {drift.message}")
        return run

    def _end_started(self, started: list[Site]) -> None:
        """A launch failed halfway: no process is left waiting at the rendezvous."""
        for site in started:
            try:
                Tmux(site.host, self.inventory, self.socket).kill(site.session)
            except DflashError as again:
                self.say("start", f"warning: could not end tmux session {site.session} on {site.host.name}: "
                                  f"{first_line(again)}")

    def _wait_started(self, site: Site, run_id: str, run: Run, where: str) -> str:
        """Wait for rank 0's trainer to start."""
        try:
            return wait_started(self.store, run, site.transport, self.start_timeout, self.clock, self.say)
        except KeyboardInterrupt:
            self.store.add_event(run_id, "startup", "launch interrupted while waiting for the trainer to start",
                                 self.clock(), severity="warning")
            raise LaunchInterrupted(
                f"interrupted: run {run_id} was started on {where} and goes on, unsupervised",
                hint=f"`dflashctl watch {shlex.quote(run_id)}` supervises it; "
                     f"`dflashctl stop {shlex.quote(run_id)}` stops it",
            ) from None
        except DflashError as e:
            # The session is started; whether the trainer came up is the supervisor's to see.
            self.store.add_event(run_id, "startup", f"could not confirm the start: {first_line(e)}",
                                 self.clock(), severity="warning")
            self.say("wait", f"warning: could not confirm the start ({first_line(e)})")
            return LAUNCHING

    def _prove_host(self, site: Site) -> None:
        """What `check` proves before anything is deployed or recorded: a detached
        process and a tmux session started through the host's route outlive the call
        (a wrapper that enters a fresh pid namespace per call kills the trainer when
        the launch returns), the workdir is writable. Not for the local host (no
        route, no wrapper: the controller's own machine)."""
        host = site.host
        if host.is_local:
            return
        if self.dry_run:
            self.say("connect", f"would prove on {host.name} that a detached process and a tmux session outlive "
                     "the call (as `dflashctl check` does)")
            return
        from dflashctl.hosts.facts import LAUNCH_BLOCKERS, prove_launchable

        _, problems = prove_launchable(site.transport)
        blocking = [p for p in problems if p.code in LAUNCH_BLOCKERS]
        if blocking:
            first = blocking[0]
            more = "".join(f"; also: {p.message}" for p in blocking[1:])
            raise LaunchError(f"{host.name} cannot hold a run: {first.message}{more}; not launching (nothing was "
                              "deployed or recorded)",
                              hint=f"{first.fix}; `dflashctl check {shlex.quote(host.name)}` shows every problem")
        self.say("connect", f"{host.name}: a detached process and a tmux session outlive the call through "
                 f"{'the wrapper' if host.wrapper else 'ssh'}")

    def _check_port(self, site: Site, port: int) -> None:
        """Rank 0's host must be able to listen on the rendezvous port before anything starts."""
        host = site.host
        if self.dry_run:
            self.say("gpus", f"would check that port {port} is free on {host.name}: "
                     f"{_show(port_check_argv(host.python, port)[:3])} <port check> {port}")
            return
        problem = rendezvous_port_problem(site.transport, host.python, port)
        if problem:
            raise port_in_use_error(host.name, port, problem)
        self.say("gpus", f"rendezvous port {port} free on {host.name}")

    def _check_gpus(self, site: Site, wanted: list[int]) -> list[int]:
        device, host = self.playbook.trainer.placement.device, site.host
        if not wanted:
            self.say("gpus", "none needed (CPU run)")
            return []
        if self.dry_run:
            argv = gpu_probe_argv(host.python)
            self.say("gpus", f"would check GPUs {wanted} with nvidia-smi through the probe: "
                     f"{_show(argv[:3])} <probe script> {argv[-1]}")
            return wanted
        probe = probe_gpus(site.transport)
        site.gpu_readings = list(probe.gpus or [])
        if probe.gpus is None:
            smi_error = next((e for e in probe.errors if "nvidia-smi" in e), "nvidia-smi gave no answer")
            if device == "auto" and not host.gpus and "not found" in smi_error:
                self.say("gpus", "no nvidia-smi on the host: the trainer will run on CPU")
                return []
            if not self.force:
                raise LaunchError(f"{host.name}: cannot check GPUs {wanted}: {smi_error}",
                                  hint="fix nvidia-smi on the host, or pass --force to launch without the check")
            self.say("gpus", f"warning: cannot check GPUs ({smi_error}); forced")
            return wanted
        busy = busy_gpus(probe, wanted)
        count = gpu_count_problem(host, len(probe.gpus))  # the inventory's gpus: against nvidia-smi
        if count is not None:
            self.say("gpus", f"warning: {count.message}")
        absent = [g for g, why in busy.items() if why.startswith("not present")]
        if busy and not self.force:
            listed = "; ".join(f"GPU {g}: {why}" for g, why in sorted(busy.items()))
            raise LaunchError(f"{host.name}: GPUs {'not present' if len(absent) == len(busy) else 'busy'}: {listed}",
                              hint=("change trainer.placement to GPUs that nvidia-smi shows, or pass --force" if absent
                                    else "wait for them, change trainer.placement, or pass --force"))
        self.say("gpus", f"GPUs {wanted} free" if not busy else f"GPUs {sorted(busy)} busy; forced")
        return wanted

    def _run_config(self, first: Site, trainer: dict[str, Any], gpus: list[int]) -> dict[str, Any]:
        """The run's config as recorded: rank 0's places (every rank's differ only there)."""
        pb = self.playbook
        trainer = copy.deepcopy(trainer)
        trainer["run_dir"] = first.run_dir
        cache = pb.compile_cache
        if first.host.is_local and "compile_cache" not in pb.model_fields_set:
            from dflashctl.core.paths import local_compile_cache

            cache = local_compile_cache() or cache  # DFLASHCTL_HOME holds a local run's cache too
        if cache and not trainer["compile"].get("cache_dir"):
            trainer["compile"]["cache_dir"] = cache
        return {
            "trainer": trainer,  # as in the playbook (physical GPU indices)
            "gpus": gpus,
            "env": first.env,
            "secret_env": sorted(pb.secret_env),  # names only: the values never reach the store
            "compile_cache": cache,
            "python": first.host.python,
            "workdir": first.workdir,
            "playbook_source": pb.source,
            "forced": self.force,
            # What the run is held to, as launched: the console shows it without
            # loading the playbook (and pydantic) while the file is unchanged.
            "thresholds": thresholds_of(pb),
        }

    def _configure(self, site: Site, run_id: str, config: dict[str, Any], rendezvous_key: str | None) -> dict[str, str]:
        """Write (or, in a dry run, show) the run files; returns them."""
        run_dir = site.run_dir
        files = run_files(run_id, run_dir, config, self.socket, rank=site.rank, session=site.session,
                          rendezvous_key=rendezvous_key, secrets=self.secrets)
        if self.dry_run:
            self.show_remote("configure", site, deploy.run_files_argv(run_dir), deploy.tar_of(files))
            self.say("configure", f"{RUN_SCRIPT}:\n" + files[RUN_SCRIPT])
            if contract.RENDEZVOUS_KEY_FILE in files:
                self.say("configure", f"{contract.RENDEZVOUS_KEY_FILE}: this start's secret, mode 0600 (not shown)")
            if SECRETS_FILE in files:
                self.say("configure", f"{SECRETS_FILE}: {', '.join(config['secret_env'])}, mode 0600 (not shown)")
            return files
        deploy.write_run_files(site.transport, run_dir, files)
        self.say("configure", f"{run_dir}: {', '.join(sorted(files))}")
        return files

    def _provide_compile_cache(self, site: Site, run_id: str, files: dict[str, str], config: dict[str, Any],
                               bundle_hash: str, gpus: list[int]) -> None:
        """Before the start: a held compile artifact that fits the run goes into its
        run directory (dflashctl.runs.compile_cache), said and recorded."""
        from dflashctl.runs import compile_cache

        run_dir = site.run_dir
        if self.dry_run:
            held = len(compile_cache.LocalCache().entries())
            if held:
                self.say("configure", f"would put a held compile artifact that fits the run (of {held} held) into "
                         f"{run_dir}/{compile_cache.trainer_cache.CACHE_DIR}/")
            return
        trainer = json.loads(files[contract.CONFIG_FILE])  # the config.json the trainer reads
        compile_cache.provide_for_run(
            site.transport, run_dir, trainer,
            compile_cache.bundle_of(part_config(config, site.rank).get("env"), bundle_hash),
            compile_cache.gpu_name(site.gpu_readings, gpus),
            lambda message: self.say("configure", message),
            lambda o: self.store.add_event(run_id, compile_cache.EVENT_KIND, o.message, self.clock(), o.severity,
                                           o.event_detail()))

    def _start(self, site: Site, run_id: str) -> None:
        command, session = start_command(site.run_dir), site.session
        where = f" on {site.host.name}" if session != run_id else ""
        if self.dry_run:
            self.say("start", f"would start tmux session {session} on {site.host.name} (tmux -L {self.socket}) "
                     f"running: {command}")
            return
        Tmux(site.host, self.inventory, self.socket).start(session, command)
        self.say("start", f"tmux session {session}{where} (tmux -L {self.socket})")


def run_session(run_id: str, rank: int) -> str:
    """The tmux session of a run's process: the run id for rank 0, ``<run id>-r<rank>``
    for the others (hosts that share one tmux server still get distinct sessions)."""
    return run_id if rank == 0 else f"{run_id}-r{rank}"


def _route(host_name: str, inventory: "Inventory") -> str:
    from dflashctl.hosts.transport import describe_route

    return describe_route(inventory.route(host_name))


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


# --------------------------------------------------------------------------- supervision


_FORWARDED_ENV = ("DFLASHCTL_HOME", "DFLASHCTL_STORE", "DFLASHCTL_TMUX_SOCKET", "DFLASHCTL_INVENTORY",
                  "DFLASHCTL_PLAYBOOKS", "DFLASHCTL_DEBUG")


def supervisor_session(run_id: str) -> str:
    return f"watch-{run_id}"


def start_supervisor(run_id: str, foreground: bool, store: Store, inventory: "Inventory",
                     progress: Progress | None = None, *, inventory_path: str | None = None,
                     playbooks_dir: str | None = None, emit: Callable[[str], None] | None = None,
                     clock: Callable[[], float] = time.time, stop: threading.Event | None = None,
                     environ: dict[str, str] | None = None, width: int | None = None) -> str | None:
    """Supervise a launched run.

    Background (default): ``dflashctl watch RUN`` in a local tmux session
    ``watch-<run_id>`` on the dflash socket; returns the session name.
    Foreground: the supervisor in this process until the run ends (or ``stop`` is
    set), printing its events and metrics lines (fitted to ``width`` when given:
    ``console.format_line``); returns the run's state then.
    ``environ``: where the forwarded variables are read (default ``os.environ``; the
    status console passes its own store's path)."""
    say = progress or quiet
    if foreground:
        from dflashctl.supervise.console import follow

        return follow(run_id, store, inventory, emit or print, playbooks_dir=playbooks_dir, stop=stop, width=width)
    argv = [sys.executable, "-m", "dflashctl"]
    if inventory_path:
        argv += ["--inventory", os.path.abspath(inventory_path)]
    if playbooks_dir:
        argv += ["--playbooks", os.path.abspath(playbooks_dir)]
    argv += ["watch", run_id]
    environ = os.environ if environ is None else environ
    env = [f"{k}={environ[k]}" for k in _FORWARDED_ENV if environ.get(k)]
    # The local tmux server may have been started by another process, with another
    # environment and directory: pass what the supervisor needs explicitly.
    command = shlex.join(["env", *env, *argv]) if env else shlex.join(argv)
    session = supervisor_session(run_id)
    socket = socket_name()
    tmux = Tmux(local_host(), inventory, socket)
    tmux.kill(session)
    tmux.start(session, f"cd {shlex.quote(os.getcwd())} && exec {command}")
    store.set_supervisor(run_id, {"kind": "tmux", "host": "local", "session": session, "socket": socket,
                                  "started": clock()})
    attach = shlex.join(["tmux", "-L", socket, "attach", "-t", f"={session}"])
    say("supervise", f"supervisor running in local tmux session {session} ({attach})")
    return session


class HandOverSignals:
    """While a run is launched and supervised in the foreground (a context manager):
    SIGTERM and SIGHUP (the terminal or the ssh connection closed) are noted instead
    of ending the process, so the run is handed to a background supervisor rather
    than left unsupervised; while following (``following``), a first Ctrl-C is
    noted the same way and a second one interrupts at once. Outside the follow,
    Ctrl-C interrupts as usual. Installed from the main thread only; the previous
    handlers come back on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.stop = threading.Event()  # set by the first signal: stop following, hand over
        self.received: str | None = None  # its name
        self.following = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGINT and (not self.following or self.stop.is_set()):
            raise KeyboardInterrupt
        self.received = self.received or signal.Signals(signum).name
        self.stop.set()

    def __enter__(self) -> "HandOverSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


@dataclass
class Supervised:
    """How ``supervise_here`` let go of a run."""

    state: str  # the run's state then: final, unless it was handed over
    session: str | None = None  # the background supervisor's tmux session, when handed over
    signal: str | None = None  # what handed it over: SIGINT, SIGTERM or SIGHUP


def supervise_here(run_id: str, store: Store, inventory: "Inventory", signals: HandOverSignals,
                   progress: Progress | None = None, *, emit: Callable[[str], None] | None = None,
                   inventory_path: str | None = None, playbooks_dir: str | None = None,
                   width: int | None = None) -> Supervised:
    """``launch --foreground``: supervise the run in this process until it ends. A
    signal noted by ``signals`` (before or while following) ends the follow after
    the tick in progress, and the run, released by this process, goes to a
    background supervisor exactly as after a plain ``launch``."""
    if not signals.stop.is_set():
        signals.following = True
        try:
            state = start_supervisor(run_id, True, store, inventory, progress, playbooks_dir=playbooks_dir,
                                     emit=emit, stop=signals.stop, width=width)
        except KeyboardInterrupt:  # the second Ctrl-C
            signals.received = signals.received or signal.SIGINT.name
        finally:
            signals.following = False
        if signals.received is None:
            return Supervised(state)
    if store.get_run(run_id).state in FINAL_STATES:  # it ended as the signal came: nothing to hand over
        return Supervised(store.get_run(run_id).state)
    session = start_supervisor(run_id, False, store, inventory, progress, inventory_path=inventory_path,
                               playbooks_dir=playbooks_dir)
    return Supervised(store.get_run(run_id).state, session, signals.received)
