"""Run commands on inventory hosts: locally (subprocess) or over SSH (fabric + paramiko).

One interface, ``Transport.run(argv, ...)``; an argv list arrives byte-exact on the
run host, through jump hosts, the container wrapper and the remote login shell.
The rooms:

    results    ``Result`` (what a command did), how messages show argv and stderr
    command    the command line, built in exactly one place (``command_line``);
               routes and not-found failures in inventory terms
    base       ``Transport``: ``run`` and the errors it raises
    local      ``LocalTransport``: the local host, through /bin/sh as sshd would
    hostkeys   known_hosts checks on every hop, ``HostKey``, ``UnknownHostKey``,
               ``HostKeyChanged``
    ssh        ``SSHTransport``: pooled connections, jumps, wedged connections
               replaced; ``Pool`` and ``default_pool``
    pooled     ``connect``, ``host_key`` and ``fanout`` over the default pool
    limits     how much of each kind of answer is read (``Limit``), and ``Capture``

This package never decides anything about runs; it runs commands and says what
happened.
"""

from dflashctl.hosts.transport.base import CLIENT_SLACK, NOT_FOUND_EXIT_CODES, TIMEOUT_EXIT_CODES, Transport
from dflashctl.hosts.transport.command import (
    KILL_AFTER,
    MAX_COMMAND_BYTES,
    command_line,
    describe_route,
    not_found_hint,
)
from dflashctl.hosts.transport.hostkeys import (
    HostKey,
    HostKeyChanged,
    UnknownHostKey,
    append_known_host,
    key_name,
    trust_command,
)
from dflashctl.hosts.transport.limits import COMMAND, Limit
from dflashctl.hosts.transport.local import LocalTransport
from dflashctl.hosts.transport.pooled import connect, fanout, host_key
from dflashctl.hosts.transport.results import SHOWN_ARG_CHARS, STDERR_TAIL_CHARS, Result, shown_argv, stderr_tail
from dflashctl.hosts.transport.ssh import MAX_SESSIONS, Pool, SSHTransport, default_pool

__all__ = [
    "CLIENT_SLACK", "COMMAND", "KILL_AFTER", "Limit", "MAX_COMMAND_BYTES", "MAX_SESSIONS", "NOT_FOUND_EXIT_CODES", "SHOWN_ARG_CHARS",
    "STDERR_TAIL_CHARS", "TIMEOUT_EXIT_CODES", "HostKey", "LocalTransport", "Pool", "Result", "SSHTransport",
    "Transport", "HostKeyChanged", "UnknownHostKey", "append_known_host", "command_line", "connect", "default_pool", "describe_route",
    "fanout", "host_key", "key_name", "not_found_hint", "shown_argv", "stderr_tail", "trust_command",
]
