"""The user's OpenSSH config, read as fabric reads it, for hosts named by ``ssh:``.

A host's ``ssh: ALIAS`` (or a name only the ssh config knows) takes its settings
from here, read once when the host is read. ProxyJump values become hops
(``proxy_jump_hops``) that the inventory turns into hosts of their own.
"""

from __future__ import annotations

import fnmatch
import os
import threading
from typing import Any, Optional

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

