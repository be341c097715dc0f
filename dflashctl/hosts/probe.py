"""The remote probe: everything one poll needs from a host, in one round trip.

``PROBE_SOURCE`` is the text of ``dflashctl/hosts/remote/probe.py``, a stdlib-only script
(Python >= 3.8, no dflashctl on the host) run by the host's python with one JSON
argument. It reads, for each run: tmux session liveness and the pane tail,
status.json, the metrics.jsonl bytes appended since an offset, the tail of
trainer.log, the trainer's process state and its exit_code file; and once per host:
nvidia-smi GPU and compute-process rows, the host's CPU and memory (/proc) and
the host clock. Each sub-step has a
time and size limit; anything that goes wrong becomes a line in an ``errors`` list,
never an exception, and the script always prints exactly one JSON object.

This side (``probe_command``, ``parse_probe_host``, ``parse_probe_output``) is pure
and treats the answer as hostile: it never raises on any text. Output that is not
the probe's answer is a ``ProbeError`` (a value); a field of the wrong type or out
of range (``"pid": "x"``, a step given as text, ``10**400``) is None in the result
and a line in that run's ``errors``, never passed on to the detectors. The checks
are the contract's (``contract.check_*``, ``contract.read_status``) and the
nvidia-smi parsers' (``parsers.read_gpu_query``), so one rule holds everywhere.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Sequence

from dflashctl.core import contract
from dflashctl.hosts import remote
from dflashctl.hosts.parsers import (
    ComputeApp,
    GpuReading,
    HostReading,
    merge_clocks,
    read_clocks,
    read_compute_apps,
    read_gpu_query,
    read_host_stats,
    read_pmon,
    read_processes,
)

PROBE_VERSION = 1
TMUX_SOCKET = "dflash"

# The host-side script (dflashctl/hosts/remote/probe.py), shipped as its text.
PROBE_SOURCE = remote.source("probe")

# --------------------------------------------------------------------------- controller side


@dataclass
class ProbeArgs:
    """What to look at for one run. Feed ``ProbeResult.next_args`` back next poll."""

    run_dir: str
    session: str | None = None  # tmux session name (exact match)
    socket: str = TMUX_SOCKET  # tmux -L socket name
    metrics_offset: int = 0
    metrics_inode: int | None = None  # of the file the offset belongs to; another inode -> start at 0
    pane_lines: int = 200
    nvidia_smi: bool = True
    pid_hint: int | None = None  # used when status.json has no pid yet
    step_timeout: float = 5.0
    metrics_max_bytes: int = 4 * 1024 * 1024
    rank: int = 0  # a multi-host run's process: its status and metrics files (contract.status_file)


@dataclass
class ProcessState:
    pid: int
    alive: bool  # exists and is not a zombie
    state: str | None  # /proc/PID/stat letter: R, S, D, T (stopped), Z (zombie), ...
    cmdline: str | None = None


@dataclass
class ProbeResult:
    """One run as the probe saw it. Times are the host's clock.

    Every field is checked: one the host sent with the wrong type or out of range
    is None here (``status.step`` and ``status.phase`` too, see
    ``contract.read_status``) and a line in ``errors``. ``errors`` holds, in order:
    what went wrong on the host, one line per failed step
    (``"status.json: ValueError: not JSON ..."``, ``"exit_code: timed out after 5s"``);
    what this side refused (``"probe answer: exit_code is not an integer ('x')"``,
    ``"status.json: step is not an integer ('3')"``); then the host-level errors
    (nvidia-smi) shared by every run of the host."""

    run_dir: str
    session: str | None
    host_time: float
    hostname: str | None = None
    session_alive: bool | None = None  # None: unknown (tmux failed) or no session asked for
    pane_tail: str | None = None
    pane_dead: bool | None = None  # the pane's command exited (remain-on-exit)
    pane_dead_status: int | None = None
    status: contract.Status | None = None
    log_tail: str | None = None
    metrics_chunk: str = ""  # complete lines only
    metrics_offset: int | None = None  # None: metrics.jsonl could not be read this time
    metrics_inode: int | None = None
    metrics_reset: bool = False  # truncated or rotated: the chunk starts at byte 0
    metrics_more: bool = False  # more complete data than one probe carries: poll again soon
    process: ProcessState | None = None
    exit_code: int | None = None
    gpus: list[GpuReading] | None = None  # None: not asked for or nvidia-smi failed
    compute_apps: list[ComputeApp] | None = None
    errors: list[str] = field(default_factory=list)
    standby_pid: int | None = None  # the pid in standby.json: the next restart's trainer, waiting
    host: HostReading | None = None  # the host's CPU and memory (None: not read, an older probe)
    disk_free: int | None = None  # bytes free to the trainer on the run directory's filesystem (None: unread)
    disk_total: int | None = None
    tmux_server_gone: bool | None = None  # the session is gone and so is its tmux server (killed?)
    oom_kills: "OomKills | None" = None  # the kernel's OOM-kill counts at this answer

    def next_args(self, previous: ProbeArgs) -> ProbeArgs:
        """The arguments for the next poll of this run: the metrics offset moves on
        (and stays put when metrics.jsonl could not be read, so nothing is read twice)."""
        if self.metrics_offset is None:
            return previous
        return replace(previous, metrics_offset=self.metrics_offset, metrics_inode=self.metrics_inode)


@dataclass(frozen=True)
class OomKills:
    """The kernel's counts of OOM kills: the host's and the run's cgroup's (None: unreadable)."""

    host: int | None
    cgroup: int | None

    def since(self, before: "OomKills | None") -> int | None:
        """Kills counted since ``before`` (the larger of the two counters' rises); None: no comparable reading."""
        if before is None:
            return None
        rises = [now - then for now, then in ((self.host, before.host), (self.cgroup, before.cgroup))
                 if now is not None and then is not None and now >= then]
        return max(rises) if rises else None


@dataclass
class ProbeError:
    """The probe's output could not be read at all (not JSON, wrong program, cut short)."""

    message: str
    output_tail: str = ""


@dataclass
class HostProbe:
    """A whole probe answer: the host-level readings and one result per run."""

    host_time: float
    hostname: str | None
    python: str | None
    elapsed: float | None
    gpus: list[GpuReading] | None
    compute_apps: list[ComputeApp] | None
    errors: list[str]
    runs: list[ProbeResult]
    host: HostReading | None = None  # its CPU and memory (None: not read)


def probe_args_json(args: Sequence[ProbeArgs | dict[str, Any]], *, nvidia_smi: bool | None = None) -> str:
    """The probe's single argument. ``nvidia_smi`` overrides the runs' wish (True
    reads the GPUs of a host with no run to look at)."""
    runs = [asdict(a) if isinstance(a, ProbeArgs) else dict(a) for a in args]
    payload: Any = runs if nvidia_smi is None else {"runs": runs, "nvidia_smi": nvidia_smi}
    return json.dumps(payload, separators=(",", ":"))


def probe_command(
    host_python: str, args: Sequence[ProbeArgs | dict[str, Any]], *, nvidia_smi: bool | None = None
) -> list[str]:
    """argv running the probe with the host's python (the inventory's ``python``,
    split as the launcher splits it). ``-I`` keeps a polluted PYTHONPATH or user
    site-packages on the host from breaking it; ``-S`` skips site-packages
    altogether (the probe is stdlib only), a fifth of its start-up on every tick."""
    return [*shlex.split(host_python), "-I", "-S", "-c", PROBE_SOURCE, probe_args_json(args, nvidia_smi=nvidia_smi)]


def estimate_skew(host_time: float, sent: float, received: float) -> float:
    """Host clock minus local clock, assuming the probe read the clock mid-way."""
    return host_time - (sent + received) / 2


def parse_probe_host(stdout: str) -> HostProbe | ProbeError:
    """The probe's stdout -> HostProbe; output that is not the probe's answer ->
    ProbeError (a value). Never raises, whatever the text."""
    if not isinstance(stdout, str):
        return ProbeError(f"the probe's output is {_kind(stdout)}, not text")
    try:
        return _parse_host(stdout)
    except Exception as e:  # a backstop: the checks below leave nothing for it, and a host must never crash its caller
        return ProbeError(f"malformed probe output: {type(e).__name__}: {str(e)[:200]}", stdout[-500:])


def parse_probe_output(stdout: str) -> list[ProbeResult] | ProbeError:
    """The probe's stdout -> one ProbeResult per run, in argument order. Host-level
    readings (GPUs, host errors) are copied into each run's result."""
    host = parse_probe_host(stdout)
    return host if isinstance(host, ProbeError) else host.runs


# --------------------------------------------------------------------------- checking the answer

MAX_ERROR_LINES = 100  # per run or host: a flood of errors is cut, and says so
MAX_ERROR_CHARS = 1000
MAX_PID = 2**31 - 1
MAX_CLOCK = 1e11  # unix seconds (the year 5138): a later "time" is not a clock reading
MAX_TAIL_CHARS = 1 << 20  # a pane or log tail (the probe sends at most 64 KiB)
MAX_CHUNK_CHARS = 1 << 27  # a metrics chunk (the probe sends at most 64 MiB)


def pair(asked: list[ProbeArgs], answered: list[ProbeResult], host: str) -> list[ProbeResult | str]:
    """Each asked run's result, or why there is none: the probe answers in the order it
    was asked, and an entry whose run directory is not the one asked at its place, or
    a missing entry, is never taken for that run."""
    out: list[ProbeResult | str] = []
    for i, args in enumerate(asked):
        if i >= len(answered):
            out.append(f"the probe's answer from {host} has no entry for this run "
                       f"({len(answered)} entries for {len(asked)} runs asked)")
        elif answered[i].run_dir != args.run_dir:
            out.append(f"the probe's answer from {host} names {answered[i].run_dir[:200]!r} where "
                       f"{args.run_dir[:200]!r} was asked: not taken for this run")
        else:
            out.append(answered[i])
    return out


def _parse_host(stdout: str) -> HostProbe | ProbeError:
    tail = stdout[-500:]
    raw = _last_json_object(stdout)
    if raw is None:
        return ProbeError("the probe printed no result", tail)
    try:
        contract.check_int(raw.get("probe"), "version", PROBE_VERSION, PROBE_VERSION)
        if not isinstance(raw.get("runs"), list):
            raise contract.ContractError("runs is not a list")
        host_time = contract.check_float(raw.get("host_time"), "host_time", 0.0, MAX_CLOCK)
    except contract.ContractError as e:
        return ProbeError(f"unexpected probe output: {e.reason}", tail)
    errors = _error_lines(raw.get("errors"))
    check = _Checked(raw, errors)
    hostname, python = check.text("hostname"), check.text("python")
    elapsed = check.number("elapsed", -MAX_CLOCK, MAX_CLOCK)  # below 0 when the host's clock was stepped back
    gpus, apps = _smi(raw.get("smi"), errors)
    _clocks(raw.get("gpu_clocks"), gpus, errors)
    host = _host_stats(raw.get("host"), errors)
    if host is not None:
        host.processes = _processes(raw.get("procs"), raw.get("pmon"), errors)
    oom = _oom(raw.get("host"), errors)
    runs = []
    for i, run in enumerate(raw["runs"]):
        run_dir = run.get("run_dir") if isinstance(run, dict) else None
        try:
            contract.check_text(run_dir, f"run {i}: run_dir")
        except contract.ContractError as e:
            # Results pair with the runs asked for by position: one without its
            # run_dir cannot be paired, so the whole answer is unusable.
            return ProbeError(f"malformed probe output: {e.reason}", tail)
        runs.append(replace(_run_result(run, host_time, hostname, gpus, apps, errors), host=host, oom_kills=oom))
    return HostProbe(
        host_time=host_time,
        hostname=hostname,
        python=python,
        elapsed=elapsed,
        gpus=gpus,
        compute_apps=apps,
        errors=errors,
        runs=runs,
        host=host,
    )


def _last_json_object(stdout: str) -> dict | None:
    # A login banner or a wrapper's chatter may precede the probe's one line.
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                raw = json.loads(line)
            except (ValueError, RecursionError):  # RecursionError: nested too deeply to be the probe's
                continue
            if isinstance(raw, dict):
                return raw
    return None


def _run_result(raw: dict, host_time: float, hostname, gpus, apps, host_errors: list[str]) -> ProbeResult:
    errors = _error_lines(raw.get("errors"))
    check = _Checked(raw, errors)
    pane = _Checked(check.object("pane"), errors, "pane.")
    status_text = check.text("status_text", contract.MAX_LINE_CHARS)
    status = _status(status_text, errors) if status_text else None
    chunk, offset, inode, reset, more = _metrics(check.object("metrics"), errors) or ("", None, None, False, False)
    disk = _Checked(check.object("disk"), errors, "disk.")
    return ProbeResult(
        run_dir=raw["run_dir"],
        session=check.text("session"),
        host_time=host_time,
        hostname=hostname,
        session_alive=check.flag("session_alive"),
        pane_tail=pane.text("tail", MAX_TAIL_CHARS),
        pane_dead=pane.flag("dead"),
        pane_dead_status=pane.int("dead_status", -(2**31), 2**31 - 1),
        status=status,
        log_tail=check.text("log_tail", MAX_TAIL_CHARS),
        metrics_chunk=chunk,
        metrics_offset=offset,
        metrics_inode=inode,
        metrics_reset=reset,
        metrics_more=more,
        process=_process(check.object("process"), errors),
        exit_code=check.int("exit_code", -(2**31), 2**31 - 1),
        gpus=gpus,
        compute_apps=apps,
        errors=errors + host_errors,
        standby_pid=check.int("standby_pid", 1, 2**31 - 1),
        disk_free=disk.int("free", 0, contract.INT64_MAX),
        disk_total=disk.int("total", 0, contract.INT64_MAX),
        tmux_server_gone=check.flag("tmux_server_gone"),
    )


def _metrics(raw: dict | None, errors: list[str]) -> tuple[str, int, int | None, bool, bool] | None:
    """(chunk, offset, inode, reset, more); None: not read this time, so the offset
    stays where it was (an offset without its chunk would skip data)."""
    if raw is None:
        return None
    check = _Checked(raw, errors, "metrics.")
    chunk = check.text("chunk", MAX_CHUNK_CHARS, required=True)
    offset = check.int("offset", 0, contract.INT64_MAX, required=True)
    inode = check.int("inode", 0, 2**64 - 1)
    reset, more, skipped = check.flag("reset"), check.flag("more"), check.int("skipped", 0, contract.INT64_MAX)
    if chunk is None or offset is None:
        return None
    if skipped:
        errors.append(f"{contract.METRICS_FILE}: skipped a {skipped}-byte line with no newline")
    return chunk, offset, inode, bool(reset), bool(more)


def _process(raw: dict | None, errors: list[str]) -> ProcessState | None:
    if raw is None:
        return None
    check = _Checked(raw, errors, "process.")
    pid, alive = check.int("pid", 1, MAX_PID, required=True), check.flag("alive", required=True)
    state, cmdline = check.text("state"), check.text("cmdline")
    if pid is None or alive is None:
        return None
    return ProcessState(pid=pid, alive=alive, state=state, cmdline=cmdline)


def _status(text: str, errors: list[str]) -> contract.Status | None:
    """status.json's text -> Status (``contract.read_status``: a bad field is None);
    each of its problems, or why it is unusable as a whole, is an error line."""
    try:
        status = contract.read_status(text)
    except contract.ContractError as e:
        errors.append(f"{contract.STATUS_FILE}: {e.reason}")
        return None
    errors.extend(f"{contract.STATUS_FILE}: {problem}" for problem in _capped(status.problems))
    return status


def _smi(raw: Any, errors: list[str]) -> tuple[list[GpuReading] | None, list[ComputeApp] | None]:
    """nvidia-smi's CSV -> readings (None: not asked for, or no answer); each row
    the parsers refuse is an error line."""
    if raw is None:
        return None, None
    if not isinstance(raw, dict):
        errors.append(f"probe answer: smi is not an object ({_kind(raw)})")
        return None, None
    check = _Checked(raw, errors, "smi.")
    gpus_text, apps_text = check.text("gpus", MAX_TAIL_CHARS), check.text("apps", MAX_TAIL_CHARS)
    gpus = apps = None
    if gpus_text is not None:
        parsed_gpus = read_gpu_query(gpus_text)
        gpus = parsed_gpus.rows
        errors.extend(f"nvidia-smi --query-gpu: {r}" for r in parsed_gpus.rejected)
    if apps_text is not None:
        parsed_apps = read_compute_apps(apps_text)
        apps = parsed_apps.rows
        errors.extend(f"nvidia-smi --query-compute-apps: {r}" for r in parsed_apps.rejected)
    return gpus, apps


def _clocks(raw: Any, gpus: list[GpuReading] | None, errors: list[str]) -> None:
    """Each GPU's clocks and throttle reasons (the probe's ``gpu_clocks`` CSV) into its
    reading's ``extra``."""
    if raw is None or gpus is None:
        return
    if not isinstance(raw, str) or len(raw) > MAX_TAIL_CHARS:
        errors.append(f"probe answer: gpu_clocks is not text ({_kind(raw)})")
        return
    parsed = read_clocks(raw)
    errors.extend(f"nvidia-smi clocks: {r}" for r in parsed.rejected)
    merge_clocks(gpus, parsed.rows)


def _processes(raw: Any, pmon: Any, errors: list[str]) -> list[dict[str, Any]] | None:
    """The host's processes (the probe's ``procs``), each GPU one with the SM share
    ``nvidia-smi pmon`` gave it; text made safe for a terminal. None: not read."""
    if raw is None:
        return None
    rows, problems = read_processes(raw)
    errors.extend(f"probe answer: {p}" for p in problems)
    if isinstance(pmon, str) and len(pmon) <= MAX_TAIL_CHARS:
        parsed = read_pmon(pmon)
        errors.extend(f"nvidia-smi pmon: {r}" for r in parsed.rejected)
        sm: dict[int, float] = {}
        for _, pid, share in parsed.rows:
            if share is not None:
                sm[pid] = sm.get(pid, 0.0) + share  # a process on several GPUs: its shares summed
        for row in rows:
            row.sm_pct = sm.get(row.pid)
    for row in rows:
        row.user = contract.printable(row.user) if row.user is not None else None
        row.cmd = contract.printable(row.cmd) if row.cmd is not None else None
    return [asdict(row) for row in rows]


def _host_stats(raw: Any, errors: list[str]) -> HostReading | None:
    """The host's /proc texts -> its CPU and memory reading (None: not read); each
    part the parser refuses is unknown in the reading and an error line."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        errors.append(f"probe answer: host is not an object ({_kind(raw)})")
        return None
    reading, problems = read_host_stats(raw.get("loadavg"), raw.get("stat"), raw.get("meminfo"), raw.get("cpus"),
                                        raw.get("cgroup_memory"), raw.get("cgroup_cpu"))
    errors.extend(f"host stats: {p}" for p in problems)
    return reading


def _oom(raw: Any, errors: list[str]) -> OomKills | None:
    """The host's and the cgroup's OOM-kill counters (None: an older probe, or neither readable)."""
    if not isinstance(raw, dict):
        return None  # _host_stats said what is wrong with it
    oom = _Checked(_Checked(raw, errors, "host.").object("oom"), errors, "host.oom.")
    kills = OomKills(oom.int("host", 0, contract.INT64_MAX), oom.int("cgroup", 0, contract.INT64_MAX))
    return kills if kills.host is not None or kills.cgroup is not None else None


class _Checked:
    """Typed reads from one object of the probe's answer (``contract.check_*``). A
    value of the wrong type or out of range reads as None and adds an error line
    saying why; an absent one (or null) reads as None quietly, unless ``required``."""

    def __init__(self, raw: dict | None, errors: list[str], prefix: str = "") -> None:
        self.raw = raw if raw is not None else {}
        self.errors = errors
        self.prefix = prefix

    def _read(self, key: str, check: Callable[[Any, str], Any], required: bool) -> Any:
        value = self.raw.get(key)
        if value is None:
            if required:
                self.errors.append(f"probe answer: {self.prefix}{key} missing")
            return None
        try:
            return check(value, self.prefix + key)
        except contract.ContractError as e:
            self.errors.append(f"probe answer: {e.reason}")
            return None

    def int(self, key: str, low: int, high: int, required: bool = False) -> int | None:
        return self._read(key, lambda v, name: contract.check_int(v, name, low, high), required)

    def number(self, key: str, low: float, high: float) -> float | None:
        return self._read(key, lambda v, name: contract.check_float(v, name, low, high), False)

    def text(self, key: str, max_chars: int = contract.MAX_TEXT_CHARS, required: bool = False) -> str | None:
        return self._read(key, lambda v, name: contract.check_text(v, name, max_chars), required)

    def flag(self, key: str, required: bool = False) -> bool | None:
        return self._read(key, _check_bool, required)

    def object(self, key: str) -> dict | None:
        return self._read(key, _check_object, False)


def _check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise contract.ContractError(f"{name} is not true or false ({_kind(value)})")
    return value


def _check_object(value: Any, name: str) -> dict:
    if not isinstance(value, dict):
        raise contract.ContractError(f"{name} is not an object ({_kind(value)})")
    return value


def _error_lines(value: Any) -> list[str]:
    """The answer's error list as lines of UTF-8 text, bounded in number and length."""
    if value is None:
        return []
    if not isinstance(value, list):
        return [f"probe answer: errors is not a list ({_kind(value)})"]
    return _capped([
        item[:MAX_ERROR_CHARS].encode("utf-8", "replace").decode("utf-8")
        if isinstance(item, str)
        else f"probe answer: an error that is not text ({_kind(item)})"
        for item in value[: MAX_ERROR_LINES + 1]
    ], len(value))  # fmt: skip


def _capped(lines: list[str], total: int | None = None) -> list[str]:
    """At most MAX_ERROR_LINES lines of ``total`` (default: all given), then how many were left out."""
    total = len(lines) if total is None else total
    if total <= MAX_ERROR_LINES:
        return lines
    return lines[:MAX_ERROR_LINES] + [f"... and {total - MAX_ERROR_LINES} more"]


def _kind(value: Any) -> str:
    """A short description of an untrusted value for an error line (never its whole text)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value[:40]) + ("..." if len(value) > 40 else "")
    if isinstance(value, int):
        return repr(value) if value.bit_length() <= 64 else f"an integer of {value.bit_length()} bits"
    if isinstance(value, float):
        return repr(value)
    return f"a {type(value).__name__}"
