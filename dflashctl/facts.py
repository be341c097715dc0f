"""Host facts for `dflashctl check`: what a run host is, gathered in ONE round trip.

A small stdlib-only Python script runs on the host (inside its container wrapper)
and prints one JSON object; everything is parsed here, on this side, with pure
functions. Hosts are checked concurrently; an unreachable host is a failed
``HostCheck`` with its message, never an exception that hides the others.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from dflashctl import parsers
from dflashctl.errors import DflashError
from dflashctl.transport import Transport, describe_route, fanout

GPU_FIELDS = ("index", "name", "memory.total", "memory.used")
DEFAULT_TIMEOUT = 30.0

# Runs on the host with its python (>= 3.7). argv: WORKDIR GPU_FIELDS
FACTS_SCRIPT = r"""
import json, os, platform, shutil, socket, subprocess, sys

def run(argv):
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=20)
        return p.returncode, p.stdout, p.stderr
    except (OSError, subprocess.SubprocessError) as e:
        return None, "", str(e)

def os_name():
    try:
        with open("/etc/os-release") as f:
            for line in f:
                key, _, value = line.strip().partition("=")
                if key == "PRETTY_NAME":
                    return value.strip('"')
    except OSError:
        pass
    return platform.platform()

workdir = os.path.expanduser(sys.argv[1])
facts = {
    "hostname": socket.gethostname(),
    "os": os_name(),
    "kernel": platform.release(),
    "python": platform.python_version(),
    "python_path": sys.executable,
    "workdir": workdir,
}
tmux = shutil.which("tmux")
facts["tmux"] = run([tmux, "-V"])[1].strip() if tmux else None
smi = shutil.which("nvidia-smi")
facts["nvidia_smi"] = smi
if smi:
    code, out, err = run([smi, "--query-gpu=" + sys.argv[2], "--format=csv,noheader,nounits"])
    facts["gpu_query"] = {"exit_code": code, "stdout": out, "stderr": err[-500:]}
try:
    os.makedirs(workdir, exist_ok=True)
    usage = shutil.disk_usage(workdir)
    facts["disk_free"], facts["disk_total"] = usage.free, usage.total
except OSError as e:
    facts["disk_error"] = str(e)
print(json.dumps(facts))
"""


@dataclass
class Gpu:
    index: int | None
    name: str | None
    memory_total_mib: float | None
    memory_used_mib: float | None


@dataclass
class HostFacts:
    hostname: str
    os: str
    kernel: str
    python: str
    python_path: str
    workdir: str
    tmux: str | None = None  # "tmux 3.3a"; None: not installed
    nvidia_smi: str | None = None  # its path; None: not installed
    gpus: list[Gpu] = field(default_factory=list)
    gpu_error: str | None = None  # nvidia-smi present but its query failed
    disk_free: int | None = None  # bytes free in workdir
    disk_total: int | None = None
    disk_error: str | None = None


def parse_facts(text: str) -> HostFacts:
    """The facts script's output -> HostFacts (ValueError when it is not its JSON)."""
    raw = json.loads(text.strip().splitlines()[-1]) if text.strip() else None
    if not isinstance(raw, dict):
        raise ValueError(f"expected the facts JSON object, got {text[:200]!r}")
    query = raw.pop("gpu_query", None)
    known = set(HostFacts.__dataclass_fields__)
    facts = HostFacts(**{k: v for k, v in raw.items() if k in known})
    if query is not None:
        if query.get("exit_code") == 0:
            facts.gpus = [
                Gpu(g.index, g.name, g.memory_total_mib, g.memory_used_mib)
                for g in parsers.parse_gpu_query(query.get("stdout", ""), GPU_FIELDS)
            ]
        else:
            reason = (query.get("stderr") or query.get("stdout") or "").strip().splitlines()
            facts.gpu_error = f"nvidia-smi exit {query.get('exit_code')}" + (f": {reason[-1]}" if reason else "")
    return facts


def gather_facts(transport: Transport, timeout: float | None = None) -> HostFacts:
    """One round trip to the host; creates its workdir if missing."""
    result = transport.run_script(
        FACTS_SCRIPT, [transport.host.workdir, ",".join(GPU_FIELDS)], timeout=timeout or DEFAULT_TIMEOUT
    )
    try:
        return parse_facts(result.stdout)
    except ValueError as e:
        raise DflashError(f"{transport.name}: unexpected answer from the facts script: {e}") from None


@dataclass
class HostCheck:
    """What `check` found for one host."""

    name: str
    ok: bool
    route: list[str]  # hosts passed through, outermost jump first, the host last
    route_text: str  # 'jump -> target [pct exec 200 --]'
    wrapper: list[str]
    address: str | None  # address:port as the last jump sees it; None for local
    seconds: float
    facts: HostFacts | None = None
    error: str | None = None
    hint: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_hosts(inventory, names: list[str] | None = None, timeout: float | None = None) -> list[HostCheck]:
    """Check every named host (default: all) at once. Unknown names: ConfigError."""
    names = list(names or inventory.hosts)
    routes = {name: inventory.route(name) for name in names}

    def blank(name: str) -> HostCheck:
        route = routes[name]
        host = route[-1]
        return HostCheck(
            name=name,
            ok=False,
            route=[h.name for h in route],
            route_text=describe_route(route),
            wrapper=list(host.wrapper),
            address=None if host.is_local else f"{host.address}:{host.port}",
            seconds=0.0,
        )

    def check(transport: Transport) -> HostCheck:
        found = blank(transport.name)
        started = time.monotonic()
        try:
            found.facts = gather_facts(transport, timeout)
            found.ok = True
        except DflashError as e:
            found.error, found.hint = str(e), e.hint
        found.seconds = time.monotonic() - started
        return found

    results = fanout(names, check, inventory=inventory)
    checks = []
    for name in names:
        found = results[name]
        if isinstance(found, Exception):  # not a DflashError: a surprise, still one host's
            found, error = blank(name), found
            found.error = f"{name}: {type(error).__name__}: {error}"
        checks.append(found)
    return checks
