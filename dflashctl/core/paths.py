"""Where dflashctl keeps its files on the operator's machine.

    config_dir()   ~/.config/dflashctl          inventory.yaml, playbooks/
    data_dir()     ~/.local/share/dflashctl     runs.db, the local host's work directory
    store_path()   data_dir()/runs.db

DFLASHCTL_HOME replaces both directories with one (tests point it at a temporary
directory so they never touch the user's files), and for runs on this machine
(the local host) it also holds their compile cache (``local_compile_cache``) in
place of the playbook default ``~/.cache/dflashctl/compile``; DFLASHCTL_STORE names the SQLite
file directly. XDG_CONFIG_HOME / XDG_DATA_HOME are honoured as usual. Nothing is
created here: callers make the directories they write into.
"""

from __future__ import annotations

import os

APP = "dflashctl"


def _home_override() -> str | None:
    home = os.environ.get("DFLASHCTL_HOME")
    return os.path.abspath(os.path.expanduser(home)) if home else None


def _xdg(var: str, fallback: str) -> str:
    base = os.environ.get(var) or os.path.expanduser(fallback)
    return os.path.abspath(os.path.join(base, APP))


def config_dir() -> str:
    """Per-user configuration: inventory.yaml and playbooks/ (searched after ./)."""
    return _home_override() or _xdg("XDG_CONFIG_HOME", "~/.config")


def data_dir() -> str:
    """Per-user data: the run store and the local host's default work directory."""
    return _home_override() or _xdg("XDG_DATA_HOME", "~/.local/share")


def store_path() -> str:
    """The SQLite run store."""
    store = os.environ.get("DFLASHCTL_STORE")
    if store:
        return os.path.abspath(os.path.expanduser(store))
    return os.path.join(data_dir(), "runs.db")


def local_compile_cache() -> str | None:
    """The compile cache of runs on the local host when DFLASHCTL_HOME is set
    (``$DFLASHCTL_HOME/cache/compile``): a playbook that names none keeps nothing
    under ~/.cache then. None when it is not set."""
    home = _home_override()
    return os.path.join(home, "cache", "compile") if home else None
