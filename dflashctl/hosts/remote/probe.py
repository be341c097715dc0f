"""The probe, as run on the host: everything one poll needs, in one round trip.

Stdlib only, Python 3.8+, no dflashctl: the controller sends this file's text
(``python -I -S -c TEXT JSON``); ``python probe.py JSON`` runs it by hand.

The argument is one JSON value: a list of run specs, or
``{"runs": [...], "nvidia_smi": bool, "step_timeout": seconds}``. A run spec:
``run_dir`` (required; ``~`` expands here), ``session``, ``socket``,
``metrics_offset``, ``metrics_inode``, ``pane_lines``, ``nvidia_smi``,
``pid_hint``, ``step_timeout``, ``metrics_max_bytes``, ``rank`` (a multi-host
run's process on this host: rank q > 0 writes ``status.rank<q>.json`` and
``metrics.rank<q>.jsonl``).

The answer is exactly one JSON line:
``{"probe": 1, "hostname", "python", "host_time", "elapsed", "errors", "smi", "host", "runs"}``
with, per run: tmux session liveness and the pane tail, status.json's text, the
metrics.jsonl bytes appended since the offset, the tail of trainer.log, the
trainer's process state and its exit_code file, the free and total bytes of the
run directory's filesystem (``disk``), and the run's own ``errors``.
``smi`` (nvidia-smi's GPU and compute-process rows, as CSV) is read once per host,
with ``gpu_clocks`` (clocks and throttle reasons, CSV) and ``pmon`` (each GPU
process's SM share, ``nvidia-smi pmon``'s text); ``procs``: the GPU processes, the
runs' trainers and standbys with their parents, and the top CPU consumers (user,
CPU share, RSS, elapsed, command line; ``"processes": false`` leaves it out, a
number asks for that many top consumers); ``smi_notes``: why the clocks or pmon
could not be read (extras: the GPU rows stand without them),
and so is ``host`` (its CPU and memory: /proc/loadavg, /proc/stat's cpu line,
/proc/meminfo as text, and the CPUs this process may use), and ``oom``: the
kernel's count of OOM kills, the host's (/proc/vmstat) and this cgroup's
(memory.events), so a SIGKILL is named the OOM killer's on the kernel's word.

Everything read here is untrusted: a run directory on a dead NFS mount, a
status.json of gigabytes or nested ten thousand deep, a binary exit_code. So every
read is bounded in bytes and in time, every per-run step stands alone (a garbage
status.json still leaves the exit code reported), and whatever goes wrong is a line
in that run's ``errors``, never an exception. The probe never writes on the host.
"""

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

# The answer's format; the controller refuses any other (dflashctl.hosts.probe.PROBE_VERSION).
PROBE_VERSION = 1

# Run directory files (dflashctl.core.contract; a controller test holds them equal).
STATUS_FILE = "status.json"
METRICS_FILE = "metrics.jsonl"
LOG_FILE = "trainer.log"
EXIT_CODE_FILE = "exit_code"
STANDBY_FILE = "standby.json"  # a standby trainer's pid, once it waits (its GPU process is named by it)

TMUX_SOCKET = "dflash"  # tmux -L socket when a run spec names none (dflashctl.hosts.probe.TMUX_SOCKET)

# nvidia-smi queries (dflashctl.hosts.parsers.GPU_QUERY_FIELDS / COMPUTE_APPS_FIELDS).
GPU_QUERY_FIELDS = (
    "index",
    "uuid",
    "name",
    "memory.used",
    "memory.total",
    "utilization.gpu",
    "temperature.gpu",
    "power.draw",
    "power.limit",
    "clocks.sm",
)
COMPUTE_APPS_FIELDS = ("pid", "process_name", "used_memory", "gpu_uuid")
# Asked apart from the GPU rows (a driver without one of them leaves those whole).
CLOCK_FIELDS = ("index", "clocks.max.sm", "clocks.mem", "clocks_throttle_reasons.active")
PMON_ARGV = ("nvidia-smi", "pmon", "-c", "1", "-s", "u")  # one sample of each GPU process's SM share

# The host's processes sent back: the GPU processes, the runs' trainers and standbys,
# their parents up to the tmux server, and the top CPU consumers.
PROC_TOP = 5
PROC_ANCESTORS = 6
PROC_SAMPLE_S = 0.25  # CPU shares are over this long
PROC_CMD_CHARS = 160
PROC_MAX_ROWS = 48

# Bounds on what is read and sent back.
STATUS_MAX_BYTES = 65536  # a status.json is a few hundred bytes; larger is not one
STATUS_MAX_DEPTH = 32  # deeper JSON is refused before parsing (no deep recursion in a thread)
TAIL_MAX_BYTES = 65536  # pane and trainer.log tails
MAX_TAIL_LINES = 10000
EXIT_CODE_MAX_BYTES = 64
CMDLINE_MAX_BYTES = 4096
METRICS_DEFAULT_BYTES = 4 * 1024 * 1024
METRICS_MAX_BYTES = 64 * 1024 * 1024
ERROR_MAX_CHARS = 500
DEFAULT_STEP_TIMEOUT = 5.0
MAX_STEP_TIMEOUT = 300.0
MAX_PID = 2**31 - 1  # pid_t; os.kill refuses larger


# --------------------------------------------------------------------------- steps


def describe(e):
    return ("%s: %s" % (type(e).__name__, e))[:ERROR_MAX_CHARS]


def step(errors, name, timeout, fn, *args):
    """fn(*args) in a daemon thread, so a hung read (dead NFS, stuck driver) costs
    at most ``timeout`` seconds and an error line, never the whole probe."""
    box = {}

    def target():
        try:
            box["value"] = fn(*args)
        except Exception as e:
            box["error"] = describe(e)

    t = threading.Thread(target=target, name="probe-" + name)
    t.daemon = True
    t.start()
    t.join(timeout + 1.0)
    if t.is_alive():
        errors.append("%s: timed out after %gs" % (name, timeout))
        return None
    if "error" in box:
        errors.append("%s: %s" % (name, box["error"]))
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


def last_lines(text, lines):
    """The last ``lines`` lines of ``text``, from its last TAIL_MAX_BYTES characters."""
    return "\n".join(text[-TAIL_MAX_BYTES:].rstrip().splitlines()[-lines:])


# --------------------------------------------------------------------------- tmux


def tmux_alive(sock, session, timeout, gone=None):
    """Whether the session lives; when it does not, ``gone["server"]`` says whether
    its tmux server is gone too (killed: the run's exit code may never be written)."""
    rc, out, err = run(["tmux", "-L", sock, "has-session", "-t", "=" + session], timeout)
    if rc == 0:
        return True
    if rc == 1:  # no such session, or no server on the socket at all
        if gone is not None:
            gone["server"] = not ("find session" in err or "session not found" in err)
        return False
    raise RuntimeError("exit %d: %s" % (rc, first_line(err)))


def tmux_pane(sock, session, lines, timeout):
    target = "=" + session + ":"
    # One tmux client for both (a command sequence): the pane's state line, then its text.
    rc, out, err = run(["tmux", "-L", sock, "display-message", "-p", "-t", target,
                        "#{pane_dead}\t#{pane_dead_status}\t#{pane_pid}", ";",
                        "capture-pane", "-p", "-J", "-S", "-%d" % lines, "-t", target], timeout)
    if rc != 0:
        raise RuntimeError("exit %d: %s" % (rc, first_line(err)))
    head, _, pane = out.partition("\n")
    dead, dead_status, pane_pid = (head.split("\t") + ["", "", ""])[:3]
    pane = "\n".join(line.rstrip() for line in pane[-TAIL_MAX_BYTES:].splitlines())  # a pane pads with blanks
    return {"tail": last_lines(pane, lines), "dead": dead == "1",
            "dead_status": small_int(dead_status), "pid": small_int(pane_pid)}


def small_int(text):
    """An int from tmux's text, or None (tmux prints "" for an unset field)."""
    text = text.strip()
    if not re.match(r"^-?[0-9]{1,10}$", text):
        return None
    return int(text)


# --------------------------------------------------------------------------- run files


def read_bounded(path, limit):
    """Up to ``limit`` bytes of the file; ValueError when it holds more. None: no file."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        return None
    if len(data) > limit:
        raise ValueError("larger than %d bytes: not read" % limit)
    return data


_JSON_TOKENS = re.compile(r'\\.|["\[\]{}]', re.S)  # an escape pair, a quote, a bracket


def json_depth(text):
    """How deeply brackets nest in ``text``, strings skipped: a guard run before
    parsing, in one linear pass (not a parser)."""
    depth = deepest = 0
    in_string = False
    for m in _JSON_TOKENS.finditer(text):
        token = m.group()
        if token == '"':
            in_string = not in_string
        elif in_string or len(token) == 2:
            continue
        elif token in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def read_status(path):
    """status.json's text and the trainer's pid in it; an error when it is not a
    small, shallow JSON object."""
    data = read_bounded(path, STATUS_MAX_BYTES)
    if data is None:
        return None
    text = data.decode("utf-8", "replace")
    if json_depth(text) > STATUS_MAX_DEPTH:
        raise ValueError("nested deeper than %d levels: not parsed" % STATUS_MAX_DEPTH)
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise ValueError("not JSON (%s)" % e)
    if not isinstance(raw, dict):
        raise ValueError("not a JSON object (a %s)" % type(raw).__name__)
    pid = raw.get("pid")
    valid_pid = type(pid) is int and 0 < pid <= MAX_PID  # type(): a bool is not a pid
    return {"text": text, "pid": pid if valid_pid else None}


def read_tail(path, lines):
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - TAIL_MAX_BYTES))
            data = f.read(TAIL_MAX_BYTES).decode("utf-8", "replace")
    except FileNotFoundError:
        return None
    return last_lines(data, lines)


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


def read_exit_code(path):
    data = read_bounded(path, EXIT_CODE_MAX_BYTES)
    if data is None or not data.strip():
        return None
    text = data.decode("utf-8", "replace").strip()
    if not re.match(r"^-?[0-9]{1,10}$", text):
        raise ValueError("not an exit status: %r" % text[:40])
    return int(text)


def read_standby_pid(path):
    """The pid a standby trainer wrote in standby.json (None: no standby waits)."""
    data = read_bounded(path, EXIT_CODE_MAX_BYTES * 64)
    if data is None or not data.strip():
        return None
    pid = json.loads(data.decode("utf-8", "replace")).get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid <= MAX_PID:
        raise ValueError("no pid in standby.json: %r" % (pid,))
    return pid


def disk_space(path):
    """Free bytes (for an unprivileged writer, as the trainer is) and total bytes of
    the filesystem holding ``path`` (None: no such directory, as no status.json is none)."""
    try:
        st = os.statvfs(path)
    except FileNotFoundError:
        return None
    return {"free": st.f_bavail * st.f_frsize, "total": st.f_blocks * st.f_frsize}


def read_live_standby_pid(path):
    """The standby's pid while that process lives (None: no standby, or it left)."""
    pid = read_standby_pid(path)
    return pid if pid is not None and process_state(pid)["alive"] else None


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
            with open("/proc/%d/stat" % pid, "rb") as f:
                stat = f.read(4096).decode("utf-8", "replace")
            state = stat[stat.rindex(")") + 2:].split()[0]
            with open("/proc/%d/cmdline" % pid, "rb") as f:
                cmdline = f.read(CMDLINE_MAX_BYTES).replace(b"\0", b" ").decode("utf-8", "replace").strip()[:300]
        except (OSError, ValueError, IndexError):
            pass  # exited meanwhile, or no /proc
    return {"pid": pid, "alive": exists and state not in ("Z", "X"), "state": state, "cmdline": cmdline}


# --------------------------------------------------------------------------- nvidia-smi


def nvidia_smi(timeout):
    out = {}
    for key, flag, fields in (("gpus", "--query-gpu=", GPU_QUERY_FIELDS),
                              ("apps", "--query-compute-apps=", COMPUTE_APPS_FIELDS)):
        try:
            rc, text, err = run(["nvidia-smi", flag + ",".join(fields), "--format=csv,noheader,nounits"], timeout)
        except FileNotFoundError:
            raise RuntimeError("nvidia-smi not found on PATH")
        if rc != 0:
            raise RuntimeError("exit %d: %s" % (rc, first_line(err) or first_line(text)))
        out[key] = text
    return out


def smi_clocks(timeout):
    rc, text, err = run(["nvidia-smi", "--query-gpu=" + ",".join(CLOCK_FIELDS), "--format=csv,noheader,nounits"],
                        timeout)
    if rc != 0:
        raise RuntimeError("exit %d: %s" % (rc, first_line(err) or first_line(text)))
    return text


def smi_pmon(timeout):
    rc, text, err = run(list(PMON_ARGV), timeout)
    if rc != 0:
        raise RuntimeError("exit %d: %s" % (rc, first_line(err) or first_line(text)))
    return text


# --------------------------------------------------------------------------- the host's processes


def proc_stats():
    """pid -> the fields of /proc/PID/stat after its command (field 3 first)."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as f:
                data = f.read(2048)
            out[int(name)] = data[data.rindex(b")") + 2:].split()
        except (OSError, ValueError):
            pass  # ended meanwhile
    return out


def proc_row(pid, fields, cpu_pct, hz, uptime, page_kib):
    import pwd

    row = {"pid": pid, "ppid": int(fields[1]), "cpu_pct": cpu_pct,
           "elapsed_s": max(0.0, uptime - int(fields[19]) / float(hz))}
    try:
        uid = os.stat("/proc/%d" % pid).st_uid
        try:
            row["user"] = pwd.getpwuid(uid).pw_name
        except KeyError:
            row["user"] = str(uid)
    except OSError:
        row["user"] = None
    try:
        with open("/proc/%d/statm" % pid, "rb") as f:
            row["rss_kib"] = int(f.read(256).split()[1]) * page_kib
    except (OSError, ValueError, IndexError):
        row["rss_kib"] = None
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            cmd = f.read(PROC_CMD_CHARS * 4)
    except OSError:
        cmd = b""
    row["cmd"] = cmd.replace(b"\0", b" ").decode("utf-8", "replace").strip()[:PROC_CMD_CHARS] or None
    return row


def processes(wanted, top=PROC_TOP, early=None):
    """The processes ``wanted`` (pids), their parents, and the top CPU consumers:
    each one's user, CPU share over at least ``PROC_SAMPLE_S``, RSS, time since it
    started and command line. ``early``: (``proc_stats()``, its monotonic time) taken
    at the probe's start, so its own work (nvidia-smi's calls, on a GPU host longer
    than the sample) is the sample's time instead of a wait added to every poll."""
    hz = os.sysconf("SC_CLK_TCK")
    page_kib = os.sysconf("SC_PAGE_SIZE") // 1024
    first, started = early if early is not None else (proc_stats(), time.monotonic())
    time.sleep(max(0.0, PROC_SAMPLE_S - (time.monotonic() - started)))
    second = proc_stats()
    span = max(1e-3, time.monotonic() - started)
    with open("/proc/uptime") as f:
        uptime = float(f.read(64).split()[0])
    cpu = {}
    for pid, fields in second.items():
        before = first.get(pid)
        if before is not None:
            ticks = int(fields[11]) + int(fields[12]) - int(before[11]) - int(before[12])
            cpu[pid] = round(max(0, ticks) * 100.0 / hz / span, 1)
    chosen = [p for p in wanted if p in second]
    for pid in list(chosen):
        parent = int(second[pid][1])
        for _ in range(PROC_ANCESTORS):
            if parent <= 1 or parent not in second or parent in chosen:
                break
            chosen.append(parent)
            parent = int(second[parent][1])
    busiest = sorted(cpu, key=lambda p: -cpu[p])[:top]
    chosen += [p for p in busiest if p not in chosen]
    rows = [proc_row(pid, second[pid], cpu.get(pid), hz, uptime, page_kib) for pid in chosen[:PROC_MAX_ROWS]]
    return {"interval": span, "rows": rows, "top": busiest}


def app_pids(apps_text):
    out = []
    for line in (apps_text or "").splitlines():
        head = line.split(",", 1)[0].strip()
        if head.isdigit():
            out.append(int(head))
    return out


# --------------------------------------------------------------------------- the host's CPU and memory

HOST_FILE_MAX_BYTES = 16384  # /proc/meminfo is about 1.5 KB; /proc/stat's first line is read alone
MEMINFO_KEYS = ("MemTotal:", "MemAvailable:")  # the lines of /proc/meminfo sent back


def read_first_line(path, limit):
    with open(path, "rb") as f:
        return f.read(limit).split(b"\n", 1)[0].decode("utf-8", "replace")


def usable_cpus():
    try:
        return len(os.sched_getaffinity(0))  # a container's or a taskset's share, not the machine's
    except (AttributeError, OSError):
        return os.cpu_count()


CGROUP_ROOT = "/sys/fs/cgroup"
SELF_CGROUP = "/proc/self/cgroup"
# cgroup v2, then v1: (its /proc/self/cgroup line's controllers, its folder under CGROUP_ROOT,
# the limit, usage and memory.stat key of the page cache that reclaim frees first)
CGROUP_MEMORY = (("", "", "memory.max", "memory.current", "inactive_file"),
                 ("memory", "memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
# cgroup v2, then v1: (controllers, folder, the quota file(s), the usage file and the factor to microseconds)
CGROUP_CPU = (("", "", ("cpu.max",), "cpu.stat", 1),
              ("cpu", "cpu", ("cpu.cfs_quota_us", "cpu.cfs_period_us"), "cpuacct.usage", 1000))


def first_line_or_empty(path):
    try:
        return read_first_line(path, 64).strip()
    except (OSError, ValueError):
        return ""


def first_lines(path):
    try:
        data = read_bounded(path, HOST_FILE_MAX_BYTES)
    except (OSError, ValueError):
        return []
    return (data or b"").decode("utf-8", "replace").splitlines()


def stat_field(path, key):
    """The value of the ``KEY VALUE`` line of a stat file (memory.stat, cpu.stat), or None."""
    return next((ln.split(" ", 1)[1].strip() for ln in first_lines(path) if ln.startswith(key + " ")), None)


def cgroup_folders(controllers, folder):
    """Each folder from this process's cgroup up to the mount's root, for the hierarchy
    of ``controllers`` ("": cgroup v2); nothing where /proc/self/cgroup names none or a
    path that leaves the mount."""
    for line in first_lines(SELF_CGROUP):
        parts = line.split(":", 2)
        if len(parts) == 3 and (parts[1] == controllers if not controllers else controllers in parts[1].split(",")):
            base = os.path.join(CGROUP_ROOT, folder) if folder else CGROUP_ROOT
            here = os.path.normpath(os.path.join(base, parts[2].lstrip("/")))
            if here != base and not here.startswith(base + os.sep):
                return []
            out = [here]
            while here != base:
                here = os.path.dirname(here)
                out.append(here)
            return out
    return []


def cgroup_memory():
    """The tightest cgroup memory limit over this process's cgroup and those above it
    (a container's: LXC, Docker, a systemd slice), v2 first: the texts of that cgroup's
    limit, usage and inactive file cache, for the controller to parse; None where no
    cgroup sets a number (a machine, a container without a limit, not Linux)."""
    for controllers, folder, limit_file, usage_file, inactive_key in CGROUP_MEMORY:
        limits = [(int(t), d, t) for d, t in ((d, first_line_or_empty(os.path.join(d, limit_file)))
                                              for d in cgroup_folders(controllers, folder)) if t.isdigit()]
        if not limits:
            continue
        _, where, limit = min(limits)
        return {"limit": limit, "usage": first_line_or_empty(os.path.join(where, usage_file)) or None,
                "inactive": stat_field(os.path.join(where, "memory.stat"), inactive_key)}
    return None


def cpu_quota(folder, files):
    """A cgroup's CPU quota as (quota, period) texts in microseconds, or None: none set."""
    if len(files) == 1:  # v2: "QUOTA PERIOD" or "max PERIOD"
        parts = first_line_or_empty(os.path.join(folder, files[0])).split()
    else:  # v1: two files, quota -1 for none
        parts = [first_line_or_empty(os.path.join(folder, f)) for f in files]
    return tuple(parts) if len(parts) == 2 and all(p.isdigit() for p in parts) and int(parts[1]) > 0 else None


def cgroup_cpu():
    """The tightest cgroup CPU quota over this process's cgroup and those above it, v2
    first: that quota, its period, the cgroup's CPU time used (microseconds) and the
    host's uptime, as texts for the controller; None where no cgroup sets a quota."""
    for controllers, folder, quota_files, usage_file, to_us in CGROUP_CPU:
        quotas = [(int(q[0]) / int(q[1]), d, q) for d, q in ((d, cpu_quota(d, quota_files))
                                                            for d in cgroup_folders(controllers, folder)) if q]
        if not quotas:
            continue
        _, where, (quota, period) = min(quotas)
        if to_us == 1:  # v2: cpu.stat's usage_usec line
            usage = stat_field(os.path.join(where, usage_file), "usage_usec") or ""
        else:  # v1: cpuacct.usage, nanoseconds, in the cpuacct hierarchy (often the same folder)
            rel = os.path.relpath(where, os.path.join(CGROUP_ROOT, folder))
            usage = next((t for t in (first_line_or_empty(os.path.join(d, usage_file))
                                      for d in (where, os.path.normpath(os.path.join(CGROUP_ROOT, "cpuacct", rel))))
                          if t.isdigit()), "")
            usage = str(int(usage) // to_us) if usage else ""
        uptime = first_line_or_empty("/proc/uptime").split(" ", 1)[0]
        return {"quota_us": quota, "period_us": period, "usage_us": usage or None, "uptime_s": uptime or None}
    return None


def oom_kills():
    """The kernel's counts of OOM kills: the host's (/proc/vmstat ``oom_kill``, Linux
    4.13+) and this process's cgroup's (v2 memory.events, v1 memory.oom_control:
    a container's own); None where unreadable."""
    host = stat_field("/proc/vmstat", "oom_kill")
    group = None
    for controllers, folder, events in (("", "", "memory.events"), ("memory", "memory", "memory.oom_control")):
        here = cgroup_folders(controllers, folder)
        group = stat_field(os.path.join(here[0], events), "oom_kill") if here else None
        if group is not None:
            break
    return {"host": int(host) if host and host.isdigit() else None,
            "cgroup": int(group) if group and group.isdigit() else None}


def host_stats():
    """The host's load, CPU time and memory as the kernel prints them (the
    controller parses them: dflashctl.hosts.parsers.read_host_stats); a file that cannot
    be read is None. ``cgroup_memory`` and ``cgroup_cpu``: a container's memory limit and
    use, its CPU quota and the CPU time it used, where such a limit is set."""
    out = {"cpus": usable_cpus(), "cgroup_memory": cgroup_memory(), "cgroup_cpu": cgroup_cpu(), "oom": oom_kills()}
    for key, path, read in (("loadavg", "/proc/loadavg", read_first_line), ("stat", "/proc/stat", read_first_line),
                            ("meminfo", "/proc/meminfo", None)):
        try:
            if read is None:
                data = read_bounded(path, HOST_FILE_MAX_BYTES)
                lines = [] if data is None else data.decode("utf-8", "replace").splitlines()
                out[key] = "\n".join(ln for ln in lines if ln.startswith(MEMINFO_KEYS)) if data is not None else None
            else:
                out[key] = read(path, HOST_FILE_MAX_BYTES)
        except (OSError, ValueError):
            out[key] = None  # no /proc (not Linux), or not readable here
    return out


# --------------------------------------------------------------------------- one run


def spec_number(spec, key, default, low, high, errors, kind=int):
    """The controller's number for ``key``, clamped to [low, high]; a bad one is an
    error line and the default, so it spoils no other step."""
    value = spec.get(key)
    if value is None:
        return default
    try:
        return max(low, min(high, kind(value)))
    except (TypeError, ValueError, OverflowError) as e:
        errors.append("argument %s: %s" % (key, describe(e)))
        return default


def probe_run(spec, default_timeout):
    errors = []
    out = {"run_dir": spec["run_dir"], "session": spec.get("session"), "errors": errors}
    timeout = spec_number(spec, "step_timeout", default_timeout, 0.01, MAX_STEP_TIMEOUT, errors, float)
    run_dir = os.path.expanduser(spec["run_dir"])
    lines = spec_number(spec, "pane_lines", 200, 1, MAX_TAIL_LINES, errors)
    session = spec.get("session")
    if session:
        sock = spec.get("socket") or TMUX_SOCKET
        gone = {}
        out["session_alive"] = step(errors, "tmux has-session", timeout, tmux_alive, sock, session, timeout, gone)
        if "server" in gone:
            out["tmux_server_gone"] = gone["server"]
        if out["session_alive"]:
            out["pane"] = step(errors, "tmux capture-pane", timeout, tmux_pane, sock, session, lines, timeout)
    rank = spec_number(spec, "rank", 0, 0, 1 << 20, errors)
    status_name = STATUS_FILE if rank == 0 else "status.rank%d.json" % rank
    metrics_name = METRICS_FILE if rank == 0 else "metrics.rank%d.jsonl" % rank
    status = step(errors, status_name, timeout, read_status, os.path.join(run_dir, status_name))
    out["status_text"] = status["text"] if status else None
    out["metrics"] = step(errors, metrics_name, timeout, read_metrics, os.path.join(run_dir, metrics_name),
                          spec_number(spec, "metrics_offset", 0, 0, 2**63, errors),
                          spec.get("metrics_inode"),
                          spec_number(spec, "metrics_max_bytes", METRICS_DEFAULT_BYTES, 1, METRICS_MAX_BYTES, errors))
    out["log_tail"] = step(errors, LOG_FILE, timeout, read_tail, os.path.join(run_dir, LOG_FILE), lines)
    out["exit_code"] = step(errors, EXIT_CODE_FILE, timeout, read_exit_code, os.path.join(run_dir, EXIT_CODE_FILE))
    out["disk"] = step(errors, "free disk", timeout, disk_space, run_dir)
    # A live standby: names its GPU process in the GPU pane, and a supervisor that
    # re-attaches keeps it rather than start another.
    out["standby_pid"] = step(errors, STANDBY_FILE, timeout, read_live_standby_pid, os.path.join(run_dir, STANDBY_FILE))
    pid = (status or {}).get("pid") or spec_number(spec, "pid_hint", 0, 0, MAX_PID, errors)
    if pid > 0:  # kill(0 or -N, 0) would address a process group
        out["process"] = step(errors, "process %d" % pid, timeout, process_state, pid)
    return out


# --------------------------------------------------------------------------- main


def main(argv):
    started = time.time()
    result = {"probe": PROBE_VERSION, "errors": [], "runs": []}
    try:
        result["hostname"] = socket.gethostname()
        result["python"] = "%d.%d.%d" % sys.version_info[:3]
        args = json.loads(argv[0]) if argv else []
        if isinstance(args, list):
            args = {"runs": args}
        runs = args.get("runs") or []
        # Host-level steps (nvidia-smi) get the most patient of the runs' limits.
        limits = [spec_number(r, "step_timeout", DEFAULT_STEP_TIMEOUT, 0.01, MAX_STEP_TIMEOUT, [], float)
                  for r in runs if isinstance(r, dict)]
        timeout = spec_number(args, "step_timeout", max(limits or [DEFAULT_STEP_TIMEOUT]), 0.01, MAX_STEP_TIMEOUT,
                              result["errors"], float)
        want_procs = args.get("processes", True)  # true, false, or how many top CPU consumers
        # The CPU sample's start (its errors, if any, are the later call's to say).
        early = step([], "processes", timeout, lambda: (proc_stats(), time.monotonic())) if want_procs else None
        want_smi = args.get("nvidia_smi")
        if want_smi is None:
            want_smi = any(r.get("nvidia_smi", True) for r in runs if isinstance(r, dict))
        if want_smi:
            result["smi"] = step(result["errors"], "nvidia-smi", timeout, nvidia_smi, timeout)
            if result["smi"] is not None:  # extras: what fails here is a note, the GPU rows stand
                notes = result["smi_notes"] = []
                result["gpu_clocks"] = step(notes, "nvidia-smi clocks", timeout, smi_clocks, timeout)
                result["pmon"] = step(notes, "nvidia-smi pmon", timeout, smi_pmon, timeout)
        result["host"] = step(result["errors"], "host stats", timeout, host_stats)
        for spec in runs:
            try:
                result["runs"].append(probe_run(spec, timeout))
            except Exception as e:
                where = spec.get("run_dir") if isinstance(spec, dict) else None
                result["runs"].append({"run_dir": where if isinstance(where, str) else repr(where)[:300],
                                       "session": spec.get("session") if isinstance(spec, dict) else None,
                                       "errors": ["probe: " + describe(e)]})
        if want_procs:
            top = PROC_TOP if isinstance(want_procs, bool) else \
                spec_number(args, "processes", PROC_TOP, 0, PROC_MAX_ROWS, result["errors"])
            wanted = app_pids((result.get("smi") or {}).get("apps"))
            for r in result["runs"]:
                wanted += [p for p in ((r.get("process") or {}).get("pid"), r.get("standby_pid"))
                           if isinstance(p, int) and 0 < p <= MAX_PID and p not in wanted]
            result["procs"] = step(result["errors"], "processes", timeout, processes, wanted, top, early)
    except Exception as e:
        result["errors"].append("probe: " + describe(e))
    result["host_time"] = time.time()
    result["elapsed"] = result["host_time"] - started
    try:
        line = json.dumps(result)
    except Exception as e:  # never expected: every value above is plain data
        line = json.dumps({"probe": PROBE_VERSION, "runs": [], "host_time": result["host_time"],
                           "errors": ["probe: answer not serializable: " + describe(e)]})
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    os._exit(0)  # do not wait on a step thread stuck in the kernel


if __name__ == "__main__":
    main(sys.argv[1:])
