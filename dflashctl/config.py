"""Inventory (where: hosts and how to reach them) and playbooks (what: a run).

Both are YAML validated at load into typed pydantic models. Unknown keys are
errors. A bad file raises ONE ``ConfigError`` whose problems are one line each,
naming the YAML path and the closest valid name, for example

    hosts.gpu1.jump: unknown host 'gatway' (did you mean 'gateway'?)
    expect.stall_windw: unknown key (did you mean 'stall_window'?)

Where files are found (first hit wins):
    explicit argument > DFLASHCTL_INVENTORY / DFLASHCTL_PLAYBOOKS
    > ./inventory.yaml, ./playbooks/ > config_dir() (~/.config/dflashctl/)
    > embedded defaults (an inventory with only the ``local`` host; the ``demo`` playbook).

A host may be described by the user's ssh config instead: ``ssh: ALIAS`` (or
a name the inventory lacks but ``~/.ssh/config`` knows) takes HostName, User,
Port, IdentityFile, ProxyJump, ServerAliveInterval, ConnectTimeout and
UserKnownHostsFile from the files fabric loads (``~/.ssh/config``, then
``/etc/ssh/ssh_config``), once, when the host is read. What the host's own entry
says wins over the ssh config, which wins over ``defaults:``. ProxyJump hops that
the inventory does not name become hosts of their own (``Inventory.route``), so
every hop is a pooled connection whose host key is checked.

A playbook's crash signatures are ``signatures.PlaybookSignature`` models (with
the signature table they extend). This module only reads and validates files
(the inventory, playbooks, the user's ssh config): it never reaches a host or
the store, never imports torch (the trainer section is
checked by ``trainer.config``, torch-free), and never imports controller modules
above it (transport, launch, supervisor): they all depend on it.
"""

from __future__ import annotations

import fnmatch
import math
import os
import re
import shlex
import sys
import threading
import typing
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    InstanceOf,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from dflashctl import paths
from dflashctl.contract import did_you_mean
from dflashctl.errors import ConfigError
from dflashctl.signatures import Action, PlaybookSignature, Severity, signature_names
from trainer import config as trainer_config
from trainer.config import TrainerConfig

__all__ = [
    "Alerts",
    "DEFAULT_INVENTORY_YAML",
    "DEMO_PLAYBOOK_YAML",
    "Duration",
    "EMBEDDED",
    "Expect",
    "Host",
    "Inventory",
    "Playbook",
    "RestartPolicy",
    "find_inventory",
    "list_playbooks",
    "load_inventory",
    "load_playbook",
    "parse_duration",
    "playbook_dirs",
    "proxy_jump_hops",
    "ssh_config",
    "ssh_config_knows",
    "ssh_config_lookup",
]

EMBEDDED = "<embedded default>"

# The inventory used when no file is found: only this machine. A local host's
# workdir defaults to data_dir()/work and its python to the interpreter running
# dflashctl (see Host), so this text needs nothing else.
DEFAULT_INVENTORY_YAML = """\
hosts:
  local:
    transport: local
"""

# The embedded `demo` playbook. playbooks/demo.yaml is this exact text (a test
# keeps the two identical), so `dflashctl launch demo` works from anywhere.
DEMO_PLAYBOOK_YAML = """\
# demo: a tiny DFlash run on this machine's CPU, finishing in under a minute.
#   dflashctl launch demo
# The target is the built-in 'tiny' preset with random weights and the data is
# the built-in synthetic task, so nothing has to be downloaded.
description: Tiny CPU run on this machine (random-weight tiny target, synthetic data)
host: local

trainer:
  model:
    preset: tiny
    drafter_layers: 2
    block_size: 8
  data:
    buckets: [256]
    batch_size: 2
    max_anchors: 16
  optim:
    lr: 1.0e-2                  # tiny model, synthetic task: learns in a few hundred steps
  train:
    steps: 300
    log_every: 10
    checkpoint_every: 50
  placement:
    device: cpu
    target: [0]
    drafter: [0]

poll_interval: 5s

expect:
  baseline_tok_s: null          # learn from earlier demo runs
  stall_window: 2m
  compile_budget: 5m
  startup_budget: 5m

restart:
  max_restarts: 3
  backoff_initial: 2s
  backoff_max: 30s
  healthy_after: 1m
"""

# --------------------------------------------------------------------------- durations

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_NUMBER = re.compile(r"\d+(?:\.\d*)?|\.\d+")
_DURATION = re.compile(r"(?:(?:\d+(?:\.\d*)?|\.\d+)[smhd])+")
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)([smhd])")
DURATION_HELP = "use seconds or a number with s, m, h or d: 45s, 30m, 36h, 7d, 1h30m"


def parse_duration(value: Any) -> float:
    """Seconds from a number or a text such as '45s', '30m', '36h', '7d', '1h30m'."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"expected a duration ({DURATION_HELP}), got {_describe(value)}")
    if isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        if _NUMBER.fullmatch(text):
            seconds = float(text)
        elif _DURATION.fullmatch(text):
            seconds = sum(float(n) * _UNITS[u] for n, u in _DURATION_PART.findall(text))
        else:
            raise ValueError(f"{_describe(value)} is not a duration ({DURATION_HELP})")
    else:
        seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{_describe(value)} is not a duration: it must be zero or more")
    return seconds


Duration = Annotated[float, BeforeValidator(parse_duration)]
"""Seconds, as a float; YAML may say 600, '45s', '30m', '36h', '7d'."""


# --------------------------------------------------------------------------- problems


class _Problems(ValueError):
    """Raised by validators to report problems at paths *below* the value being validated.

    Each item is (relative path, message); the path is joined to the location pydantic
    reports, so a model-level check can still name the exact field.
    """

    def __init__(self, items: list[tuple[str, str]]):
        self.items = items
        super().__init__("; ".join(f"{p}: {m}" if p else m for p, m in items))


def _join(base: str, rel: str) -> str:
    if not rel:
        return base
    if not base or rel.startswith("["):
        return base + rel
    return f"{base}.{rel}"


def _loc_path(loc: tuple) -> str:
    path = ""
    for part in loc:
        path = _join(path, f"[{part}]" if isinstance(part, int) else str(part))
    return path


def _describe(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return f"'{value}'"  # not repr(): a regex's backslashes would show doubled
    return _number(value)


def _number(value: Any) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _unwrap(tp: Any) -> Any:
    """Strip Annotated[...] and Optional[...] down to the type that holds the value."""
    while True:
        origin = typing.get_origin(tp)
        if origin is Annotated:
            tp = typing.get_args(tp)[0]
            continue
        if origin is Union or type(tp).__name__ == "UnionType":
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) == 1:
                tp = args[0]
                continue
        return tp


def _type_at(root: Any, loc: tuple) -> Any:
    """The declared type at a pydantic error location (for key and choice suggestions)."""
    tp = root
    for part in loc:
        tp = _unwrap(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            field = tp.model_fields.get(str(part))
            if field is None:
                return None
            tp = field.annotation
        elif typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1]
        elif typing.get_origin(tp) is list:
            tp = typing.get_args(tp)[0]
        else:
            return None
    return _unwrap(tp)


# Filled in by the loader, not written in YAML: Host.name (its key), Playbook.name/source.
_DERIVED_KEYS = {"Host": ("name", "ssh_config"), "Playbook": ("name", "source")}


def _user_keys(model: type[BaseModel]) -> list[str]:
    """Keys a YAML file may set (suggestions never propose the derived ones)."""
    derived = _DERIVED_KEYS.get(model.__name__, ())
    return [k for k in model.model_fields if k not in derived]


_EXPECTED = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "a whole number",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "list_type": "a list",
}

_BOUNDS = {
    "greater_than": ("gt", "must be greater than"),
    "greater_than_equal": ("ge", "must be at least"),
    "less_than": ("lt", "must be less than"),
    "less_than_equal": ("le", "must be at most"),
}


def _translate(error: ValidationError, root: type[BaseModel], prefix: tuple = ()) -> list[tuple[str, str, str]]:
    """pydantic errors -> (path, kind, message) in the user's terms, never pydantic's text."""
    out = []
    for e in error.errors():
        loc, kind, value, ctx = tuple(e["loc"]), e["type"], e.get("input"), e.get("ctx") or {}
        path = _loc_path(prefix + loc)
        if kind == "extra_forbidden":
            parent = _type_at(root, loc[:-1])
            keys = _user_keys(parent) if isinstance(parent, type) and issubclass(parent, BaseModel) else []
            out.append((path, kind, f"unknown key{did_you_mean(loc[-1], keys)}"))
        elif kind == "missing":
            out.append((path, kind, "required"))
        elif kind == "literal_error":
            choices = typing.get_args(_type_at(root, loc))
            listed = ", ".join(repr(c) for c in choices) or ctx.get("expected", "")
            out.append((path, kind, f"{_describe(value)} is not one of {listed}{did_you_mean(value, choices)}"))
        elif kind in _BOUNDS:
            key, words = _BOUNDS[kind]
            out.append((path, kind, f"{words} {_number(ctx.get(key))}, got {_describe(value)}"))
        elif kind in _EXPECTED:
            out.append((path, kind, f"expected {_EXPECTED[kind]}, got {_describe(value)}"))
        elif kind in ("value_error", "assertion_error"):
            exc = ctx.get("error")
            if isinstance(exc, _Problems):
                out.extend((_join(path, rel), kind, msg) for rel, msg in exc.items)
            else:
                out.append((path, kind, str(exc) if exc is not None else e["msg"]))
        else:  # a rare pydantic check with no wording of ours: its short message is still clear
            out.append((path, kind, e["msg"]))
    return out


def _lines(found: list[tuple[str, str, str]]) -> list[str]:
    """Problem lines, dropping "X: required" when a misspelt key already points at X."""
    suggested = set()
    for path, kind, msg in found:
        m = re.search(r"did you mean '([^']+)'\?", msg)
        if kind == "extra_forbidden" and m:
            suggested.add(_join(path.rsplit(".", 1)[0] if "." in path else "", m.group(1)))
    lines = []
    for path, kind, msg in found:
        if kind in ("missing", "required") and path in suggested:
            continue
        line = f"{path}: {msg}" if path else msg
        if line not in lines:
            lines.append(line)
    return lines


# --------------------------------------------------------------------------- ssh config

# Where ssh reads its configuration, in its order: the first value found wins.
SSH_CONFIG_FILES = ("~/.ssh/config", "/etc/ssh/ssh_config")
# The options an `ssh:` alias takes from there (lower case, as paramiko's lookup names them).
SSH_CONFIG_OPTIONS = (
    "hostname", "user", "port", "identityfile", "proxyjump", "serveraliveinterval", "connecttimeout",
    "userknownhostsfile",
)  # fmt: skip
_ssh_config_lock = threading.Lock()
_ssh_config_cache: dict[str, Any] = {}


def _stamp(path: str) -> Optional[tuple[int, int]]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def ssh_config():
    """The user's and the system's ssh config (``SSH_CONFIG_FILES``, ``~`` expanded
    against $HOME now), as fabric loads them: a ``paramiko.SSHConfig``. Re-read when
    either file changes. (paramiko's parser does not follow ``Include`` lines.)"""
    files = tuple(os.path.expanduser(p) for p in SSH_CONFIG_FILES)
    stamp = (files, tuple(_stamp(f) for f in files))
    with _ssh_config_lock:
        if _ssh_config_cache.get("stamp") == stamp:
            return _ssh_config_cache["config"]
    from fabric import Config as FabricConfig  # the SSH library the transport opens connections with

    loaded = FabricConfig(user_ssh_path=files[0], system_ssh_path=files[1]).base_ssh_config
    with _ssh_config_lock:
        _ssh_config_cache.update(stamp=stamp, config=loaded)
    return loaded


def ssh_config_lookup(alias: str) -> dict[str, Any]:
    """What the ssh config says for ``alias`` (``SSH_CONFIG_OPTIONS`` only; ``hostname``
    is the alias itself when no HostName applies, as with ssh)."""
    found = ssh_config().lookup(alias)
    return {key: found[key] for key in SSH_CONFIG_OPTIONS if key in found}


def ssh_config_knows(name: str) -> bool:
    """Whether a ``Host`` line of the ssh config names ``name`` (a pattern other than
    a bare ``*`` counts: ``Host gpu*`` knows ``gpu7``)."""
    try:
        patterns = ssh_config().get_hostnames()
    except Exception:  # noqa: BLE001  (an unreadable ssh config knows no host; `ssh:` hosts report why)
        return False
    patterns = [p for p in patterns if p != "*" and not p.startswith("!")]
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def proxy_jump_hops(value: Optional[str]) -> list[dict[str, Any]]:
    """A ProxyJump value as hops, outermost first: ``{"text", "host", "user", "port"}``
    each (fabric's parsing of ``[user@]host[:port]``); ``none`` or nothing: no hop."""
    if not value or value.strip().lower() == "none":
        return []
    from fabric.connection import derive_shorthand

    hops = []
    for text in (h.strip() for h in value.split(",")):
        if text:
            hops.append({"text": text, **derive_shorthand(text.removeprefix("ssh://"))})
    return hops


# --------------------------------------------------------------------------- models


def _none_is_empty(factory):
    """An empty YAML section (``env:`` with nothing under it) means the defaults."""

    def convert(value: Any) -> Any:
        return factory() if value is None else value

    return BeforeValidator(convert)


def _env_values(value: Any) -> Any:
    """Environment values are text; YAML turns `OMP_NUM_THREADS: 4` into a number."""
    if not isinstance(value, dict):
        return value
    out, bad = {}, []
    for k, v in value.items():
        if not _ENV_NAME.fullmatch(str(k)):
            # Names go into `export NAME=...` lines and `env NAME=...` argv on the host.
            bad.append((str(k), "not a valid environment variable name (letters, digits and '_', not starting "
                                "with a digit)"))
            continue
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            v = _number(v)
        elif not isinstance(v, str):
            bad.append((str(k), f"expected a string, got {_describe(v)} (quote the value)"))
        out[str(k)] = v
    if bad:
        raise _Problems(bad)
    return out


EnvMap = Annotated[dict[str, str], BeforeValidator(_env_values), _none_is_empty(dict)]

_LOCAL_HOST_HAS_ROUTE = "a local host runs commands on this machine: remove it, or set transport: ssh"
_HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PLAYBOOK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


def no_control_characters(value: str) -> str:
    """``value`` when it has no control character (a newline, a tab, ESC, ...), else a
    ValueError saying which and where: a value that reaches a shell, a file of lines
    or a terminal on the host would be cut or misread there."""
    for i, c in enumerate(value):
        if ord(c) < 32 or 0x7F <= ord(c) < 0xA0:
            raise ValueError(f"{value!r} contains a control character ({c!r} at position {i}): it would be cut or "
                             "misread on the host; remove it (a path or a command with a newline, tab or escape "
                             "cannot be used)")
    return value


class Host(BaseModel):
    """One machine and how to reach it. Commands run inside ``wrapper`` when one is set."""

    model_config = ConfigDict(extra="forbid")

    name: str
    """The key under ``hosts:``."""
    transport: Literal["local", "ssh"] = "ssh"
    ssh: Optional[str] = None
    """An alias of the user's ssh config (``Host ALIAS`` in ~/.ssh/config or
    /etc/ssh/ssh_config): its HostName, User, Port, IdentityFile, ProxyJump,
    ServerAliveInterval, ConnectTimeout and UserKnownHostsFile apply. Keys set in
    this host's entry win; ``defaults:`` fill only what the ssh config leaves unset."""
    address: Optional[str] = None
    """Name or IP to connect to; behind a jump host, as the jump host sees it."""
    port: int = Field(22, ge=1, le=65535)
    user: Optional[str] = None
    identity_file: Optional[str] = None
    """Private key on this machine; relative paths are relative to the inventory file."""
    known_hosts: Optional[str] = Field("~/.ssh/known_hosts", validate_default=True)
    """Host keys are always checked against this file unless trust_on_first_use."""
    trust_on_first_use: bool = False
    jump: Optional[str] = None
    """Name of another host to connect through (that host may have a jump too)."""
    wrapper: Annotated[list[str], _none_is_empty(list)] = []
    """Command prefix entering the container, e.g. 'pct exec 200 --' (a string is shell-split)."""
    python: str = "python3"
    """Python on the run host (inside the container); local hosts default to this interpreter."""
    workdir: str = "~/dflash"
    """Work directory on the run host, inside the container; '~' expands there.
    Local hosts default to data_dir()/work."""
    gpus: Optional[int] = Field(None, ge=0)
    connect_timeout: Duration = Field(10.0, gt=0)
    """Longest to open the connection, and to wait for the server to open a session
    on it: an open connection that does not answer for this long is replaced."""
    command_timeout: Duration = Field(120.0, gt=0)
    keepalive: Duration = Field(15.0, ge=0)
    """Seconds between SSH keepalives on an idle connection (ServerAliveInterval); 0: none."""
    env: EnvMap = {}
    env_audit: Annotated[dict, _none_is_empty(dict)] = {}
    """Env-audit policy for this host (allow, ignore), merged with a playbook's;
    checked by dflashctl.envaudit.Policy when an audit runs."""

    ssh_config: dict[str, Any] = {}
    """Filled when the host is read, never written in YAML: what the ssh config said
    for ``ssh`` (its lower-case keys: hostname, user, port, identityfile, proxyjump,
    serveraliveinterval, connecttimeout, userknownhostsfile)."""

    @property
    def is_local(self) -> bool:
        return self.transport == "local"

    @field_validator("name")
    @classmethod
    def _name_ok(cls, name: str) -> str:
        if not _HOST_NAME.fullmatch(name):
            raise ValueError(f"host name '{name}': use letters, digits, '.', '_' or '-'")
        return name

    @field_validator("python", "workdir")
    @classmethod
    def _no_control_characters(cls, value: str) -> str:
        return no_control_characters(value)

    @field_validator("wrapper")
    @classmethod
    def _wrapper_words(cls, value: list[str]) -> list[str]:
        return [no_control_characters(word) for word in value]

    @field_validator("wrapper", mode="before")
    @classmethod
    def _split_wrapper(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                return shlex.split(value)
            except ValueError as e:
                raise ValueError(f"cannot split '{value}' into words: {e}") from None
        return value

    @field_validator("identity_file", "known_hosts")
    @classmethod
    def _expand_home(cls, value: Optional[str]) -> Optional[str]:
        return os.path.expanduser(value) if value else value

    @model_validator(mode="after")
    def _transport_rules(self, info: ValidationInfo) -> "Host":
        problems = []
        if self.is_local:
            for key in ("address", "jump", "ssh"):
                if getattr(self, key) is not None:
                    problems.append((key, _LOCAL_HOST_HAS_ROUTE))
            if "workdir" not in self.model_fields_set:
                self.workdir = os.path.join(paths.data_dir(), "work")
            if "python" not in self.model_fields_set:
                self.python = sys.executable
        else:
            if self.ssh is not None and not self.ssh_config:
                # The keys of the host's own entry (the loader says which; else all given).
                own = (info.context or {}).get("own") if info is not None else None
                problems += self._take_ssh_config(self.model_fields_set if own is None else set(own))
            if not self.address:  # (or `ssh: ALIAS`, which sets it)
                problems.append(("address", "required for ssh hosts (the name or IP to connect to)"))
        if self.jump is not None and self.jump == self.name:
            problems.append(("jump", f"jump cycle {self.name} -> {self.name}"))
        if problems:
            raise _Problems(problems)
        return self

    def _take_ssh_config(self, own: set[str]) -> list[tuple[str, str]]:
        """Fill what the host's own entry leaves unset from the ssh config's ``Host``
        block for ``ssh``; the problems found, each naming the alias and the option."""
        try:
            found = ssh_config_lookup(self.ssh)
        except Exception as e:  # noqa: BLE001  (any failure to read the user's file is one message)
            return [("ssh", f"cannot read the ssh config for '{self.ssh}': {e}")]
        self.ssh_config = found
        problems: list[tuple[str, str]] = []

        def number(option: str, low: int) -> Optional[int]:
            try:
                value = int(found[option])
                if value >= low:
                    return value
            except ValueError:
                pass
            problems.append(("ssh", f"the ssh config gives '{self.ssh}' {option} {found[option]!r}: "
                                    f"expected a whole number of at least {low}"))
            return None

        if "address" not in own:
            self.address = found.get("hostname") or self.ssh
        if "user" in found and "user" not in own:
            self.user = found["user"]
        if "port" in found and "port" not in own:
            port = number("port", 1)
            if port is not None and port <= 65535:
                self.port = port
        if found.get("identityfile") and "identity_file" not in own:
            # As ssh does: files that do not exist are skipped.
            existing = [f for f in map(os.path.expanduser, found["identityfile"]) if os.path.isfile(f)]
            if existing:
                self.identity_file = existing[0]
        if "serveraliveinterval" in found and "keepalive" not in own:
            interval = number("serveraliveinterval", 0)
            if interval is not None:
                self.keepalive = float(interval)
        if "connecttimeout" in found and "connect_timeout" not in own:
            timeout = number("connecttimeout", 1)
            if timeout is not None:
                self.connect_timeout = float(timeout)
        if found.get("userknownhostsfile") and "known_hosts" not in own:
            self.known_hosts = os.path.expanduser(found["userknownhostsfile"].split()[0])
        try:
            hops = proxy_jump_hops(found.get("proxyjump"))
        except ValueError as e:
            problems.append(("ssh", f"the ssh config gives '{self.ssh}' ProxyJump {found['proxyjump']!r}: {e}"))
            hops = []
        if hops and "jump" not in own and hops[-1]["host"] not in (self.ssh, self.name):
            self.jump = hops[-1]["host"]
        return problems


# Host keys that make sense once for every ssh host.
_DEFAULTABLE = (
    "port", "user", "identity_file", "known_hosts", "trust_on_first_use", "wrapper",
    "python", "workdir", "connect_timeout", "command_timeout", "keepalive", "env",
)  # fmt: skip


def _jump_problems(jumps: dict[str, Optional[str]], local: set[str]) -> list[tuple[str, str]]:
    """Jumps naming missing or local hosts, and jump cycles (each reported once)."""
    problems, cycles = [], set()
    for name, jump in jumps.items():
        where = f"hosts.{name}.jump"
        if jump is None or jump == name:
            continue  # a self-jump is reported by Host itself
        if jump not in jumps and not ssh_config_knows(jump):
            problems.append((where, f"unknown host '{jump}'{did_you_mean(jump, list(jumps))}"))
        elif jump in local:
            problems.append((where, f"'{jump}' is a local host; a jump host must be reached over ssh"))
        chain = [name]
        while jumps.get(chain[-1]) in jumps and jumps[chain[-1]] not in chain:
            chain.append(jumps[chain[-1]])
        nxt = jumps.get(chain[-1])
        if nxt == name and len(chain) > 1 and frozenset(chain) not in cycles:
            cycles.add(frozenset(chain))
            problems.append((where, "jump cycle " + " -> ".join(chain + [name])))
    return problems


class Inventory(BaseModel):
    """All hosts of one inventory file; ``source`` is its path or '<embedded default>'.

    A name the inventory lacks is still a host when the user's ssh config has a
    ``Host`` for it (``get``), and ProxyJump hops of ``ssh:`` hosts are hosts too
    (``route``): both are built from the ssh config (and ``defaults``) when first
    asked for, then kept, so every caller sees the same ``Host``."""

    model_config = ConfigDict(extra="forbid")

    hosts: dict[str, Host]
    groups: dict[str, list[str]] = {}
    """Named lists of hosts: a playbook's ``hosts: [name]`` may name a group."""
    source: str = EMBEDDED
    defaults: dict[str, Any] = {}
    """The file's ``defaults:`` section, for hosts that only the ssh config names."""
    _from_ssh_config: dict[tuple, Host] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _check_routes(self) -> "Inventory":
        problems = [(f"hosts.{k}.name", f"does not match its key '{k}'") for k, h in self.hosts.items() if h.name != k]
        # A jump that the ssh config's ProxyJump named may be a host the inventory lacks.
        jumps = {k: (None if h.is_local or (h.jump not in self.hosts and h.ssh_config.get("proxyjump")) else h.jump)
                 for k, h in self.hosts.items()}
        problems += _jump_problems(jumps, {k for k, h in self.hosts.items() if h.is_local})
        for group, members in self.groups.items():
            if group in self.hosts:
                problems.append((f"groups.{group}", "a group cannot have the name of a host"))
            if not members:
                problems.append((f"groups.{group}", "an empty group: list at least one host"))
            for i, member in enumerate(members):
                if member not in self.hosts:
                    problems.append((f"groups.{group}[{i}]", f"unknown host '{member}'{did_you_mean(member, list(self.hosts))}"))
        if problems:
            raise _Problems(problems)
        return self

    def expand(self, names: list[str]) -> list[str]:
        """Host names, with group names replaced by their hosts (in order, each once)."""
        out: list[str] = []
        for name in names:
            for host in self.groups.get(name, [name]):
                if host not in out:
                    out.append(host)
        return out

    def knows(self, name: str) -> bool:
        """Whether ``get(name)`` finds a host (the inventory's, or the ssh config's)."""
        return name in self.hosts or ssh_config_knows(name)

    def get(self, name: str) -> Host:
        host = self.hosts.get(name)
        if host is not None:
            return host
        if ssh_config_knows(name):
            return self._ssh_host(name)
        raise ConfigError(
            f"unknown host '{name}'{did_you_mean(name, list(self.hosts))}",
            source=self.source,
            hint=f"hosts in {self.source}: {', '.join(self.hosts) or '(none)'}; "
            f"a `Host {name}` entry in ~/.ssh/config would also do",
        )

    def route(self, name: str) -> list[Host]:
        """The hosts to pass through: outermost jump first, the host itself last."""
        return self.route_of(self.get(name))

    def route_of(self, host: Host) -> list[Host]:
        """``route`` for a host given as a model (it may be a changed copy of one)."""
        chain = [host]
        while chain[-1].jump is not None:
            nxt = self._jump_of(chain[-1])
            if any(h.name == nxt.name for h in chain):
                names = " -> ".join(h.name for h in chain + [nxt])
                raise ConfigError(f"hosts.{chain[-1].name}.jump: jump cycle {names}", source=self.source)
            chain.append(nxt)
        return chain[::-1]

    def _jump_of(self, host: Host) -> Host:
        """The host that ``host`` connects through: an inventory host by name, or a
        ProxyJump hop of its ssh config (a chain ``a,b`` reaches ``b`` through ``a``).

        fabric's own reading of ProxyJump (``Connection.get_gateway``) is not used:
        it builds a private gateway Connection per target, with fabric's accept-any-key
        policy and no known_hosts, opened outside any lock. A hop that is a host here
        is one pooled, host-key-checked Connection shared by every route through it."""
        if host.jump in self.hosts:
            return self.hosts[host.jump]
        hops = proxy_jump_hops(host.ssh_config.get("proxyjump"))
        if hops and hops[-1]["host"] == host.jump:
            last, before = hops[-1], hops[:-1]
            return self._ssh_host(last["host"], user=last["user"], port=last["port"],
                                  via=",".join(h["text"] for h in before) or None)
        return self.get(host.jump)

    def _ssh_host(self, name: str, user: Optional[str] = None, port: Optional[int] = None,
                  via: Optional[str] = None) -> Host:
        """A host described by the ssh config's ``Host name`` (and ``defaults``);
        ``user``/``port`` from a ``user@host:port`` hop win, ``via`` is the
        ProxyJump chain that leads to it."""
        key = (name, user, port, via)
        found = self._from_ssh_config.get(key)
        if found is not None:
            return found
        own: dict[str, Any] = {k: v for k, v in (("user", user), ("port", port)) if v is not None}
        if via:
            own["jump"] = proxy_jump_hops(via)[-1]["host"]
        data = {**{k: v for k, v in self.defaults.items() if k in _DEFAULTABLE}, **own, "name": name, "ssh": name}
        try:
            host = Host.model_validate(data, context={"own": set(own)})
        except ValidationError as e:
            lines = _lines(_translate(e, Host))
            raise ConfigError([f"host '{name}' from the ssh config: {line}" for line in lines],
                              source=self.source) from None
        if via:
            host.ssh_config = {**host.ssh_config, "proxyjump": via}
        self._from_ssh_config[key] = host
        return host


class Expect(BaseModel):
    """What a healthy run looks like; the detectors compare against it."""

    model_config = ConfigDict(extra="forbid")

    baseline_tok_s: Optional[float] = Field(None, gt=0)
    """Healthy tokens/s; None: the median of earlier healthy runs of this playbook."""
    regression_fraction: float = Field(0.6, gt=0, le=1)
    """Below this fraction of the baseline a window counts as slow."""
    regression_windows: int = Field(3, ge=1)
    """Slow windows in a row before a regression is reported."""
    max_eta: Optional[Duration] = Field(None, gt=0)
    stall_window: Duration = Field(300.0, gt=0)
    """No new step for this long while training is a stall."""
    compile_budget: Duration = Field(1800.0, gt=0)
    """Longest the `compiling` phase may take."""
    startup_budget: Duration = Field(600.0, gt=0)
    """Longest from launch to the first status (imports, model load)."""
    compile_cache_after: Duration = Field(300.0, ge=0)
    """Training this long before the compile artifacts a cold start saved are copied
    back into the controller's cache store (``dflashctl cache ls``)."""


class RestartPolicy(BaseModel):
    """When and how a crashed run is restarted (the policy module applies it)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    max_restarts: int = Field(5, ge=0)
    """At most this many restarts within ``window``; then the run is stopped."""
    window: Duration = Field(6 * 3600.0, gt=0)
    backoff_initial: Duration = Field(10.0, ge=0)
    backoff_max: Duration = Field(600.0, ge=0)
    backoff_factor: float = Field(2.0, ge=1)
    jitter: float = Field(0.2, ge=0, le=1)
    """Each backoff is scaled by a random factor in [1 - jitter, 1 + jitter]."""
    healthy_after: Duration = Field(900.0, ge=0)
    """Sustained healthy training for this long resets the restart count."""
    crash_loop_k: int = Field(3, ge=1)
    """Stop after this many restarts in a row without step progress."""
    actions: Annotated[dict[str, Action], _none_is_empty(dict)] = {}
    """Per crash-signature name: what to do instead of the signature's own action."""
    standby: bool = True
    """Once a process trains, start the next one's standby beside it (imports done,
    waiting; no GPU touched): a restart then pays no import of torch and transformers."""

    @model_validator(mode="after")
    def _backoff_order(self) -> "RestartPolicy":
        if self.backoff_max < self.backoff_initial:
            low, high = _number(self.backoff_max), _number(self.backoff_initial)
            raise _Problems([("backoff_max", f"{low}s is less than backoff_initial ({high}s)")])
        return self


class Alerts(BaseModel):
    """Where events at or above ``min_severity`` go (as JSON)."""

    model_config = ConfigDict(extra="forbid")

    min_severity: Severity = "error"
    command: Union[str, list[str], None] = None
    """Run with the event JSON on stdin: a shell command line, or an argument list."""
    webhook: Optional[str] = None
    """URL receiving an HTTP POST of the event JSON."""
    min_interval: Duration = Field(60.0, ge=0)
    """At most one alert per this interval for the same run and kind."""
    timeout: Duration = Field(30.0, gt=0)
    """Longest one hook may take for one alert, all told: then a command's process
    group is killed and a webhook request abandoned, and the failure reported."""
    connect_timeout: Duration = Field(10.0, gt=0)
    """Longest a webhook may take to accept the connection (within ``timeout``)."""

    @field_validator("command", mode="before")
    @classmethod
    def _command_shape(cls, value: Any) -> Any:
        ok = value is None or (isinstance(value, str) and value.strip())
        ok = ok or (isinstance(value, list) and value and all(isinstance(a, str) for a in value))
        if not ok:
            raise ValueError(f"expected a command line or a non-empty list of arguments, got {_describe(value)}")
        return value

    @field_validator("webhook")
    @classmethod
    def _url(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and not re.match(r"https?://[^\s/]+", value):
            raise ValueError(f"'{value}' is not an http:// or https:// URL")
        return value


def _trainer_from_raw(value: Any) -> Any:
    """The trainer section is validated by the trainer's own config code (torch-free)."""
    if value is None:
        value = {}
    if isinstance(value, TrainerConfig):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"expected a mapping, got {_describe(value)}")
    try:
        return trainer_config.from_dict(value, prefix="trainer")
    except trainer_config.ConfigError as e:
        items = []
        for line in e.problems:
            path, sep, msg = line.partition(": ")
            if not sep:
                path, msg = "", line
            items.append((re.sub(r"^trainer\.?", "", path), msg))
        raise _Problems(items) from None


class EvalSettings(BaseModel):
    """Speculative decoding with the trained drafter once the run ends ``done``
    (``python -m trainer eval`` on the run host, its GPUs): measured acceptance
    length tau, tokens per target forward and the speed-up over greedy decoding,
    stored with the run (``dflashctl runs``, ``dflashctl evals RUN``)."""

    model_config = ConfigDict(extra="forbid")

    after_done: bool = False
    """Run it by itself when the run ends done (else only ``dflashctl eval RUN``)."""
    data: Optional[str] = None
    """Shards on the run host (directory or glob); default: the run's own data."""
    prompts: int = Field(20, ge=1)
    max_new_tokens: int = Field(256, ge=1)
    temperature: float = Field(0.0, ge=0)
    """0: greedy verification; > 0: sampling with the speculative rejection rule."""
    threads: Optional[int] = Field(None, ge=1)
    """CPU threads for a CPU eval (1 is fastest for tiny models on a busy machine)."""
    timeout: Duration = Field(1800.0, gt=0)


class Rendezvous(BaseModel):
    """Where the processes of a multi-host run meet (torch.distributed, env://): rank 0's host."""

    model_config = ConfigDict(extra="forbid")

    port: int = Field(29500, ge=1024, le=65535)
    """TCP port on rank 0's host; checked free before the start."""
    address: Optional[str] = None
    """How the other hosts reach rank 0's host (default: its inventory ``address``;
    a local host: 127.0.0.1). How long the processes wait for each other, at the start
    and in every collective, is the trainer's ``distributed.timeout``."""


class Playbook(BaseModel):
    """One run profile: which host, trainer settings, expectations, restart and alert policy."""

    model_config = ConfigDict(extra="forbid")

    name: str
    """From the file name (prod.yaml -> prod)."""
    description: str = ""
    host: Optional[str] = None
    """The run host (or ``hosts``)."""
    hosts: Annotated[list[str], _none_is_empty(list)] = []
    """Several hosts (names or inventory groups): one torch.distributed process on each,
    rank 0 on the first. ``host`` is then the first of them."""
    rendezvous: Annotated[Rendezvous, _none_is_empty(dict)] = Field(default_factory=Rendezvous)
    trainer: Annotated[InstanceOf[TrainerConfig], BeforeValidator(_trainer_from_raw)] = Field(
        default_factory=TrainerConfig
    )
    env: EnvMap = {}
    """Extra environment of the trainer process on the run host."""
    compile_cache: Optional[str] = "~/.cache/dflashctl/compile"
    """Persistent compile cache on the run host; kept across restarts, never cleared."""
    poll_interval: Duration = Field(15.0, gt=0)
    expect: Annotated[Expect, _none_is_empty(dict)] = Field(default_factory=Expect)
    restart: Annotated[RestartPolicy, _none_is_empty(dict)] = Field(default_factory=RestartPolicy)
    signatures: Annotated[list[PlaybookSignature], _none_is_empty(list)] = []
    """Checked before the built-in signature table."""
    alerts: Annotated[Alerts, _none_is_empty(dict)] = Field(default_factory=Alerts)
    eval: Annotated[EvalSettings, _none_is_empty(dict)] = Field(default_factory=EvalSettings)
    env_audit: Annotated[dict, _none_is_empty(dict)] = {}
    """Environment-audit policy (free-form for now)."""
    source: str = ""
    """The file it came from, or '<embedded demo playbook>'."""

    @field_validator("name")
    @classmethod
    def _name_ok(cls, name: str) -> str:
        if not _PLAYBOOK_NAME.fullmatch(name):
            raise ValueError(f"playbook name '{name}' (from the file name): use letters, digits, '_' or '-'")
        return name

    @model_validator(mode="after")
    def _one_place(self) -> "Playbook":
        if self.hosts and self.host is not None and self.host != self.hosts[0]:
            raise _Problems([("host", f"give host or hosts, not both (hosts: {self.hosts})")])
        if len(set(self.hosts)) != len(self.hosts):
            raise _Problems([("hosts", "a host is listed twice")])
        if self.host is None and not self.hosts:
            raise _Problems([("host", "required: the run host (or hosts: a list of them)")])
        if self.host is None:
            self.host = self.hosts[0]
        return self

    def host_names(self, inventory: "Inventory") -> list[str]:
        """The run's hosts in rank order (groups expanded); one for a single-host run."""
        return inventory.expand(self.hosts or [self.host])

    @model_validator(mode="after")
    def _signature_names(self) -> "Playbook":
        seen, problems = set(), []
        for i, sig in enumerate(self.signatures):
            if sig.name in seen:
                problems.append((f"signatures[{i}].name", f"duplicate signature name '{sig.name}'"))
            seen.add(sig.name)
        known = signature_names(self.signatures)  # this playbook's, then the built-in table
        for key in self.restart.actions:
            if key not in known:
                problems.append((f"restart.actions.{key}", f"unknown crash signature{did_you_mean(key, known)}"))
        if problems:
            raise _Problems(problems)
        return self


# --------------------------------------------------------------------------- YAML


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys and reads scalars the YAML 1.2 way:
    only true/false are booleans (`enabled: on` stays the text 'on', a valid
    choice) and 6e-4 is a number, not a string."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.value != "<<":
                if key_node.value in seen:
                    raise yaml.constructor.ConstructorError(
                        f"in the mapping starting at line {seen[key_node.value].line + 1}",
                        None,
                        f"duplicate key '{key_node.value}'",
                        key_node.start_mark,
                    )
                seen[key_node.value] = key_node.start_mark
        return super().construct_mapping(node, deep)


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+$"), list("-+0123456789.")
)


def _parse_yaml(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        what = e.problem or e.context or "unreadable"
        context = f" ({e.context})" if e.context and e.problem else ""
        raise ConfigError(f"{where}invalid YAML: {what}{context}", source=source) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"invalid YAML: {e}", source=source) from None


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ConfigError(f"not UTF-8 text ({e.reason} at byte {e.start})", source=path) from None
    except OSError as e:
        raise ConfigError(f"cannot read: {e.strerror}", source=path) from None


# --------------------------------------------------------------------------- inventory


def find_inventory(path: Optional[str] = None) -> Optional[str]:
    """The inventory file to use, or None for the embedded default (see module docstring)."""
    if path or os.environ.get("DFLASHCTL_INVENTORY"):
        given, how = (path, "given") if path else (os.environ["DFLASHCTL_INVENTORY"], "named by DFLASHCTL_INVENTORY")
        if not os.path.isfile(given):
            raise ConfigError(
                [f"inventory file not found: {given} ({how})", f"searched: {os.path.abspath(given)}"],
                hint="pass an existing file with --inventory, or unset DFLASHCTL_INVENTORY to use "
                f"./inventory.yaml, {os.path.join(paths.config_dir(), 'inventory.yaml')} or the built-in 'local' host",
            )
        return given
    for candidate in ("inventory.yaml", os.path.join(paths.config_dir(), "inventory.yaml")):
        if os.path.isfile(candidate):
            return candidate
    return None


def load_inventory(path: Optional[str] = None) -> Inventory:
    """Load and validate the inventory (explicit path > env > ./ > config dir > embedded)."""
    found = find_inventory(path)
    if found is None:
        return _inventory_from_text(DEFAULT_INVENTORY_YAML, EMBEDDED, base_dir=None)
    return _inventory_from_text(_read(found), found, base_dir=os.path.dirname(os.path.abspath(found)))


def _local_paths(raw: dict, base_dir: Optional[str]) -> dict:
    """identity_file / known_hosts relative to the inventory file, not the current directory."""
    if base_dir is None:
        return raw
    out = dict(raw)
    for key in ("identity_file", "known_hosts"):
        value = out.get(key)
        if isinstance(value, str) and value and not value.startswith("~") and not os.path.isabs(value):
            out[key] = os.path.join(base_dir, value)
    return out


def _inventory_from_text(text: str, source: str, base_dir: Optional[str]) -> Inventory:
    raw = _parse_yaml(text, source)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"expected a mapping with `hosts:` at the top level, got {_describe(raw)}", source=source)

    found: list[tuple[str, str, str]] = []
    for key in raw:
        if key not in ("hosts", "defaults", "groups"):
            found.append((str(key), "extra_forbidden", f"unknown key{did_you_mean(key, ['hosts', 'defaults', 'groups'])}"))
    groups = raw.get("groups") or {}
    if not isinstance(groups, dict) or not all(
            isinstance(v, list) and all(isinstance(h, str) for h in v) for v in groups.values()):
        found.append(("groups", "type", "expected a mapping of group names to lists of host names"))
        groups = {}

    defaults = raw.get("defaults") or {}
    if not isinstance(defaults, dict):
        found.append(("defaults", "type", f"expected a mapping, got {_describe(defaults)}"))
        defaults = {}
    bad_defaults = False
    for key in defaults:
        if key not in _DEFAULTABLE:
            bad_defaults = True
            if key in Host.model_fields:
                found.append((f"defaults.{key}", "not_defaultable", "set it per host, not in defaults"))
            else:
                found.append((f"defaults.{key}", "extra_forbidden", f"unknown key{did_you_mean(key, _DEFAULTABLE)}"))
    if not bad_defaults and defaults:
        try:  # check the values once, reported under defaults.*, not once per host
            Host.model_validate({"name": "defaults", "address": "-", **_local_paths(defaults, base_dir)})
        except ValidationError as e:
            found += _translate(e, Host, ("defaults",))
            bad_defaults = True

    hosts_raw = raw.get("hosts")
    if "hosts" not in raw:
        found.append(("hosts", "missing", "required (a mapping of host names to their settings)"))
        hosts_raw = {}
    elif not isinstance(hosts_raw, dict) or not hosts_raw:
        found.append(("hosts", "type", f"expected a mapping of host names to settings, got {_describe(hosts_raw)}"))
        hosts_raw = {}

    hosts: dict[str, Host] = {}
    jumps: dict[str, Optional[str]] = {}
    local: set[str] = set()
    for key, host_raw in hosts_raw.items():
        name = str(key)
        where = ("hosts", name)
        host_raw = {} if host_raw is None else host_raw
        if not isinstance(host_raw, dict):
            found.append((_loc_path(where), "type", f"expected a mapping of host settings, got {_describe(host_raw)}"))
            continue
        if "name" in host_raw:
            message = "a host's name is its key under hosts:; remove this line"
            found.append((_loc_path(where + ("name",)), "derived", message))
            host_raw = {k: v for k, v in host_raw.items() if k != "name"}
        if "ssh_config" in host_raw:
            message = "filled from the ssh config of `ssh:` when the host is read; remove this line"
            found.append((_loc_path(where + ("ssh_config",)), "derived", message))
            host_raw = {k: v for k, v in host_raw.items() if k != "ssh_config"}
        own = set(host_raw)
        if host_raw.get("transport", "ssh") == "local":
            local.add(name)
            jumps[name] = None
        else:
            jumps[name] = host_raw["jump"] if isinstance(host_raw.get("jump"), str) else None
            if defaults and not bad_defaults:
                merged = {**defaults, **host_raw}
                if isinstance(defaults.get("env"), dict) and isinstance(host_raw.get("env"), dict):
                    merged["env"] = {**defaults["env"], **host_raw["env"]}  # per-key: host wins
                host_raw = merged
        try:
            hosts[name] = Host.model_validate({**_local_paths(host_raw, base_dir), "name": name},
                                              context={"own": own})
        except ValidationError as e:
            found += _translate(e, Host, where)
    found += [(path, "route", msg) for path, msg in _jump_problems(jumps, local)]

    lines = _lines(found)
    if lines:
        raise ConfigError(lines, source=source)
    try:
        return Inventory(hosts=hosts, source=source, groups={str(k): v for k, v in groups.items()},
                         defaults=_local_paths(defaults, base_dir) if not bad_defaults else {})
    except ValidationError as e:  # a cycle through jumps that the ssh config's ProxyJump named
        raise ConfigError(_lines(_translate(e, Inventory)), source=source) from None


# --------------------------------------------------------------------------- playbooks


def playbook_dirs(playbooks_dir: Optional[str] = None) -> list[str]:
    """Directories searched for NAME.yaml, in order (the embedded demo comes after them)."""
    given = playbooks_dir or os.environ.get("DFLASHCTL_PLAYBOOKS")
    if given:
        if not os.path.isdir(given):
            how = "given" if playbooks_dir else "named by DFLASHCTL_PLAYBOOKS"
            raise ConfigError(
                f"playbooks directory not found: {given} ({how})",
                hint="pass an existing directory with --playbooks, or unset DFLASHCTL_PLAYBOOKS to use "
                f"./playbooks and {os.path.join(paths.config_dir(), 'playbooks')}",
            )
        return [given]
    return ["playbooks", os.path.join(paths.config_dir(), "playbooks")]


def list_playbooks(playbooks_dir: Optional[str] = None) -> list[str]:
    """Names of the playbooks that ``load_playbook`` can find, sorted (includes 'demo')."""
    names = {"demo"}
    for directory in playbook_dirs(playbooks_dir):
        if os.path.isdir(directory):
            names.update(f[: -len(".yaml")] for f in os.listdir(directory) if f.endswith(".yaml") and f[0] != ".")
    return sorted(names)


def load_playbook(
    name_or_path: str, playbooks_dir: Optional[str] = None, inventory: Optional[Inventory] = None
) -> Playbook:
    """Load and validate a playbook by name (searched as in the module docstring) or by path.

    With an inventory, ``host`` must name one of its hosts, and GPU indices in the
    trainer placement must exist on that host when its ``gpus`` is known.
    """
    if os.sep in name_or_path or "/" in name_or_path or name_or_path.endswith((".yaml", ".yml")):
        if not os.path.isfile(name_or_path):
            raise ConfigError(
                [f"playbook file not found: {name_or_path}", f"searched: {os.path.abspath(name_or_path)}"],
                hint="give a playbook name (playbooks/NAME.yaml) or the path of an existing YAML file",
            )
        name = os.path.splitext(os.path.basename(name_or_path))[0]
        return _playbook_from_text(_read(name_or_path), name, name_or_path, inventory)

    searched = []
    for directory in playbook_dirs(playbooks_dir):
        candidate = os.path.join(directory, name_or_path + ".yaml")
        if os.path.isfile(candidate):
            return _playbook_from_text(_read(candidate), name_or_path, candidate, inventory)
        searched.append(candidate)
    if name_or_path == "demo":
        return _playbook_from_text(DEMO_PLAYBOOK_YAML, "demo", "<embedded demo playbook>", inventory)
    available = list_playbooks(playbooks_dir)
    raise ConfigError(
        [
            f"playbook '{name_or_path}' not found{did_you_mean(name_or_path, available)}",
            "searched: " + ", ".join(os.path.abspath(p) for p in searched),
        ],
        hint=f"create {searched[0]}, or point --playbooks / DFLASHCTL_PLAYBOOKS at the directory holding it; "
        f"available: {', '.join(available)}",
    )


def _playbook_from_text(text: str, name: str, source: str, inventory: Optional[Inventory]) -> Playbook:
    raw = _parse_yaml(text, source)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        what = f"expected a mapping of playbook settings at the top level, got {_describe(raw)}"
        raise ConfigError(what, source=source)

    found: list[tuple[str, str, str]] = []
    if "name" in raw:
        found.append(("name", "derived", f"set from the file name ({name}), not in the file; remove this line"))
    if "source" in raw:
        found.append(("source", "derived", "set to the file's path when loading; remove this line"))
    fields = {k: v for k, v in raw.items() if k not in ("name", "source")}
    playbook = None
    try:
        playbook = Playbook.model_validate({**fields, "name": name, "source": source})
    except ValidationError as e:
        found += _translate(e, Playbook)

    hint = None
    listed = raw.get("hosts") if isinstance(raw.get("hosts"), list) else None
    names = [(f"hosts[{i}]", h) for i, h in enumerate(listed)] if listed else [("host", raw.get("host"))]
    for where, host_name in names:
        if inventory is None or not isinstance(host_name, str):
            continue
        if host_name in inventory.groups:
            if where == "host":
                found.append(("host", "route", f"'{host_name}' is a group of hosts: write hosts: [{host_name}]"))
            continue
        if not inventory.knows(host_name):
            suggestion = did_you_mean(host_name, list(inventory.hosts) + list(inventory.groups))
            found.append((where, "route", f"unknown host '{host_name}'{suggestion}"))
            hint = (
                f"hosts in {inventory.source}: {', '.join(inventory.hosts)}; add a '{host_name}' entry under "
                f"hosts: in the inventory (the shipped inventory.yaml has a commented example) or change {where}:"
            )
    if inventory is not None and playbook is not None and not any(kind == "route" for _, kind, _ in found):
        expanded = playbook.host_names(inventory)
        for host_name in expanded:
            found += _gpu_problems(playbook, inventory.get(host_name))
        if listed and len(expanded) == 1:
            found.append(("hosts", "route", "a multi-host run needs two or more hosts (one host: write host:)"))

    lines = _lines(found)
    if lines:
        raise ConfigError(lines, source=source, hint=hint)
    return playbook


def _gpu_problems(playbook: Playbook, host: Host) -> list[tuple[str, str, str]]:
    placement = playbook.trainer.placement
    if host.gpus is None or placement.device == "cpu" or (placement.device == "auto" and host.gpus == 0):
        return []  # nothing known, or the trainer runs on the CPU
    problems = []
    for role in ("target", "drafter"):
        for i, gpu in enumerate(getattr(placement, role)):
            if not 0 <= gpu < host.gpus:
                have = f"GPUs 0-{host.gpus - 1}" if host.gpus else "no GPUs"
                message = f"GPU {gpu} does not exist on host {host.name} ({have})"
                problems.append((f"trainer.placement.{role}[{i}]", "range", message))
    return problems
