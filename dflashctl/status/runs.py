"""Run views: one line per run, its columns, and the order that puts trouble first.

A ``RunView`` is what the console's run list and ``status --once`` show of a run:
its freshness, phase, progress, rates, tau, restarts, hosts; ``notices_of`` says
what of it the operator must act on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Sequence

from dflashctl.core.contract import describe_exit, tau_estimate, tau_gap
from dflashctl.core.errors import first_line
from dflashctl.core.states import ACTIVE_STATES, RESTARTING, STALLED
from dflashctl.core.units import NA, fmt_clock, fmt_duration, fmt_tok_s, short_duration, short_rate
from dflashctl.status.columns import Col, choose
from dflashctl.status.events import EventView, matching
from dflashctl.status.freshness import Freshness
from dflashctl.status.phase import PROGRESSING, PhaseView
from dflashctl.status.styles import PHASE_STYLE, SEVERITY_STYLE, STATE_STYLE, _num, spark
from dflashctl.store import Event, Run


@dataclass
class RunHostView:
    """One host (rank) of a multi-host run: its process as the supervisor last saw it
    (``Store.update_run_hosts``), and how old that is. ``stale``: older than the
    run's freshness window (``Freshness.stale_after_s``), the rule a run's own data
    is held to; a finished run's rows are shown with their age, never as stale."""

    rank: int
    host: str
    phase: str | None = None  # the process's status.json phase
    step: int | None = None
    alive: bool | None = None  # the process exists (None: not read)
    exit_code: int | None = None  # what run.sh wrote: the process ended
    exit_reason: str | None = None  # the exit code in words (contract.describe_exit)
    error: str | None = None  # what the probe could not read, or why the host did not answer
    seen: float | None = None  # when the supervisor last got an answer from it (local clock)
    age_s: float | None = None  # now - seen; None: never seen
    stale: bool = False

    @classmethod
    def from_row(cls, row: dict[str, Any], now: float, stale_after_s: float | None) -> "RunHostView":
        seen, code = row.get("seen"), row.get("exit_code")
        age = None if seen is None else max(0.0, now - seen)
        return cls(row["rank"], row["host"], row.get("phase"), row.get("step"), row.get("alive"), code,
                   None if code is None else describe_exit(code), row.get("error"), seen, age,
                   age is not None and stale_after_s is not None and age > stale_after_s)

    def state_text(self) -> str:
        """What the process is doing: its phase, or that it ended or is gone."""
        if self.exit_code is not None:
            return f"ended: {self.exit_reason}"
        if self.alive is False:
            return "not alive"
        return self.phase or NA

    def seen_text(self) -> str:
        if self.age_s is None:
            return "no answer yet"
        return ("stale: " if self.stale else "") + f"seen {short_duration(self.age_s)} ago"


@dataclass
class DirectProbe:
    """What the status console saw itself of a run nobody supervises (one probe round
    trip, in a worker): nothing of it is stored."""

    time: float
    session_alive: bool | None = None
    trainer_alive: bool | None = None
    trainer_state: str | None = None  # /proc state letter: T is stopped
    phase: str | None = None
    step: int | None = None
    exit_code: int | None = None
    error: str | None = None

    @classmethod
    def from_probe(cls, time: float, result: Any) -> "DirectProbe":
        """From a ``probe.ProbeResult``."""
        status, process = result.status, result.process
        return cls(time, result.session_alive, process.alive if process else None, process.state if process else None,
                   status.phase if status else None, status.step if status else None, result.exit_code)

    @classmethod
    def of(cls, run_id: str, store: Any, inventory: Callable[[], Any], clock: Callable[[], float],
           timeout: float) -> "DirectProbe":
        """Probe run ``run_id`` on its host now (one round trip; ``inventory()`` loads
        the inventory); an inventory or a host that cannot be read is an ``error``,
        never an exception."""
        from dflashctl.runs.access import host_transport, probe_run

        try:
            run = store.get_run(run_id)
            return cls.from_probe(clock(), probe_run(host_transport(run.host, inventory()), run, timeout=timeout))
        except Exception as e:  # noqa: BLE001  (shown as "no answer (...)", never a crash of the caller)
            return cls(clock(), error=first_line(e))

    def text(self, now: float) -> str:
        head = f"probed by status {fmt_duration(max(0.0, now - self.time))} ago: "
        if self.error:
            return head + f"no answer ({self.error})"
        if self.exit_code is not None:
            alive = f"the trainer ended (exit code {self.exit_code})"
        elif self.trainer_alive:
            alive = "the trainer is alive" + (" but stopped (SIGSTOP)" if self.trainer_state == "T" else "")
        elif self.session_alive:
            alive = "its tmux session is alive"
        else:
            alive = "no trainer and no session"
        return head + alive + (f", {self.phase}" if self.phase else "") + (f" at step {self.step:,}" if self.step else "")


@dataclass
class Notice:
    """Something the operator must act on, with the command that does it."""

    severity: str  # warning | error
    text: str
    fix: str | None = None
    run_id: str | None = None


@dataclass
class RunView:
    id: str
    playbook: str
    host: str
    state: str  # as stored
    created: float
    freshness: Freshness
    phase: PhaseView
    total_steps: int | None = None
    step: int | None = None
    tok_s: float | None = None  # mean over the window (training samples)
    tok_s_last: float | None = None  # the newest sample's
    window_s: float = 0.0  # what tok/s and the ETA are averaged over
    tok_s_history: list[float] = field(default_factory=list)  # the current process's newest samples
    loss_history: list[float] = field(default_factory=list)
    accept_history: list[float] = field(default_factory=list)
    baseline_tok_s: float | None = None
    baseline_pct: float | None = None
    eta_s: float | None = None  # None when the data is not live
    mfu: float | None = None  # the trainer's estimate against the GPU's nominal peak, 0..1 (GPU runs only)
    mfu_measured: float | None = None  # the same against the rate a large matmul reaches there
    samples_s: float | None = None  # the newest line's samples (sequences) per second
    loss: float | None = None
    acc: float | None = None
    accept_len: float | None = None  # the trainer's expected run of correct drafter slots (tau_est - 1)
    tau: float | None = None  # measured tau (accepted + 1 per target forward), the newest eval's
    tau_eval: dict[str, Any] | None = None  # that eval's figures (store.preferred_eval)
    sample_time: float | None = None  # newest sample, trainer's clock
    restarts: int = 0
    last_event: EventView | None = None
    exit_reason: str | None = None
    gpus: list[int] = field(default_factory=list)
    roles: dict[int, str] = field(default_factory=dict)
    hosts: list[RunHostView] = field(default_factory=list)  # a multi-host run's, by rank ([]: one host)
    probe: DirectProbe | None = None  # what the console saw itself of it, while nobody supervises it
    attention: str | None = None  # failed, crash loop, stalled, regressed: what sorts it first (``ATTENTION``)

    @property
    def probed(self) -> DirectProbe | None:
        """The console's own probe, where it says more than the store: an active run
        nobody supervises, probed without an error."""
        p = self.probe
        return p if p is not None and not p.error and self.active and not self.freshness.supervised else None

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    @property
    def display_state(self) -> str:
        """The state as the operator should read it: an active run nobody watches is
        ``unsupervised``, one whose host does not answer ``unreachable`` (or
        ``stale`` while its supervisor has not yet said so)."""
        f = self.freshness
        if not self.active:
            return self.state
        if not f.supervised:
            return "unsupervised"
        if f.store_busy:
            return "store busy"
        if f.host_down_since is not None:
            return "unreachable"
        if not f.live and f.host_last_answer is not None:
            return "stale"
        return self.state

    @property
    def tau_est(self) -> float | None:
        """The training-time tau, accept_len + 1 (dflashctl.core.contract.tau_estimate)."""
        return tau_estimate(self.accept_len)

    @property
    def tau_note(self) -> str | None:
        """Why the measured tau is well below the estimate, when it is (contract.tau_gap)."""
        return tau_gap(self.tau_est, self.tau)

    @property
    def progress_pct(self) -> float | None:
        if self.step is None or not self.total_steps:
            return None
        return 100.0 * self.step / self.total_steps

    def step_text(self) -> str:
        if self.step is None:
            return NA
        return f"{self.step:,}/{self.total_steps:,}" if self.total_steps else f"{self.step:,}"

    def progress_text(self) -> str:
        pct = self.progress_pct
        return NA if pct is None else (f"{pct:.0f}%" if pct >= 10 or pct == 0 else f"{pct:.1f}%")

    def eta_text(self, compact: bool = False) -> str:
        if not self.active:
            return "-"
        if self.state == STALLED or self.attention == "stalled":
            return "-" if compact else "none (stalled: no step rate says when it ends)"
        if not self.freshness.live and self.state != RESTARTING:
            return "stale" if self.step is not None else NA
        return NA if self.eta_s is None else (short_duration if compact else fmt_duration)(self.eta_s)

    def tok_s_text(self, compact: bool = True) -> str:
        return (short_rate if compact else fmt_tok_s)(self.tok_s if self.tok_s is not None else self.tok_s_last) \
            if (self.tok_s is not None or self.tok_s_last is not None) else NA

    def last_event_text(self) -> str:
        if self.last_event is None:
            return NA
        return f"{fmt_clock(self.last_event.time)} {self.last_event.message}"

    def age_text(self) -> str:
        age = self.freshness.data_age_s
        return NA if age is None else short_duration(age)

    def phase_text(self, compact: bool = False) -> str:
        """The run's phase as every view shows it (the table's cell, the console's row
        and detail): what a direct probe saw for a run nobody supervises, else the
        phase recorded with its time against its budget."""
        probed = self.probed
        if probed is not None and (probed.phase or probed.exit_code is not None):
            return f"{probed.phase or f'exit {probed.exit_code}'} (probed)"
        if self.active and not self.freshness.supervised:
            # Nobody records it: the phase last recorded, its time in it not known (never
            # "starting 0s/10m"); the age column says how old that is.
            return f"{self.phase.name}?" if self.phase.name else NA
        if not self.active:
            return "-" if compact else self.phase.text()
        return self.phase.text(compact=compact)

    def cell(self, key: str) -> str:
        """Display text of one run column (``COLUMNS``)."""
        if key == "run":
            return self.id
        if key == "state":
            # A run that crashed and was restarted carries its count ("running ↻2") where
            # it fits the column (and is underlined, ``style``): it never looks like one
            # that never crashed, whichever columns fit.
            shown = self.attention if self.attention in ("crash loop", "regressed") \
                and self.display_state in PROGRESSING + (RESTARTING,) else self.display_state
            mark = f" ↻{self.restarts}" if self.restarts and shown != RESTARTING else ""
            return shown + mark if len(shown + mark) <= COLUMN["state"].width else shown
        probed = self.probed
        if key == "phase":
            return self.phase_text(compact=True)
        if key == "progress":
            return self.progress_text()
        if key == "eta":
            return self.eta_text(compact=True)
        if key == "tok_s":
            return self.tok_s_text()
        if key == "baseline":
            return NA if self.baseline_pct is None else f"{self.baseline_pct:.0f}%"
        if key == "step":
            if probed is not None and probed.step is not None:
                return f"{probed.step:,} (probed)"
            return self.step_text()
        if key == "host":
            return self.host
        if key == "age":
            return self.age_text()
        if key == "history":
            return spark(self.tok_s_history, 12, high=self.baseline_tok_s) or NA
        if key == "loss":
            return _num(self.loss, ".3f")
        if key == "accept":
            return _num(self.tau_est, ".2f")
        if key == "tau":
            return _num(self.tau, ".2f")
        if key == "mfu":
            return NA if self.mfu is None else f"{100 * self.mfu:.0f}%"
        if key == "restarts":
            return str(self.restarts)
        if key == "last_event":
            return self.last_event_text()
        raise KeyError(key)

    def style(self, key: str) -> str:
        """Style of one cell ('' for none)."""
        if key == "state":
            if self.attention in ("crash loop", "regressed") and self.display_state in PROGRESSING + (RESTARTING,):
                return "bold red"
            return STATE_STYLE.get(self.display_state, "") + (" underline" if self.restarts else "")
        if key in ("phase", "step") and self.probed is not None:
            return "cyan"
        if key == "phase" and self.active:
            return "bold red" if self.phase.over_budget else PHASE_STYLE.get(self.phase.name or "", "")
        if key in ("eta", "tok_s", "age", "progress", "step") and self.active and not self.freshness.live:
            return "dim"
        if key == "baseline" and self.baseline_pct is not None and self.baseline_pct < 60:
            return "bold red"
        if key == "last_event" and self.last_event is not None:
            return SEVERITY_STYLE.get(self.last_event.severity, "")
        if key == "tau" and self.tau_note:
            return "yellow"
        if key == "restarts" and self.restarts:
            return "bold red" if self.attention == "crash loop" else "bold yellow"
        return ""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["freshness"] = self.freshness.to_dict()
        d["phase"] = {**asdict(self.phase), "over_budget": self.phase.over_budget}
        d.update(active=self.active, display_state=self.display_state, progress_pct=self.progress_pct,
                 tau_est=self.tau_est, tau_note=self.tau_note)
        d["roles"] = {str(k): v for k, v in self.roles.items()}
        return d


# --------------------------------------------------------------------------- run columns


LAST_EVENT_MAX = 60  # the widest the last-event column grows (its full text is in the detail view)
COLUMNS = (
    Col("run", "run", 25, 0),
    Col("state", "state", 12, 0),
    Col("phase", "phase", 17, 1),
    Col("progress", "done", 5, 1, "right"),
    Col("eta", "ETA", 6, 1, "right"),
    Col("tok_s", "tok/s", 6, 2, "right"),
    Col("baseline", "%base", 5, 2, "right"),
    Col("step", "step", 15, 3, "right"),
    Col("host", "host", 10, 4),
    Col("age", "age", 5, 3, "right"),
    Col("history", "tok/s history", 13, 6),
    Col("loss", "loss", 6, 5, "right"),
    Col("accept", "τ est", 5, 5, "right"),
    Col("tau", "τ", 5, 5, "right"),
    Col("restarts", "rst", 3, 5, "right"),
    Col("mfu", "MFU", 4, 7, "right"),
    Col("last_event", "last event", 24, 8, grow=LAST_EVENT_MAX - 24),
)
COLUMN = {c.key: c for c in COLUMNS}
COMPACT_RUN_WIDTH = 18


def select_columns(width: int, gap: int = 2, run_width: int = 25) -> list[Col]:
    """The run columns that fit ``width`` cells (each column costs its width plus
    ``gap``), most important first, shown in ``COLUMNS`` order; the last-event
    column takes what is left, up to ``LAST_EVENT_MAX``. Cells are never folded:
    a column that does not fit is left out (``columns.choose``)."""
    columns = [Col("run", "run", run_width, 0)] + [c for c in COLUMNS if c.key != "run"]
    return choose(columns, width - gap, gap)


# --------------------------------------------------------------------------- sorting and attention


SORTS = ("default", "state", "host", "progress", "tok/s", "ETA", "created")


def sort_runs(runs: list[RunView], key: str) -> list[RunView]:
    """Runs in the order of a sort key (``SORTS``); ``default``: needs-attention first,
    then active, then newest."""
    if key == "state":
        return sorted(runs, key=lambda r: (r.display_state, -r.created))
    if key == "host":
        return sorted(runs, key=lambda r: (r.host, -r.created))
    if key == "progress":
        return sorted(runs, key=lambda r: -(r.progress_pct or -1))
    if key == "tok/s":
        return sorted(runs, key=lambda r: -(r.tok_s or r.tok_s_last or -1))
    if key == "ETA":
        return sorted(runs, key=lambda r: (r.eta_s is None, r.eta_s or 0))
    if key == "created":
        return sorted(runs, key=lambda r: -r.created)
    return sorted(runs, key=lambda r: (attention_rank(r), not r.active, -r.created))


# What needs the operator first: a run's ``attention`` (failed, crash loop, stalled,
# regressed), then an active run's display state; everything else after, active first.
ATTENTION = {"failed": 0, "crash loop": 0, "unsupervised": 1, "stalled": 1, "unreachable": 2, "regressed": 2,
             "lost": 3, "stale": 3, "store busy": 3, "restarting": 4}
FAILED_RECENT_S = 24 * 3600.0  # a failed run sorts first this long after it ended
CRASH_LOOP_RESTARTS = 2  # counted restarts in the playbook's restart window without step progress


def attention_rank(r: RunView) -> int:
    ranks = [ATTENTION[r.attention]] if r.attention in ATTENTION else []
    if r.active:
        ranks.append(ATTENTION.get(r.display_state, 8))
    return min(ranks, default=9)


def attention_of(run: Run, display_state: str, restarts: Sequence[Any], regression: Event | None, now: float,
                 window_s: float) -> str | None:
    """Why a run needs the operator before the others (None: it does not): it failed
    (within ``FAILED_RECENT_S``), it is crash-looping (``CRASH_LOOP_RESTARTS`` counted
    restarts within ``window_s`` with no step gained between them), it is stalled,
    or its newest regression finding has not been cleared."""
    if run.state == "failed":
        return "failed" if now - (run.ended or run.updated or run.created) <= FAILED_RECENT_S else None
    if run.state not in ACTIVE_STATES:
        return None
    recent = [r for r in restarts if r.counts and now - r.time <= window_s]
    steps = {r.step_before for r in recent}
    if len(recent) >= CRASH_LOOP_RESTARTS and len(steps) == 1:
        return "crash loop"
    if display_state == "stalled":
        return "stalled"
    if regression is not None and regression.severity != "info":
        return "regressed"
    return None


def filter_runs(runs: list[RunView], text: str) -> list[RunView]:
    """Runs whose id, playbook, host, state or phase contains every word of ``text``."""
    return matching(runs, text, lambda r: " ".join([r.id, r.playbook, r.host, r.display_state, r.phase.name or ""]))


def notices_of(runs: Iterable[RunView], now: float) -> list[Notice]:
    """What needs the operator, most urgent first: runs nobody watches (with the
    command that watches them), unreachable hosts, phases over budget."""
    out: list[Notice] = []
    down: set[str] = set()
    for r in runs:
        if not r.active:
            continue
        f = r.freshness
        if not f.supervised:
            out.append(Notice("error", f"{r.id} {f.note}", f.fix, r.id))
        elif f.host_down_since is not None and r.host not in down:
            down.add(r.host)
            out.append(Notice("error", f.note, None, r.id))
        elif not f.live and f.note:
            out.append(Notice("warning", f"{r.id}: {f.note}", None, r.id))
        if r.phase.over_budget:
            out.append(Notice("warning", f"{r.id}: {r.phase.text()} (over budget)", f"dflashctl logs {r.id}", r.id))
    for r in runs:
        if r.tau_note:
            out.append(Notice("warning", f"{r.id}: {r.tau_note}", TAU_GAP_FIX, r.id))
    return out


TAU_GAP_FIX = ("regenerate the training data with the target: data.regenerate in the playbook, or python -m "
               "trainer.data regenerate; then train again")
"""What a gap between τ and τ est asks for: data the target wrote (another eval measures the same gap)."""


def eval_source(e: dict) -> str:
    """Which eval a tau came from, its size and its spread (``store.eval_figures``)."""
    parts = [f"eval {e['attempt']}" if e.get("attempt") else "eval"]
    if e.get("step") is not None:
        parts[0] += f" at step {e['step']}"
    size = [f"{e['prompts']} prompt{'s' if e['prompts'] != 1 else ''}" if e.get("prompts") is not None else None,
            f"{e['new_tokens']} tokens" if e.get("new_tokens") is not None else None]
    parts += [p for p in size if p]
    if e.get("tau_sd") is not None:
        parts.append(f"τ ±{e['tau_sd']:.2f}")
    if e.get("speedup"):
        spread = e.get("speedup_range")
        parts.append(f"{e['speedup']:.2f}x greedy" + (f", {spread[0]:.1f}-{spread[1]:.1f}x by prompt" if spread else ""))
    if e.get("complete") is False:
        parts.append("partial")
    if e.get("newer"):
        parts.append(f"{e['newer']} newer, smaller eval{'s' if e['newer'] != 1 else ''} not shown")
    return ", ".join(parts)
