"""The local host: the same command line, run by /bin/sh as sshd would run it.

A subprocess in its own process group, with the environment a login over SSH
would give it; stdout whole, or handed to a sink as it arrives.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from typing import Callable

from dflashctl.hosts.transport.base import Transport
from dflashctl.hosts.transport.results import _Outcome

# What points this process's own Python at its packages is not the host's: a
# command on the local host runs with the environment sshd would give it.
_CONTROLLER_ONLY_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONSAFEPATH")


class LocalTransport(Transport):
    """This machine: the same command line, run by /bin/sh as sshd would."""

    def _execute(self, command, input, deadline, shown, stdout_sink=None):
        proc = subprocess.Popen(
            ["/bin/sh", "-c", command],
            env={k: v for k, v in os.environ.items() if k not in _CONTROLLER_ONLY_ENV},
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group, so a give-up kills it all
        )
        if stdout_sink is not None:
            return _stream_local(proc, input, deadline, stdout_sink)
        try:
            out, err = proc.communicate(input, timeout=deadline)
            return _Outcome(True, proc.returncode, out, err)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, err = proc.communicate()
            return _Outcome(False, proc.returncode, out, err)


def _stream_local(proc: subprocess.Popen, input: bytes | None, deadline: float,
                  sink: Callable[[bytes], bool]) -> _Outcome:
    """``LocalTransport._execute`` with stdout handed to ``sink`` as it arrives."""
    err: list[bytes] = []
    readers = [threading.Thread(target=lambda: err.append(proc.stderr.read()), name="local-stderr", daemon=True)]
    if input is not None:
        def feed() -> None:
            try:
                proc.stdin.write(input)
                proc.stdin.close()
            except OSError:
                pass
        readers.append(threading.Thread(target=feed, name="local-stdin", daemon=True))
    for t in readers:
        t.start()
    end, finished = time.monotonic() + deadline, True
    timer = threading.Timer(deadline, lambda: _kill_group(proc))
    timer.daemon = True
    timer.start()
    try:
        while True:
            chunk = proc.stdout.read1(65536)
            if not chunk:
                break
            if not sink(chunk):
                _kill_group(proc)
                break
    finally:
        timer.cancel()
    finished = time.monotonic() < end
    proc.stdout.close()
    code = proc.wait()
    for t in readers:
        t.join(1.0)
    return _Outcome(finished, code, b"", b"".join(err))


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
