"""The remote probe: everything one poll needs from a host, in one round trip.

``PROBE_SOURCE`` is a small stdlib-only script (Python >= 3.8, no dflashctl on the
host) run by the host's python with one JSON argument. It reads, for each run:
tmux session liveness and the pane tail, status.json, the metrics.jsonl bytes
appended since an offset, the tail of trainer.log, the trainer's process state and
its exit_code file; and once per host: nvidia-smi GPU and compute-process rows and
the host clock. Each sub-step has a time limit; anything that goes wrong becomes a
line in an ``errors`` list, never an exception, and the script always prints
exactly one JSON object.

The controller side (``probe_command``, ``parse_probe_output``) is pure.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Sequence

from dflashctl import contract
from dflashctl.parsers import (
    COMPUTE_APPS_FIELDS,
    GPU_QUERY_FIELDS,
    ComputeApp,
    GpuReading,
    parse_compute_apps,
    parse_gpu_query,
)

PROBE_VERSION = 1
TMUX_SOCKET = "dflash"

# --------------------------------------------------------------------------- the remote script

# %-formatted once, at import, with names from the contract: a literal % in the
# script is written %%.
PROBE_SOURCE = r'''
import json, os, socket, subprocess, sys, threading, time

STATUS_FILE = %(status_file)r
METRICS_FILE = %(metrics_file)r
LOG_FILE = %(log_file)r
EXIT_CODE_FILE = %(exit_code_file)r
GPU_QUERY = %(gpu_query)r
APPS_QUERY = %(apps_query)r
MAX_TEXT = 65536


def step(errors, name, timeout, fn, *args):
    """fn(*args) in a daemon thread, so a hung read (dead NFS, stuck driver) costs
    at most ``timeout`` seconds and an error line, never the whole probe."""
    box = {}

    def target():
        try:
            box["value"] = fn(*args)
        except Exception as e:
            box["error"] = "%%s: %%s" %% (type(e).__name__, e)

    t = threading.Thread(target=target, name="probe-" + name)
    t.daemon = True
    t.start()
    t.join(timeout + 1.0)
    if t.is_alive():
        errors.append("%%s: timed out after %%gs" %% (name, timeout))
        return None
    if "error" in box:
        errors.append("%%s: %%s" %% (name, box["error"]))
        return None
    return box.get("value")


def utf8_env():
    # tmux mangles non-ASCII output in the C locale.
    env = dict(os.environ)
    if not (env.get("LC_ALL") or env.get("LC_CTYPE") or env.get("LANG")):
        env["LANG"] = "C.UTF-8"
    return env


def run(argv, timeout):
    p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       stdin=subprocess.DEVNULL, timeout=timeout, env=utf8_env())
    return p.returncode, p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace")


def first_line(text):
    lines = text.strip().splitlines()
    return lines[0][:300] if lines else ""


def tmux_alive(sock, session, timeout):
    rc, out, err = run(["tmux", "-L", sock, "has-session", "-t", "=" + session], timeout)
    if rc == 0:
        return True
    if rc == 1:  # no such session, or no server on the socket at all
        return False
    raise RuntimeError("exit %%d: %%s" %% (rc, first_line(err)))


def tmux_pane(sock, session, lines, timeout):
    target = "=" + session + ":"
    # One tmux client for both (a command sequence): the pane's state line, then its text.
    rc, out, err = run(["tmux", "-L", sock, "display-message", "-p", "-t", target,
                        "#{pane_dead}\t#{pane_dead_status}\t#{pane_pid}", ";",
                        "capture-pane", "-p", "-J", "-S", "-%%d" %% lines, "-t", target], timeout)
    if rc != 0:
        raise RuntimeError("exit %%d: %%s" %% (rc, first_line(err)))
    head, _, pane = out.partition("\n")
    dead, dead_status, pane_pid = (head.split("\t") + ["", "", ""])[:3]
    text = "\n".join(l.rstrip() for l in pane.rstrip().splitlines()[-lines:])
    return {"tail": text, "dead": dead == "1",
            "dead_status": int(dead_status) if dead_status.lstrip("-").isdigit() else None,
            "pid": int(pane_pid) if pane_pid.isdigit() else None}


def read_text(path, limit):
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", "replace")
    except FileNotFoundError:
        return None


def read_tail(path, lines):
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - MAX_TEXT))
            data = f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return None
    return "\n".join(data.rstrip().splitlines()[-lines:])


def read_metrics(path, offset, inode, max_bytes):
    """Complete lines appended since ``offset``. A file shorter than the offset,
    or another file (new inode), was truncated or rotated: start again at 0."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return {"chunk": "", "offset": 0, "inode": None, "size": None, "reset": offset > 0, "more": False}
    reset = st.st_size < offset or (inode is not None and st.st_ino != inode)
    if reset:
        offset = 0
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(max_bytes)
    end = data.rfind(b"\n")
    skipped = 0
    if end >= 0:
        chunk, new_offset = data[:end + 1], offset + end + 1
    elif len(data) >= max_bytes:  # one line longer than the whole budget: skip it
        chunk, new_offset, skipped = b"", offset + len(data), len(data)
    else:  # a partial line being written: wait for its newline
        chunk, new_offset = b"", offset
    return {"chunk": chunk.decode("utf-8", "replace"), "offset": new_offset, "inode": st.st_ino,
            "size": st.st_size, "reset": reset, "more": new_offset < st.st_size, "skipped": skipped}


def process_state(pid):
    try:
        os.kill(pid, 0)
        exists = True
    except ProcessLookupError:
        exists = False
    except PermissionError:
        exists = True
    state = cmdline = None
    if exists:
        try:
            with open("/proc/%%d/stat" %% pid) as f:
                stat = f.read()
            state = stat[stat.rindex(")") + 2:].split()[0]
            with open("/proc/%%d/cmdline" %% pid, "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()[:300]
        except (OSError, ValueError, IndexError):
            pass  # exited meanwhile, or no /proc
    return {"pid": pid, "alive": exists and state not in ("Z", "X"), "state": state, "cmdline": cmdline}


def read_exit_code(path):
    text = read_text(path, 64)
    if text is None or not text.strip():
        return None
    return int(text.strip())


def nvidia_smi(timeout):
    out = {}
    for key, query in (("gpus", GPU_QUERY), ("apps", APPS_QUERY)):
        try:
            rc, text, err = run(["nvidia-smi", query, "--format=csv,noheader,nounits"], timeout)
        except FileNotFoundError:
            raise RuntimeError("nvidia-smi not found on PATH")
        if rc != 0:
            raise RuntimeError("exit %%d: %%s" %% (rc, first_line(err) or first_line(text)))
        out[key] = text
    return out


def status_pid(text):
    try:
        pid = json.loads(text).get("pid")
        return int(pid) if pid else None
    except (ValueError, TypeError, AttributeError):
        return None


def probe_run(spec, default_timeout):
    errors = []
    timeout = float(spec.get("step_timeout") or default_timeout)
    run_dir = os.path.expanduser(spec["run_dir"])
    lines = int(spec.get("pane_lines") or 200)
    out = {"run_dir": spec["run_dir"], "session": spec.get("session"), "errors": errors}
    session = spec.get("session")
    if session:
        sock = spec.get("socket") or "dflash"
        out["session_alive"] = step(errors, "tmux has-session", timeout, tmux_alive, sock, session, timeout)
        if out["session_alive"]:
            out["pane"] = step(errors, "tmux capture-pane", timeout, tmux_pane, sock, session, lines, timeout)
    out["status_text"] = step(errors, STATUS_FILE, timeout, read_text, os.path.join(run_dir, STATUS_FILE), MAX_TEXT)
    out["metrics"] = step(errors, METRICS_FILE, timeout, read_metrics, os.path.join(run_dir, METRICS_FILE),
                          int(spec.get("metrics_offset") or 0), spec.get("metrics_inode"),
                          int(spec.get("metrics_max_bytes") or 4194304))
    out["log_tail"] = step(errors, LOG_FILE, timeout, read_tail, os.path.join(run_dir, LOG_FILE), lines)
    out["exit_code"] = step(errors, EXIT_CODE_FILE, timeout, read_exit_code, os.path.join(run_dir, EXIT_CODE_FILE))
    pid = status_pid(out["status_text"]) if out["status_text"] else None
    pid = pid or spec.get("pid_hint")
    if pid and int(pid) > 0:  # kill(0 or -N, 0) would address a process group
        out["process"] = step(errors, "process %%s" %% pid, timeout, process_state, int(pid))
    return out


def main():
    started = time.time()
    result = {"probe": %(version)d, "errors": [], "runs": []}
    try:
        result["hostname"] = socket.gethostname()
        result["python"] = "%%d.%%d.%%d" %% sys.version_info[:3]
        args = json.loads(sys.argv[1]) if len(sys.argv) > 1 else []
        if isinstance(args, list):
            args = {"runs": args}
        runs = args.get("runs") or []
        # Host-level steps (nvidia-smi) get the most patient of the runs' limits.
        timeout = float(args.get("step_timeout") or max([r.get("step_timeout") or 5.0 for r in runs] or [5.0]))
        want_smi = args.get("nvidia_smi")
        if want_smi is None:
            want_smi = any(r.get("nvidia_smi", True) for r in runs)
        if want_smi:
            result["smi"] = step(result["errors"], "nvidia-smi", timeout, nvidia_smi, timeout)
        for spec in runs:
            try:
                result["runs"].append(probe_run(spec, timeout))
            except Exception as e:
                result["runs"].append({"run_dir": str(spec.get("run_dir")), "session": spec.get("session"),
                                       "errors": ["probe: %%s: %%s" %% (type(e).__name__, e)]})
    except Exception as e:
        result["errors"].append("probe: %%s: %%s" %% (type(e).__name__, e))
    result["host_time"] = time.time()
    result["elapsed"] = result["host_time"] - started
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # do not wait on a step thread stuck in the kernel


main()
''' % {
    "status_file": contract.STATUS_FILE,
    "metrics_file": contract.METRICS_FILE,
    "log_file": contract.LOG_FILE,
    "exit_code_file": contract.EXIT_CODE_FILE,
    "gpu_query": "--query-gpu=" + ",".join(GPU_QUERY_FIELDS),
    "apps_query": "--query-compute-apps=" + ",".join(COMPUTE_APPS_FIELDS),
    "version": PROBE_VERSION,
}

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


@dataclass
class ProcessState:
    pid: int
    alive: bool  # exists and is not a zombie
    state: str | None  # /proc/PID/stat letter: R, S, D, T (stopped), Z (zombie), ...
    cmdline: str | None = None


@dataclass
class ProbeResult:
    """One run as the probe saw it. Times are the host's clock."""

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

    def next_args(self, previous: ProbeArgs) -> ProbeArgs:
        """The arguments for the next poll of this run: the metrics offset moves on
        (and stays put when metrics.jsonl could not be read, so nothing is read twice)."""
        if self.metrics_offset is None:
            return previous
        return replace(previous, metrics_offset=self.metrics_offset, metrics_inode=self.metrics_inode)


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
    """The probe's stdout -> HostProbe; unreadable output -> ProbeError (a value)."""
    raw = _last_json_object(stdout)
    if raw is None:
        return ProbeError("the probe printed no result", (stdout or "")[-500:])
    if raw.get("probe") != PROBE_VERSION or not isinstance(raw.get("runs"), list):
        return ProbeError(f"unexpected probe output (version {raw.get('probe')!r})", (stdout or "")[-500:])
    try:
        host_time = float(raw["host_time"])
        errors = [str(e) for e in raw.get("errors") or []]
        smi = raw.get("smi") or {}
        gpus = parse_gpu_query(smi["gpus"]) if isinstance(smi.get("gpus"), str) else None
        apps = parse_compute_apps(smi["apps"]) if isinstance(smi.get("apps"), str) else None
        runs = [_run_result(r, host_time, raw.get("hostname"), gpus, apps, errors) for r in raw["runs"]]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        return ProbeError(f"malformed probe output: {type(e).__name__}: {e}", (stdout or "")[-500:])
    return HostProbe(
        host_time=host_time,
        hostname=raw.get("hostname"),
        python=raw.get("python"),
        elapsed=raw.get("elapsed"),
        gpus=gpus,
        compute_apps=apps,
        errors=errors,
        runs=runs,
    )


def parse_probe_output(stdout: str) -> list[ProbeResult] | ProbeError:
    """The probe's stdout -> one ProbeResult per run, in argument order. Host-level
    readings (GPUs, host errors) are copied into each run's result."""
    host = parse_probe_host(stdout)
    return host if isinstance(host, ProbeError) else host.runs


def _last_json_object(stdout: str) -> dict | None:
    # A login banner or a wrapper's chatter may precede the probe's one line.
    for line in reversed((stdout or "").splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                raw = json.loads(line)
            except ValueError:
                continue
            if isinstance(raw, dict):
                return raw
    return None


def _run_result(raw: dict, host_time: float, hostname, gpus, apps, host_errors: list[str]) -> ProbeResult:
    pane = raw.get("pane") or {}
    metrics = raw.get("metrics")
    read_metrics = isinstance(metrics, dict)
    metrics = metrics if read_metrics else {}
    process = raw.get("process")
    status_text = raw.get("status_text")
    errors = [str(e) for e in raw.get("errors") or []] + host_errors
    status = contract.parse_status(status_text) if status_text else None
    if status_text and status is None:
        errors.append(f"{contract.STATUS_FILE}: not a valid status object")
    if metrics.get("skipped"):
        errors.append(f"{contract.METRICS_FILE}: skipped a {metrics['skipped']}-byte line with no newline")
    return ProbeResult(
        run_dir=str(raw["run_dir"]),
        session=raw.get("session"),
        host_time=host_time,
        hostname=hostname,
        session_alive=raw.get("session_alive"),
        pane_tail=pane.get("tail"),
        pane_dead=pane.get("dead"),
        pane_dead_status=pane.get("dead_status"),
        status=status,
        log_tail=raw.get("log_tail"),
        metrics_chunk=metrics.get("chunk") or "",
        metrics_offset=int(metrics.get("offset") or 0) if read_metrics else None,
        metrics_inode=metrics.get("inode"),
        metrics_reset=bool(metrics.get("reset")),
        metrics_more=bool(metrics.get("more")),
        process=ProcessState(**process) if isinstance(process, dict) else None,
        exit_code=raw.get("exit_code"),
        gpus=gpus,
        compute_apps=apps,
        errors=errors,
    )
