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
"""

from __future__ import annotations

import math
import os
import re
import shlex
import sys
import typing
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    InstanceOf,
    ValidationError,
    field_validator,
    model_validator,
)

from dflashctl import paths
from dflashctl.contract import did_you_mean
from dflashctl.errors import ConfigError
from dflashctl.signatures import signature_names
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
    "Signature",
    "find_inventory",
    "list_playbooks",
    "load_inventory",
    "load_playbook",
    "parse_duration",
    "playbook_dirs",
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

Severity = Literal["info", "warning", "error", "critical"]
Action = Literal["restart", "restart_serialized", "stop"]

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
_DERIVED_KEYS = {"Host": ("name",), "Playbook": ("name", "source")}


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


class Host(BaseModel):
    """One machine and how to reach it. Commands run inside ``wrapper`` when one is set."""

    model_config = ConfigDict(extra="forbid")

    name: str
    """The key under ``hosts:``."""
    transport: Literal["local", "ssh"] = "ssh"
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
    command_timeout: Duration = Field(120.0, gt=0)
    env: EnvMap = {}

    @property
    def is_local(self) -> bool:
        return self.transport == "local"

    @field_validator("name")
    @classmethod
    def _name_ok(cls, name: str) -> str:
        if not _HOST_NAME.fullmatch(name):
            raise ValueError(f"host name '{name}': use letters, digits, '.', '_' or '-'")
        return name

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
    def _transport_rules(self) -> "Host":
        problems = []
        if self.is_local:
            for key in ("address", "jump"):
                if getattr(self, key) is not None:
                    problems.append((key, _LOCAL_HOST_HAS_ROUTE))
            if "workdir" not in self.model_fields_set:
                self.workdir = os.path.join(paths.data_dir(), "work")
            if "python" not in self.model_fields_set:
                self.python = sys.executable
        elif not self.address:
            problems.append(("address", "required for ssh hosts (the name or IP to connect to)"))
        if self.jump is not None and self.jump == self.name:
            problems.append(("jump", f"jump cycle {self.name} -> {self.name}"))
        if problems:
            raise _Problems(problems)
        return self


# Host keys that make sense once for every ssh host.
_DEFAULTABLE = (
    "port", "user", "identity_file", "known_hosts", "trust_on_first_use", "wrapper",
    "python", "workdir", "connect_timeout", "command_timeout", "env",
)  # fmt: skip


def _jump_problems(jumps: dict[str, Optional[str]], local: set[str]) -> list[tuple[str, str]]:
    """Jumps naming missing or local hosts, and jump cycles (each reported once)."""
    problems, cycles = [], set()
    for name, jump in jumps.items():
        where = f"hosts.{name}.jump"
        if jump is None or jump == name:
            continue  # a self-jump is reported by Host itself
        if jump not in jumps:
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
    """All hosts of one inventory file; ``source`` is its path or '<embedded default>'."""

    model_config = ConfigDict(extra="forbid")

    hosts: dict[str, Host]
    source: str = EMBEDDED

    @model_validator(mode="after")
    def _check_routes(self) -> "Inventory":
        problems = [(f"hosts.{k}.name", f"does not match its key '{k}'") for k, h in self.hosts.items() if h.name != k]
        jumps = {k: (None if h.is_local else h.jump) for k, h in self.hosts.items()}
        problems += _jump_problems(jumps, {k for k, h in self.hosts.items() if h.is_local})
        if problems:
            raise _Problems(problems)
        return self

    def get(self, name: str) -> Host:
        try:
            return self.hosts[name]
        except KeyError:
            raise ConfigError(
                f"unknown host '{name}'{did_you_mean(name, list(self.hosts))}",
                source=self.source,
                hint=f"hosts in {self.source}: {', '.join(self.hosts) or '(none)'}",
            ) from None

    def route(self, name: str) -> list[Host]:
        """The hosts to pass through: outermost jump first, the host itself last."""
        chain = [self.get(name)]
        while chain[-1].jump is not None:
            nxt = self.get(chain[-1].jump)
            if any(h.name == nxt.name for h in chain):
                names = " -> ".join(h.name for h in chain + [nxt])
                raise ConfigError(f"hosts.{chain[-1].name}.jump: jump cycle {names}", source=self.source)
            chain.append(nxt)
        return chain[::-1]


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

    @model_validator(mode="after")
    def _backoff_order(self) -> "RestartPolicy":
        if self.backoff_max < self.backoff_initial:
            low, high = _number(self.backoff_max), _number(self.backoff_initial)
            raise _Problems([("backoff_max", f"{low}s is less than backoff_initial ({high}s)")])
        return self


class Signature(BaseModel):
    """A crash signature of this playbook, matched against the error text before the built-in table."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    pattern: str
    """Python regular expression, searched in the traceback / pane tail."""
    action: Action = "restart"
    severity: Severity = "error"
    hint: Optional[str] = None
    """Shown to the operator with the alert."""

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"invalid regular expression '{pattern}': {e}") from None
        return pattern


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


class Playbook(BaseModel):
    """One run profile: which host, trainer settings, expectations, restart and alert policy."""

    model_config = ConfigDict(extra="forbid")

    name: str
    """From the file name (prod.yaml -> prod)."""
    description: str = ""
    host: str
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
    signatures: Annotated[list[Signature], _none_is_empty(list)] = []
    """Checked before the built-in signature table."""
    alerts: Annotated[Alerts, _none_is_empty(dict)] = Field(default_factory=Alerts)
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
        if key not in ("hosts", "defaults"):
            found.append((str(key), "extra_forbidden", f"unknown key{did_you_mean(key, ['hosts', 'defaults'])}"))

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
            hosts[name] = Host.model_validate({**_local_paths(host_raw, base_dir), "name": name})
        except ValidationError as e:
            found += _translate(e, Host, where)
    found += [(path, "route", msg) for path, msg in _jump_problems(jumps, local)]

    lines = _lines(found)
    if lines:
        raise ConfigError(lines, source=source)
    return Inventory(hosts=hosts, source=source)


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
    host_name = raw.get("host")
    if inventory is not None and isinstance(host_name, str):
        if host_name not in inventory.hosts:
            suggestion = did_you_mean(host_name, list(inventory.hosts))
            found.append(("host", "route", f"unknown host '{host_name}'{suggestion}"))
            hint = (
                f"hosts in {inventory.source}: {', '.join(inventory.hosts)}; add a '{host_name}' entry under "
                "hosts: in the inventory (the shipped inventory.yaml has a commented example) or change host:"
            )
        elif playbook is not None:
            found += _gpu_problems(playbook, inventory.hosts[host_name])

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
