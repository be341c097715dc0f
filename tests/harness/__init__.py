"""Test harness: real loopback sshd hosts, container wrappers (a fake `pct`, an
`lxc-attach` into a long-lived namespace, a `docker run --rm` that makes a new one
per call) and a fake `nvidia-smi`.

Importable by tests (tests/conftest.py) and by bench scripts::

    from tests.harness import SshEnv
    with SshEnv(tmpdir) as env:
        env.add_hosts(8)
"""

import contextlib
import os
from typing import Iterator

from tests.harness.sshd import BASE_HOSTS, HostSpec, Server, SshEnv, free_port

__all__ = ["BASE_HOSTS", "HostSpec", "Server", "SshEnv", "environ", "free_port"]


@contextlib.contextmanager
def environ(**values: str) -> Iterator[None]:
    """Set environment variables for a block, then restore them: module-scoped
    fixtures cannot use monkeypatch."""
    previous = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
