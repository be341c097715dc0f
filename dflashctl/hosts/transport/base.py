"""The interface every transport implements: ``Transport.run`` and its errors.

``run`` builds the command line, hands it to the implementation's ``_execute``
with a client-side deadline, and turns the outcome into a ``Result``, a
``CommandTimeout`` or a ``TransportError``.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Callable, Iterable

from dflashctl.core.errors import AnswerTooLarge, CommandTimeout, TransportError
from dflashctl.hosts.transport.command import KILL_AFTER, command_line, describe_route, env_input, not_found_hint
from dflashctl.hosts.transport.limits import COMMAND, Capture, Limit
from dflashctl.hosts.transport.results import Result, _Outcome, shown_argv, stderr_tail

if TYPE_CHECKING:
    from dflashctl.config import Host, Inventory

# The client gives up this long after the host should have killed the command:
# covers a host (or a frozen container) that never answers.
CLIENT_SLACK = 3.0
# Exit codes of coreutils `timeout` when it had to stop the command (TERM / KILL).
# When it sends KILL it also kills itself (it signals its whole process group), so
# the host reports a signal: a negative code locally, -1 (no exit status) over SSH.
TIMEOUT_EXIT_CODES = (124, 137)
# Exit codes of a shell or `timeout` that could not find / execute the command.
NOT_FOUND_EXIT_CODES = (126, 127)


class Transport(ABC):
    """Runs argv lists on one host. Thread-safe; reusable; a context manager."""

    def __init__(self, host: "Host", route: list["Host"] | None = None, inventory: "Inventory | None" = None):
        self.host = host
        self.route = route or [host]
        self.inventory = inventory  # the one the host was read from (None: made without one)

    @property
    def name(self) -> str:
        return self.host.name

    def describe_route(self) -> str:
        return describe_route(self.route)

    def run(
        self,
        argv: list[str],
        *,
        timeout: float | None = None,
        input: bytes | None = None,
        env: dict[str, str] | None = None,
        check: bool = True,
        cwd: str | None = None,
        stdout_sink: Callable[[bytes], bool] | None = None,
        limit: Limit = COMMAND,
    ) -> Result:
        """Run ``argv`` on the host (inside its wrapper). ``env`` adds to the host's
        ``env`` from the inventory. ``input`` is sent as stdin, then EOF; without it
        stdin is empty. ``timeout`` (default: the host's command_timeout) kills the
        command on the host and raises CommandTimeout. ``check`` raises
        TransportError on a non-zero exit. ``stdout_sink``: stdout is handed to it
        piece by piece as it arrives (never held: ``Result.stdout_bytes`` is empty); a
        sink that returns False ends the command at once (it was sent more than it
        takes; the sink knows, the exit code is then the kill's). ``limit``: the most
        of this kind of answer that is read (``limits``); past it on stdout or stderr
        the command is ended and AnswerTooLarge raised, whatever ``check`` says."""
        bound, limit = limit, float(timeout if timeout is not None else self.host.command_timeout)
        merged_env = {**(self.host.env or {}), **(env or {})}
        shown = shown_argv(argv)
        try:
            command = command_line(argv, wrapper=self.host.wrapper, timeout=limit, env=merged_env, cwd=cwd)
        except ValueError as e:
            raise TransportError(self.name, shown, str(e)) from None
        if merged_env:  # the values go on stdin, never on the command line (``command_line``)
            input = env_input(merged_env) + (input or b"")
        started = time.monotonic()
        deadline = limit + KILL_AFTER + CLIENT_SLACK
        out, err = Capture(bound.stdout), Capture(bound.stderr)
        outcome = self._execute(command, input, deadline, shown, stdout_sink or out.take, err.take)
        duration = time.monotonic() - started
        for stream, capture in (("stdout", out), ("stderr", err)):
            if capture.over:
                raise AnswerTooLarge(self.name, shown, bound.what, stream, capture.limit)
        code = outcome.exit_code
        result = Result(self.name, list(argv), command, code, out.value(), err.value(), duration, outcome.notes)
        if not outcome.finished:
            raise CommandTimeout(
                self.name,
                shown,
                f"no answer within {deadline:g}s (timeout {limit:g}s): gave up; the host did not confirm the "
                "command was stopped" + "".join(f"; {n}" for n in outcome.notes),
                stderr_tail=stderr_tail(result.stderr),
            )
        if (code in TIMEOUT_EXIT_CODES or code < 0) and duration >= limit:
            raise CommandTimeout(
                self.name,
                shown,
                f"timed out after {limit:g}s and was killed on the host",
                exit_code=code,
                stderr_tail=stderr_tail(result.stderr),
            )
        if check and code != 0:
            hint = not_found_hint(self.host, argv, result.stderr) if code in NOT_FOUND_EXIT_CODES else None
            raise TransportError(
                self.name, shown, "command failed", exit_code=code, stderr_tail=stderr_tail(result.stderr), hint=hint
            )
        return result

    def run_script(self, source: str, args: Iterable[str] = (), **kwargs: Any) -> Result:
        """Run Python ``source`` with the host's python, ``args`` as sys.argv[1:].
        The source travels as an argument, so stdin stays free for ``input=``."""
        return self.run([self.host.python, "-c", source, *args], **kwargs)

    @abstractmethod
    def _execute(self, command: str, input: bytes | None, deadline: float, shown: str,
                 out: Callable[[bytes], bool], err: Callable[[bytes], bool]) -> _Outcome:
        """Run one command line; give up after ``deadline`` seconds. Its stdout and
        stderr are handed to ``out`` and ``err`` piece by piece as they arrive; one
        that returns False ends the command at once (nothing more is read)."""

    def close(self) -> None:
        pass

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
