"""Hosts reached over SSH: one pooled connection each, jumps, wedged connections.

Connections. Each SSH host has one fabric ``Connection``, opened on first use and
reused by every command (``Pool``); a jump host is a ``gateway=`` of the hosts
behind it, and that gateway is the jump's own pooled Connection, opened (under its
lock) before any connection tunnelled through it, so concurrent first use of a
shared jump cannot race. What the user's ``~/.ssh/config`` says about a host
(``ssh: ALIAS``: HostName, User, Port, IdentityFile, ProxyJump, ...) was read
through fabric when the inventory was loaded (``dflashctl.config``); a Connection
here is built from those resolved values and never re-reads the files. Commands
run on the Connection's paramiko client (``Connection.client``), not through
``Connection.run``: invoke's runner has no way to send a byte-exact command line
with stdin bytes and a client-side deadline, and would read this process's stdin.

A connection that stops answering (the server's session process frozen, a
half-open TCP connection behind a NAT or a jump) is replaced: when the server does
not open a session within ``connect_timeout``, or a command gets no answer by its
deadline, the connection is dropped, with every connection tunnelled through it.
A session that was never opened ran nothing, so that command is retried at once
on a new connection; the Result's ``notes`` say what happened. Keepalives
(``keepalive``, ServerAliveInterval) keep idle connections through NATs.

The pool lives here with the transports it holds: a transport asks it for its
gateway and for the connections riding on its own.
"""

from __future__ import annotations

import atexit
import getpass
import logging
import math
import os
import shlex
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Union

import paramiko
from fabric import Config as FabricConfig
from fabric import Connection

from dflashctl.core.errors import HOST_KEY_CHANGED, TransportError, UnreachableError
from dflashctl.hosts.transport.base import Transport
from dflashctl.hosts.transport.command import describe_route
from dflashctl.hosts.transport.hostkeys import (
    HostKey,
    HostKeyChanged,
    UnknownHostKey,
    _dflashctl_command,
    _KeyNotKnown,
    _Refuse,
    _TrustOnFirstUse,
    key_name,
)
from dflashctl.hosts.transport.local import LocalTransport
from dflashctl.hosts.transport.results import _Outcome

if TYPE_CHECKING:
    from dflashctl.config import Host, Inventory

# paramiko logs connection failures from its own threads; they reach the user as
# UnreachableError messages instead (DFLASHCTL_DEBUG=1 keeps paramiko's output).
if not os.environ.get("DFLASHCTL_DEBUG"):
    logging.getLogger("paramiko").addHandler(logging.NullHandler())

# Concurrent commands per connection: sshd refuses more than MaxSessions (default
# 10) sessions on one connection; further commands wait for a free one.
MAX_SESSIONS = 8


def _fabric_config() -> FabricConfig:
    # An explicit, empty SSHConfig: the host's ssh config was applied once, when the
    # inventory was read; a second lookup here (of the resolved address) could
    # change the hostname, add keys or set a gateway behind the inventory's back.
    return FabricConfig(ssh_config=paramiko.SSHConfig())


def _close_quietly(connection: Connection) -> None:
    try:
        connection.client.close()
    except Exception:  # noqa: BLE001  (closing a dead connection may fail in many ways; it is gone either way)
        pass


def _bare(error: TransportError) -> str:
    """A TransportError's own message: without its 'host: ' prefix and command line."""
    text = str(error).split("\n", 1)[0]
    return text.removeprefix(f"{error.host}: ")


class SSHTransport(Transport):
    """A host reached over SSH, possibly through jump hosts, possibly inside a
    container wrapper. One fabric Connection, opened on first use and reopened when
    it has died or stopped answering; many commands may run over it at once."""

    def __init__(self, host: "Host", inventory: "Inventory", pool: "Pool | None" = None):
        # The host may be a variant of the inventory's (tests, trust_on_first_use).
        super().__init__(host, inventory.route_of(host), inventory)
        self.pool = pool or default_pool
        self.address = host.address or host.ssh or host.name
        self.port = int(host.port)
        self.user = host.user or getpass.getuser()
        self.known_hosts = os.path.expanduser(host.known_hosts or "~/.ssh/known_hosts")
        self._connection: Connection | None = None
        self._notes: list[str] = []  # what connecting took, for the next Result
        self._lock = threading.Lock()
        self._sessions = threading.BoundedSemaphore(MAX_SESSIONS)

    # -- connection ------------------------------------------------------------

    def _where(self) -> str:
        via = " -> ".join(h.name for h in self.route[:-1])
        return f"{self.user}@{self.address}:{self.port}" + (f" via {via}" if via else " (direct)")

    def _unreachable(self, message: str, hint: str | None = None, cls: type = UnreachableError) -> UnreachableError:
        return cls(self.name, f"ssh {self._where()}", message, hint=hint)

    def connection(self) -> Connection:
        """The open fabric Connection, connecting (gateways first) if needed."""
        with self._lock:
            current = self._connection
            if current is not None:
                if current.transport is not None and current.transport.is_active():
                    return current
                _close_quietly(current)
                self._connection = None
            self._connection = self._connect()
            return self._connection

    def ssh_transport(self) -> paramiko.Transport:
        """The live paramiko Transport of ``connection()``."""
        return self.connection().transport

    def drop(self, connection: Connection | None = None) -> bool:
        """Close the pooled connection (only if it is still ``connection``, when
        given) and every pooled connection tunnelled through it; the next command
        reconnects. True when something was dropped."""
        with self._lock:
            current = self._connection
            if current is None or (connection is not None and current is not connection):
                return False
            self._connection = None
        _close_quietly(current)  # first: its tunnels then close without a word on the dead link
        for tunnelled in self.pool.riding_on(self.name):
            # Not under the tunnelled transport's lock: it may hold it right now,
            # connecting through this very gateway. A closed connection is replaced
            # at its next use.
            riding = tunnelled._connection
            if riding is not None:
                _close_quietly(riding)
        return True

    def _gateway(self) -> "SSHTransport":
        gateway = self.pool.get(self.route[-2], self.inventory)
        if not isinstance(gateway, SSHTransport):
            raise self._unreachable(f"jump host '{gateway.name}' is not an ssh host")
        return gateway

    def _gateway_connection(self) -> tuple["SSHTransport", Connection]:
        """The jump host's open Connection (its whole chain opened first, under its lock)."""
        gateway = self._gateway()
        try:
            return gateway, gateway.connection()
        except UnknownHostKey as e:
            raise self._unreachable(f"jump host '{gateway.name}' unreachable: {_bare(e)}",
                                    hint=e.hint, cls=UnknownHostKey) from None
        except UnreachableError as e:
            # Say which host was asked for, and that the hop before it is what failed.
            raise self._unreachable(f"jump host '{gateway.name}' unreachable: {_bare(e)}", hint=e.hint) from None

    def _identity_files(self) -> list[str]:
        """The private keys to offer: the inventory's identity_file (which must exist),
        then the other IdentityFiles the ssh config names that exist. None: ssh's
        defaults (the agent, ~/.ssh/id_*)."""
        if not self.host.identity_file:
            return []
        first = os.path.expanduser(self.host.identity_file)
        if not os.path.isfile(first):
            raise self._unreachable(
                f"identity file {first} not found",
                hint=f"point `identity_file:` for host '{self.name}' at your private key for it (or remove the "
                "line to use the ssh agent and ~/.ssh/id_*)",
            )
        others = [os.path.expanduser(f) for f in self.host.ssh_config.get("identityfile", [])]
        return [first, *(f for f in others if f != first and os.path.isfile(f))]

    def _connect(self) -> Connection:
        try:
            return self._connect_once()
        except UnreachableError as e:
            if not getattr(e, "gateway_dropped", False):
                raise
            first = _bare(e)
        # The jump's connection did not answer and was dropped; nothing ran yet:
        # once more, through a new one.
        try:
            connection = self._connect_once()
        except UnreachableError as e:
            raise self._unreachable(f"{first}; reconnecting failed: {_bare(e)}", hint=e.hint, cls=type(e)) from None
        self._notes.append(f"{first.removesuffix(', the next command reconnects')}; reconnected")
        return connection

    def _connect_once(self) -> Connection:
        timeout = float(self.host.connect_timeout)
        keys = self._identity_files()
        connect_kwargs: dict[str, Any] = {
            "allow_agent": not keys,
            "look_for_keys": not keys,
            "timeout": timeout,  # here, not as connect_timeout=: fabric rounds that down to whole seconds
            "banner_timeout": timeout,
            "auth_timeout": timeout,
            # Bounds every channel opened on this connection, the tunnels that
            # fabric opens through it for the hosts behind (it passes no timeout).
            "channel_timeout": timeout,
        }
        if keys:
            connect_kwargs["key_filename"] = keys
        gateway: tuple[SSHTransport, Connection] | None = None
        if len(self.route) > 1:
            gateway = self._gateway_connection()
        else:
            # Our own socket rather than paramiko's: TCP_NODELAY, and messages that
            # tell a refused port from a silent one.
            connect_kwargs["sock"] = self._open_socket(timeout)
        connection = Connection(
            self.address,
            user=self.user,
            port=self.port,
            config=_fabric_config(),
            gateway=gateway[1] if gateway else False,  # False: none (None would look in the ssh config)
            connect_kwargs=connect_kwargs,
        )
        client = connection.client
        if os.path.exists(self.known_hosts):
            client.load_host_keys(self.known_hosts)
        client.set_missing_host_key_policy(
            _TrustOnFirstUse(self.known_hosts) if self.host.trust_on_first_use else _Refuse()
        )
        started = time.monotonic()
        try:
            connection.open()
        except Exception as e:
            # fabric opens the tunnel (open_gateway) before paramiko's client makes
            # its Transport: without one, the tunnel is what failed.
            tunnel_failed = gateway is not None and client.get_transport() is None
            _close_quietly(connection)
            raise self._connect_failure(e, gateway if tunnel_failed else None, timeout,
                                        time.monotonic() - started) from None
        if self.host.keepalive > 0:
            connection.transport.set_keepalive(max(1, math.ceil(self.host.keepalive)))
        return connection

    def _connect_failure(
        self, e: Exception, tunnel: "tuple[SSHTransport, Connection] | None", timeout: float, elapsed: float
    ) -> Exception:
        """The UnreachableError for an exception of ``Connection.open``; ``tunnel``:
        the gateway, when opening the tunnel through it is what failed."""
        target = f"{self.address}:{self.port}"
        if isinstance(e, _KeyNotKnown):
            return self._unknown_key(e)
        if isinstance(e, paramiko.BadHostKeyException):
            return self._unreachable(
                f"{HOST_KEY_CHANGED}: {e.key.get_name()} {e.key.fingerprint} does not match "
                f"{self.known_hosts}; this may be an attack, or the host was reinstalled",
                hint="if the change is expected: "
                f"`{shlex.join(['ssh-keygen', '-f', self.known_hosts, '-R', key_name(self.address, self.port)])}`, "
                f"then `{_dflashctl_command(self.inventory, 'trust', self.name)}`",
                cls=HostKeyChanged,
            )
        if isinstance(e, paramiko.AuthenticationException):
            keys = self._identity_files()
            return self._unreachable(
                f"authentication failed as {self.user!r} ({e})",
                hint=f"check user/identity_file for host '{self.name}' "
                f"(identity_file: {', '.join(keys) or 'ssh defaults: the agent, ~/.ssh/id_*'})",
            )
        if not isinstance(e, (paramiko.SSHException, OSError, EOFError)):
            raise e
        if tunnel is not None:
            gw, gw_connection = tunnel
            if isinstance(e, paramiko.ChannelException):
                return self._unreachable(f"jump host '{gw.name}' could not connect to {target}: {e.text or e}")
            up = gw_connection.transport is not None and gw_connection.transport.is_active()
            # The jump's connection closed under us (its sshd session ended: EOF before
            # paramiko's reader saw it), or is up but did not answer the tunnel request:
            # either way replace it (and everything riding on it), and try once more.
            closed = isinstance(e, EOFError) or not up
            silent = not closed and elapsed >= gw.host.connect_timeout
            if closed or silent:
                gw.drop(gw_connection)
            why = (f"no answer on the jump host's open connection for {gw.host.connect_timeout:g}s" if silent
                   else f"the jump host's connection closed ({_cause(e)})" if closed else _cause(e))
            error = self._unreachable(f"no tunnel through '{gw.name}' to {target}: {why}"
                                      + ("; dropped it, the next command reconnects" if closed or silent else ""))
            error.gateway_dropped = closed or silent
            return error
        return self._unreachable(
            f"SSH handshake with {target} failed"
            + (f": no answer within {timeout:g}s (connect_timeout)" if elapsed >= timeout - 0.1 else f": {_cause(e)}")
        )

    def _open_socket(self, timeout: float) -> socket.socket:
        """A TCP socket to the host (no jump)."""
        target = f"{self.address}:{self.port}"
        try:
            sock = socket.create_connection((self.address, self.port), timeout=timeout)
            # SSH sends many small packets per command; without this, Nagle plus
            # delayed ACKs add ~40 ms to every exec.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except ConnectionRefusedError:
            raise self._unreachable(
                f"connection refused at {target}", hint="is sshd running there, and is the port right?"
            ) from None
        except socket.timeout:
            raise self._unreachable(f"no answer from {target} within {timeout:g}s (connect_timeout)") from None
        except OSError as e:
            raise self._unreachable(f"cannot connect to {target}: {e}") from None

    def _trust_hint(self) -> str:
        """How to accept this host's key (and its jumps'): commands runnable as printed."""
        hint = f"verify the fingerprint, then trust it: `{_dflashctl_command(self.inventory, 'trust', self.name)}`"
        if len(self.route) == 1:
            keyscan = (f"ssh-keyscan -p {self.port} {shlex.quote(self.address)} >> "
                       f"{shlex.quote(self.known_hosts)}")
            hint += f" (or `{keyscan}`)"
        return hint + f"; or set `trust_on_first_use: true` for host '{self.name}' in the inventory"

    def _unknown_key(self, e: _KeyNotKnown) -> UnreachableError:
        return self._unreachable(
            f"unknown host key {e.key.get_name()} {e.key.fingerprint} for "
            f"{key_name(self.address, self.port)}: not in {self.known_hosts}; refused",
            hint=self._trust_hint(),
            cls=UnknownHostKey,
        )

    def host_key(self) -> HostKey:
        """The key the host presents (fetched through its jumps, which must already be
        trusted; nothing is authenticated or run on the host) and its known_hosts status."""
        timeout = float(self.host.connect_timeout)
        if len(self.route) > 1:
            gateway, gw_connection = self._gateway_connection()
            try:
                sock = gw_connection.transport.open_channel(
                    "direct-tcpip", (self.address, self.port), ("", 0), timeout=timeout)
            except paramiko.ChannelException as e:
                raise self._unreachable(f"jump host '{gateway.name}' could not connect to "
                                        f"{self.address}:{self.port}: {e.text or e}") from None
            except (paramiko.SSHException, OSError, EOFError) as e:
                raise self._unreachable(f"no tunnel through '{gateway.name}': {e or type(e).__name__}") from None
        else:
            sock = self._open_socket(timeout)
        name = key_name(self.address, self.port)
        known = paramiko.HostKeys()
        if os.path.exists(self.known_hosts):
            known.load(self.known_hosts)
        entry = known.lookup(name)
        ssh = paramiko.Transport(sock)
        try:
            if entry:  # as paramiko's client does: ask for the key type already known
                options = ssh.get_security_options()
                first = [t for t in entry.keys() if t in options.key_types][:1]
                options.key_types = first + [t for t in options.key_types if t not in first]
            ssh.start_client(timeout=timeout)
            key = ssh.get_remote_server_key()
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise self._unreachable(f"no SSH host key from {self.address}:{self.port}: {_cause(e)}") from None
        finally:
            ssh.close()
        if entry and key.get_name() in entry:
            status = "trusted" if entry[key.get_name()] == key else "changed"
        else:
            status = "unknown"
        return HostKey(self.name, describe_route(self.route, wrapper=False), name, key.get_name(),
                       key.fingerprint, self.known_hosts, status, key)

    # -- commands --------------------------------------------------------------

    def _open_session(self, wait: float) -> tuple[paramiko.Channel, list[str]]:
        """A new session channel, and notes on what it took.

        A connection found dead is reopened once (nothing ran on it yet, so this
        cannot run a command twice). A connection on which the server does not
        answer a session request within ``connect_timeout`` is dropped (with its
        tunnels) and replaced once, the same way. A session the server refuses
        (sshd's MaxSessions, while other sessions are closing) is retried until
        ``wait`` seconds pass."""
        end = time.monotonic() + wait
        limit = float(self.host.connect_timeout)
        delay, reopened, notes = 0.02, False, []
        silent: str | None = None
        while True:
            try:
                connection = self.connection()
            except UnreachableError as e:
                if silent is None:
                    raise
                raise self._unreachable(f"{silent}; reconnecting failed: {_bare(e)}", hint=e.hint,
                                        cls=type(e)) from None
            if silent is not None:
                notes.append(f"{silent}; reconnected")
                silent = None
            while self._notes:
                notes.append(self._notes.pop(0))
            ssh = connection.transport
            asked = time.monotonic()
            try:
                return ssh.open_session(timeout=limit), notes
            except (paramiko.SSHException, OSError, EOFError) as e:
                # (paramiko reports a refusal as ChannelException to one waiting
                # thread and as a bare "Unable to open channel." to the others.)
                if ssh.is_active() and time.monotonic() - asked >= limit:
                    if reopened:
                        raise self._unreachable(f"no answer on a new connection either within {limit:g}s "
                                                "(connect_timeout)") from None
                    self.drop(connection)
                    silent = f"no answer on the open connection for {limit:g}s"
                    reopened = True
                elif ssh.is_active():
                    if time.monotonic() + delay > end:
                        raise self._unreachable(f"the server refused a new session: {e or type(e).__name__}") from None
                    time.sleep(delay)
                    delay = min(2 * delay, 0.5)
                elif reopened:
                    raise self._unreachable(f"cannot open a session: {e or type(e).__name__}") from None
                else:
                    reopened = True  # connection() reconnects on the next turn

    def _execute(self, command, input, deadline, shown, out, err):
        if not self._sessions.acquire(timeout=deadline):
            return _Outcome(False, -1, ["waited in vain for a free session on the connection"])
        try:
            chan, notes = self._open_session(deadline)
            try:
                chan.exec_command(command)
                finished, code = _pump(chan, input, deadline, out, err)
            except (paramiko.SSHException, OSError, EOFError) as e:
                raise TransportError(self.name, shown, f"connection lost: {e or type(e).__name__}") from None
            finally:
                chan.close()
            if not finished:
                # No answer by the deadline, though the host's `timeout` should have
                # ended the command before it: the connection (or the host) is not
                # answering. Replace it rather than wait on it again.
                connection = self._connection
                if connection is not None and connection.transport is chan.get_transport():
                    self.drop(connection)
                    notes.append(f"no answer on the open connection for {deadline:g}s: dropped it, "
                                 "the next command reconnects")
            return _Outcome(finished, code, notes)
        finally:
            self._sessions.release()

    def close(self) -> None:
        with self._lock:
            current, self._connection = self._connection, None
        if current is not None:
            _close_quietly(current)


def _cause(e: BaseException) -> str:
    """An SSH library exception in the user's terms."""
    text = str(e).strip()
    if text == "No existing session":  # paramiko: the transport ended before authentication began
        return "the server closed the connection before authentication"
    return text or type(e).__name__


def _pump(chan: paramiko.Channel, input: bytes | None, deadline: float,
          out: Callable[[bytes], bool], err: Callable[[bytes], bool]) -> tuple[bool, int]:
    """Feed stdin (then EOF) and hand stdout/stderr of one exec channel to their
    readers until the remote side closes them, or ``deadline`` seconds pass; a
    reader that takes no more closes the channel (sshd then ends the command).
    (finished, exit code).

    The nudge: sshd sends a command's output, its EOF and its exit status in
    separate writes and does not disable Nagle's algorithm, so each later write
    waits for the previous one to be ACKed; the receiving kernel (a jump host's,
    or ours) may delay that ACK by 40 ms when it has nothing to send back. A tiny
    SSH_MSG_IGNORE towards the host after each piece of output and after the EOF
    carries the ACK along at once: a command with output through a jump drops
    from ~50 ms to ~6 ms on loopback."""
    refused: list[bool] = []  # a reader took no more

    def drain(recv: Callable[[int], bytes], take: Callable[[bytes], bool]) -> None:
        while True:
            data = recv(65536)
            try:
                chan.get_transport().send_ignore(1)
            except (OSError, EOFError, paramiko.SSHException):
                pass  # a dead connection shows up on the channel itself
            if not data:
                return
            if not take(data):
                refused.append(True)
                chan.close()  # the command is sent SIGHUP by sshd; nothing more is read
                return

    def feed() -> None:
        try:
            if input:
                view = memoryview(input)
                for i in range(0, len(view), 65536):
                    chan.sendall(view[i : i + 65536])
            chan.shutdown_write()
        except (OSError, EOFError, paramiko.SSHException):
            pass  # the command exited without reading all of it; its exit code says so

    threads = [
        threading.Thread(target=drain, args=(chan.recv, out), name="ssh-stdout", daemon=True),
        threading.Thread(target=drain, args=(chan.recv_stderr, err), name="ssh-stderr", daemon=True),
        threading.Thread(target=feed, name="ssh-stdin", daemon=True),
    ]
    for t in threads:
        t.start()
    end = time.monotonic() + deadline
    for t in threads[:2]:
        t.join(max(0.0, end - time.monotonic()))
        if refused:
            chan.close()
            for other in threads[:2]:
                other.join(1.0)
            return True, -1
    finished = not any(t.is_alive() for t in threads[:2]) and chan.status_event.wait(max(0.0, end - time.monotonic()))
    if not finished:
        chan.close()  # unblocks the threads
        for t in threads:
            t.join(1.0)
        return False, -1
    return True, chan.recv_exit_status()


# --------------------------------------------------------------------------- the pool


class Pool:
    """One transport per host name, reused across calls and threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._transports: dict[str, Transport] = {}

    def get(self, host_or_name: Union["Host", str], inventory: "Inventory") -> Transport:
        # ConfigError (with did-you-mean) for an unknown name.
        route = inventory.route(host_or_name) if isinstance(host_or_name, str) else inventory.route_of(host_or_name)
        host = route[-1]
        name = host.name
        with self._lock:
            current = self._transports.get(name)
            # The same name in another inventory may mean another machine (and is
            # another trust domain: the transport carries its inventory).
            if current is not None and current.route == route and \
                    getattr(current.inventory, "source", None) == inventory.source:
                return current
            fresh = LocalTransport(host, route, inventory) if host.is_local else SSHTransport(host, inventory, pool=self)
            self._transports[name] = fresh
        if current is not None:
            current.close()
        return fresh

    def riding_on(self, name: str) -> list["SSHTransport"]:
        """The pooled ssh transports whose connection is tunnelled through host ``name``."""
        with self._lock:
            return [t for t in self._transports.values()
                    if isinstance(t, SSHTransport) and any(h.name == name for h in t.route[:-1])]

    def close(self) -> None:
        with self._lock:
            transports, self._transports = list(self._transports.values()), {}
        # Tunnelled connections before the gateways they ride on.
        for t in sorted(transports, key=lambda t: -len(t.route)):
            t.close()


default_pool = Pool()
atexit.register(default_pool.close)
