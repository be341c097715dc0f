"""The local host: the same command line, run by /bin/sh as sshd would run it.

A subprocess in its own process group, with the environment a login over SSH
would give it; stdout and stderr handed to their readers as they arrive.
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

    def _execute(self, command, input, deadline, shown, out, err):
        proc = subprocess.Popen(
            ["/bin/sh", "-c", command],
            env={k: v for k, v in os.environ.items() if k not in _CONTROLLER_ONLY_ENV},
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group, so a give-up kills it all
        )
        return _stream_local(proc, input, deadline, out, err)


def _stream_local(proc: subprocess.Popen, input: bytes | None, deadline: float,
                  out: Callable[[bytes], bool], err: Callable[[bytes], bool]) -> _Outcome:
    """Feed stdin, hand stdout and stderr to their readers as they arrive; a reader
    that takes no more, or the deadline, kills the command's process group."""
    def drain(pipe, take: Callable[[bytes], bool]) -> None:
        while True:
            chunk = pipe.read1(65536)
            if not chunk:
                return
            if not take(chunk):
                _kill_group(proc)
                pipe.close()  # the writer (under `timeout`, in a group of its own) gets SIGPIPE
                return

    threads = [threading.Thread(target=drain, args=(proc.stderr, err), name="local-stderr", daemon=True)]
    if input is not None:
        def feed() -> None:
            try:
                proc.stdin.write(input)
                proc.stdin.close()
            except OSError:
                pass
        threads.append(threading.Thread(target=feed, name="local-stdin", daemon=True))
    for t in threads:
        t.start()
    end = time.monotonic() + deadline
    timer = threading.Timer(deadline, lambda: _kill_group(proc))
    timer.daemon = True
    timer.start()
    try:
        drain(proc.stdout, out)
        threads[0].join(max(0.0, end - time.monotonic()))
        code = proc.wait(max(0.0, end - time.monotonic()))
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        code = proc.wait()
    finally:
        timer.cancel()
    finished = time.monotonic() < end
    proc.stdout.close()
    for t in threads:
        t.join(1.0)
    proc.stderr.close()
    return _Outcome(finished, code)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
