"""Test harness: what the tests share, none of it a test.

- ``sshd``: real loopback sshd hosts, container wrappers (a fake `pct`, an
  `lxc-attach` into a long-lived namespace, a `docker run --rm` that makes a new
  one per call) and a fake `nvidia-smi` (``fake_nvidia_smi``);
- ``fake_trainer``: the trainer's run-directory contract without torch;
- ``local``: the local host as a run host (LocalEnv, a supervisor thread, a
  webhook, tmux servers on private sockets);
- ``launch``: real launches of the fake trainer through the command line;
- ``cli``: the command line in this process (``invoke``) or as a process (``run``);
- ``waiting``: ``wait_for`` and deadlines scaled by the machine's load;
- ``scenes``, ``tui``: stores as the supervisor leaves them, the console headless;
- ``observations``: what the supervisor sees, as values (core and detector tables);
- ``tiny``: the real trainer, small (as a process or in this one), its files;
- ``multihost``: one run on two sshd hosts; ``envs``: Python environments for
  env-audit; ``disk``: a full disk; ``engines``: what each serving engine's mask
  lets a query see; ``compile_race``: compiled layers in threads (torch: run as a
  script).

torch is never imported at module level here (compile_race runs as its own
process). No module here is named like one the scripts here import: they run with
this folder first on sys.path (tests/unit/test_lanes.py checks it). Importable by
tests and by bench scripts::

    from tests.harness import SshEnv
    with SshEnv(tmpdir) as env:
        env.add_hosts(8)
"""

import contextlib
import os
from pathlib import Path
from typing import Iterator

from tests.harness.sshd import BASE_HOSTS, HostSpec, Server, SshEnv, free_port

REPO = Path(__file__).resolve().parents[2]  # the checkout
FIXTURES = REPO / "tests" / "fixtures"  # captures from real hosts: nvidia-smi, /proc, logs, environments

__all__ = ["BASE_HOSTS", "FIXTURES", "REPO", "HostSpec", "Server", "SshEnv", "environ", "free_port"]


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
