"""The inventory's models: each ``Host`` and how to reach it, and the ``Inventory`` of them.

A host may be described by the user's ssh config (``ssh: ALIAS``); ProxyJump hops
and names only the ssh config knows become hosts when first asked for
(``Inventory.get``, ``Inventory.route``), so every hop is a checked connection.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from typing import Annotated, Any, Literal, Optional

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from dflashctl.config.fields import Duration, EnvMap, _none_is_empty
from dflashctl.config.problems import _lines, _Problems, _translate
from dflashctl.config.sshconfig import proxy_jump_hops, ssh_config_knows, ssh_config_lookup
from dflashctl.core import paths
from dflashctl.core.contract import did_you_mean
from dflashctl.core.errors import ConfigError

EMBEDDED = "<embedded default>"

_LOCAL_HOST_HAS_ROUTE = "a local host runs commands on this machine: remove it, or set transport: ssh"
_HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


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
    trust_group: Optional[str] = None
    """Hosts that trust each other's compile artifacts and bytecode (they may run each
    other's code: the same owners, the same image). An artifact copied back from a host
    is put only into runs on hosts of its group; without a group, only on that host."""
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

    @property
    def trust_domain(self) -> str:
        """Where this host's compile artifacts may go: ``group:NAME``, else ``host:NAME``."""
        return f"group:{self.trust_group}" if self.trust_group else f"host:{self.name}"

    @field_validator("trust_group")
    @classmethod
    def _trust_group_ok(cls, group: Optional[str]) -> Optional[str]:
        if group is not None and not _HOST_NAME.fullmatch(group):
            raise ValueError(f"trust_group '{group}': use letters, digits, '.', '_' or '-'")
        return group

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

