"""Host facts for `dflashctl check`, as run on the host: what the machine is, and
whether it can hold a run.

Stdlib only, Python 3.8+, no dflashctl: the controller sends this file's text
(``python -c TEXT JSON``); ``python facts.py JSON`` runs it by hand.

The argument is one JSON object. Gathering facts:

    {"workdir": "~/dflash", "gpu_fields": ["index", ...],
     "launch": {"token": "ab12", "packages": ["torch", ...]}}

(``~`` expands here; the workdir is created when missing.) The answer is one JSON
line: hostname, OS, kernel, Python and its path, the workdir, tmux's version,
nvidia-smi's path and its answer to the GPU query (exit code, stdout, stderr tail,
each bounded), free and total disk in the workdir. With ``launch``, also what a
launch needs: whether the workdir takes a file (written, then removed), the
installed versions of ``packages`` and what torch requires of triton (with the
values its requirement markers are read against), this process's pid namespace
(its inode, and when its pid 1 started: an inode may be reused by a later
namespace, a start time is not), and two things started to outlive this call: a detached process (a new session,
sleeping ``LINGER_S`` seconds) and a tmux session on the private socket
``dflashctl-check-TOKEN``.

Checking a launch's inputs, before anything is deployed:

    {"inputs": {"workdir": "~/dflash", "shards": "/data/s" or null, "model": "/models/q" or null}}

answers, for ``shards`` (a directory of ``*.jsonl`` files or a glob, as the trainer
reads it): whether the path exists, how many shards it names, the first one, and
whether that shard opens and its first non-blank line is a JSON object with
``input_ids`` and ``loss_mask`` lists of one length (else why not); for ``model``:
whether the directory exists and holds a ``config.json`` that parses (its
``hidden_size``, ``intermediate_size`` and ``vocab_size`` when given); and the free
disk where the workdir is (or will be: this call creates nothing).

Looking again, in a later call:

    {"look": {"pid": 123, "start": 456789, "pidns": "pid:[4026531836]", "token": "ab12"}}

answers whether that process still lives (same pid, same start time, not a
zombie), this call's pid namespace (as above), and whether the tmux session is still there;
then stops both and removes the session's socket file. A detached process or a tmux session that dies when the first
call returns cannot hold a run: the controller says why and what to use instead.

A tool that is missing or fails is a value in the answer, never an exception; the
controller parses everything. The only things this script writes or starts are
the workdir, its one probe file, the sleeping process and the tmux session named
above, and the last two end within ``LINGER_S`` seconds even if nobody looks again.
"""

import glob
import json
import os
import platform
import shutil
import signal
import socket
import stat
import subprocess
import sys

COMMAND_TIMEOUT = 20.0
OUTPUT_MAX_CHARS = 65536  # of one command's stdout
STDERR_MAX_CHARS = 500
LINGER_S = 300  # how long the processes started to be looked at again live at most
TMUX_SOCKET_PREFIX = "dflashctl-check-"
TMUX_SESSION = "dflashctl-check"


def run(argv):
    try:
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                           timeout=COMMAND_TIMEOUT)
    except (OSError, subprocess.SubprocessError) as e:
        return None, "", str(e)[:STDERR_MAX_CHARS]
    out = p.stdout.decode("utf-8", "replace")[:OUTPUT_MAX_CHARS]
    return p.returncode, out, p.stderr.decode("utf-8", "replace")[-STDERR_MAX_CHARS:]


def os_name():
    try:
        with open("/etc/os-release") as f:
            for line in f.read(65536).splitlines():
                key, _, value = line.strip().partition("=")
                if key == "PRETTY_NAME":
                    return value.strip('"')
    except (OSError, ValueError):
        pass
    return platform.platform()


def pid_namespace():
    """{"pidns": 'pid:[4026531836]', "pid1_start": ticks} of this process, each None when unknown."""
    try:
        inode = os.readlink("/proc/self/ns/pid")
    except OSError:
        inode = None
    return {"pidns": inode, "pid1_start": start_time(1)}


def start_time(pid):
    """The process's start time (clock ticks since boot, /proc/PID/stat field 22),
    or None when there is no such process or it is a zombie."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError, ValueError):
        return None
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def tmux_argv(tmux, token, *args):
    return [tmux, "-L", TMUX_SOCKET_PREFIX + token] + list(args)


def marker_environment():
    """What requirement markers are evaluated against (PEP 508), for this python."""
    return {
        "implementation_name": sys.implementation.name,
        "implementation_version": platform.python_version(),
        "os_name": os.name,
        "platform_machine": platform.machine(),
        "platform_python_implementation": platform.python_implementation(),
        "platform_release": platform.release(),
        "platform_system": platform.system(),
        "platform_version": platform.version(),
        "python_full_version": platform.python_version(),
        "python_version": ".".join(platform.python_version_tuple()[:2]),
        "sys_platform": sys.platform,
    }


def packages(names):
    """{name: installed version or None}, and torch's requirements on triton."""
    found, triton = {}, []
    try:
        from importlib import metadata
    except ImportError:  # a python without importlib.metadata (< 3.8): nothing can be told
        return {"versions": {}, "error": "importlib.metadata is missing"}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except Exception:  # noqa: BLE001  (not installed, or broken metadata: both mean "not usable")
            found[name] = None
    if found.get("torch"):
        try:
            for requirement in metadata.requires("torch") or []:
                if requirement.replace("_", "-").lower().startswith(("triton", "pytorch-triton")):
                    triton.append(requirement[:300])
        except Exception:  # noqa: BLE001
            pass
    return {"versions": found, "torch_requires_triton": triton, "markers": marker_environment()}


def writable(workdir, token):
    """None when a file can be created, written and removed in the workdir, else why not."""
    path = os.path.join(workdir, ".dflashctl-check-" + token)
    try:
        with open(path, "w") as f:
            f.write("dflashctl check\n")
        os.remove(path)
        return None
    except OSError as e:
        return str(e)[:STDERR_MAX_CHARS]


def start_lingering(token):
    """A detached process and a tmux session, both meant to outlive this call."""
    answer = pid_namespace()
    try:
        child = subprocess.Popen(
            [sys.executable, "-S", "-c", "import time; time.sleep(%d)" % LINGER_S],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            close_fds=True, start_new_session=True,
        )
        answer["detached"] = {"pid": child.pid, "start": start_time(child.pid)}
    except OSError as e:
        answer["detached"] = {"error": str(e)[:STDERR_MAX_CHARS]}
    tmux = shutil.which("tmux")
    if tmux:
        code, out, err = run(tmux_argv(tmux, token, "new-session", "-d", "-s", TMUX_SESSION,
                                       "sleep %d" % LINGER_S))
        answer["tmux"] = {"exit_code": code, "stderr": (err or out).strip()[-STDERR_MAX_CHARS:]}
    return answer


def look(args):
    """The second call: are they still there? Then stop them."""
    answer = pid_namespace()
    pid, start = args.get("pid"), args.get("start")
    if isinstance(pid, int) and pid > 0:
        alive = start is not None and start_time(pid) == start
        answer["detached_alive"] = alive
        if alive:
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:
                pass
    tmux = shutil.which("tmux")
    token = args.get("token")
    if tmux and isinstance(token, str) and token.isalnum():
        code, _, err = run(tmux_argv(tmux, token, "has-session", "-t", "=" + TMUX_SESSION))
        answer["tmux_alive"] = code == 0
        if code not in (0, 1):
            answer["tmux_error"] = err.strip()[-STDERR_MAX_CHARS:]
        run(tmux_argv(tmux, token, "kill-server"))
        remove_socket(token)
    return answer


def remove_socket(token):
    """The check's own tmux socket file, once its server is gone: tmux leaves the file
    behind when its server exits (kill-server, or a wrapper's namespace ending with
    the first call), and a check must leave nothing on the host."""
    path = os.path.join(os.environ.get("TMUX_TMPDIR") or "/tmp", "tmux-%d" % os.getuid(), TMUX_SOCKET_PREFIX + token)
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.remove(path)
    except OSError:
        pass


def gather(args):
    workdir = os.path.expanduser(args["workdir"])
    facts = {
        "hostname": socket.gethostname(),
        "os": os_name(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "python_path": sys.executable,
        "workdir": workdir,
    }
    tmux = shutil.which("tmux")
    facts["tmux"] = run([tmux, "-V"])[1].strip()[:200] if tmux else None
    smi = shutil.which("nvidia-smi")
    facts["nvidia_smi"] = smi
    if smi:
        fields = ",".join(args.get("gpu_fields") or ["index", "name", "memory.total", "memory.used"])
        code, out, err = run([smi, "--query-gpu=" + fields, "--format=csv,noheader,nounits"])
        facts["gpu_query"] = {"exit_code": code, "stdout": out, "stderr": err}
    try:
        os.makedirs(workdir, exist_ok=True)
        usage = shutil.disk_usage(workdir)
        facts["disk_free"], facts["disk_total"] = usage.free, usage.total
    except OSError as e:
        facts["disk_error"] = str(e)[:STDERR_MAX_CHARS]
    launch = args.get("launch")
    if isinstance(launch, dict) and isinstance(launch.get("token"), str) and launch["token"].isalnum():
        token = launch["token"]
        facts["launch"] = {
            "workdir_error": facts.get("disk_error") or writable(workdir, token),
            "packages": packages([n for n in launch.get("packages") or [] if isinstance(n, str)]),
        }
        facts["launch"].update(start_lingering(token))
    return facts


FIRST_LINE_MAX_BYTES = 64 << 20  # the first shard line read at most (a sample is far smaller)


def first_record(path):
    """Why the shard's first non-blank line is not a sample, or None when it is one."""
    try:
        with open(path, "rb") as f:
            while True:
                line = f.readline(FIRST_LINE_MAX_BYTES)
                if not line:
                    return "the shard is empty"
                if line.strip():
                    break
    except OSError as e:
        return "cannot read it: " + str(e)[:STDERR_MAX_CHARS]
    try:
        record = json.loads(line.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        return "its first line is not valid JSON: " + str(e)[:200]
    if not isinstance(record, dict):
        return "its first line is not a JSON object"
    ids, mask = record.get("input_ids"), record.get("loss_mask")
    if not isinstance(ids, list) or not isinstance(mask, list):
        return "its first line has no 'input_ids' and 'loss_mask' lists"
    if len(ids) != len(mask):
        return "its first line's 'input_ids' has %d tokens but 'loss_mask' has %d" % (len(ids), len(mask))
    return None


def shards_answer(spec):
    path = os.path.expanduser(spec)
    is_dir = os.path.isdir(path)
    paths = sorted(glob.glob(os.path.join(path, "*.jsonl")) if is_dir else glob.glob(path))
    answer = {"path": path, "exists": is_dir or os.path.exists(path) or bool(paths), "is_dir": is_dir,
              "count": len(paths), "first": paths[0] if paths else None, "first_error": None}
    if paths:
        answer["first_error"] = first_record(paths[0])
    return answer


def model_answer(path):
    path = os.path.expanduser(path)
    answer = {"path": path, "exists": os.path.isdir(path), "config": False, "config_error": None}
    config = os.path.join(path, "config.json")
    if not answer["exists"]:
        return answer
    try:
        with open(config, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        answer["config_error"] = str(e)[:STDERR_MAX_CHARS]
        return answer
    answer["config"] = isinstance(raw, dict)
    if not answer["config"]:
        answer["config_error"] = "config.json is not a JSON object"
        return answer
    for key in ("hidden_size", "intermediate_size", "vocab_size"):
        if isinstance(raw.get(key), int) and not isinstance(raw.get(key), bool):
            answer[key] = raw[key]
    return answer


def inputs(args):
    """A launch's inputs, checked where the trainer will read them."""
    answer = {}
    if isinstance(args.get("shards"), str):
        answer["shards"] = shards_answer(args["shards"])
    if isinstance(args.get("model"), str):
        answer["model"] = model_answer(args["model"])
    if isinstance(args.get("workdir"), str):
        place = os.path.abspath(os.path.expanduser(args["workdir"]))
        while not os.path.exists(place) and os.path.dirname(place) != place:
            place = os.path.dirname(place)  # read only: the disk the workdir will be created on
        try:
            answer["disk_free"] = shutil.disk_usage(place).free
        except OSError as e:
            answer["disk_error"] = str(e)[:STDERR_MAX_CHARS]
    return answer


def main(argv):
    try:
        args = json.loads(argv[0]) if argv else {}
    except ValueError:
        args = None
    if isinstance(args, dict) and isinstance(args.get("look"), dict):
        sys.stdout.write(json.dumps(look(args["look"])) + "\n")
        return 0
    if isinstance(args, dict) and isinstance(args.get("inputs"), dict):
        sys.stdout.write(json.dumps(inputs(args["inputs"])) + "\n")
        return 0
    if not isinstance(args, dict) or not isinstance(args.get("workdir"), str):
        sys.stdout.write(json.dumps({"error": "expected one JSON argument {\"workdir\": ...}"}) + "\n")
        return 2
    sys.stdout.write(json.dumps(gather(args)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
