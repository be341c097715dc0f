"""SSH host keys: checked against known_hosts on every hop, trusted only on request.

Host keys are checked against the host's known_hosts file on every hop, gateways
included (fabric's default is to accept any key); unknown keys are refused, with
``dflashctl trust HOST`` as the way to accept one, unless the inventory says
``trust_on_first_use: true``, in which case the key is appended to that file.
"""

from __future__ import annotations

import os
import shlex
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import paramiko

from dflashctl.core.errors import UnreachableError

if TYPE_CHECKING:
    from dflashctl.config import Inventory


class UnknownHostKey(UnreachableError):
    """The host presented a key its known_hosts file does not list: refused."""


class HostKeyChanged(UnreachableError):
    """The host presented another key than its known_hosts file holds: refused. An
    attack, or a reinstalled host; either way nothing reaches it until someone looks."""

    def says(self) -> str:
        """Its message's first line and the fix, as one line (an event, an alert)."""
        head = str(self).strip().splitlines()[0]
        return f"{head}; {self.hint}" if self.hint else head


class _KeyNotKnown(paramiko.SSHException):
    def __init__(self, hostname: str, key: paramiko.PKey):
        super().__init__(f"host key for {hostname} is not known")
        self.key = key


class _Refuse(paramiko.MissingHostKeyPolicy):
    """RejectPolicy that keeps the key, so the message can show its fingerprint."""

    def missing_host_key(self, client, hostname, key):
        raise _KeyNotKnown(hostname, key)


_known_hosts_lock = threading.Lock()


def append_known_host(path: str, key_name: str, key: paramiko.PKey) -> None:
    """Add one ``key_name key-type base64`` line to a known_hosts file (created with
    its directory if missing; the file's other lines are never rewritten)."""
    with _known_hosts_lock:
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(f"{key_name} {key.get_name()} {key.get_base64()}\n")


class _TrustOnFirstUse(paramiko.MissingHostKeyPolicy):
    """Accept an unknown key and append it to known_hosts, as `ssh` does with
    StrictHostKeyChecking=accept-new."""

    def __init__(self, path: str):
        self.path = path

    def missing_host_key(self, client, hostname, key):
        append_known_host(self.path, hostname, key)
        client.get_host_keys().add(hostname, key.get_name(), key)


def key_name(address: str, port: int) -> str:
    """How known_hosts names a host: ``address``, or ``[address]:port`` off port 22."""
    return address if port == 22 else f"[{address}]:{port}"


@dataclass
class HostKey:
    """The key a host presented, and what its known_hosts file says about it."""

    host: str  # the inventory name
    route: str  # 'jump -> target' or 'direct'
    key_name: str  # '[127.0.0.4]:2222', as known_hosts keys it
    key_type: str  # 'ssh-ed25519'
    fingerprint: str  # 'SHA256:...', as `ssh` shows it
    known_hosts: str
    status: str  # 'trusted', 'unknown' or 'changed'
    key: paramiko.PKey

    def trust(self) -> None:
        """Append the key to the host's known_hosts file."""
        append_known_host(self.known_hosts, self.key_name, self.key)


def _dflashctl_command(inventory: "Inventory", *args: str) -> str:
    """A dflashctl command line that, typed where this one ran, uses this inventory."""
    from dflashctl.config import EMBEDDED, find_inventory

    words = ["dflashctl"]
    source = inventory.source
    if source != EMBEDDED and os.path.isfile(source):
        try:
            found = find_inventory(None)
        except Exception:  # noqa: BLE001  (a broken search path: name the file explicitly)
            found = None
        if found is None or os.path.abspath(found) != os.path.abspath(source):
            words += ["--inventory", os.path.abspath(source)]
    return shlex.join([*words, *args])


def trust_command(inventory: "Inventory", name: str) -> str:
    """The `dflashctl trust NAME` command line for this inventory, runnable as printed."""
    return _dflashctl_command(inventory, "trust", name)
