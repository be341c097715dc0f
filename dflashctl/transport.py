"""Run commands on inventory hosts: locally (subprocess) or over SSH (paramiko).

One interface, ``Transport.run(argv, ...)``; an argv list arrives byte-exact on the
run host, through jump hosts, the container wrapper and the remote login shell.
The command line is built in exactly one place, ``command_line``:

    [wrapper...] timeout -k K T [env K=V...] [sh -c CD_PRELUDE sh DIR] argv...

joined with ``shlex.join`` for the remote login shell (sshd runs the command
string through the user's shell). The wrapper (``pct exec 200 --``) executes the
rest as an argv, without a second shell, so one level of quoting is right. Every
layer after the wrapper is an argv-executing program (``timeout``, ``env``, a ``sh
-c`` whose script is constant and whose data travels as positional parameters),
so nothing in ``argv``, ``env`` or ``cwd`` is ever interpreted by a shell.

SSH connections are opened once per host and reused (``Pool``). Jump hosts are
other inventory hosts; a gateway is the jump's own pooled connection, opened (under
its lock) before any connection tunnelled through it, so concurrent first use of a
shared jump cannot race. Host keys are checked against the host's known_hosts
file on every hop; unknown keys are refused unless the inventory says
``trust_on_first_use: true``, in which case the key is appended to that file.
"""

from __future__ import annotations

import atexit
import getpass
import logging
import os
import shlex
import signal
import socket
import subprocess
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Union

import paramiko

from dflashctl.errors import CommandTimeout, TransportError, UnreachableError, first_line

if TYPE_CHECKING:
    from dflashctl.config import Host, Inventory

# paramiko logs connection failures from its own threads; they reach the user as
# UnreachableError messages instead (DFLASHCTL_DEBUG=1 keeps paramiko's output).
if not os.environ.get("DFLASHCTL_DEBUG"):
    logging.getLogger("paramiko").addHandler(logging.NullHandler())

# `timeout -k`: seconds between SIGTERM and SIGKILL on the host.
KILL_AFTER = 2.0
# The client gives up this long after the host should have killed the command:
# covers a host (or a frozen container) that never answers.
CLIENT_SLACK = 3.0
# Linux caps one argv string at 128 KiB, and sshd hands the whole command line to
# the login shell as one `-c` argument.
MAX_COMMAND_BYTES = 120_000
STDERR_TAIL_CHARS = 2000
# Concurrent commands per connection: sshd refuses more than MaxSessions (default
# 10) sessions on one connection; further commands wait for a free one.
MAX_SESSIONS = 8
# Exit codes of coreutils `timeout` when it had to stop the command (TERM / KILL).
# When it sends KILL it also kills itself (it signals its whole process group), so
# the host reports a signal: a negative code locally, -1 (no exit status) over SSH.
TIMEOUT_EXIT_CODES = (124, 137)

# Enter the working directory, then exec the argv. "~" and "~/..." expand against
# the run host's $HOME; the directory itself is data ($1), never shell text.
_CD_PRELUDE = (
    'd=$1; shift; case $d in "~") d=$HOME ;; "~/"*) d=$HOME/${d#"~/"} ;; esac; '
    'cd -- "$d" || exit 125; exec "$@"'
)


# --------------------------------------------------------------------------- results


@dataclass
class Result:
    """What a command did on a host. ``command`` is the full line the host ran."""

    host: str
    argv: list[str]
    command: str
    exit_code: int
    stdout_bytes: bytes
    stderr_bytes: bytes
    duration: float

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", errors="replace")

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


def stderr_tail(text: str, limit: int = STDERR_TAIL_CHARS) -> str:
    text = text.strip()
    return text if len(text) <= limit else "..." + text[-limit:]


# --------------------------------------------------------------------------- the command line


def command_line(
    argv: list[str],
    *,
    wrapper: Iterable[str] = (),
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> str:
    """The one place a command string is built (see the module docstring)."""
    if not argv:
        raise ValueError("argv is empty")
    if not timeout > 0:
        raise ValueError(f"timeout must be more than 0 seconds, got {timeout!r}")  # `timeout 0` means none
    inner = [str(a) for a in argv]
    if cwd is not None:
        inner = ["sh", "-c", _CD_PRELUDE, "sh", str(cwd), *inner]
    if env:
        for key in env:
            if not key.isidentifier() or not key.isascii():
                raise ValueError(f"environment variable name {key!r} is not a valid name")
        if "=" in inner[0]:  # env would take it for one more variable
            raise ValueError(f"with env, the command name cannot contain '=': {inner[0]!r}")
        inner = ["env", *(f"{k}={v}" for k, v in env.items()), *inner]
    inner = ["timeout", "-k", f"{KILL_AFTER:g}", f"{timeout:g}", *inner]
    line = shlex.join([*wrapper, *inner])
    if len(line.encode("utf-8")) > MAX_COMMAND_BYTES:
        raise ValueError(
            f"command line is {len(line.encode('utf-8'))} bytes, over {MAX_COMMAND_BYTES}: "
            "send large data as input= (stdin) instead"
        )
    return line


def describe_route(route: list["Host"], wrapper: bool = True) -> str:
    """'jump -> jump2 -> target [pct exec 200 --]', 'direct' or 'local'."""
    target = route[-1]
    if target.is_local:
        text = "local"
    else:
        text = " -> ".join(h.name for h in route) if len(route) > 1 else "direct"
    if wrapper and target.wrapper:
        text += f" [{shlex.join(target.wrapper)}]"
    return text


# --------------------------------------------------------------------------- the interface


class Transport(ABC):
    """Runs argv lists on one host. Thread-safe; reusable; a context manager."""

    def __init__(self, host: "Host", route: list["Host"] | None = None):
        self.host = host
        self.route = route or [host]

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
    ) -> Result:
        """Run ``argv`` on the host (inside its wrapper). ``env`` adds to the host's
        ``env`` from the inventory. ``input`` is sent as stdin, then EOF; without it
        stdin is empty. ``timeout`` (default: the host's command_timeout) kills the
        command on the host and raises CommandTimeout. ``check`` raises
        TransportError on a non-zero exit."""
        limit = float(timeout if timeout is not None else self.host.command_timeout)
        merged_env = {**(self.host.env or {}), **(env or {})}
        shown = shlex.join([str(a) for a in argv])
        try:
            command = command_line(argv, wrapper=self.host.wrapper, timeout=limit, env=merged_env, cwd=cwd)
        except ValueError as e:
            raise TransportError(self.name, shown, str(e)) from None
        started = time.monotonic()
        finished, code, out, err = self._execute(command, input, limit + KILL_AFTER + CLIENT_SLACK, shown)
        duration = time.monotonic() - started
        result = Result(self.name, list(argv), command, code, out, err, duration)
        if not finished:
            raise CommandTimeout(
                self.name,
                shown,
                f"no answer within {limit + KILL_AFTER + CLIENT_SLACK:g}s (timeout {limit:g}s): "
                "gave up on the connection; the host did not confirm the command was stopped",
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
            raise TransportError(
                self.name, shown, "command failed", exit_code=code, stderr_tail=stderr_tail(result.stderr)
            )
        return result

    def run_script(self, source: str, args: Iterable[str] = (), **kwargs: Any) -> Result:
        """Run Python ``source`` with the host's python, ``args`` as sys.argv[1:].
        The source travels as an argument, so stdin stays free for ``input=``."""
        return self.run([self.host.python, "-c", source, *args], **kwargs)

    @abstractmethod
    def _execute(
        self, command: str, input: bytes | None, deadline: float, shown: str
    ) -> tuple[bool, int, bytes, bytes]:
        """Run one command line; (finished, exit code, stdout, stderr). ``finished``
        is False when the client gave up after ``deadline`` seconds."""

    def close(self) -> None:
        pass

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- local


class LocalTransport(Transport):
    """This machine: the same command line, run by /bin/sh as sshd would."""

    def _execute(self, command, input, deadline, shown):
        proc = subprocess.Popen(
            ["/bin/sh", "-c", command],
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group, so a give-up kills it all
        )
        try:
            out, err = proc.communicate(input, timeout=deadline)
            return True, proc.returncode, out, err
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, err = proc.communicate()
            return False, proc.returncode, out, err


# --------------------------------------------------------------------------- ssh


class _UnknownHostKey(paramiko.SSHException):
    def __init__(self, hostname: str, key: paramiko.PKey):
        super().__init__(f"host key for {hostname} is not known")
        self.key = key


class _Refuse(paramiko.MissingHostKeyPolicy):
    """RejectPolicy that keeps the key, so the message can show its fingerprint."""

    def missing_host_key(self, client, hostname, key):
        raise _UnknownHostKey(hostname, key)


_known_hosts_lock = threading.Lock()


class _TrustOnFirstUse(paramiko.MissingHostKeyPolicy):
    """Accept an unknown key and append it to known_hosts, as `ssh` does with
    StrictHostKeyChecking=accept-new (never rewrites the file's other lines)."""

    def __init__(self, path: str):
        self.path = path

    def missing_host_key(self, client, hostname, key):
        with _known_hosts_lock:
            os.makedirs(os.path.dirname(self.path) or ".", mode=0o700, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            with os.fdopen(fd, "a") as f:
                f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(hostname, key.get_name(), key)


def _key_name(address: str, port: int) -> str:
    return address if port == 22 else f"[{address}]:{port}"


class SSHTransport(Transport):
    """A host reached over SSH, possibly through jump hosts, possibly inside a
    container wrapper. One SSH connection, opened on first use and reopened when
    it has died; many commands may run over it at once."""

    def __init__(self, host: "Host", inventory: "Inventory", pool: "Pool | None" = None):
        # The host may be a variant of the inventory's (tests, trust_on_first_use).
        super().__init__(host, [*(inventory.route(host.jump) if host.jump else []), host])
        self.inventory = inventory
        self.pool = pool or default_pool
        self.address = host.address or host.name
        self.port = int(host.port)
        self.user = host.user or getpass.getuser()
        self.known_hosts = os.path.expanduser(host.known_hosts or "~/.ssh/known_hosts")
        self._client: paramiko.SSHClient | None = None
        self._lock = threading.Lock()
        self._sessions = threading.BoundedSemaphore(MAX_SESSIONS)

    # -- connection ------------------------------------------------------------

    def _where(self) -> str:
        via = " -> ".join(h.name for h in self.route[:-1])
        return f"{self.user}@{self.address}:{self.port}" + (f" via {via}" if via else " (direct)")

    def _unreachable(self, message: str, hint: str | None = None) -> UnreachableError:
        return UnreachableError(self.name, f"ssh {self._where()}", message, hint=hint)

    def ssh_transport(self) -> paramiko.Transport:
        """The live paramiko Transport, connecting (gateways first) if needed."""
        with self._lock:
            if self._client is not None:
                t = self._client.get_transport()
                if t is not None and t.is_active():
                    return t
                self._client.close()
                self._client = None
            self._client = self._connect()
            return self._client.get_transport()

    def _connect(self) -> paramiko.SSHClient:
        timeout = float(self.host.connect_timeout)
        deadline = time.monotonic() + timeout
        left = lambda: max(0.1, deadline - time.monotonic())  # noqa: E731
        sock = self._open_socket(timeout, left)
        client = paramiko.SSHClient()
        if os.path.exists(self.known_hosts):
            client.load_host_keys(self.known_hosts)
        client.set_missing_host_key_policy(
            _TrustOnFirstUse(self.known_hosts) if self.host.trust_on_first_use else _Refuse()
        )
        identity = os.path.expanduser(self.host.identity_file) if self.host.identity_file else None
        try:
            client.connect(
                self.address,
                port=self.port,
                username=self.user,
                key_filename=identity,
                allow_agent=identity is None,
                look_for_keys=identity is None,
                sock=sock,
                timeout=left(),
                banner_timeout=left(),
                auth_timeout=left(),
                channel_timeout=timeout,
            )
        except _UnknownHostKey as e:
            client.close()
            raise self._unknown_key(e) from None
        except paramiko.BadHostKeyException as e:
            client.close()
            raise self._unreachable(
                f"host key CHANGED: {e.key.get_name()} {e.key.fingerprint} does not match "
                f"{self.known_hosts}; this may be an attack, or the host was reinstalled",
                hint=f"if the change is expected: ssh-keygen -f {self.known_hosts} -R "
                f"'{_key_name(self.address, self.port)}' and connect again",
            ) from None
        except paramiko.AuthenticationException as e:
            client.close()
            raise self._unreachable(
                f"authentication failed as {self.user!r} ({e})",
                hint=f"check user/identity_file for host '{self.name}' (identity_file: {identity or 'ssh defaults'})",
            ) from None
        except (paramiko.SSHException, OSError, EOFError) as e:
            t = client.get_transport()
            cause = (t.saved_exception if t is not None else None) or e
            client.close()
            timed_out = time.monotonic() >= deadline - 0.1
            raise self._unreachable(
                f"SSH handshake with {self.address}:{self.port} failed"
                + (f": no answer within {timeout:g}s (connect_timeout)" if timed_out else "")
                + f": {cause or type(cause).__name__}"
            ) from None
        client.get_transport().set_keepalive(15)
        return client

    def _open_socket(self, timeout: float, left: Callable[[], float]):
        """A TCP socket to the host, or a direct-tcpip channel through its jump."""
        target = f"{self.address}:{self.port}"
        if self.host.jump:
            gateway = self.pool.get(self.host.jump, self.inventory)
            if not isinstance(gateway, SSHTransport):
                raise self._unreachable(f"jump host '{self.host.jump}' is not an ssh host")
            try:
                gw = gateway.ssh_transport()  # opens the gateway chain first, under its lock
            except UnreachableError as e:
                # Say which host was asked for, and that the hop before it is what failed.
                raise self._unreachable(f"jump host '{self.host.jump}' unreachable: {first_line(e)}",
                                        hint=e.hint) from None
            try:
                return gw.open_channel("direct-tcpip", (self.address, self.port), ("127.0.0.1", 0), timeout=left())
            except paramiko.ChannelException as e:
                raise self._unreachable(
                    f"jump host '{self.host.jump}' could not connect to {target}: {e.text or e}"
                ) from None
            except (paramiko.SSHException, OSError, EOFError) as e:
                raise self._unreachable(
                    f"no tunnel through '{self.host.jump}' to {target} within {timeout:g}s: {e or type(e).__name__}"
                ) from None
        try:
            sock = socket.create_connection((self.address, self.port), timeout=left())
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

    def _unknown_key(self, e: _UnknownHostKey) -> UnreachableError:
        keyscan = f"ssh-keyscan -p {self.port} {self.address} >> {self.known_hosts}"
        if self.host.jump:
            keyscan = f"ssh {self.host.jump} {shlex.quote(f'ssh-keyscan -p {self.port} {self.address}')} >> {self.known_hosts}"
        return self._unreachable(
            f"unknown host key {e.key.get_name()} {e.key.fingerprint} for "
            f"{_key_name(self.address, self.port)}: not in {self.known_hosts}; refused",
            hint=f"verify the fingerprint, then trust it: {keyscan}  "
            f"(or set `trust_on_first_use: true` for host '{self.name}' in the inventory)",
        )

    # -- commands --------------------------------------------------------------

    def _open_session(self, wait: float) -> paramiko.Channel:
        """A new session channel. A connection found dead is reopened once (nothing
        ran on it yet, so this cannot run a command twice); a session the server
        refuses (sshd's MaxSessions, while other sessions are closing) is retried
        until ``wait`` seconds pass."""
        end = time.monotonic() + wait
        delay, reconnected = 0.02, False
        while True:
            connection = self.ssh_transport()
            try:
                return connection.open_session(timeout=float(self.host.connect_timeout))
            except (paramiko.SSHException, OSError, EOFError) as e:
                # (paramiko reports a refusal as ChannelException to one waiting
                # thread and as a bare "Unable to open channel." to the others.)
                if connection.is_active():
                    if time.monotonic() + delay > end:
                        raise self._unreachable(f"the server refused a new session: {e or type(e).__name__}") from None
                    time.sleep(delay)
                    delay = min(2 * delay, 0.5)
                elif reconnected:
                    raise self._unreachable(f"cannot open a session: {e or type(e).__name__}") from None
                else:
                    reconnected = True  # ssh_transport() reconnects on the next turn

    def _execute(self, command, input, deadline, shown):
        if not self._sessions.acquire(timeout=deadline):
            return False, -1, b"", b"waited in vain for a free session on the connection"
        try:
            chan = self._open_session(deadline)
            try:
                chan.exec_command(command)
                return _pump(chan, input, deadline)
            except (paramiko.SSHException, OSError, EOFError) as e:
                raise TransportError(self.name, shown, f"connection lost: {e or type(e).__name__}") from None
            finally:
                chan.close()
        finally:
            self._sessions.release()

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


def _pump(chan: paramiko.Channel, input: bytes | None, deadline: float) -> tuple[bool, int, bytes, bytes]:
    """Feed stdin (then EOF) and drain stdout/stderr of one exec channel until
    the remote side closes them, or ``deadline`` seconds pass.

    The nudge: sshd sends a command's output, its EOF and its exit status in
    separate writes and does not disable Nagle's algorithm, so each later write
    waits for the previous one to be ACKed; the receiving kernel (a jump host's,
    or ours) may delay that ACK by 40 ms when it has nothing to send back. A tiny
    SSH_MSG_IGNORE towards the host after each piece of output and after the EOF
    carries the ACK along at once: a command with output through a jump drops
    from ~50 ms to ~6 ms on loopback."""
    out: list[bytes] = []
    err: list[bytes] = []

    def drain(recv: Callable[[int], bytes], sink: list[bytes]) -> None:
        while True:
            data = recv(65536)
            try:
                chan.get_transport().send_ignore(1)
            except (OSError, EOFError, paramiko.SSHException):
                pass  # a dead connection shows up on the channel itself
            if not data:
                return
            sink.append(data)

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
    finished = not any(t.is_alive() for t in threads[:2]) and chan.status_event.wait(max(0.0, end - time.monotonic()))
    if not finished:
        chan.close()  # unblocks the threads
        for t in threads:
            t.join(1.0)
        return False, -1, b"".join(out), b"".join(err)
    return True, chan.recv_exit_status(), b"".join(out), b"".join(err)


# --------------------------------------------------------------------------- pool and fan-out


class Pool:
    """One transport per host name, reused across calls and threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._transports: dict[str, Transport] = {}

    def get(self, host_or_name: Union["Host", str], inventory: "Inventory") -> Transport:
        name = host_or_name if isinstance(host_or_name, str) else host_or_name.name
        route = inventory.route(name)  # ConfigError (with did-you-mean) for an unknown name
        host = route[-1]
        with self._lock:
            current = self._transports.get(name)
            # The same name in another inventory may mean another machine.
            if current is not None and current.route == route:
                return current
            fresh = LocalTransport(host, route) if host.is_local else SSHTransport(host, inventory, pool=self)
            self._transports[name] = fresh
        if current is not None:
            current.close()
        return fresh

    def close(self) -> None:
        with self._lock:
            transports, self._transports = list(self._transports.values()), {}
        # Tunnelled connections before the gateways they ride on.
        for t in sorted(transports, key=lambda t: -len(t.route)):
            t.close()


default_pool = Pool()
atexit.register(default_pool.close)


def connect(host_or_name: Union["Host", str], inventory: "Inventory") -> Transport:
    """The pooled transport for a host (connections open lazily, on first run)."""
    return default_pool.get(host_or_name, inventory)


def fanout(
    transports_or_names: Iterable[Union[Transport, str]],
    fn: Callable[[Transport], Any],
    max_workers: int | None = None,
    inventory: "Inventory | None" = None,
) -> dict[str, Any]:
    """Call ``fn(transport)`` for every host at once: {name: return value or the
    Exception it raised}. Names need ``inventory``. A failing host is a value in
    the answer, never an exception that loses the others."""
    items = list(transports_or_names)
    if not items:
        return {}

    def one(item: Union[Transport, str]) -> Any:
        try:
            transport = item if isinstance(item, Transport) else connect(item, _need(inventory))
            return fn(transport)
        except Exception as e:  # noqa: BLE001  (a dead host is a finding, not a crash)
            return e

    names = [item.name if isinstance(item, Transport) else item for item in items]
    with ThreadPoolExecutor(max_workers or min(32, len(items)), thread_name_prefix="fanout") as ex:
        return dict(zip(names, ex.map(one, items)))


def _need(inventory: "Inventory | None") -> "Inventory":
    if inventory is None:
        raise ValueError("fanout over host names needs inventory=")
    return inventory
