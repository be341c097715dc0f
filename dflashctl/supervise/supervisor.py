"""The supervisor's shell: one loop watching many runs on many hosts.

Its decisions live in ``dflashctl.supervise.supervisor_core.step``, a pure function; this
module does the I/O around it. Each tick:

    probe    every host with a run to watch, concurrently (``transport.fanout``),
             ONE round trip per host: ``probe.probe_command`` for all its runs
    parse    ``probe.parse_probe_host`` and ``parsers.parse_metrics_chunk`` (pure)
    step     ``supervisor_core.step`` for each run with what its host answered (or
             that it did not), a restart or kill that finished, or only the clock
    store    every write of the tick (samples with their metrics.jsonl offset,
             events, state transitions, restart rows) in ONE transaction
    act      restarts, kills, evaluations and compile-artifact copies back on worker
             threads, so a slow host never holds up the other runs' ticks; alerts to
             the playbook's hooks (their own thread)

An unreachable host is a finding, never an error of the loop: its runs go ``lost``
after ``LOST_AFTER_POLLS`` failed polls and back to their state when it answers.
Nothing that matters lives only in memory: metrics offsets (stored with the
samples), samples and restart history are in the store, and the supervisor records
itself on each run (``Store.set_supervisor``), so a supervisor killed and started
again picks its runs up where it left them, without restarting anything.

Never here: a decision about a run (that is the core's), or anything drawn on a
terminal (``dflashctl.supervise.console`` formats the stream of events).
"""

from __future__ import annotations

import os
import queue
import random
import shlex
import socket
import sqlite3
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

from dflashctl.core import contract
from dflashctl.core.errors import ConfigError, DflashError, StoreError, first_line
from dflashctl.core.states import FINAL_STATES, LOST, RESTARTING, RUNNING, more_severe
from dflashctl.hosts.parsers import read_metrics_chunk
from dflashctl.hosts.probe import (
    ProbeArgs,
    ProbeError,
    ProbeResult,
    estimate_skew,
    pair,
    parse_probe_host,
    probe_command,
)
from dflashctl.hosts.transport import limits
from dflashctl.runs.recorded import playbook_now
from dflashctl.store import EVENT_STATE, InvalidTransition, Run, Store
from dflashctl.supervise import alerts as alerts_mod
from dflashctl.supervise import detectors, policy
from dflashctl.supervise import supervisor_core as core
from dflashctl.supervise.detectors import Finding, Sample
from dflashctl.supervise.supervisor_core import RESTART_MARKER, WINDOW, RunPolicy  # noqa: F401  (part of this module's API)

if TYPE_CHECKING:
    from dflashctl.config import Alerts, Inventory

PANE_LINES = 100
MEMBER_METRICS_BYTES = 64 * 1024  # per poll, of another rank's metrics file (only read to move past it)

# Before a restart: the previous process's answers (exit_code, status.json) must not
# be read as the next one's, and trainer.log (appended to by every process of the
# run) gets a marker, so the next crash is classified from its own output only.
PENDING_STOP_TIMEOUT_S = 30.0  # a stop that reaches a host late waits this long for its checkpoint

Emit = Callable[[str, Any], None]  # ('event', store.Event) | ('metrics', (run_id, Metrics)) | ('info', str)
# | ('observation', dict): with claim=False, what one tick saw of each run


class SupervisorConflict(DflashError):
    """Another live supervisor already watches the run."""


class RestartCancelled(DflashError):
    """The run was ended (an operator's stop) between the decision and the restart."""


def policy_for_run(run: Run, inventory: "Inventory", playbooks_dir: str | None = None) -> tuple[RunPolicy, str | None]:
    """The run's playbook (``recorded.playbook_now``); when it does not load, the
    defaults and a warning saying why."""
    pb, error = playbook_now(run, inventory, playbooks_dir)
    if pb is not None:
        return RunPolicy.from_playbook(pb), None
    return RunPolicy.defaults(run.playbook), (
        f"playbook {run.playbook} cannot be loaded ({error}); holding the run to the default expectations "
        "and restart policy"
    )


# --------------------------------------------------------------------------- what the shell holds


@dataclass
class Watched:
    """One run as this process follows it: the core's state plus the shell's handles."""

    state: core.RunState
    policy: RunPolicy
    alerter: alerts_mod.Alerter
    job: Future | None = None
    detached: str | None = None  # why it is no longer watched here
    member_args: dict[int, ProbeArgs] = field(default_factory=dict)  # a multi-host run's other ranks

    def probes(self) -> list[tuple[str, int]]:
        """(host, rank) of every process this run has: rank 0 first."""
        return [(self.run.host, 0)] + [(p.host, p.rank) for p in self.run.parts()[1:]]

    def args_of(self, rank: int) -> ProbeArgs:
        return self.state.args if rank == 0 else self.member_args[rank]

    @property
    def id(self) -> str:
        return self.state.run.id

    @property
    def run(self) -> Run:
        return self.state.run

    @property
    def active(self) -> bool:
        return self.state.run.state not in FINAL_STATES and self.detached is None


@dataclass
class _HostState:
    down_since: float | None = None
    polls: int = 0
    severity: str | None = None  # of the last unreachable event written
    skew: float = 0.0
    last_ok: float | None = None  # local: the last probe answer
    error: str | None = None  # why the last probe failed

    def heartbeat(self) -> dict[str, Any]:
        return {"last_ok": self.last_ok, "error": self.error, "down_since": self.down_since,
                "skew_s": round(self.skew, 3)}


@dataclass
class TickReport:
    time: float
    seconds: float
    hosts: dict[str, float | str]  # host -> probe round trip in seconds, or why it failed
    findings: dict[str, list[Finding]]  # run id -> this tick's finding events


@dataclass
class _Tick:
    """What one tick will store and do, gathered before anything is written."""

    writes: list[tuple[str | None, Any]] = field(default_factory=list)  # (run id, core write); None: a host's readings
    actions: list[tuple[Watched, Any]] = field(default_factory=list)
    claims: list[Run] = field(default_factory=list)
    metrics: list[tuple[str, contract.Metrics]] = field(default_factory=list)


# --------------------------------------------------------------------------- the supervisor


class Supervisor:
    """Watches runs (``attach``, ``watch_playbook``) and ticks (``tick``, ``run``).

    act=False observes only (samples, findings, alerts) and never changes a run's
    state, restarts or stops anything; claim=False does not record this process as
    the runs' supervisor. ``restart_fn(run_id, serialized_warmup, store, inventory)``
    defaults to ``runhost.restart_run``. ``clock`` is the local clock; ``rng`` drives
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
        # run -> {event id: its time} emitted, within EVENT_LOOKBACK_S of the newest
        self._cursor: dict[str, dict[int, float]] = {}
        self._evals: list[Future] = []  # evaluations of finished runs, on the workers
        self._side_jobs: list[Future] = []  # compile-artifact copies back and standby starts/ends, on the workers
        self._carry: list[tuple[str, Any]] = []  # writes still to store (after a tick's transaction, or failed)
        self._store_down: float | None = None  # since when the store refuses writes
        self._store_alerted: float | None = None
        self._hurry = False
        self._pruned = float("-inf")  # when the retention was last applied
        self.ticks = 0
        self.last_report: TickReport | None = None

    # ----------------------------------------------------------------- what to watch

    @property
    def interval(self) -> float:
        if self.interval_override is not None:
            return float(self.interval_override)
        return min([w.policy.poll_interval for w in self.active()] or [15.0])

    def _policy(self, w: Watched) -> core.Policy:
        return core.Policy(w.policy, act=self.act, interval=self.interval, escalate_after=self.escalate_after,
                           rng=self.rng)

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
                hint=f"stop that supervisor first (kill {other['pid']}); `dflashctl status {shlex.quote(run.id)}` shows "
                "the run",
            )
        run_policy, warning = policy_for_run(run, self.inventory, self.playbooks_dir)
        offset, inode = self.store.metrics_position(run.id)
        state = core.RunState(
            run=run,
            args=ProbeArgs(run_dir=run.run_dir or "", session=run.tmux_session,
                           socket=run.tmux_socket or _tmux_socket(), metrics_offset=offset, metrics_inode=inode,
                           pane_lines=PANE_LINES, nvidia_smi=bool(run.gpus)),
        )
        rows = [r for r in self.store.restarts(run.id) if r.counts]
        state.history = tuple(policy.Restart(r.time, r.step_before, r.step_after) for r in rows)
        if rows:
            last = rows[-1]
            state.attempt_started = last.time
            first = last.time + last.time_to_first_step_s if last.time_to_first_step_s is not None else None
            state.latest = core.Latest(last.time, None, first, last.step_after)
        # A run left restarting: its restart was either issued (watch the new process
        # start) or decided by a supervisor that is gone, its backoff in memory, or an
        # operator's restart that never confirmed: watch it as a starting process too;
        # if nothing runs, that is a crash and this supervisor decides again.
        state.restart_issued = run.state == RESTARTING
        state.stop_pending = self._stop_pending(run)
        last = self.store.samples(run.id, limit=1)
        state.last_line = (last[0].time, last[0].step) if last else None
        samples = []
        for s in self.store.samples(run.id, since=state.attempt_started, limit=WINDOW):
            samples.append(Sample(s.time, s.step, s.tok_s, s.phase or contract.PHASE_TRAINING, s.eta_s,
                                  loss=s.loss, acc=s.acc))
            state.step_max = max(state.step_max or 0, s.step)
            if state.healthy_since is None and s.phase == contract.PHASE_TRAINING:
                state.healthy_since = s.time  # host clock: the skew is not known yet, and small
        state.samples = tuple(samples)
        state.baseline = run_policy.expect.baseline_tok_s or self.store.baseline_tok_s(run.playbook, exclude_run=run.id)
        last_event = self.store.events(run.id, limit=1)
        since = (last_event[0].time if last_event else 0.0) - EVENT_LOOKBACK_S
        self._cursor[run.id] = {e.id: e.time for e in self.store.events(run.id, since=since)} if last_event else {}
        w = Watched(state=state, policy=run_policy, alerter=self._alerter(run_policy.alerts))
        # The other ranks' metrics are their own figures (rank 0's are the run's): only
        # their liveness and status are looked at, so a small bounded chunk per poll.
        w.member_args = {p.rank: ProbeArgs(run_dir=p.run_dir or "", session=p.tmux_session, rank=p.rank,
                                           socket=run.tmux_socket or _tmux_socket(), pane_lines=PANE_LINES,
                                           nvidia_smi=bool(run.gpus), metrics_max_bytes=MEMBER_METRICS_BYTES)
                         for p in run.parts()[1:]}
        self.runs[run.id] = w
        if not self.claim:  # looking once (`watch --once`) is not watching: nothing to record on the run
            if warning:
                self.emit("info", f"{run.id}: {warning}")
            return w
        with self.store.batch():
            self._claim(w)
            if warning:
                self.store.add_event(run.id, "supervisor", warning, self.clock(), "warning")
            how = "re-attached to" if (offset or rows) else "watching"
            self.store.add_event(run.id, "supervisor", f"supervisor pid {os.getpid()} {how} run {run.id} "
                                 f"({run.state} on {run.host})", self.clock(), "info",
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

    def _alerter(self, alerts: "Alerts") -> alerts_mod.Alerter:
        key = alerts.model_dump_json()
        if key not in self._alerters:
            # Hook failures arrive on the alert thread: handed over, stored by the loop.
            self._alerters[key] = alerts_mod.Alerter(alerts, on_hook_failure=self._hook_failures.put)
        return self._alerters[key]

    def _claim(self, w: Watched) -> None:
        # The launcher records its tmux session (after starting us): keep what it wrote.
        info = {**(w.run.supervisor or {}), **self.identity}
        if not os.environ.get("TMUX"):
            info["kind"] = "process"
        self.store.set_supervisor(w.id, info)
        w.state.run = replace(w.state.run, supervisor=info)

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
                dues = [w.state.pending.due - self.clock() for w in self.active()
                        if w.state.pending and w.job is None]
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
                except Exception:  # noqa: BLE001  (recorded as the job's outcome)
                    pass
        for job in self._side_jobs:  # each records its own outcome; none is waited for past the deadline
            try:
                job.result(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001  (a copy back that fails or takes too long is only a cold start later)
                pass
        for job in self._evals:  # an evaluation has its own time limit (eval.timeout)
            if not job.done():
                self.emit("info", "waiting for the evaluation of a finished run")
            try:
                job.result()
            except Exception as e:  # noqa: BLE001  (a bug in it must not lose the rest of close)
                self.emit("info", f"the evaluation failed: {type(e).__name__}: {first_line(e)}")
        t = _Tick(writes=self._carry)
        self._carry = []
        self._collect_jobs(t)
        self._workers.shutdown(wait=False)
        for alerter in self._alerters.values():
            alerter.close(timeout=max(0.1, min(10.0, deadline - time.monotonic())))
        self._drain_hook_failures(t)
        try:
            self._store_tick(t)
            self._act(t)
        except DflashError:
            pass
        if self.claim:
            for w in self.runs.values():
                try:
                    if (self.store.get_run(w.id).supervisor or {}).get("pid") == os.getpid():
                        self.store.set_supervisor(w.id, None)
                except DflashError:
                    pass
            try:
                self._heartbeat(self.clock(), stopped=True)
            except (sqlite3.Error, DflashError):
                pass  # the store refuses writes: its last tick's age says the same
        self._emit_new_events()

    def tick(self) -> TickReport:
        from dflashctl.hosts.transport import fanout

        t0, now = time.monotonic(), self.clock()
        self.ticks += 1
        self._hurry = False
        if self.playbooks:
            self._refresh_playbooks()
        t = _Tick(writes=self._carry)
        self._carry = []
        self._drain_hook_failures(t)
        for w in self.active():
            self._refresh(w, t)
        self._collect_jobs(t)
        for w in self.active():
            if w.job is None:
                # Every host of the run (a multi-host restart runs on each): else when they are back.
                host_up = all(self.hosts.get(host, _HostState()).down_since is None for host, _ in w.probes())
                self._step(w, core.Clock(host_up=host_up), now, t)
        by_host: dict[str, list[tuple[Watched, int]]] = {}  # (run, rank): every process of every run
        for w in self.active():
            for host, rank in w.probes():
                entries = by_host.setdefault(host, [])  # a host is read even while its runs are not looked at
                if w.job is None and w.state.job is None:  # a restart or kill in flight: look again when it is done
                    entries.append((w, rank))
        answers = fanout(list(by_host), lambda tr: self._probe(tr, by_host[tr.name]), inventory=self.inventory)
        report = TickReport(now, 0.0, {}, {})
        # Each answer parsed and paired with what was asked once; the other ranks of
        # every run gathered before any rank 0 is stepped.
        parsed = {host: None if isinstance(answer, Exception) else parse_probe_host(answer[0].stdout)
                  for host, answer in answers.items()}
        paired = {host: pair([w.args_of(rank) for w, rank in by_host[host]], p.runs, host)
                  for host, p in parsed.items() if p is not None and not isinstance(p, ProbeError)}
        members: dict[str, list[core.Member]] = {}  # run id -> its other ranks
        for host, answer in answers.items():
            self._members(host, by_host[host], answer, parsed[host], paired.get(host), members)
        for host, answer in answers.items():
            self._host_answer(host, by_host[host], answer, parsed[host], paired.get(host), report, t, members)
        self._store_tick(t)
        self._act(t)
        self._emit_new_events([(m.time, "metrics", (run_id, m)) for run_id, m in t.metrics])
        report.findings = {run_id: [Finding(e.kind, e.severity, e.message, e.detail or {})
                                    for rid, e in t.writes if rid == run_id and isinstance(e, core.Event)
                                    and e.kind in _FINDING_KINDS]
                           for run_id in report.findings}
        if not self.claim:
            for w in [w for ws in by_host.values() for w, rank in ws if rank == 0]:
                self.emit("observation", self._observation(w, report))
        report.seconds = time.monotonic() - t0
        self.last_report = report
        return report

    def _observation(self, w: Watched, report: TickReport) -> dict:
        """What one look at a run found (``watch --once``): nothing of it is stored as
        an event on a run this process does not watch."""
        st = w.state
        last = st.samples[-1] if st.samples else None
        answer = report.hosts.get(w.run.host)
        return {
            "kind": "observation", "run_id": w.id, "host": w.run.host, "state": w.run.state, "phase": st.phase,
            "step": st.step_max, "total_steps": last.total_steps if last else None,
            "tok_s": last.tok_s if last else None, "sample_time": last.time if last else None,
            "host_answer_s": answer if isinstance(answer, float) else None,
            "host_error": answer if isinstance(answer, str) else None,
            "findings": [{"kind": f.kind, "severity": f.severity, "message": f.message}
                         for f in report.findings.get(w.id, [])],
        }

    def _step(self, w: Watched, obs: Any, now: float, t: _Tick) -> None:
        w.state, writes, actions = core.step(w.state, obs, now, self._policy(w))
        if not self.claim:  # looking is not watching: only the samples it read are kept
            writes = [x for x in writes if isinstance(x, core.Samples)]
        t.writes.extend((w.id, x) for x in writes)
        t.actions.extend((w, a) for a in actions)

    # ----------------------------------------------------------------- probe

    def _probe(self, transport, watched: list[tuple[Watched, int]]):
        limit = self.probe_timeout or min(float(transport.host.command_timeout), max(10.0, 3 * self.interval))
        args = [w.args_of(rank) for w, rank in watched]
        sent = self.clock()
        result = transport.run(probe_command(transport.host.python, args, nvidia_smi=self._reads_gpus(transport.host)),
                               timeout=limit, check=False, limit=limits.probe(args))
        return result, sent, self.clock()

    def _reads_gpus(self, host: Any) -> bool:
        """Whether a poll of ``host`` asks nvidia-smi: the inventory gives it GPUs, or a
        watched run holds some there (a host whose runs are CPU runs still shows its GPUs)."""
        return bool(getattr(host, "gpus", None)) or any(
            w.run.gpus for w in self.active() if host.name in {h for h, _ in w.probes()})

    def _members(self, host: str, entries: list[tuple[Watched, int]], answer: Any, parsed: Any,
                 paired: list | None, members: dict[str, list[core.Member]]) -> None:
        """The processes of ranks > 0 in one host's answer (``paired``: its entries for
        ``entries``, ``probe.pair``), or its failure."""
        error = _failure(answer) if isinstance(answer, Exception) else (
            parsed.message if isinstance(parsed, ProbeError) else None)
        for i, (w, rank) in enumerate(entries):
            if rank == 0:
                continue
            pr, why = None, error
            if error is None:
                pr, why = (paired[i], None) if isinstance(paired[i], ProbeResult) else (None, paired[i])
            if pr is not None:
                w.member_args[rank] = pr.next_args(w.member_args[rank])
            members.setdefault(w.id, []).append(core.Member(rank, host, pr, why))

    def _host_answer(self, host: str, entries: list[tuple[Watched, int]], answer: Any, parsed: Any,
                     paired: list | None, report: TickReport, t: _Tick, members: dict[str, list[core.Member]]) -> None:
        watched = [w for w, rank in entries if rank == 0]
        if isinstance(answer, Exception):
            report.hosts[host] = _failure(answer)
            self._host_failed(host, watched, report.hosts[host], t, members)
            return
        result, sent, received = answer
        for note in getattr(result, "notes", None) or ():  # e.g. a wedged connection replaced
            t.writes.extend((w.id, core.Event("transport", "warning", f"host {host}: {note}")) for w in watched)
        if isinstance(parsed, ProbeError):
            tail = (result.stderr.strip() or parsed.output_tail.strip())[-300:]
            report.hosts[host] = f"the probe failed (exit {result.exit_code}): {parsed.message}: {tail}"
            self._host_failed(host, watched, report.hosts[host], t, members)
            return
        report.hosts[host] = received - sent
        hs = self.hosts.setdefault(host, _HostState())
        hs.skew = estimate_skew(parsed.host_time, sent, received)
        hs.last_ok, hs.error = received, None
        back = (hs.down_since, hs.polls) if hs.down_since is not None else None
        hs.down_since, hs.polls, hs.severity = None, 0, None
        now = self.clock()
        readings = core.host_readings(host, parsed, [(w.id, pr) for (w, _), pr in zip(entries, paired)
                                                     if isinstance(pr, ProbeResult)], received)
        if readings is not None:
            t.writes.append((None, readings))
        for (w, rank), pr in zip(entries, paired):
            if rank != 0:
                continue
            report.findings[w.id] = []
            if not isinstance(pr, ProbeResult):  # not this run's answer: nothing is concluded from it
                t.writes.append((w.id, core.Event("supervisor", "warning", pr)))
                continue
            chunk = read_metrics_chunk(pr.metrics_chunk)
            lines = chunk.rows
            obs = core.Probed(pr, hs.skew, tuple(lines), tuple(chunk.rejected), back,
                              tuple(sorted(members.get(w.id, ()), key=lambda m: m.rank)))
            try:
                self._step(w, obs, now, t)
            except Exception as e:  # noqa: BLE001  (one run's trouble must not stop the watch of the others)
                if os.environ.get("DFLASHCTL_DEBUG"):
                    raise
                t.writes.append((w.id, core.Event("supervisor", "error",
                                                  f"could not handle this poll: {type(e).__name__}: {first_line(e)}")))
                continue
            self._hurry = self._hurry or pr.metrics_more
            if self.metrics:
                t.metrics.extend((w.id, m) for m in lines)

    def _host_failed(self, host: str, watched: list[Watched], error: str, t: _Tick,
                     members: dict[str, list[core.Member]] | None = None) -> None:
        now = self.clock()
        hs = self.hosts.setdefault(host, _HostState())
        if hs.down_since is None:
            hs.down_since, hs.polls, hs.severity = now, 0, None
        hs.polls += 1
        hs.error = error
        finding = detectors.detect_unreachable(host, hs.down_since, hs.polls, now, error=error,
                                               escalate_after=self.escalate_after)
        worse = hs.severity is None or more_severe(finding.severity, hs.severity)
        for w in watched:
            others = tuple(sorted((members or {}).get(w.id, ()), key=lambda m: m.rank))
            self._step(w, core.Unreachable(host, finding, hs.polls, hs.down_since, worse, others), now, t)
        if worse:
            hs.severity = finding.severity

    def _refresh(self, w: Watched, t: _Tick) -> None:
        """Pick up what others changed: an operator's stop or restart, a new supervisor."""
        run = self.store.get_run(w.id)
        before = w.state.run.state
        if run.state == LOST and before != LOST and not w.state.stop_pending:
            w.state.stop_pending = self._stop_pending(run)  # `dflashctl stop` could not reach every host
        if before == RESTARTING and run.state == RUNNING and w.state.pending is None and not w.state.restart_issued:
            # An operator's restart (`dflashctl restart` of a running run, watched here): its process is new.
            core.new_attempt(w.state, self.clock(), self.hosts.get(run.host, _HostState()).skew)
        w.state.run = run
        if self.claim:
            theirs = run.supervisor or {}
            if theirs.get("pid") not in (None, os.getpid()) and live_supervisor(theirs) is not None:
                w.detached = f"supervisor pid {theirs['pid']} took it over"
                self.emit("info", f"{w.id}: {w.detached}; no longer watching it here")
            elif theirs.get("pid") != os.getpid():
                t.claims.append(run)

    # ----------------------------------------------------------------- store, then act

    def _store_tick(self, t: _Tick) -> None:
        """Every write of the tick in one transaction. When the store cannot take it
        (disk full, locked for too long), the writes wait in memory for the next tick,
        in order, and the operator is alerted: supervision never waits for the store."""
        now = self.clock()
        try:
            with self.store.batch():
                if self.claim:
                    self._heartbeat(now)
                for run in t.claims:
                    if run.id in self.runs:
                        self._claim(self.runs[run.id])
                for run_id, x in t.writes:
                    self._write(run_id, x, now)
                if self.claim and now - self._pruned >= PRUNE_EVERY_S:
                    self._pruned = now
                    apply_retention(self.store, [(w.run, w.policy) for w in self.active()])
        except (sqlite3.Error, StoreError) as e:
            self._store_failed(self.store.error(e), t)
            return
        if self._store_down is not None:
            self.emit("info", f"the run store takes writes again after {detectors.fmt_duration(now - self._store_down)}")
            self._store_down = self._store_alerted = None
        for run_id in {run_id for run_id, x in t.writes if isinstance(x, core.Transition)}:
            w = self.runs.get(run_id)
            if w is not None:
                w.state.run = self.store.get_run(run_id)  # what was stored: the state, ended, exit code

    def _heartbeat(self, now: float, stopped: bool = False) -> None:
        """This supervisor's tick in the store: what `status` tells "supervised" and
        "data N s old" from."""
        self.store.heartbeat(
            f"{self.identity['host']}:{self.identity['pid']}:{self.identity['started']:.3f}",
            pid=self.identity["pid"], host=self.identity["host"], started=self.identity["started"],
            interval=self.interval, now=now, runs=sorted(w.id for w in self.active()),
            hosts={name: hs.heartbeat() for name, hs in self.hosts.items()}, stopped=stopped)

    def _store_failed(self, error: StoreError, t: _Tick) -> None:
        now = self.clock()
        self._store_down = self._store_down or now
        kept = _bounded_carry(t.writes)
        self._carry = kept + self._carry
        message = f"{error} (since {detectors.fmt_clock(self._store_down)}; {len(kept)} writes kept in memory " \
                  "and retried each tick)"
        self.emit("info", f"supervisor: {message}" + (f"; {error.hint}" if error.hint else ""))
        if self._store_alerted is None or now - self._store_alerted >= core.REPEAT_FINDING_S:
            self._store_alerted = now
            for w in self.active():
                w.alerter.send(alerts_mod.make_event("store", "critical", message, run_id=w.id, host=w.run.host,
                                                     detail={"hint": error.hint}, now=now))

    def _write(self, run_id: str | None, x: Any, now: float) -> None:
        if isinstance(x, core.Event):
            self.store.add_event(run_id, x.kind, x.message, now, x.severity, x.detail)
        elif isinstance(x, core.Transition):
            try:
                self.store.transition(run_id, x.to, x.message, now, x.detail, severity=x.severity,
                                      exit_code=x.exit_code, exit_reason=x.exit_reason)
            except InvalidTransition:
                pass  # changed meanwhile (an operator's stop): the next tick reads the run again
        elif isinstance(x, core.Samples):
            self.store.add_samples(run_id, x.lines, metrics_offset=x.offset, metrics_inode=x.inode,
                                   observed=x.observed)
        elif isinstance(x, core.Readings):
            self.store.add_readings(x.host, x.observed, x.gpu, x.reading)
        elif isinstance(x, core.RestartRow):
            self.store.add_restart(run_id, x.time, x.reason, signature=x.signature, action=x.action,
                                   step_before=x.step_before, detect_delay_s=x.detect_delay_s, outcome=x.outcome)
        elif isinstance(x, core.RestartUpdate):
            self.store.update_latest_restart(run_id, **x.changes)
        elif isinstance(x, core.HostRows):
            self.store.update_run_hosts(run_id, list(x.rows), now)
        else:
            raise TypeError(f"not a write: {x!r}")

    def _act(self, t: _Tick) -> None:
        for w, a in t.actions:
            if isinstance(a, core.Alert):
                # A hook that fails, times out or drops the alert reports it (on_hook_failure).
                w.alerter.send(alerts_mod.make_event(a.kind, a.severity, a.message, run_id=w.id, host=w.run.host,
                                                     detail=a.detail, now=self.clock()))
            elif isinstance(a, core.IssueRestart):
                w.job = self._workers.submit(self._restart, w.run, a.serialized, a.marker, a.hung)
            elif isinstance(a, core.KillSession):
                w.job = self._workers.submit(self._kill_session, w.run)
            elif isinstance(a, core.StopParts):
                w.job = self._workers.submit(self._stop_parts, w.run, a.ranks)
            elif isinstance(a, core.RunEval):
                self._evals.append(self._workers.submit(self._eval, w.run, w.policy.eval))
            elif isinstance(a, core.FetchCompileCache):
                self._side_job(self._fetch_compile_cache, w.run, a.outcome)
            elif isinstance(a, (core.StartStandby, core.EndStandby)):
                self._side_job(self._standby, w.run, isinstance(a, core.StartStandby))

    def _side_job(self, fn: Callable, *args: Any) -> None:
        self._side_jobs = [f for f in self._side_jobs if not f.done()]
        self._side_jobs.append(self._workers.submit(fn, *args))

    # ----------------------------------------------------------------- restarts and kills, on a worker

    def _restart(self, run: Run, serialized: bool, marker: str, hung: bool = False) -> float:
        from dflashctl.runs.runhost import restart_run

        current = self.store.get_run(run.id)
        if current.state in FINAL_STATES:  # `dflashctl stop` won the race: never start what was stopped
            raise RestartCancelled(f"restart not issued: the run is {current.state} meanwhile")
        issued = self.clock()
        # The marker goes into trainer.log first; a hung process's stacks before it is
        # ended (SIGUSR1: where it hung is the diagnosis). On one host, one round trip.
        (self.restart_fn or restart_run)(run.id, serialized, self.store, self.inventory, clock=self.clock,
                                         marker=marker, hung=hung)
        return issued

    def _eval(self, run: Run, settings: Any) -> None:
        from dflashctl.runs.evaluate import eval_run

        try:
            eval_run(run.id, self.store, self.inventory, settings, clock=self.clock)
        except DflashError as e:
            self.emit("info", f"{run.id}: {first_line(e)}")  # stored with the run by eval_run

    def _fetch_compile_cache(self, run: Run, claim: str) -> None:
        from dflashctl.runs.compile_cache import copy_back
        from dflashctl.runs.runhost import artifact_inputs

        try:
            trainer, bundle, gpu = artifact_inputs(self.store, self.store.get_run(run.id))
            copy_back(run.id, self.store, self.inventory, trainer, bundle, gpu, claim,
                      clock=self.clock)  # its outcome is an event of the run
        except (DflashError, ValueError, KeyError, OSError, sqlite3.Error) as e:
            self.emit("info", f"{run.id}: compile artifacts not copied back: {first_line(e)}")

    def _standby(self, run: Run, start: bool) -> None:
        from dflashctl.runs.standby import end_standby, start_standby

        try:
            if start:
                start_standby(run.id, self.store, self.inventory, clock=self.clock)  # an event of the run
            else:
                end_standby(run, self.inventory)
        except (DflashError, sqlite3.Error) as e:
            self.emit("info", f"{run.id}: standby not {'started' if start else 'ended'}: {first_line(e)}")

    def _kill_session(self, run: Run) -> None:
        from dflashctl.runs.access import part_tmux

        for part in run.parts():
            part_tmux(part, self.inventory).kill(part.tmux_session)

    def _stop_parts(self, run: Run, ranks: tuple[int, ...]) -> None:
        from dflashctl.runs.runhost import stop_parts

        stop_parts(run, ranks, self.inventory, timeout=PENDING_STOP_TIMEOUT_S)

    def _stop_pending(self, run: Run) -> frozenset:
        """The ranks a stop could not reach, as the run's last transition to lost (or
        the stop that found it lost) recorded them; none for a run not lost."""
        if run.state != LOST:
            return frozenset()
        last = [e for kind in (EVENT_STATE, "stop") for e in self.store.events(run.id, kind=kind, limit=1)]
        newest = max(last, key=lambda e: (e.time, e.id), default=None)
        ranks = (newest.detail or {}).get("stop_pending") if newest is not None else None
        return frozenset(r for r in ranks if isinstance(r, int)) if isinstance(ranks, list) else frozenset()

    def _collect_jobs(self, t: _Tick) -> None:
        now = self.clock()
        for w in self.runs.values():
            if w.job is None or not w.job.done():
                continue
            job, kind = w.job, w.state.job or core.RESTART
            w.job = None
            error = job.exception()
            skew = self.hosts.get(w.run.host, _HostState()).skew
            if error is None:
                done = core.JobDone(kind, issued=job.result() if kind == core.RESTART else None, skew=skew)
            else:
                done = core.JobDone(kind, error=first_line(error), cancelled=isinstance(error, RestartCancelled),
                                    retry=isinstance(error, DflashError), skew=skew)
            self._step(w, done, now, t)

    # ----------------------------------------------------------------- output

    def _drain_hook_failures(self, t: _Tick) -> None:
        while True:
            try:
                failure = self._hook_failures.get_nowait()
            except queue.Empty:
                return
            if failure.get("run_id") in self.runs:
                detail = {k: v for k, v in failure["detail"].items() if k != "event"}
                t.writes.append((failure["run_id"], core.Event(failure["kind"], failure["severity"],
                                                               failure["message"], core.jsonable(detail))))

    def _emit_new_events(self, metrics: Sequence[tuple[float, str, Any]] = ()) -> None:
        """Every event stored for the watched runs since the last call, whoever wrote it
        (this loop, the launcher's restart, an operator's command), and this tick's
        metrics records, emitted in time order across runs. An event stored late with
        an earlier time (another writer's clock, a transaction that waited) is still
        emitted once: emitted ids are remembered for ``EVENT_LOOKBACK_S``."""
        pending = list(metrics)
        for w in self.runs.values():
            emitted = self._cursor.setdefault(w.id, {})
            since = max(emitted.values(), default=0.0) - EVENT_LOOKBACK_S
            fresh = [e for e in self.store.events(w.id, since=since) if e.id not in emitted]
            pending.extend((e.time, "event", e) for e in fresh)
            emitted.update((e.id, e.time) for e in fresh)
            since = max(emitted.values(), default=0.0) - EVENT_LOOKBACK_S
            for old in [i for i, t in emitted.items() if t <= since]:  # the next query cannot return them
                del emitted[old]
        for _, kind, payload in sorted(pending, key=lambda item: item[0]):
            self.emit(kind, payload)


# --------------------------------------------------------------------------- helpers


def _failure(error: Exception) -> str:
    """Why a host did not answer, in one line: a changed host key with its fix."""
    from dflashctl.hosts.transport import HostKeyChanged

    return error.says() if isinstance(error, HostKeyChanged) else first_line(error)


def live_supervisor(info: dict | None) -> dict | None:
    """``info`` when it names a live supervisor process of this machine other than
    this one: a `watch`, or a `launch --foreground` (it supervises its run itself)."""
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
    supervises = b"watch" in argv or (b"launch" in argv and b"--foreground" in argv)
    return info if supervises else None  # the pid may have been reused by another program


_attempt_output = core.attempt_output


_FINDING_KINDS = (detectors.CRASH, detectors.STALL, detectors.REGRESSION, detectors.FINISHED, detectors.CONFLICT)
EVENT_LOOKBACK_S = 60.0  # an event stored this much later than a newer one's time is still emitted
MAX_CARRIED_SAMPLES = 2000  # sample batches kept in memory while the store refuses writes


def _bounded_carry(writes: list[tuple[str | None, Any]]) -> list[tuple[str | None, Any]]:
    """The writes to keep while the store refuses them: all events, transitions and
    restart rows; of the sample batches the newest (each carries the metrics offset
    after its lines, so a dropped older batch loses its lines, never the position);
    of each host's readings the newest."""
    samples = [i for i, (_, x) in enumerate(writes) if isinstance(x, core.Samples)]
    dropped = set(samples[:-MAX_CARRIED_SAMPLES]) if len(samples) > MAX_CARRIED_SAMPLES else set()
    newest = {x.host: i for i, (_, x) in enumerate(writes) if isinstance(x, core.Readings)}
    dropped |= {i for i, (_, x) in enumerate(writes) if isinstance(x, core.Readings) and newest[x.host] != i}
    return [w for i, w in enumerate(writes) if i not in dropped]


PRUNE_EVERY_S = 60.0  # the retention is applied in a tick this often: a minute's rows at a time


def apply_retention(store: Store, runs: Sequence[tuple[Run, RunPolicy]]) -> dict[str, int]:
    """Each run's playbook retention on its samples and rollups, and on its hosts'
    readings (a host shared by runs keeps the longest of theirs); the rows deleted, by table."""
    from dflashctl.config import Retention

    default = Retention()
    by_policy: dict[tuple[float, float], list[str]] = {}
    hosts: dict[str, tuple[float, float]] = {}  # host -> (readings, fine) kept
    for run, pol in runs:
        keep = pol.retention or default
        by_policy.setdefault((float(keep.full), float(keep.fine)), []).append(run.id)
        for host in run.host_names:
            mine = (float(keep.readings), float(keep.fine))
            hosts[host] = (max(hosts.get(host, mine)[0], mine[0]), max(hosts.get(host, mine)[1], mine[1]))
    deleted: dict[str, int] = {}
    jobs = [dict(runs=ids, full_s=full, fine_s=fine) for (full, fine), ids in by_policy.items()]
    jobs += [dict(hosts=[host], full_s=readings, fine_s=fine) for host, (readings, fine) in hosts.items()]
    for job in jobs:
        for table, n in store.prune(**job).items():
            deleted[table] = deleted.get(table, 0) + n
    return deleted


def _tmux_socket() -> str:
    from dflashctl.hosts.tmux import socket_name

    return socket_name()


# --------------------------------------------------------------------------- the watch command's library side


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
        except ConfigError as e:  # no such run: bad input (exit 2)
            raise ConfigError(f"no run or playbook named '{target}'",
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
    store.quick_check()  # a supervisor never writes days of runs into a file that is already damaged
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
