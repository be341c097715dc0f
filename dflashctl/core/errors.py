"""Errors users see as messages (not tracebacks; DFLASHCTL_DEBUG=1 shows those).

Each carries what the operator needs (host, command, exit code, stderr tail, a
hint that says what to do). Never here: printing, or anything but plain data.
"""

from __future__ import annotations

from dflashctl.core.units import fmt_bytes


def first_line(error: BaseException) -> str:
    """The first line of an error's message (its type when the message is empty):
    what an event, a progress line or a wrapping error quotes."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class DflashError(Exception):
    """Base of every error the CLI turns into a clean message and an exit code."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


class ConfigError(DflashError):
    """A bad inventory, playbook or option. ``problems``: one line per problem."""

    exit_code = 2

    def __init__(self, problems: list[str] | str, source: str | None = None, hint: str | None = None):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        head = f"{source}: " if source and len(self.problems) == 1 else (f"{source}:\n  " if source else "")
        super().__init__(head + "\n  ".join(self.problems), hint)


class TransportError(DflashError):
    """A command could not be run, or failed, on a host. Carries the data to act on."""

    def __init__(
        self,
        host: str,
        command: str,
        message: str,
        exit_code: int | None = None,
        stderr_tail: str = "",
        hint: str | None = None,
    ):
        self.host = host
        self.command = command
        self.remote_exit_code = exit_code
        self.stderr_tail = stderr_tail
        text = f"{host}: {message}"
        if exit_code is not None:
            text += f" (exit {exit_code})"
        text += f"\n  command: {command[:300]}"
        if stderr_tail:
            text += "\n  stderr: " + stderr_tail.strip().replace("\n", "\n          ")
        super().__init__(text, hint)


class UnreachableError(TransportError):
    """The host could not be reached at all (connect, auth, host key, timeout)."""


HOST_KEY_CHANGED = "host key CHANGED"  # how a refused, changed host key is said: its readers look for it


class CommandTimeout(TransportError):
    """The remote command outlived its timeout and was killed on the host."""


class AnswerTooLarge(TransportError):
    """A host sent more than is read of one kind of answer: the command was ended
    there, and nothing of the answer is used. ``what``: the answer's kind in
    messages ("the probe"); ``stream``: stdout or stderr; ``limit``: bytes read."""

    def __init__(self, host: str, command: str, what: str, stream: str, limit: int, hint: str | None = None):
        self.what, self.stream, self.limit = what, stream, limit
        said = "answered" if stream == "stdout" else "wrote to stderr"
        super().__init__(host, command, f"{said} more than {fmt_bytes(limit)} to {what}; at most {fmt_bytes(limit)} "
                         "is read, so the command was ended there and its answer is not used", hint=hint)
        self.args = (f"host {host} {str(self.args[0]).removeprefix(host + ': ')}",)


class StoreError(DflashError):
    """The run store cannot be used as it is: written by a newer dflashctl, corrupted,
    or out of space. The message names the file; the hint says what to do."""


class StoreBusy(StoreError):
    """Another process held the store's write lock for longer than a writer waits."""
