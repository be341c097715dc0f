"""Test harness: real loopback sshd hosts, a fake `pct` and a fake `nvidia-smi`.

Importable by tests (tests/conftest.py) and by bench scripts::

    from tests.harness import SshEnv
    with SshEnv(tmpdir) as env:
        env.add_hosts(8)
"""

from tests.harness.sshd import BASE_HOSTS, HostSpec, Server, SshEnv, free_port

__all__ = ["BASE_HOSTS", "HostSpec", "Server", "SshEnv", "free_port"]
