"""Scripts that run ON a run host, shipped there as their file's text.

Each module here (``probe.py``, ``facts.py``, ...) is a whole program for the host's
python: stdlib only, Python 3.8+ syntax and APIs, never an import from dflashctl
(the host has none). It takes ONE JSON argument and prints ONE JSON answer:

    python [-I -S] -c "<the module's text>" '<json>'   what the controller sends
    python dflashctl/hosts/remote/probe.py '<json>'           the same, run by hand or by a test

Anything the controller must tell a script comes in that JSON argument, or is a
constant of the script that a controller-side test holds equal to its counterpart
in ``dflashctl.core.contract`` / ``dflashctl.hosts.parsers``. A script never raises at its
caller: what goes wrong on the host is a line in the answer's ``errors``.

This ``__init__`` is the controller's side: ``source(name)`` is the text that is
shipped. It is never sent to a host itself.
"""

from __future__ import annotations

import functools
from importlib import resources


@functools.lru_cache(maxsize=None)
def source(name: str) -> str:
    """The text of ``dflashctl/hosts/remote/<name>.py``, read once: what a host runs."""
    return resources.files(__name__).joinpath(f"{name}.py").read_text(encoding="utf-8")
