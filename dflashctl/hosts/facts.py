"""Host facts for `dflashctl check`: what a run host is, and whether it can hold a run.

A small stdlib-only Python script (``dflashctl/hosts/remote/facts.py``) runs on the host
(inside its container wrapper) and prints one JSON object; everything is parsed
here, on this side, with pure functions. That answer is untrusted: a value of the
wrong type is a ValueError naming the field (``contract.check_*``), never a crash
of `check`.

For a run host, `check` proves what `launch` needs, in two round trips: the first
gathers the facts, writes and removes a file in the workdir, reads the installed
versions of what the trainer imports (``TRAINER_REQUIREMENTS``) and starts a detached process and a tmux session;
the second (after the first call has returned) looks whether both are still there,
and in which pid namespace, then stops them. ``launch_problems`` turns that into
``Problem``s, each naming the cause and the fix (a wrapper that runs every call in
a new pid namespace kills the trainer's tmux session when the launch returns).
A host that only serves as a jump is reached and described, nothing started on it.

Hosts are checked concurrently; an unreachable host is a failed ``HostCheck`` with
its message, never an exception that hides the others. Nothing in this module
runs on the host.
"""

from __future__ import annotations

import getpass
import json
import secrets
import shlex
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from packaging.markers import InvalidMarker, Marker
from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

from dflashctl.core import contract
from dflashctl.core.errors import DflashError
from dflashctl.core.units import fmt_bytes
from dflashctl.hosts import parsers, remote
from dflashctl.hosts.transport import Transport, describe_route, fanout
from dflashctl.hosts.transport.limits import FACTS

if TYPE_CHECKING:
    from dflashctl.config import Host, Inventory

GPU_FIELDS = ("index", "name", "memory.total", "memory.used")
DEFAULT_TIMEOUT = 30.0
# What the bundled trainer needs of the run host's python: pyproject.toml's
# `trainer` extra (a test holds them equal). triton is needed where torch itself
# requires it (CUDA builds), at the version torch pins.
TRAINER_REQUIREMENTS = (
    "torch>=2.6",
    "triton>=3.0; sys_platform == 'linux'",
    "transformers>=4.51",
    "safetensors>=0.4",
)
LAUNCH_PACKAGES = tuple(Requirement(r).name for r in TRAINER_REQUIREMENTS)
# Read too, never required: they change which attention kernels a run gets (``attention_text``).
OPTIONAL_PACKAGES = (contract.FLASH_ATTN_PACKAGE,)
CONTAINER_WRAPPERS = "`pct exec VMID --`, `lxc-attach -n NAME --` or `docker exec NAME`"

# The host-side script (dflashctl/hosts/remote/facts.py), shipped as its text.
FACTS_SCRIPT = remote.source("facts")


@dataclass
class Gpu:
    index: int | None
    name: str | None
    memory_total_mib: float | None
    memory_used_mib: float | None


@dataclass
class LaunchFacts:
    """What the first call found and started for the launch checks."""

    workdir_error: str | None = None  # why a file cannot be written there; None: it can
    versions: dict[str, str | None] = field(default_factory=dict)  # package -> installed version
    torch_requires_triton: list[str] = field(default_factory=list)  # torch's requirement lines
    markers: dict[str, str] = field(default_factory=dict)  # the host python's PEP 508 environment
    pidns: str | None = None  # 'pid:[4026531836]'
    pid1_start: int | None = None  # when that namespace's pid 1 started (clock ticks since boot)
    detached_pid: int | None = None
    detached_start: int | None = None
    detached_error: str | None = None
    tmux_exit_code: int | None = None  # of `tmux new-session -d`; None: not tried (no tmux)
    tmux_error: str | None = None


@dataclass
class LookAgain:
    """What the second call saw of what the first one started."""

    pidns: str | None = None
    pid1_start: int | None = None
    detached_alive: bool | None = None
    tmux_alive: bool | None = None
    tmux_error: str | None = None


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
    launch: LaunchFacts | None = None


@dataclass
class Problem:
    """One thing that would stop (``error``) or mislead (``warning``) a launch on a host."""

    code: str
    severity: str  # 'error' | 'warning'
    message: str
    fix: str


_TEXT_FACTS = ("hostname", "os", "kernel", "python", "python_path", "workdir")
_OPTIONAL_TEXT_FACTS = ("tmux", "nvidia_smi", "disk_error")
_OPTIONAL_INT_FACTS = ("disk_free", "disk_total")
_MAX_SMI_CHARS = 1 << 20
_MAX_SHORT = 2000


def _json_line(text: str, what: str) -> dict:
    last = text.strip().splitlines()[-1] if isinstance(text, str) and text.strip() else ""
    try:
        raw = json.loads(last) if last.startswith("{") else None
    except (RecursionError, ValueError):
        raw = None
    if not isinstance(raw, dict):
        raise ValueError(f"expected the {what} JSON object, got {str(text)[:200]!r}")
    return raw


def _opt_text(raw: dict, key: str, name: str, limit: int = _MAX_SHORT) -> str | None:
    return None if raw.get(key) is None else contract.check_text(raw[key], name, limit)


def _opt_int(raw: dict, key: str, name: str, low: int = -(2**63), high: int = 2**63) -> int | None:
    return None if raw.get(key) is None else contract.check_int(raw[key], name, low, high)


def _opt_bool(raw: dict, key: str, name: str) -> bool | None:
    value = raw.get(key)
    if value is None or isinstance(value, bool):
        return value
    raise ValueError(f"{name} is not true or false ({type(value).__name__})")


def _object(value: Any, name: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{name} is not an object ({type(value).__name__})")
    return value


def _parse_launch(raw: Any) -> LaunchFacts:
    raw = _object(raw, "'launch'")
    found = LaunchFacts(workdir_error=_opt_text(raw, "workdir_error", "'launch' workdir_error"),
                        pidns=_opt_text(raw, "pidns", "'launch' pidns", 200),
                        pid1_start=_opt_int(raw, "pid1_start", "'launch' pid1_start", 0))
    pkgs = _object(raw.get("packages") or {}, "'launch' packages")
    versions = _object(pkgs.get("versions") or {}, "'launch' packages versions")
    for name in (*LAUNCH_PACKAGES, *OPTIONAL_PACKAGES):  # only these names: nothing else the host says is kept
        found.versions[name] = _opt_text(versions, name, f"'launch' version of {name}", 200)
    requires = pkgs.get("torch_requires_triton") or []
    if not isinstance(requires, list):
        raise ValueError("'launch' torch_requires_triton is not a list")
    found.torch_requires_triton = [contract.check_text(r, "'launch' torch requirement", 300) for r in requires[:20]]
    markers = _object(pkgs.get("markers") or {}, "'launch' markers")
    found.markers = {str(k): contract.check_text(v, f"'launch' marker {k}", 300) for k, v in list(markers.items())[:20]}
    detached = _object(raw.get("detached") or {}, "'launch' detached")
    found.detached_pid = _opt_int(detached, "pid", "'launch' detached pid", 1, 2**31)
    found.detached_start = _opt_int(detached, "start", "'launch' detached start", 0)
    found.detached_error = _opt_text(detached, "error", "'launch' detached error")
    tmux = raw.get("tmux")
    if tmux is not None:
        tmux = _object(tmux, "'launch' tmux")
        found.tmux_exit_code = _opt_int(tmux, "exit_code", "'launch' tmux exit_code", -(2**31), 2**31)
        found.tmux_error = _opt_text(tmux, "stderr", "'launch' tmux stderr")
        if found.tmux_exit_code is None:  # tmux was found but could not be run at all
            found.tmux_exit_code = -1
    return found


def parse_facts(text: str) -> HostFacts:
    """The facts script's output -> HostFacts. ValueError (only) when it is not its
    JSON, or a fact has the wrong type (the message names it)."""
    raw = _json_line(text, "facts")
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
    if raw.get("launch") is not None:
        facts.launch = _parse_launch(raw["launch"])
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


def parse_look(text: str) -> LookAgain:
    """The second call's answer -> LookAgain (ValueError as ``parse_facts``)."""
    raw = _json_line(text, "look-again")
    return LookAgain(
        pidns=_opt_text(raw, "pidns", "'pidns'", 200),
        pid1_start=_opt_int(raw, "pid1_start", "'pid1_start'", 0),
        detached_alive=_opt_bool(raw, "detached_alive", "'detached_alive'"),
        tmux_alive=_opt_bool(raw, "tmux_alive", "'tmux_alive'"),
        tmux_error=_opt_text(raw, "tmux_error", "'tmux_error'"),
    )


# --------------------------------------------------------------------------- round trips


def gather_facts(transport: Transport, timeout: float | None = None, launch_token: str | None = None) -> HostFacts:
    """One round trip to the host; creates its workdir if missing. With a
    ``launch_token``, also the launch checks' first half (``look_again`` is the second)."""
    args: dict[str, Any] = {"workdir": transport.host.workdir, "gpu_fields": list(GPU_FIELDS)}
    if launch_token is not None:
        args["launch"] = {"token": launch_token, "packages": [*LAUNCH_PACKAGES, *OPTIONAL_PACKAGES]}
    result = transport.run_script(FACTS_SCRIPT, [json.dumps(args)], timeout=timeout or DEFAULT_TIMEOUT, limit=FACTS)
    try:
        return parse_facts(result.stdout)
    except ValueError as e:
        raise DflashError(f"{transport.name}: unexpected answer from the facts script: {e}") from None


def look_again(transport: Transport, launch: LaunchFacts, token: str, timeout: float | None = None) -> LookAgain:
    """The second round trip: are the detached process and the tmux session that the
    first one started still there? Stops them either way."""
    args = {"look": {"pid": launch.detached_pid, "start": launch.detached_start, "token": token}}
    result = transport.run_script(FACTS_SCRIPT, [json.dumps(args)], timeout=timeout or DEFAULT_TIMEOUT, limit=FACTS)
    try:
        return parse_look(result.stdout)
    except ValueError as e:
        raise DflashError(f"{transport.name}: unexpected answer from the facts script: {e}") from None


# --------------------------------------------------------------------------- what launch needs (pure)


def _inside(host: "Host") -> str:
    return f"inside the container (`{shlex.join(host.wrapper)}`)" if host.wrapper else "on the host"


def _pip(facts: HostFacts, spec: str) -> str:
    return f"`{shlex.join([facts.python_path, '-m', 'pip', 'install', spec])}`"


def _package_problems(host: "Host", facts: HostFacts, launch: LaunchFacts) -> list[Problem]:
    problems = []
    where = f"{facts.python_path} (python {facts.python}) {_inside(host)}"
    other_python = f"or set `python:` for host '{host.name}' to the interpreter that has it"
    wanted = {Requirement(r).name: Requirement(r) for r in TRAINER_REQUIREMENTS}
    for name in (n for n in LAUNCH_PACKAGES if n != "triton"):  # triton: as torch requires it, below
        requirement, installed = wanted[name], launch.versions.get(name)
        spec = f"{name}{requirement.specifier}"
        if installed is None:
            problems.append(Problem(f"{name}-missing", "error", f"{name} is not installed for {where}: the trainer "
                                    "imports it", f"install it for that python: {_pip(facts, spec)} "
                                    f"(a CUDA build of torch on GPU hosts), {other_python}"))
        elif not _satisfies(requirement, installed):
            problems.append(Problem(f"{name}-version", "error", f"{name} {installed} is installed for {where}; the "
                                    f"trainer needs {spec}", f"upgrade it: {_pip(facts, spec)}, {other_python}"))
    torch_version = launch.versions.get("torch")
    for line in launch.torch_requires_triton if torch_version else []:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        if requirement.marker is not None and not _marker_holds(requirement.marker, launch.markers):
            continue
        installed = launch.versions.get("triton")
        floor = wanted["triton"]
        if installed is not None and _satisfies(requirement, installed) and _satisfies(floor, installed):
            continue
        spec = f"triton{requirement.specifier}"
        have = f"triton {installed} is installed" if installed else "triton is not installed"
        problems.append(Problem(
            "triton-version", "error",
            f"torch {torch_version} requires {spec}; {have} for {where}: torch.compile kernels will fail to build "
            "or fall back to slow paths", f"install the triton torch was built with: {_pip(facts, spec)}"))
        break
    return problems


def _satisfies(requirement: Requirement, version: str) -> bool:
    try:
        return requirement.specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def _marker_holds(marker: Marker, environment: dict[str, str]) -> bool:
    try:
        return marker.evaluate({**environment, "extra": ""})
    except (InvalidMarker, KeyError, ValueError, TypeError):
        return True  # cannot tell: check the requirement rather than skip it


def _other_namespace(launch: LaunchFacts, look: LookAgain) -> bool:
    """Whether the second call ran in another pid namespace than the first: another
    inode, or the same inode (reused by the kernel) with a pid 1 started since."""
    if launch.pidns and look.pidns and launch.pidns != look.pidns:
        return True
    return launch.pid1_start is not None and look.pid1_start is not None and launch.pid1_start != look.pid1_start


def launch_problems(host: "Host", facts: HostFacts, look: LookAgain | None, user: str | None = None) -> list[Problem]:
    """What would stop a launch on this host, from the two calls' answers; each
    problem names the cause and the fix. ``user``: who the host's commands run as."""
    launch = facts.launch
    if launch is None:
        return []
    problems: list[Problem] = []
    user = user or host.user or getpass.getuser()
    through = f"the wrapper `{shlex.join(host.wrapper)}`" if host.wrapper else "an SSH command"
    new_namespace = look is not None and _other_namespace(launch, look)
    if new_namespace:
        problems.append(Problem(
            "pid-namespace", "error",
            f"this wrapper (`{shlex.join(host.wrapper)}`) runs each command in a new pid namespace: processes die "
            "when the call returns (a detached process and a tmux session started by one call were gone at the "
            "next, in another namespace), so the trainer's tmux session would die as soon as `launch` returns",
            f"use a wrapper that enters the running container instead of starting a new one: {CONTAINER_WRAPPERS} "
            f"(`wrapper:` of host '{host.name}' in the inventory)"))
    lingering_fix = (f"let user {user}'s processes outlive the SSH session on the host: "
                     f"`loginctl enable-linger {shlex.quote(user)}` (systemd-logind's KillUserProcesses), or a "
                     "wrapper that does not kill what it started")
    if launch.detached_error:
        problems.append(Problem("detached-start", "error", f"cannot start a detached process through {through}: "
                                f"{launch.detached_error}", lingering_fix))
    elif look is not None and look.detached_alive is False and not new_namespace:
        problems.append(Problem(
            "detached-killed", "error",
            f"a detached process started through {through} did not outlive the call that started it (same pid "
            "namespace): something ends a session's processes when it closes, so the trainer would die with "
            "its launch call", lingering_fix))
    if facts.tmux is None:
        problems.append(Problem("tmux-missing", "error", f"tmux is not installed {_inside(host)}: launch starts "
                                "the trainer in a tmux session there",
                                f"install it {_inside(host)}: `apt-get install -y tmux` (or the distribution's "
                                "package)"))
    elif launch.tmux_exit_code not in (None, 0):
        problems.append(Problem("tmux-failed", "error", f"tmux cannot start a session {_inside(host)} "
                                f"(exit {launch.tmux_exit_code}): {launch.tmux_error or 'no message'}",
                                f"make `tmux new-session -d` work for user {user} there (a writable $TMUX_TMPDIR "
                                "or /tmp, a UTF-8 locale)"))
    elif look is not None and look.tmux_alive is False and not new_namespace:
        problems.append(Problem(
            "tmux-lost", "error",
            f"a tmux session started through {through} was gone at the next call: the tmux server does not "
            "outlive the call, nor would the trainer's session", lingering_fix))
    if launch.workdir_error:
        problems.append(Problem(
            "workdir", "error", f"the work directory {facts.workdir} is not writable {_inside(host)}: "
            f"{launch.workdir_error}",
            f"set `workdir:` for host '{host.name}' to a directory that user {user} can write there, or fix its "
            "owner and permissions"))
    problems += _package_problems(host, facts, launch)
    return problems


# The problems that end a launched trainer however its environment looks: `launch`
# refuses a host that has one (`check` shows every problem).
LAUNCH_BLOCKERS = ("pid-namespace", "detached-start", "detached-killed", "tmux-missing", "tmux-failed", "tmux-lost",
                   "workdir")


def prove_launchable(transport: Transport, timeout: float | None = None) -> tuple[HostFacts, list[Problem]]:
    """`check`'s proof of what a launch needs, on one run host: the facts, with a
    detached process and a tmux session started, then looked at again in a second
    call (``look_again``, which stops them); the problems found."""
    token = secrets.token_hex(6)
    facts = gather_facts(transport, timeout, launch_token=token)
    if facts.launch is None:
        return facts, []
    look = look_again(transport, facts.launch, token, timeout)
    return facts, launch_problems(transport.host, facts, look, getattr(transport, "user", None))


def gpu_count_problem(host: "Host", found: int | None, smi_present: bool = True) -> Problem | None:
    """A warning when the inventory's ``gpus:`` differs from the GPUs nvidia-smi
    shows (``found``; None: it gave no answer); None when they agree or nothing is claimed."""
    if host.gpus is None or found is None and smi_present:
        return None
    if not smi_present:
        if not host.gpus:
            return None
        seen = "the host has no nvidia-smi"
    elif found == host.gpus:
        return None
    else:
        seen = f"nvidia-smi shows {found} GPU{'s' if found != 1 else ''}"
    return Problem("gpu-count", "warning", f"the inventory says `gpus: {host.gpus}` for host '{host.name}', but {seen}",
                   f"set `gpus: {found or 0}` for host '{host.name}' in the inventory (playbook GPU placement is "
                   "checked against it), or find out where the missing GPUs went (`nvidia-smi -L`)")


# --------------------------------------------------------------------------- which attention a run gets


def attention_text(facts: HostFacts) -> tuple[str | None, Problem | None]:
    """Which attention kernels the trainer runs on this host with ``compile.flex_kernel:
    auto``, in words, from its packages (the image's, not what the user has elsewhere) and
    its GPUs' names; and a warning where an installed flash-attn-4 is refused. (None, None)
    for a host without launch checks."""
    if facts.launch is None or not facts.launch.versions:
        return None, None
    if facts.nvidia_smi is None or not facts.gpus:
        return "dense SDPA over the DFlash mask (no GPU)", None
    version = facts.launch.versions.get(contract.FLASH_ATTN_PACKAGE)
    other = sorted({g.name or "unnamed" for g in facts.gpus if not contract.flash_capable_gpu(g.name or "")})
    why = f"{', '.join(other)}: not a Hopper or Blackwell GPU" if other else contract.flash_attn_problem(version)
    if why is None:
        return (f"flex_attention compiled on flash-attention 4's kernels "
                f"(compile.flex_kernel auto; {contract.FLASH_ATTN_PACKAGE} {version})"), None
    text = f"flex_attention compiled, its own Triton kernels (compile.flex_kernel auto); not flash-attention 4's: {why}"
    if other or version is None:
        return text, None
    return text, Problem("flash-attn-version", "warning",
                         f"{why}: the trainer does not use it (compile.flex_kernel: flash is refused)",
                         f"install the fixed release: {_pip(facts, contract.FLASH_ATTN_SPEC)}")


# --------------------------------------------------------------------------- check


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
    role: str = "run"  # 'run', or 'jump': only a jump host for others (no launch checks)
    facts: HostFacts | None = None
    problems: list[Problem] = field(default_factory=list)
    error: str | None = None
    hint: str | None = None
    attention: str | None = None  # which attention kernels a run gets here (``attention_text``)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def jump_only(inventory: "Inventory", name: str) -> bool:
    """Whether the host only carries connections to others: another inventory host
    goes through it, and it declares no GPUs and no container."""
    host = inventory.get(name)
    if host.is_local or host.gpus or host.wrapper:
        return False
    return any(h.name == name for other in inventory.hosts if other != name for h in inventory.route(other)[:-1])


def check_hosts(inventory: "Inventory", names: list[str] | None = None, timeout: float | None = None) -> list[HostCheck]:
    """Check every named host (default: all) at once. Unknown names: ConfigError."""
    names = list(names or inventory.hosts)
    routes = {name: inventory.route(name) for name in names}
    jumps = {name: jump_only(inventory, name) for name in names}

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
            role="jump" if jumps[name] else "run",
        )

    def check(transport: Transport) -> HostCheck:
        found = blank(transport.name)
        host = transport.host
        started = time.monotonic()
        try:
            if jumps[transport.name]:
                found.facts = gather_facts(transport, timeout)
            else:
                found.facts, found.problems = prove_launchable(transport, timeout)
                found.attention, flash = attention_text(found.facts)
                found.problems += [flash] if flash else []
            smi = found.facts.nvidia_smi is not None
            count = gpu_count_problem(host, None if found.facts.gpu_error else len(found.facts.gpus), smi)
            if count is not None:
                found.problems.append(count)
            found.ok = not any(p.severity == "error" for p in found.problems)
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


# --------------------------------------------------------------------------- a launch's inputs (before deploying)

MIN_CHECKPOINT_FREE = 1 << 30  # bytes free in the workdir at the least, whatever the estimate
CHECKPOINT_BYTES_PER_PARAM = 16  # fp32 weights and two fp32 Adam moments, with room for the bf16 copy


@dataclass
class InputsCheck:
    """What the host said of a launch's inputs (``dflashctl/hosts/remote/facts.py`` ``inputs``)."""

    shards: dict[str, Any] | None = None  # path, exists, is_dir, count, first, first_error
    model: dict[str, Any] | None = None  # path, exists, config, config_error, hidden_size, ...
    disk_free: int | None = None
    disk_error: str | None = None


def inputs_argument(trainer: dict[str, Any], workdir: str) -> dict[str, Any]:
    data, model = trainer.get("data") or {}, trainer.get("model") or {}
    return {"inputs": {"workdir": workdir, "shards": data.get("shards"), "model": model.get("path")}}


def parse_inputs(text: str) -> InputsCheck:
    """The inputs answer -> InputsCheck. ValueError (only) when it is not that JSON,
    or a value has the wrong type (the message names it)."""
    raw = _json_line(text, "inputs")
    found = InputsCheck(disk_free=_opt_int(raw, "disk_free", "'disk_free'", 0),
                        disk_error=_opt_text(raw, "disk_error", "'disk_error'"))
    if raw.get("shards") is not None:
        s = _object(raw["shards"], "'shards'")
        found.shards = {"path": contract.check_text(s.get("path"), "'shards' path"),
                        "exists": bool(_opt_bool(s, "exists", "'shards' exists")),
                        "is_dir": bool(_opt_bool(s, "is_dir", "'shards' is_dir")),
                        "count": _opt_int(s, "count", "'shards' count", 0) or 0,
                        "first": _opt_text(s, "first", "'shards' first"),
                        "first_error": _opt_text(s, "first_error", "'shards' first_error")}
    if raw.get("model") is not None:
        m = _object(raw["model"], "'model'")
        found.model = {"path": contract.check_text(m.get("path"), "'model' path"),
                       "exists": bool(_opt_bool(m, "exists", "'model' exists")),
                       "config": bool(_opt_bool(m, "config", "'model' config")),
                       "config_error": _opt_text(m, "config_error", "'model' config_error"),
                       **{k: _opt_int(m, k, f"'model' {k}", 1, 2**40)
                          for k in ("hidden_size", "intermediate_size", "vocab_size")}}
    return found


def check_inputs(transport: Transport, trainer: dict[str, Any], workdir: str,
                 timeout: float | None = None) -> InputsCheck:
    """One round trip: the run's data shards, model directory and free disk, as the
    host sees them. Reads only (nothing is created or deployed)."""
    result = transport.run_script(FACTS_SCRIPT, [json.dumps(inputs_argument(trainer, workdir))],
                                  timeout=timeout or DEFAULT_TIMEOUT, limit=FACTS)
    try:
        return parse_inputs(result.stdout)
    except ValueError as e:
        raise DflashError(f"{transport.name}: unexpected answer from the facts script: {e}",
                          hint=f"check that {transport.host.python} runs on {transport.name}") from None


def checkpoint_bytes(trainer: dict[str, Any], model: dict[str, Any] | None) -> int | None:
    """An estimate of one checkpoint's size: the drafter's parameters (each decoder
    layer ~ 4 h^2 attention + 3 h i MLP, and the K-layer fusion K h^2) at
    ``CHECKPOINT_BYTES_PER_PARAM``; None when the target's shape is not known here
    (a preset: its shape lives in the trainer)."""
    h, i = (model or {}).get("hidden_size"), (model or {}).get("intermediate_size")
    if not h or not i:
        return None
    m = trainer.get("model") or {}
    layers, k = int(m.get("drafter_layers", 5)), int(m.get("num_target_layers", 5))
    return CHECKPOINT_BYTES_PER_PARAM * (layers * (4 * h * h + 3 * h * i) + k * h * h)


def input_problems(found: InputsCheck, trainer: dict[str, Any], host: str, source: str) -> list[Problem]:
    """What in a launch's inputs would stop the trainer, each with its fix. The fix is
    in the playbook (``source``) and needs a new launch: a restart reuses the config
    recorded at launch."""
    again = f"in {source}, then launch again (`dflashctl restart` would reuse the config recorded at launch)"
    problems: list[Problem] = []
    s = found.shards
    if s is not None:
        where = f"data.shards '{s['path']}' on {host}"
        if not s["exists"]:
            problems.append(Problem("shards-missing", "error", f"{where} does not exist",
                                    f"copy the shards there, or correct `trainer.data.shards` {again}"))
        elif not s["count"]:
            problems.append(Problem("shards-empty", "error", f"{where} holds no *.jsonl shard",
                                    f"convert the data set (`python -m trainer.data convert IN.jsonl OUT_DIR "
                                    f"--tokenizer PATH`), or point `trainer.data.shards` at the shards {again}"))
        elif s["first_error"]:
            problems.append(Problem("shard-unreadable", "error",
                                    f"{where}: the first of {s['count']} shard(s), {s['first']}: {s['first_error']}",
                                    "fix or re-convert that shard (trainer/data/__init__.py describes the format: one JSON "
                                    "object per line with input_ids and loss_mask), or point `trainer.data.shards` "
                                    f"at good shards {again}"))
    m = found.model
    if m is not None:
        where = f"model.path '{m['path']}' on {host}"
        if not m["exists"]:
            problems.append(Problem("model-missing", "error", f"{where} does not exist (models are never fetched)",
                                    f"copy the model directory there, or correct `trainer.model.path` {again}"))
        elif not m["config"]:
            problems.append(Problem("model-config", "error",
                                    f"{where} has no readable config.json ({m['config_error'] or 'missing'})",
                                    "copy the whole Hugging Face model directory (config.json, weights, tokenizer), "
                                    f"or correct `trainer.model.path` {again}"))
    if found.disk_error:
        problems.append(Problem("disk", "error", f"cannot read the free disk of the workdir on {host}: "
                                f"{found.disk_error}", "check the host's `workdir:` in the inventory"))
    elif found.disk_free is not None:
        keep = int((trainer.get("train") or {}).get("keep_checkpoints", 3))
        one = checkpoint_bytes(trainer, m)
        need = max(MIN_CHECKPOINT_FREE, (keep + 1) * one) if one else MIN_CHECKPOINT_FREE
        if found.disk_free < need:
            what = f"{keep} + 1 checkpoints of ~{one / 2**30:.1f} GiB" if one else "checkpoints and logs"
            problems.append(Problem("disk-full", "error",
                                    f"the workdir on {host} has {fmt_bytes(found.disk_free)} free; the run "
                                    f"needs {fmt_bytes(need)} for {what}",
                                    f"free space in the workdir on {host} (each run's directory is "
                                    "<workdir>/runs/<run id>; `dflashctl runs` names those that ended), then launch "
                                    "again; or lower `trainer.train.keep_checkpoints` in "
                                    f"{source} and launch again"))
    return problems
