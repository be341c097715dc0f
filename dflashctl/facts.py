"""Host facts for `dflashctl check`: what a run host is, gathered in ONE round trip.

A small stdlib-only Python script (``dflashctl/remote/facts.py``) runs on the host
(inside its container wrapper) and prints one JSON object; everything is parsed
here, on this side, with pure functions. That answer is untrusted: a value of the
wrong type is a ValueError naming the field (``contract.check_*``), never a crash
of `check`. Hosts are checked concurrently; an unreachable host is a failed
``HostCheck`` with its message, never an exception that hides the others. Nothing
in this module runs on the host.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from dflashctl import contract, parsers, remote
from dflashctl.errors import DflashError
from dflashctl.transport import Transport, describe_route, fanout

GPU_FIELDS = ("index", "name", "memory.total", "memory.used")
DEFAULT_TIMEOUT = 30.0

# The host-side script (dflashctl/remote/facts.py), shipped as its text.
FACTS_SCRIPT = remote.source("facts")


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


_TEXT_FACTS = ("hostname", "os", "kernel", "python", "python_path", "workdir")
_OPTIONAL_TEXT_FACTS = ("tmux", "nvidia_smi", "disk_error")
_OPTIONAL_INT_FACTS = ("disk_free", "disk_total")
_MAX_SMI_CHARS = 1 << 20


def parse_facts(text: str) -> HostFacts:
    """The facts script's output -> HostFacts. ValueError (only) when it is not its
    JSON, or a fact has the wrong type (the message names it)."""
    last = text.strip().splitlines()[-1] if isinstance(text, str) and text.strip() else ""
    try:
        raw = json.loads(last) if last.startswith("{") else None
    except RecursionError:
        raw = None
    if not isinstance(raw, dict):
        raise ValueError(f"expected the facts JSON object, got {str(text)[:200]!r}")
    values: dict[str, Any] = {}
    for key in _TEXT_FACTS:
        values[key] = contract.check_text(raw.get(key), f"'{key}'")
    for key in _OPTIONAL_TEXT_FACTS:
        if raw.get(key) is not None:
            values[key] = contract.check_text(raw[key], f"'{key}'")
    for key in _OPTIONAL_INT_FACTS:
        if raw.get(key) is not None:
            values[key] = contract.check_int(raw[key], f"'{key}'", 0, 2**64)
    facts = HostFacts(**values)
    query = raw.get("gpu_query")
    if query is None:
        return facts
    if not isinstance(query, dict):
        raise ValueError(f"'gpu_query' is not an object ({type(query).__name__})")
    code = None if query.get("exit_code") is None else contract.check_int(query["exit_code"], "'gpu_query' exit_code",
                                                                           -(2**31), 2**31)  # fmt: skip
    stdout = contract.check_text(query.get("stdout", ""), "'gpu_query' stdout", _MAX_SMI_CHARS)
    stderr = contract.check_text(query.get("stderr", ""), "'gpu_query' stderr", _MAX_SMI_CHARS)
    if code == 0:
        parsed = parsers.read_gpu_query(stdout, GPU_FIELDS)
        facts.gpus = [Gpu(g.index, g.name, g.memory_total_mib, g.memory_used_mib) for g in parsed.rows]
        if parsed.rejected:
            facts.gpu_error = f"nvidia-smi answer refused: {parsed.rejected[0]}"
    else:
        reason = (stderr or stdout).strip().splitlines()
        facts.gpu_error = f"nvidia-smi exit {code}" + (f": {reason[-1]}" if reason else "")
    return facts


def gather_facts(transport: Transport, timeout: float | None = None) -> HostFacts:
    """One round trip to the host; creates its workdir if missing."""
    args = json.dumps({"workdir": transport.host.workdir, "gpu_fields": list(GPU_FIELDS)})
    result = transport.run_script(FACTS_SCRIPT, [args], timeout=timeout or DEFAULT_TIMEOUT)
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
