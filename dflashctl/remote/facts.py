"""Host facts for `dflashctl check`, as run on the host: what the machine is.

Stdlib only, Python 3.8+, no dflashctl: the controller sends this file's text
(``python -c TEXT JSON``); ``python facts.py JSON`` runs it by hand.

The argument is one JSON object: ``{"workdir": "~/dflash", "gpu_fields": ["index", ...]}``
(``~`` expands here; the workdir is created when missing, the one thing this
script writes). The answer is one JSON line: hostname, OS, kernel, Python and its
path, the workdir, tmux's version, nvidia-smi's path and its answer to the GPU
query (exit code, stdout, stderr tail, each bounded), free and total disk in the
workdir. A tool that is missing or fails is a value in the answer, never an
exception; the controller parses everything.
"""

import json
import os
import platform
import shutil
import socket
import subprocess
import sys

COMMAND_TIMEOUT = 20.0
OUTPUT_MAX_CHARS = 65536  # of one command's stdout
STDERR_MAX_CHARS = 500


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
    return facts


def main(argv):
    args = json.loads(argv[0]) if argv else {}
    if not isinstance(args, dict) or not isinstance(args.get("workdir"), str):
        sys.stdout.write(json.dumps({"error": "expected one JSON argument {\"workdir\": ...}"}) + "\n")
        return 2
    sys.stdout.write(json.dumps(gather(args)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
