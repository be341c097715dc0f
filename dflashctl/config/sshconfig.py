"""The user's OpenSSH config, read as OpenSSH reads it, for hosts named by ``ssh:``.

A host's ``ssh: ALIAS`` (or a name only the ssh config knows) takes its settings
from here, read once when the host is read. Where OpenSSH is installed, the
system's ``ssh -G ALIAS`` says what applies (``Include``, ``Match``, ``HostName``
tokens such as ``%h``, the first value wins), and an option counts as the config's
where it differs from what ``ssh -G`` says with no config at all; elsewhere
paramiko's parser (as fabric reads it; it follows no ``Include``) stands in. The
answer says which read it (``READ_BY``); ``DFLASHCTL_SSH_CONFIG=paramiko`` in the
environment asks for paramiko's reading anyway. ProxyJump values become hops
(``proxy_jump_hops``) that the inventory turns into hosts of their own.
"""

from __future__ import annotations

import fnmatch
import os
import pwd
import shutil
import subprocess
import tempfile
import threading
from typing import Any, Optional

# Where ssh reads its configuration, in its order: the first value found wins.
SSH_CONFIG_FILES = ("~/.ssh/config", "/etc/ssh/ssh_config")
# The options an `ssh:` alias takes from there (lower case, as paramiko's lookup names them).
SSH_CONFIG_OPTIONS = (
    "hostname", "user", "port", "identityfile", "proxyjump", "serveraliveinterval", "connecttimeout",
    "userknownhostsfile",
)  # fmt: skip
READ_BY = "_read_by"  # the key of a lookup's answer that says how it was read: "ssh -G" or "paramiko"
READER_ENV = "DFLASHCTL_SSH_CONFIG"  # "paramiko": read the ssh config with paramiko, not `ssh -G`
OPENSSH_TIMEOUT_S = 10.0  # `ssh -G` reads files (and runs a `Match exec` command): bounded
_ssh_config_lock = threading.Lock()
_ssh_config_cache: dict[str, Any] = {}
_openssh_cache: dict[tuple, Optional[dict[str, Any]]] = {}
_UNLIKELY = "dflashctl-no-such-host.invalid"  # a name no Host block of a real config names


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


class OpenSshRefused(ValueError):
    """``ssh -G`` refused the config (a bad line): its own words, file and line."""


def _openssh_g(alias: str, config: Optional[str]) -> Optional[dict[str, Any]]:
    """``ssh -G [-F config] alias`` as {option: value} (``identityfile`` a list), or
    None: no OpenSSH here. A config it refuses raises ``OpenSshRefused``."""
    ssh = shutil.which("ssh")
    if ssh is None or os.environ.get(READER_ENV, "").strip().lower() == "paramiko":
        return None
    argv = [ssh, "-G", *(["-F", config] if config else []), "--", alias]
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=OPENSSH_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        said = [ln.strip() for ln in done.stderr.splitlines() if ln.strip() and "Pseudo-terminal" not in ln]
        raise OpenSshRefused(f"`ssh -G` refuses it: {'; '.join(said[:3])[:400] or f'exit {done.returncode}'}")
    out: dict[str, Any] = {}
    for line in done.stdout.splitlines():
        key, _, value = line.strip().partition(" ")
        key = key.lower()
        if key == "identityfile":
            out.setdefault(key, []).append(value)
        elif key and key not in out:
            out[key] = value
    return out


def _user_config_for_openssh() -> tuple[Optional[str], Optional[str]]:
    """(-F file for ``ssh -G``, a temporary file to remove after). OpenSSH reads
    ~/.ssh/config of the account's home; this reads $HOME's, as the rest of
    dflashctl does: where they differ, a file that includes $HOME's and the
    system's config stands for both."""
    user = os.path.expanduser(SSH_CONFIG_FILES[0])
    try:
        own = os.path.join(pwd.getpwuid(os.getuid()).pw_dir, ".ssh", "config")
    except KeyError:
        own = None
    if own is not None and os.path.realpath(own) == os.path.realpath(user):
        return None, None
    fd, path = tempfile.mkstemp(prefix="dflashctl-ssh-", suffix=".conf")
    with os.fdopen(fd, "w") as f:
        f.write("".join(f"Include {p}\n" for p in (user, SSH_CONFIG_FILES[1]) if os.path.isfile(p)))
    return path, path


def openssh_lookup(alias: str) -> Optional[dict[str, Any]]:
    """What OpenSSH applies to ``alias`` from the config: ``SSH_CONFIG_OPTIONS`` whose
    ``ssh -G`` value differs from the one with no config (``hostname`` always), or
    None where there is no OpenSSH; ``OpenSshRefused`` for a config it refuses.
    Cached until either config file changes."""
    files = tuple(os.path.expanduser(p) for p in SSH_CONFIG_FILES)
    key = (alias, files, tuple(_stamp(f) for f in files), os.environ.get(READER_ENV))
    with _ssh_config_lock:
        if key in _openssh_cache:
            return _openssh_cache[key]
    config, temporary = _user_config_for_openssh()
    try:
        bare = _openssh_g(alias, os.devnull)
        found = _openssh_g(alias, config) if bare is not None else None
    finally:
        if temporary:
            os.unlink(temporary)
    answer = None
    if found is not None and bare is not None:
        answer = {k: found[k] for k in SSH_CONFIG_OPTIONS if k in found and (found[k] != bare.get(k) or k == "hostname")}
        if answer.get("proxyjump", "").lower() == "none":
            answer.pop("proxyjump")
        answer[READ_BY] = "ssh -G"
    with _ssh_config_lock:
        _openssh_cache[key] = answer
    return answer


def ssh_config_lookup(alias: str) -> dict[str, Any]:
    """What the ssh config says for ``alias`` (``SSH_CONFIG_OPTIONS`` only; ``hostname``
    is the alias itself when no HostName applies, as with ssh), as OpenSSH reads it
    where it is installed (``openssh_lookup``), else as paramiko does; ``READ_BY``
    says which."""
    found = openssh_lookup(alias)
    if found is not None:
        return found
    found = ssh_config().lookup(alias)
    return {**{key: found[key] for key in SSH_CONFIG_OPTIONS if key in found}, READ_BY: "paramiko"}


def ssh_config_origin(found: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """A lookup's answer as (how it was read, the options it gave): for `hosts` and `check`."""
    return found.get(READ_BY), {k: v for k, v in found.items() if k != READ_BY}


def ssh_config_knows(name: str) -> bool:
    """Whether a block of the ssh config applies to ``name`` in particular: OpenSSH
    gives it something it gives no other name (a ``Host`` or ``Match`` for it, in an
    ``Include``d file too); without OpenSSH, a ``Host`` pattern other than a bare
    ``*`` names it (``Host gpu*`` knows ``gpu7``)."""
    try:
        found, other = openssh_lookup(name), openssh_lookup(_UNLIKELY)
    except OpenSshRefused:
        return False  # a config OpenSSH refuses knows no host; an `ssh:` host says why
    if found is not None and other is not None:
        mine = {k: v for k, v in found.items() if k != "hostname"}
        theirs = {k: v for k, v in other.items() if k != "hostname"}
        return found.get("hostname") != name or mine != theirs
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

