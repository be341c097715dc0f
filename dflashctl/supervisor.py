"""The supervisor: one loop watching many runs on many hosts.

Each tick:

    probe    every host with a run to watch, concurrently (``transport.fanout``),
             ONE round trip per host: ``probe.probe_command`` for all its runs
    parse    ``probe.parse_probe_host`` (pure); new metrics lines become samples,
             stored with the new metrics.jsonl offset in the same transaction
    detect   ``detectors.detect`` (pure) with ``now`` = local clock + the host's
             estimated skew: the trainer stamps its metrics with the host's clock
    decide   ``policy.decide`` (pure): restart, restart with serialized warm-up,
             stop, or nothing; alerts
    act      restarts (``launch.restart_run``) and kills run on a worker thread, so
             a slow host never holds up the other runs' ticks; alerts go to the
             playbook's hooks (``alerts.Alerter``, its own worker thread)
    store    samples, events, state transitions, restart rows with their cost

Clocks: events, restart rows and the restart policy use the local clock; samples,
phase tracking and the detectors the host's (host time - skew = local time).

A restart's cost, in its restarts row:

    detect_delay_s        detection - failure. The failure time is the trainer's own
                          when it reported one (status.json ``failed``), else the last
                          poll that saw it healthy (so at most a poll interval plus a
                          probe: an upper bound), and for a stall its last step.
    downtime_s            failure -> first step of the restarted process
    time_to_first_step_s  restart issued -> first step of the restarted process

An unreachable host is a finding, never an error of the loop: its runs go ``lost``
after ``LOST_AFTER_POLLS`` failed polls and back to their state when it answers.
Nothing that matters lives only in memory: metrics offsets (stored with the
samples), samples and restart history are in the store, and the supervisor records
itself on each run (``Store.set_supervisor``), so a supervisor killed and started
again picks its runs up where it left them, without restarting anything.
"""

from __future__ import annotations

import os
import queue
import random
import re
import socket
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from dflashctl import alerts as alerts_mod
from dflashctl import contract, detectors, policy, signatures
from dflashctl.detectors import Finding, Sample, fmt_duration
from dflashctl.errors import DflashError, first_line
from dflashctl.parsers import parse_metrics_chunk
from dflashctl.probe import ProbeArgs, ProbeError, ProbeResult, estimate_skew, parse_probe_host, probe_command
from dflashctl.store import (
    DONE, FAILED, FINAL_STATES, LAUNCHING, LOST, RESTARTING, RUNNING, STALLED, STOPPED, TRANSITIONS, Run, Store,
)

if TYPE_CHECKING:
    from dflashctl.config import Alerts, Expect, Inventory, Playbook, RestartPolicy

WINDOW = 256  # samples kept per run for the detectors
PANE_LINES = 100
LOST_AFTER_POLLS = 2  # one failed poll can be a blip; two in a row mark the host's runs lost
RESTART_TRIES = 3  # restarts that could not be issued (host gone) before the run is failed
SETTLE_S = 3.0  # a process found gone: wait this long for run.sh to write its exit code
REPEAT_FINDING_S = 600.0  # a lasting finding is written (and alerted) again this often
RESTART_MARKER = "--- dflashctl:"  # the trainer.log line written before each restart

# Before a restart: the previous process's answers (exit_code, status.json) must not
# be read as the next one's, and trainer.log (appended to by every process of the
# run) gets a marker, so the next crash is classified from its own output only.
STACK_DUMP_WAIT_S = 2.0  # faulthandler writes within milliseconds; the log is on a shared disk
_PREPARE_RESTART = 'cd "$1" || exit 1; rm -f "$2"; printf "%s\\n" "$4" >> "$5"'  # $3: status.json, kept:
# the restart reads the old trainer's pid from it to make sure that process is gone
# (launch.restart_run), then removes it before the new process starts.

Emit = Callable[[str, Any], None]  # ('event', store.Event) | ('metrics', (run_id, Metrics)) | ('info', str)


class SupervisorConflict(DflashError):
    """Another live supervisor already watches the run."""


class RestartCancelled(DflashError):
    """The run was ended (an operator's stop) between the decision and the restart."""


# --------------------------------------------------------------------------- per-run policy


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

    @classmethod
    def from_playbook(cls, pb: "Playbook") -> "RunPolicy":
        return cls(pb.name, pb.expect, pb.restart, pb.alerts, list(pb.signatures), float(pb.poll_interval))

    @classmethod
    def defaults(cls, playbook: str) -> "RunPolicy":
        from dflashctl.config import Alerts, Expect, RestartPolicy

        return cls(playbook, Expect(), RestartPolicy(), Alerts())


def policy_for_run(run: Run, inventory: "Inventory", playbooks_dir: str | None = None) -> tuple[RunPolicy, str | None]:
    """The run's playbook (the file it was launched from, else by name); when neither
    loads, the defaults and a warning saying why."""
    from dflashctl.config import load_playbook

    source = (run.config or {}).get("playbook_source")
    error = "not found"
    for ref in [s for s in (source if source and os.path.isfile(source) else None, run.playbook) if s]:
        try:
            return RunPolicy.from_playbook(load_playbook(ref, playbooks_dir, inventory)), None
        except DflashError as e:
            error = first_line(e)
    return RunPolicy.defaults(run.playbook), (
        f"playbook {run.playbook} cannot be loaded ({error}); holding the run to the default expectations "
        "and restart policy"
    )


# --------------------------------------------------------------------------- state


@dataclass
class _Pending:
    """A restart decided, waiting for its backoff."""

    due: float
    action: str  # restart | restart_serialized
    reason: str
    signature: str | None
    detected_at: float
    failed_at: float | None
    step_before: int | None
    tries: int = 0


@dataclass
class _Latest:
    """The latest restart: its cost is known once its process has made a step."""

    id: int
    issued_at: float
    failed_at: float | None
    first_step_at: float | None = None
    step_after: int | None = None


@dataclass
class _Open:
    """A finding already written: since when, how bad, its wording, when last written."""

    severity: str
    since: float
    written: float
    shape: str


def _shape(message: str) -> str:
    """A finding's wording without its numbers: a new shape is news ("ETA 9 d > 7 d"
    becoming "4.3 Ktok/s = 34% of baseline ...; ETA ..."), new numbers are not."""
    return re.sub(r"\d+(\.\d+)?", "N", message)


@dataclass
class Watched:
    """One run as the supervisor follows it (all of it rebuilt from the store on attach)."""

    run: Run
    policy: RunPolicy
    alerter: alerts_mod.Alerter
    args: ProbeArgs
    samples: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # the current process's
    history: list[policy.Restart] = field(default_factory=list)
    baseline: float | None = None
    phase: str | None = None
    phase_since: float | None = None  # host clock
    step_max: int | None = None  # highest step of the current process
    attempt_started: float | None = None  # local: when the current process was started by a restart
    last_ok: float | None = None  # local: the last poll that saw the trainer healthy
    healthy_since: float | None = None  # local: first step of the current process
    pending: _Pending | None = None
    job: Future | None = None
    job_kind: str | None = None
    latest: _Latest | None = None
    restart_issued: bool = False  # a restart we issued whose process was not yet seen running
    crash_seen: float | None = None
    findings: dict[str, _Open] = field(default_factory=dict)
    state_before_lost: str | None = None
    detached: str | None = None  # why it is no longer watched here

    @property
    def id(self) -> str:
        return self.run.id

    @property
    def active(self) -> bool:
        return self.run.state not in FINAL_STATES and self.detached is None


@dataclass
class _HostState:
    down_since: float | None = None
    polls: int = 0
    severity: str | None = None  # of the last unreachable event written
    skew: float = 0.0


@dataclass
class TickReport:
    time: float
    seconds: float
    hosts: dict[str, float | str]  # host -> probe round trip in seconds, or why it failed
    findings: dict[str, list[Finding]]  # run id -> this tick's findings


# --------------------------------------------------------------------------- the supervisor


class Supervisor:
    """Watches runs (``attach``, ``watch_playbook``) and ticks (``tick``, ``run``).

    act=False observes only (samples, findings, alerts) and never changes a run's
    state, restarts or stops anything; claim=False does not record this process as
    the runs' supervisor. ``restart_fn(run_id, serialized_warmup, store, inventory)``
    defaults to ``launch.restart_run``. ``clock`` is the local clock; ``rng`` drives
    the backoff jitter. ``emit`` receives every event as it is stored.
    """

    def __init__(
        self,
        store: Store,
        inventory: "Inventory",
        *,
        interval: float | None = None,
        playbooks_dir: str | None = None,
        emit: Emit | None = None,
        metrics: bool = False,
        act: bool = True,
        claim: bool = True,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.time,
        escalate_after: float = 300.0,
        probe_timeout: float | None = None,
        restart_fn: Callable[..., Any] | None = None,
    ):
        self.store = store
        self.inventory = inventory
        self.interval_override = interval
        self.playbooks_dir = playbooks_dir
        self.emit = emit or (lambda kind, payload: None)
        self.metrics = metrics
        self.act = act
        self.claim = claim
        self.rng = rng or random.Random()
        self.clock = clock
        self.escalate_after = escalate_after
        self.probe_timeout = probe_timeout
        self.restart_fn = restart_fn
        self.runs: dict[str, Watched] = {}
        self.hosts: dict[str, _HostState] = {}
        self.playbooks: set[str] = set()
        self.identity = {"pid": os.getpid(), "host": socket.gethostname(), "started": clock()}
        self._skipped: set[str] = set()
        self._alerters: dict[str, alerts_mod.Alerter] = {}
        self._hook_failures: "queue.SimpleQueue[dict]" = queue.SimpleQueue()
        self._workers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="dflashctl-act")
        self._cursor: dict[str, tuple[int, float]] = {}  # run -> (last event id, its time) emitted
        self._hurry = False
        self.ticks = 0
        self.last_report: TickReport | None = None

    # ----------------------------------------------------------------- what to watch

    @property
    def interval(self) -> float:
        if self.interval_override is not None:
            return float(self.interval_override)
        return min([w.policy.poll_interval for w in self.active()] or [15.0])

    def attach(self, run_ref: str) -> Watched:
        """Watch a run, resuming from what the store knows of it: metrics offset,
        recent samples, restart history. Nothing on its host is touched."""
        run = self.store.get_run(run_ref)
        if run.id in self.runs:
            return self.runs[run.id]
        other = live_supervisor(run.supervisor)
        if other is not None:
            raise SupervisorConflict(
                f"run {run.id} is already supervised by pid {other['pid']}"
                + (f" (tmux session {other['session']})" if other.get("session") else ""),
                hint=f"stop that supervisor first (kill {other['pid']}); `dflashctl status {run.id}` shows the run",
            )
        run_policy, warning = policy_for_run(run, self.inventory, self.playbooks_dir)
        offset, inode = self.store.metrics_position(run.id)
        w = Watched(
            run=run,
            policy=run_policy,
            alerter=self._alerter(run_policy.alerts),
            args=ProbeArgs(run_dir=run.run_dir or "", session=run.tmux_session,
                           socket=run.tmux_socket or _tmux_socket(), metrics_offset=offset, metrics_inode=inode,
                           pane_lines=PANE_LINES, nvidia_smi=bool(run.gpus)),
        )
        rows = self.store.restarts(run.id)
        w.history = [policy.Restart(r.time, r.step_before, r.step_after) for r in rows]
        if rows:
            last = rows[-1]
            w.attempt_started = last.time
            first = last.time + last.time_to_first_step_s if last.time_to_first_step_s is not None else None
            w.latest = _Latest(last.id, last.time, None, first, last.step_after)
            w.restart_issued = run.state == RESTARTING and self._issued_since_restarting(run, last.time)
        if run.state == RESTARTING and not w.restart_issued:
            # Decided by a supervisor that is gone (its backoff was in memory), or an
            # operator's restart that never confirmed: watch it as a starting process;
            # if nothing runs, that is a crash and this supervisor decides again.
            w.restart_issued = True
        for s in self.store.samples(run.id, since=w.attempt_started, limit=WINDOW):
            w.samples.append(Sample(s.time, s.step, s.tok_s, s.phase or contract.PHASE_TRAINING, s.eta_s))
            w.step_max = max(w.step_max or 0, s.step)
            if w.healthy_since is None and s.phase == contract.PHASE_TRAINING:
                w.healthy_since = s.time  # host clock: the skew is not known yet, and small
        w.baseline = run_policy.expect.baseline_tok_s or self.store.baseline_tok_s(run.playbook, exclude_run=run.id)
        last_event = self.store.events(run.id, limit=1)
        self._cursor[run.id] = (last_event[0].id, last_event[0].time) if last_event else (0, 0.0)
        self.runs[run.id] = w
        if self.claim:
            self._claim(run)
        if warning:
            self._event(w, "supervisor", "warning", warning)
        how = "re-attached to" if (offset or rows) else "watching"
        self._event(w, "supervisor", "info",
                    f"supervisor pid {os.getpid()} {how} run {run.id} ({run.state} on {run.host})",
                    {"pid": os.getpid(), "metrics_offset": offset, "restarts": len(rows)})
        return w

    def watch_playbook(self, name: str) -> list[Watched]:
        """Watch every active run of a playbook, now and as new ones are launched."""
        self.playbooks.add(name)
        return self._refresh_playbooks()

    def _refresh_playbooks(self) -> list[Watched]:
        added = []
        for name in sorted(self.playbooks):
            for run in self.store.list_runs(playbook=name, active_only=True):
                if run.id in self.runs or run.id in self._skipped:
                    continue
                try:
                    added.append(self.attach(run.id))
                except SupervisorConflict as e:
                    self._skipped.add(run.id)  # its own supervisor has it
                    self.emit("info", f"{e}; not watching it here")
        return added

    def active(self) -> list[Watched]:
        return [w for w in self.runs.values() if w.active]

    def _issued_since_restarting(self, run: Run, restart_time: float) -> bool:
        """Whether the latest restart row was issued after the run last went
        ``restarting`` (else that restart is still to do: its supervisor died first)."""
        went = [e.time for e in self.store.events(run.id, kind="state", limit=50)
                if (e.detail or {}).get("to") == RESTARTING]
        return bool(went) and restart_time >= went[-1]

    def _alerter(self, alerts: "Alerts") -> alerts_mod.Alerter:
        key = alerts.model_dump_json()
        if key not in self._alerters:
            # Hook failures arrive on the alert thread: handed over, stored by the loop.
            self._alerters[key] = alerts_mod.Alerter(alerts, on_hook_failure=self._hook_failures.put)
        return self._alerters[key]

    def _claim(self, run: Run) -> None:
        # The launcher records its tmux session (after starting us): keep what it wrote.
        info = {**(run.supervisor or {}), **self.identity}
        if not os.environ.get("TMUX"):
            info["kind"] = "process"
        self.store.set_supervisor(run.id, info)
        run.supervisor = info

    # ----------------------------------------------------------------- the loop

    def run(self, stop: threading.Event | None = None, once: bool = False) -> None:
        """Tick every ``interval`` until ``stop`` is set or nothing active is left."""
        stop = stop or threading.Event()
        try:
            while True:
                started = time.monotonic()
                try:
                    self.tick()
                except Exception as e:  # noqa: BLE001  (e.g. the store locked for too long: try again next tick)
                    if os.environ.get("DFLASHCTL_DEBUG") or once:
                        raise
                    self.emit("info", f"supervisor: this tick failed ({type(e).__name__}: {first_line(e)}); "
                              "trying again at the next one")
                if once or stop.is_set() or not self.active():
                    return
                if self._hurry:
                    continue
                wait = self.interval - (time.monotonic() - started)
                dues = [w.pending.due - self.clock() for w in self.active() if w.pending and w.job is None]
                if stop.wait(max(0.0, min([wait, *dues]))):
                    return
        finally:
            self.close()

    def close(self, wait: float = 60.0) -> None:
        """Finish the restarts in flight, deliver queued alerts, release the runs."""
        deadline = time.monotonic() + wait
        for w in self.runs.values():
            if w.job is not None:
                try:
                    w.job.result(timeout=max(0.1, deadline - time.monotonic()))
                except Exception:  # noqa: BLE001  (recorded by _collect_jobs)
                    pass
        self._collect_jobs()
        self._workers.shutdown(wait=False)
        for alerter in self._alerters.values():
            alerter.close(timeout=max(0.1, min(10.0, deadline - time.monotonic())))
        self._drain_hook_failures()
        if self.claim:
            for w in self.runs.values():
                try:
                    if (self.store.get_run(w.id).supervisor or {}).get("pid") == os.getpid():
                        self.store.set_supervisor(w.id, None)
                except DflashError:
                    pass
        self._emit_new_events()

    def tick(self) -> TickReport:
        from dflashctl.transport import fanout

        t0, now = time.monotonic(), self.clock()
        self.ticks += 1
        self._hurry = False
        if self.playbooks:
            self._refresh_playbooks()
        self._drain_hook_failures()
        self._collect_jobs()
        for w in self.active():
            self._refresh(w)
        if self.act:
            for w in self.active():
                host_up = self.hosts.get(w.run.host, _HostState()).down_since is None  # else: when it is back
                if w.pending is not None and w.job is None and now >= w.pending.due and host_up:
                    self._issue_restart(w)
        by_host: dict[str, list[Watched]] = {}
        for w in self.active():
            if w.job is None:  # a restart or kill in flight: look again when it is done
                by_host.setdefault(w.run.host, []).append(w)
        answers = fanout(list(by_host), lambda t: self._probe(t, by_host[t.name]), inventory=self.inventory)
        report = TickReport(now, 0.0, {}, {})
        for host, answer in answers.items():
            watched = by_host[host]
            if isinstance(answer, Exception):
                report.hosts[host] = first_line(answer)
                self._host_failed(host, watched, report.hosts[host])
                continue
            result, sent, received = answer
            parsed = parse_probe_host(result.stdout)
            if isinstance(parsed, ProbeError):
                tail = (result.stderr.strip() or parsed.output_tail.strip())[-300:]
                report.hosts[host] = f"the probe failed (exit {result.exit_code}): {parsed.message}: {tail}"
                self._host_failed(host, watched, report.hosts[host])
                continue
            report.hosts[host] = received - sent
            hs = self.hosts.setdefault(host, _HostState())
            hs.skew = estimate_skew(parsed.host_time, sent, received)
            self._host_back(host, watched)
            for w, pr in zip(watched, parsed.runs):
                try:
                    report.findings[w.id] = self._observe(w, pr, hs.skew)
                except Exception as e:  # noqa: BLE001  (one run's trouble must not stop the watch of the others)
                    if os.environ.get("DFLASHCTL_DEBUG"):
                        raise
                    self._event(w, "supervisor", "error",
                                f"could not handle this poll: {type(e).__name__}: {first_line(e)}")
        self._emit_new_events()
        report.seconds = time.monotonic() - t0
        self.last_report = report
        return report

    # ----------------------------------------------------------------- probe

    def _probe(self, transport, watched: list[Watched]):
        limit = self.probe_timeout or min(float(transport.host.command_timeout), max(10.0, 3 * self.interval))
        argv = probe_command(transport.host.python, [w.args for w in watched])
        sent = self.clock()
        result = transport.run(argv, timeout=limit, check=False)
        return result, sent, self.clock()

    def _refresh(self, w: Watched) -> None:
        """Pick up what others changed: an operator's stop or restart, a new supervisor."""
        run = self.store.get_run(w.id)
        if self.claim:
            theirs = run.supervisor or {}
            if theirs.get("pid") not in (None, os.getpid()) and live_supervisor(theirs) is not None:
                w.detached = f"supervisor pid {theirs['pid']} took it over"
                self.emit("info", f"{w.id}: {w.detached}; no longer watching it here")
            elif theirs.get("pid") != os.getpid():
                self._claim(run)
        w.run = run

    # ----------------------------------------------------------------- one run, one probe

    def _observe(self, w: Watched, pr: ProbeResult, skew: float) -> list[Finding]:
        local = self.clock()
        now = local + skew  # the host's clock
        self._ingest_metrics(w, pr, skew)
        status = pr.status
        if status is not None and status.step and status.step > (w.step_max or 0):
            w.step_max = status.step
        self._track_phase(w, pr, now, skew)

        started = status is not None and pr.exit_code is None and status.phase not in contract.FINAL_PHASES
        if started and self.act and w.run.state == LAUNCHING:
            self._transition(w, RUNNING, f"trainer started (pid {status.pid}, phase {status.phase})")
        elif started and self.act and w.run.state == RESTARTING and w.restart_issued:
            w.restart_issued = False
            self._transition(w, RUNNING, f"trainer running again (pid {status.pid}, phase {status.phase})")
        if w.run.state == RESTARTING and (w.pending is not None or not w.restart_issued):
            return []  # a restart is coming: ours after its backoff, or an operator's

        findings = detectors.detect(
            list(w.samples), pr, LAUNCHING if w.run.state == RESTARTING else w.run.state, w.policy.expect, now,
            baseline_tok_s=w.baseline, assigned_gpus=w.run.gpus or None, phase_since=w.phase_since,
        )
        if not {f.kind for f in findings} & {detectors.CRASH, detectors.STALL, detectors.FINISHED}:
            w.last_ok, w.crash_seen = local, None
        self._act(w, pr, findings, local, skew)
        return findings

    def _track_phase(self, w: Watched, pr: ProbeResult, now: float, skew: float) -> None:
        """When the current phase began (status.json does not say): first seen, or
        for a process still starting, its start time."""
        phase = pr.status.phase if pr.status else None
        if phase == w.phase and w.phase_since is not None:
            return
        since = now
        if pr.status is not None and phase == contract.PHASE_STARTING and pr.status.started:
            since = pr.status.started
        elif pr.status is None and w.phase_since is None:
            # Nothing written yet: count from the (re)start.
            since = (w.attempt_started or w.run.created) + skew
        w.phase, w.phase_since = phase, since

    def _ingest_metrics(self, w: Watched, pr: ProbeResult, skew: float) -> None:
        if pr.metrics_offset is None:
            return  # metrics.jsonl could not be read this time; the offset stays
        lines, malformed = parse_metrics_chunk(pr.metrics_chunk)
        if pr.metrics_reset and w.args.metrics_offset:
            self._event(w, "metrics", "warning",
                        f"{contract.METRICS_FILE} was truncated or replaced; read again from the start")
        if malformed:
            self._event(w, "metrics", "warning", f"{malformed} malformed line(s) of {contract.METRICS_FILE} skipped")
        if lines or (pr.metrics_offset, pr.metrics_inode) != (w.args.metrics_offset, w.args.metrics_inode):
            gpu = [g.__dict__ for g in pr.gpus or [] if g.index in w.run.gpus] or None
            self.store.add_samples(w.id, lines, gpu=gpu, metrics_offset=pr.metrics_offset,
                                   metrics_inode=pr.metrics_inode)
        w.args = pr.next_args(w.args)
        self._hurry = self._hurry or pr.metrics_more
        for m in lines:
            w.samples.append(Sample.from_metrics(m))
            if self.metrics:
                self.emit("metrics", (w.id, m))
        self._progress(w, lines, skew)

    def _progress(self, w: Watched, lines: list[contract.Metrics], skew: float) -> None:
        """The current process's steps: healthy_since, and its restart's cost and step_after."""
        # Lines an earlier process wrote but that are read only now do not count.
        ours = [m for m in lines if w.attempt_started is None or m.time - skew >= w.attempt_started - 1.0]
        if not ours:
            return
        w.step_max = max([w.step_max or 0, *(m.step for m in ours)])
        first = ours[0].time - skew  # local
        if w.healthy_since is None:
            w.healthy_since = first
        r = w.latest
        if r is None or (r.step_after is not None and r.step_after >= w.step_max):
            return
        r.step_after = w.step_max
        w.history[-1] = policy.Restart(w.history[-1].time, w.history[-1].step_before, w.step_max)
        changes: dict[str, Any] = {"step_after": w.step_max}
        if r.first_step_at is None:
            r.first_step_at = first
            changes["time_to_first_step_s"] = round(max(0.0, first - r.issued_at), 3)
            if r.failed_at is not None:
                changes["downtime_s"] = round(max(0.0, first - r.failed_at), 3)
            self._event(w, "restart", "info", f"training resumed at step {ours[0].step}, "
                        f"{_seconds(first - r.issued_at)} after the restart"
                        + (f" ({_seconds(first - r.failed_at)} down in all)" if r.failed_at else ""),
                        {"restart_id": r.id, **changes})
        self.store.update_restart(r.id, **changes)

    # ----------------------------------------------------------------- act

    def _act(self, w: Watched, pr: ProbeResult, findings: list[Finding], local: float, skew: float) -> None:
        finished = next((f for f in findings if f.kind == detectors.FINISHED), None)
        if finished is not None:
            self._finished(w, pr, finished, local)
            return
        crash = next((f for f in findings if f.kind == detectors.CRASH), None)
        classification = None
        if crash is not None:
            w.crash_seen = w.crash_seen or local
            proc = pr.process
            if pr.exit_code is None and pr.session_alive and proc is not None and not proc.alive \
                    and local - w.crash_seen < SETTLE_S:
                return  # run.sh is writing the exit code: classify with it at the next poll
            classification = signatures.classify(
                _attempt_output(pr), pr.status.error if pr.status else None, pr.exit_code, w.policy.signatures
            )
            crash.detail.update(signature=classification.name, matched_line=classification.matched_line)
        actions = policy.decide(findings, classification, w.policy.restart, w.history, local, self.rng,
                                healthy_since=w.healthy_since)
        decision, alerts = actions[0], actions[1:]
        trigger = crash or next((f for f in findings if f.kind == detectors.STALL), None)
        fresh = self._note_findings(w, findings, local)
        for f in findings:
            if f.kind in fresh:
                self._event(w, f.kind, f.severity, f.message, f.detail)
        if trigger is not None:
            self._decided(w, pr, trigger, decision, local, skew)
        elif w.run.state == STALLED and self.act:
            self._transition(w, RUNNING, "making progress again" + (f": step {w.step_max}" if w.step_max else ""))
        for a in alerts:
            one_shot = trigger is not None and a.finding == trigger.kind and decision.kind != policy.NONE
            if one_shot or a.finding in fresh:
                self._alert(w, a.finding or "finding", a.severity, a.reason, a.detail, local)

    def _note_findings(self, w: Watched, findings: list[Finding], local: float) -> set[str]:
        """Kinds to write now: new, worse or worded otherwise than when last written,
        or lasting long enough to say again. Kinds that went away are written as cleared."""
        fresh = set()
        for f in findings:
            o = w.findings.get(f.kind)
            worse = o is not None and _rank(f.severity) > _rank(o.severity)
            if o is None or worse or o.shape != _shape(f.message) or local - o.written >= REPEAT_FINDING_S:
                fresh.add(f.kind)
                w.findings[f.kind] = _Open(f.severity, o.since if o else local, local, _shape(f.message))
        for kind in set(w.findings) - {f.kind for f in findings}:
            o = w.findings.pop(kind)
            if kind != detectors.CRASH:
                self._event(w, kind, "info", f"{kind} cleared after {fmt_duration(local - o.since)}")
        return fresh

    def _decided(self, w: Watched, pr: ProbeResult, trigger: Finding, decision: policy.Action, local: float,
                 skew: float) -> None:
        detail = {"decision": decision.kind, "signature": decision.signature, "finding": trigger.kind,
                  "delay_s": round(decision.delay, 3), **trigger.detail}
        if not self.act:
            if decision.kind != policy.NONE:
                self._event(w, "decision", "info", f"would {decision.kind.replace('_', ' ')} (observing only): "
                            f"{decision.reason}", detail)
            return
        if decision.kind == policy.NONE:  # e.g. a process someone stopped on purpose
            if w.run.state != STALLED:
                self._transition(w, STALLED, decision.reason, detail, severity=decision.severity)
            return
        w.findings.pop(trigger.kind, None)  # acted on: the next one is news again
        if decision.kind == signatures.STOP:
            if pr.session_alive or (pr.process is not None and pr.process.alive):
                self._submit(w, "kill", self._kill_session, w.run)
            self._transition(w, FAILED, decision.reason, detail, severity=decision.severity,
                             exit_code=pr.exit_code, exit_reason=_stop_why(trigger, decision))
            return
        w.pending = _Pending(
            due=local + decision.delay, action=decision.kind, reason=decision.reason, signature=decision.signature,
            detected_at=w.crash_seen or local, failed_at=self._failure_time(w, pr, trigger, skew),
            step_before=w.step_max,
        )
        w.crash_seen = None
        if not self._transition(w, RESTARTING, decision.reason, detail, severity=decision.severity):
            # A restarted process that failed before it was seen running: still one decision, one event.
            self._event(w, "restart", decision.severity, decision.reason, detail)
        if decision.delay <= 0:
            self._issue_restart(w)

    def _failure_time(self, w: Watched, pr: ProbeResult, trigger: Finding, skew: float) -> float | None:
        """Local time the failure happened (see the module docstring)."""
        status = pr.status
        seen = w.last_ok or w.attempt_started
        if trigger.kind == detectors.CRASH:
            if status is not None and status.phase == contract.PHASE_FAILED and status.updated:
                return status.updated - skew
            return seen
        if trigger.detail.get("process_state") == "T":
            return seen
        progress = detectors.last_progress(list(w.samples), status)
        return progress[1] - skew if progress else seen

    def _finished(self, w: Watched, pr: ProbeResult, finding: Finding, local: float) -> None:
        code = pr.exit_code
        if not self.act:
            self._event(w, detectors.FINISHED, "info", finding.message, finding.detail)
            return
        state = DONE if finding.detail.get("outcome") == "done" else STOPPED
        reason = contract.describe_exit(code) if code is not None else finding.detail.get("outcome")
        self._transition(w, state, finding.message, finding.detail, exit_code=code, exit_reason=reason)
        self._alert(w, detectors.FINISHED, "info", finding.message, finding.detail, local)

    def _alert(self, w: Watched, kind: str, severity: str, message: str, detail: dict | None, local: float) -> None:
        event = alerts_mod.make_event(kind, severity, message, run_id=w.id, host=w.run.host,
                                      detail=_jsonable(detail), now=local)
        if w.alerter.send(event) == alerts_mod.DROPPED:
            self._event(w, "alert", "warning", f"alert queue full: the '{kind}' alert was dropped")

    # ----------------------------------------------------------------- restarts and kills, on a worker

    def _submit(self, w: Watched, kind: str, fn: Callable, *args) -> None:
        w.job_kind, w.job = kind, self._workers.submit(fn, *args)

    def _issue_restart(self, w: Watched) -> None:
        p = w.pending
        serialized = p.action == signatures.RESTART_SERIALIZED
        marker = (f"{RESTART_MARKER} restart {len(w.history) + 1} at {time.strftime('%Y-%m-%d %H:%M:%S')} "
                  f"({p.signature or 'unknown'}{', serialized warm-up' if serialized else ''}) ---")
        hung = p.signature == policy.STALL_SIGNATURE
        self._submit(w, "restart", self._restart, w.run, serialized, marker, hung)

    def _restart(self, run: Run, serialized: bool, marker: str, hung: bool = False) -> float:
        from dflashctl.launch import signal_trainer_argv
        from dflashctl.transport import connect

        current = self.store.get_run(run.id)
        if current.state in FINAL_STATES:  # `dflashctl stop` won the race: never start what was stopped
            raise RestartCancelled(f"restart not issued: the run is {current.state} meanwhile")
        transport = connect(run.host, self.inventory)
        if hung:
            # Before the hung process is killed, its threads' stacks go into trainer.log
            # (the trainer's faulthandler on SIGUSR1): where it hung is the diagnosis.
            transport.run(signal_trainer_argv(run.run_dir, "USR1"), timeout=15, check=False)
            time.sleep(STACK_DUMP_WAIT_S)
        transport.run(
            ["sh", "-c", _PREPARE_RESTART, "dflashctl-restart", run.run_dir, contract.EXIT_CODE_FILE,
             contract.STATUS_FILE, marker, contract.LOG_FILE], timeout=30)
        issued = self.clock()
        if self.restart_fn is not None:
            self.restart_fn(run.id, serialized, self.store, self.inventory)
        else:
            from dflashctl.launch import restart_run

            restart_run(run.id, serialized, self.store, self.inventory, clock=self.clock)
        return issued

    def _kill_session(self, run: Run) -> None:
        from dflashctl.tmux import Tmux

        Tmux(self.inventory.get(run.host), self.inventory, run.tmux_socket or _tmux_socket()).kill(run.tmux_session)

    def _collect_jobs(self) -> None:
        for w in self.runs.values():
            if w.job is None or not w.job.done():
                continue
            job, kind = w.job, w.job_kind
            w.job = w.job_kind = None
            error = job.exception()
            if kind == "restart":
                self._restarted(w, None if error else job.result(), error)
            elif error is not None:
                self._event(w, "stop", "warning",
                            f"could not kill tmux session {w.run.tmux_session}: {first_line(error)}")

    def _restarted(self, w: Watched, issued: float | None, error: BaseException | None) -> None:
        p, now = w.pending, self.clock()
        if isinstance(error, RestartCancelled):
            w.pending = None
            self._event(w, "restart", "info", str(error))
            return
        if error is not None:
            p.tries += 1
            if p.tries >= RESTART_TRIES or not isinstance(error, DflashError):  # e.g. a bug: no retry
                w.pending = None
                message = f"restart failed ({p.tries} tries): {first_line(error)}"
                self._transition(w, FAILED, message, severity="critical", exit_reason="restart failed")
                self._alert(w, "restart_failed", "critical", message, {"signature": p.signature}, now)
            else:
                p.due = now + max(w.policy.restart.backoff_initial, self.interval)
                self._event(w, "restart", "error", f"restart not issued (try {p.tries}/{RESTART_TRIES}; again in "
                            f"{fmt_duration(p.due - now)}): {first_line(error)}")
            return
        w.pending = None
        delay = p.detected_at - p.failed_at if p.failed_at is not None else None
        restart_id = self.store.add_restart(
            w.id, issued, p.reason, signature=p.signature, action=p.action, step_before=p.step_before,
            detect_delay_s=round(max(0.0, delay), 3) if delay is not None else None,
        )
        w.history.append(policy.Restart(issued, p.step_before, None))
        w.latest = _Latest(restart_id, issued, p.failed_at)
        # A new process: it resumes from a checkpoint, so the old one's steps are not its progress.
        w.restart_issued, w.attempt_started = True, issued
        w.samples.clear()
        w.findings.clear()
        w.step_max = w.healthy_since = w.last_ok = None
        w.phase, w.phase_since = None, issued + self.hosts.get(w.run.host, _HostState()).skew

    # ----------------------------------------------------------------- hosts

    def _host_failed(self, host: str, watched: list[Watched], error: str) -> None:
        now = self.clock()
        hs = self.hosts.setdefault(host, _HostState())
        if hs.down_since is None:
            hs.down_since, hs.polls, hs.severity = now, 0, None
        hs.polls += 1
        finding = detectors.detect_unreachable(host, hs.down_since, hs.polls, now, error=error,
                                               escalate_after=self.escalate_after)
        worse = hs.severity is None or _rank(finding.severity) > _rank(hs.severity)
        for w in watched:
            if worse:
                self._event(w, detectors.UNREACHABLE, finding.severity, finding.message, finding.detail)
                self._alert(w, detectors.UNREACHABLE, finding.severity, finding.message, finding.detail, now)
            if self.act and hs.polls >= LOST_AFTER_POLLS and w.run.state in (LAUNCHING, RUNNING, STALLED, RESTARTING):
                w.state_before_lost = w.run.state
                self._transition(w, LOST, f"host {host} unreachable for {hs.polls} polls; the trainer may still be "
                                 "running there", {"host": host, "since": hs.down_since})
        if worse:
            hs.severity = finding.severity

    def _host_back(self, host: str, watched: list[Watched]) -> None:
        hs = self.hosts[host]
        if hs.down_since is None:
            for w in watched:  # lost under an earlier supervisor (the outage and a restart of ours often coincide)
                if self.act and w.run.state == LOST:
                    self._transition(w, RUNNING, f"host {host} answers again; watching the run")
            return
        now = self.clock()
        message = f"host {host} reachable again after {fmt_duration(now - hs.down_since)} ({hs.polls} failed poll(s))"
        for w in watched:
            self._event(w, detectors.UNREACHABLE, "info", message, {"host": host, "down_s": now - hs.down_since})
            if self.act and w.run.state == LOST:
                back = w.state_before_lost if w.state_before_lost in TRANSITIONS[LOST] else RUNNING
                self._transition(w, back, message)
                w.state_before_lost = None
        hs.down_since, hs.polls, hs.severity = None, 0, None

    # ----------------------------------------------------------------- store and output

    def _transition(self, w: Watched, state: str, message: str, detail: dict | None = None, **kw) -> bool:
        """Move the run to ``state`` (False when it already is there, or is finished)."""
        current = self.store.get_run(w.id).state
        moved = False
        if current != state and current not in FINAL_STATES:  # only an operator revives a finished run
            if state not in TRANSITIONS[current] and state in TRANSITIONS[RUNNING] and RUNNING in TRANSITIONS[current]:
                # e.g. a (re)started process that fails or finishes before it was seen running
                self.store.transition(w.id, RUNNING, "trainer started", self.clock())
            moved = self.store.transition(w.id, state, message, self.clock(), _jsonable(detail), **kw)
        w.run = self.store.get_run(w.id)
        return moved

    def _event(self, w: Watched, kind: str, severity: str, message: str, detail: dict | None = None) -> None:
        self.store.add_event(w.id, kind, message, self.clock(), severity, _jsonable(detail))

    def _drain_hook_failures(self) -> None:
        while True:
            try:
                failure = self._hook_failures.get_nowait()
            except queue.Empty:
                return
            w = self.runs.get(failure.get("run_id"))
            if w is not None:
                detail = {k: v for k, v in failure["detail"].items() if k != "event"}
                self._event(w, failure["kind"], failure["severity"], failure["message"], detail)

    def _emit_new_events(self) -> None:
        """Every event stored for the watched runs since the last call, whoever wrote it
        (this loop, the launcher's restart, an operator's command)."""
        for w in self.runs.values():
            last_id, last_time = self._cursor.get(w.id, (0, 0.0))
            for e in self.store.events(w.id, since=last_time - 60.0):
                if e.id > last_id:
                    self.emit("event", e)
                    last_id, last_time = e.id, max(last_time, e.time)
            self._cursor[w.id] = (last_id, last_time)


# --------------------------------------------------------------------------- helpers


def live_supervisor(info: dict | None) -> dict | None:
    """``info`` when it names a live `watch` process of this machine other than this one."""
    if not info or not info.get("pid") or info.get("host") != socket.gethostname():
        return None
    pid = int(info["pid"])
    if pid == os.getpid():
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return None
    if stat[stat.rindex(")") + 2 :].split()[0] in ("Z", "X"):
        return None
    return info if b"watch" in argv else None  # the pid may have been reused by another program


def _attempt_output(pr: ProbeResult) -> str:
    """The current process's output: trainer.log after the last restart marker, else
    the pane (which holds only this process's output, but is gone once it ended)."""
    log = pr.log_tail or ""
    cut = log.rfind(RESTART_MARKER)
    if cut >= 0:
        end = log.find("\n", cut)
        log = log[end + 1 :] if end >= 0 else ""
    return log if log.strip() else (pr.pane_tail or "")


def _stop_why(trigger: Finding, decision: policy.Action) -> str:
    """The short reason a run was not restarted, for the runs table."""
    what = f"{trigger.kind} ({decision.signature}): {trigger.message}; "
    why = decision.reason[len(what) :] if decision.reason.startswith(what) else decision.reason
    return f"{decision.signature or trigger.kind}: {why}"[:300]


def _rank(severity: str) -> int:
    return detectors.SEVERITIES.index(severity)


def _seconds(value: float) -> str:
    return f"{value:.1f} s" if value < 60 else fmt_duration(value)


def _tmux_socket() -> str:
    from dflashctl.tmux import socket_name

    return socket_name()


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


# --------------------------------------------------------------------------- the watch command's library side


def format_line(kind: str, payload: Any) -> str:
    """One line per event (clock time, run, severity, kind, message) or metrics line."""
    if kind == "event":
        e = payload
        return f"{detectors.fmt_clock(e.time)}  {e.run_id}  {e.severity:<8} {e.kind:<11} {e.message}"
    if kind == "metrics":
        from dflashctl.launch import format_metrics

        run_id, m = payload
        return f"{detectors.fmt_clock(m.time)}  {run_id}  {format_metrics(m)}"
    return str(payload)


def follow(run_id: str, store: Store, inventory: "Inventory", emit_line: Callable[[str], None], *,
           interval: float | None = None, playbooks_dir: str | None = None) -> str:
    """Supervise one run in the foreground until it ends (``launch --foreground``),
    printing its events and metrics lines; returns its final state."""
    sup = Supervisor(store, inventory, interval=interval, playbooks_dir=playbooks_dir, metrics=True,
                     emit=lambda kind, payload: emit_line(format_line(kind, payload)))
    try:
        sup.attach(run_id)
    except BaseException:
        sup.close()
        raise
    sup.run()
    return store.get_run(run_id).state


def resolve_targets(sup: Supervisor, targets: Sequence[str]) -> None:
    """Each target: a run id, else a playbook name (its active runs, now and later),
    else an unambiguous prefix of a run id."""
    from dflashctl.config import list_playbooks

    for target in targets:
        if any(r.id == target for r in sup.store.list_runs(limit=None)):
            sup.attach(target)
            continue
        try:
            playbooks = set(list_playbooks(sup.playbooks_dir))
        except DflashError:
            playbooks = set()
        playbooks.update(r.playbook for r in sup.store.list_runs(limit=None))
        if target in playbooks:
            sup.watch_playbook(target)
            continue
        try:
            sup.attach(target)
        except SupervisorConflict:
            raise
        except DflashError as e:
            raise DflashError(f"no run or playbook named '{target}'",
                              hint=f"{first_line(e)}; `dflashctl runs` lists runs, playbooks/ holds playbooks",
                              ) from None


def watch(
    targets: Sequence[str],
    store: Store,
    inventory: "Inventory",
    *,
    interval: float | None = None,
    once: bool = False,
    metrics: bool = False,
    playbooks_dir: str | None = None,
    emit: Emit | None = None,
    stop: threading.Event | None = None,
) -> Supervisor:
    """The `watch` command: attach to the targets and tick until ``stop`` is set or
    nothing is left to watch. ``once``: one observing tick (no restarts, no claim)."""
    sup = Supervisor(store, inventory, interval=interval, playbooks_dir=playbooks_dir, emit=emit, metrics=metrics,
                     act=not once, claim=not once)
    try:
        resolve_targets(sup, targets)
        if not sup.active():
            raise DflashError(f"nothing to watch: no active run in {', '.join(targets)}",
                              hint="`dflashctl runs` lists runs and their states; "
                              "`dflashctl launch PLAYBOOK` starts one")
    except BaseException:
        sup.close()
        raise
    sup.run(stop, once=once)
    return sup
