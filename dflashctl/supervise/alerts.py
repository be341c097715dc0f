"""Alert hooks: a command (event JSON on stdin) and/or a webhook (JSON POST).

``Alerter.send`` never blocks the supervisor: each hook has its own bounded
queue and its own named worker thread, so a hung command never delays the
webhook (and the other way round). Every delivery is bounded three ways, so a
hook can never block, leak into or bloat the supervisor:

- time: one total deadline per hook and alert (``alerts.timeout``). A command
  runs in a session of its own and its whole process group is killed and reaped
  at the deadline; a webhook has a connect timeout (``alerts.connect_timeout``)
  and its socket is shut down at the deadline, however slowly the server
  trickles bytes.
- memory: at most ``output_limit`` bytes of a command's stdout and of its
  stderr are kept (the rest is read and dropped, so the command never stalls on
  a full pipe), and at most that much of a webhook's response body is read.
- queue: a full queue drops the event and counts it; the count rides along on
  the hook's next delivered event (``dropped``).

Events of one kind for one run are rate-limited to one per ``min_interval`` (a
more severe one always goes through); suppressed ones are counted the same way
(``suppressed``). Every alert a hook did not take (error, non-2xx answer,
deadline, full queue, closed before its turn) is reported back through
``on_hook_failure`` as an event of its own, from the hook's worker thread, or
from the caller of ``send`` for a full queue. This module never raises into the
caller for a hook's sake and never repeats a webhook URL (it may hold a token).
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import selectors
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any, Callable

from dflashctl import __version__
from dflashctl.core.states import SEVERITIES, more_severe, severity_at_least

if TYPE_CHECKING:
    from dflashctl.config import Alerts

HOOK_FAILED = "alert_hook_failed"

QUEUED = "queued"
BELOW_MIN_SEVERITY = "below_min_severity"
RATE_LIMITED = "rate_limited"
DROPPED = "dropped"
NO_HOOK = "no_hook"

OUTPUT_LIMIT = 64 * 1024  # bytes kept of each output stream of a hook
TAIL_CHARS = 300  # of a hook's output, quoted in its failure message
_CHUNK = 64 * 1024
_POLL_S = 0.1  # how soon a running command notices that its delivery was abandoned


def make_event(
    kind: str,
    severity: str,
    message: str,
    *,
    run_id: str | None = None,
    host: str | None = None,
    detail: dict[str, Any] | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """The JSON object hooks receive."""
    if severity not in SEVERITIES:
        raise ValueError(f"severity {severity!r} is not one of {', '.join(SEVERITIES)}")
    return {
        "kind": kind,
        "severity": severity,
        "message": message,
        "run_id": run_id,
        "host": host,
        "time": time.time() if now is None else now,
        "detail": detail or {},
    }


class Alerter:
    """The hooks of one ``alerts`` section; ``send`` queues, a thread per hook delivers.

    ``timeout`` and ``connect_timeout`` override the section's (tests, benches).
    """

    def __init__(
        self,
        alerts: "Alerts",
        on_hook_failure: Callable[[dict[str, Any]], None] | None = None,
        *,
        queue_size: int = 100,
        timeout: float | None = None,
        connect_timeout: float | None = None,
        output_limit: int = OUTPUT_LIMIT,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.alerts = alerts
        self.on_hook_failure = on_hook_failure
        self.timeout = float(alerts.timeout if timeout is None else timeout)
        connect = alerts.connect_timeout if connect_timeout is None else connect_timeout
        self.connect_timeout = min(self.timeout, float(connect))
        self.output_limit = output_limit
        self.clock = clock
        self.dropped = 0  # events a hook's full queue refused, total, for status displays
        self.suppressed = 0
        self._lock = threading.Lock()
        self._suppressed_since: dict[tuple, int] = {}
        self._last_sent: dict[tuple, tuple[float, str]] = {}  # (run, kind) -> (clock, severity)
        self._hooks: list[_Hook] = []
        if alerts.command:
            self._hooks.append(_Hook("command", self._run_command, queue_size))
        if alerts.webhook:
            self._hooks.append(_Hook("webhook", self._post, queue_size))
        for hook in self._hooks:
            name = f"dflashctl-alerts-{hook.name}"
            hook.thread = threading.Thread(target=self._run, args=(hook,), name=name, daemon=True)
            hook.thread.start()

    # ----------------------------------------------------------------- caller side

    def send(self, event: dict[str, Any]) -> str:
        """Queue ``event`` (see ``make_event``) for the hooks; returns at once with
        queued, below_min_severity, rate_limited, dropped (a hook's queue was full:
        reported through ``on_hook_failure``) or no_hook."""
        if not self._hooks:
            return NO_HOOK
        if not severity_at_least(event["severity"], self.alerts.min_severity):
            return BELOW_MIN_SEVERITY
        key = (event.get("run_id"), event["kind"])
        refused: list[_Hook] = []
        with self._lock:
            now = self.clock()
            last = self._last_sent.get(key)
            if last is not None and now - last[0] < self.alerts.min_interval and not more_severe(event["severity"], last[1]):
                self._suppressed_since[key] = self._suppressed_since.get(key, 0) + 1
                self.suppressed += 1
                return RATE_LIMITED
            out = dict(event)
            if self._suppressed_since.get(key):
                out["suppressed"] = self._suppressed_since.pop(key)
            for hook in self._hooks:
                item = dict(out, dropped=hook.dropped_since) if hook.dropped_since else out
                try:
                    hook.queue.put_nowait(item)
                except queue.Full:
                    hook.dropped_since += 1
                    refused.append(hook)
                else:
                    hook.dropped_since = 0
            if len(refused) < len(self._hooks):
                self._last_sent[key] = (now, event["severity"])
            elif "suppressed" in out:  # nobody took it: the count waits for the next one
                self._suppressed_since[key] = out["suppressed"]
            if refused:
                self.dropped += 1
        for hook in refused:  # outside the lock: the callback is the caller's code
            self._failed(hook.name, out, f"dropped: {hook.queue.maxsize} alerts already wait for this hook")
        return DROPPED if refused else QUEUED

    @property
    def queued(self) -> int:
        """Events waiting for a hook (not counting the ones being delivered), the
        longest queue's."""
        return max((h.queue.qsize() for h in self._hooks), default=0)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued event went through its hooks (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while any(h.queue.unfinished_tasks for h in self._hooks):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Deliver what is queued (up to ``timeout``), then stop the hooks: a delivery
        still running is abandoned (a command's process group killed) and every event
        not delivered is reported as a failure."""
        if not self._hooks:
            return
        self.flush(timeout)
        for hook in self._hooks:
            with hook.lock:
                hook.closing = True
                running = hook.running
            if running is not None:
                running.abandon("abandoned: the alerts were closed before it finished")
        for hook in self._hooks:
            try:  # the worker empties a closing queue quickly (each event reported as failed)
                hook.queue.put(None, timeout=2.0)
            except queue.Full:
                pass  # the daemon worker ends with the process
        for hook in self._hooks:
            if hook.thread is not None:
                hook.thread.join(timeout=2.0)
        self._hooks = []

    def __enter__(self) -> "Alerter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------------- worker side

    def _run(self, hook: "_Hook") -> None:
        while True:
            event = hook.queue.get()
            try:
                if event is None:
                    return
                self._deliver(hook, event)
            finally:
                hook.queue.task_done()

    def _deliver(self, hook: "_Hook", event: dict[str, Any]) -> None:
        deadline = _Deadline(self.timeout)
        with hook.lock:
            closing = hook.closing
            if not closing:
                hook.running = deadline
        if closing:
            self._failed(hook.name, event, "not sent: the alerts were closed before its turn")
            return
        try:
            hook.deliver(event, deadline)
        except _HookError as e:
            self._failed(hook.name, event, str(e))
        except Exception as e:  # any failure of a hook is reported, never raised in the worker
            self._failed(hook.name, event, deadline.reason or f"{type(e).__name__}: {e}")
        finally:
            with hook.lock:
                hook.running = None
            deadline.release()

    def _run_command(self, event: dict[str, Any], deadline: "_Deadline") -> None:
        command = self.alerts.command
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        env = {
            **os.environ,
            "DFLASHCTL_ALERT_KIND": str(event["kind"]),
            "DFLASHCTL_ALERT_SEVERITY": str(event["severity"]),
            "DFLASHCTL_ALERT_MESSAGE": str(event["message"]),
        }
        body = json.dumps(event, default=str).encode()
        returncode, stdout, stderr = run_bounded(argv, body, deadline, env=env, output_limit=self.output_limit)
        tail = _tail(stderr) or _tail(stdout)
        if returncode is None:
            raise _HookError(f"{deadline.reason}, its process group killed" + (f": {tail}" if tail else ""))
        if returncode != 0:
            raise _HookError(f"exit {returncode}" + (f": {tail}" if tail else ""))

    def _post(self, event: dict[str, Any], deadline: "_Deadline") -> None:
        request = urllib.request.Request(
            self.alerts.webhook,
            data=json.dumps(event, default=str).encode(),
            method="POST",
            headers={"Content-Type": "application/json", "User-Agent": f"dflashctl/{__version__}"},
        )
        opener = urllib.request.build_opener(_WatchedHTTPHandler(deadline), _WatchedHTTPSHandler(deadline))
        # A socket timeout bounds each read, not the whole: a server trickling a byte
        # a second never trips it. This timer shuts the socket down at the deadline.
        timer = threading.Timer(deadline.left(), deadline.expire)
        timer.name, timer.daemon = "dflashctl-alerts-webhook-deadline", True
        timer.start()
        try:
            with opener.open(request, timeout=self.connect_timeout) as response:
                read_at_most(response, self.output_limit)
        except urllib.error.HTTPError as e:
            if deadline.reason:
                raise _HookError(deadline.reason) from None
            try:
                tail = _tail(read_at_most(e, self.output_limit))
            except Exception:  # noqa: BLE001  (the status says enough)
                tail = ""
            finally:
                e.close()
            raise _HookError(f"HTTP {e.code} {e.reason}" + (f": {tail}" if tail else "")) from None
        except urllib.error.URLError as e:
            raise _HookError(deadline.reason or f"cannot reach the webhook: {e.reason}") from None
        except Exception:
            if deadline.reason:
                raise _HookError(deadline.reason) from None
            raise
        finally:
            timer.cancel()
        if deadline.reason:  # the answer came, but after the deadline
            raise _HookError(deadline.reason)

    def _failed(self, hook: str, event: dict[str, Any], error: str) -> None:
        if self.on_hook_failure is None:
            return
        # The webhook URL is not repeated: such URLs often carry a secret token.
        failure = make_event(
            HOOK_FAILED,
            "warning",
            f"alert {hook} failed: {error} (event: {event['kind']}: {event['message'][:120]})",
            run_id=event.get("run_id"),
            host=event.get("host"),
            detail={"hook": hook, "error": error, "event": event},
        )
        try:
            self.on_hook_failure(failure)
        except Exception:
            pass  # the caller's callback must not kill the alert worker


# --------------------------------------------------------------------------- delivery


class _Hook:
    """One hook's delivery line: a bounded queue and a thread of its own, so a hung
    hook holds up only its own later alerts, each by at most its deadline."""

    def __init__(self, name: str, deliver: Callable[[dict[str, Any], "_Deadline"], None], queue_size: int):
        self.name = name
        self.deliver = deliver
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.dropped_since = 0
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()
        self.closing = False
        self.running: _Deadline | None = None


class _Deadline:
    """The total time one delivery may take. ``abandon`` (from another thread, or
    ``expire`` from a timer) ends it: the sockets it watches are shut down, which
    wakes a read blocked on them; a command's loop sees ``left() == 0``."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.end = time.monotonic() + seconds
        self.reason: str | None = None  # why it ended early or late; None while it runs
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []

    def left(self) -> float:
        if self.reason is None and time.monotonic() >= self.end:
            self.expire()
        return 0.0 if self.reason is not None else max(0.0, self.end - time.monotonic())

    def expire(self) -> None:
        self.abandon(f"timed out after {self.seconds:g}s")

    def abandon(self, reason: str) -> None:
        with self._lock:
            if self.reason is not None:
                return
            self.reason = reason
            for sock in self._socks:
                _shutdown(sock)

    def watch(self, sock: socket.socket) -> None:
        """Shut ``sock`` down when the delivery ends early. A duplicate of it is kept:
        shutdown acts on the connection, so it also reaches the TLS socket that
        takes ``sock`` over."""
        with self._lock:
            if self.reason is None:
                self._socks.append(sock.dup())
                return
        _shutdown(sock)
        raise TimeoutError(self.reason)

    def release(self) -> None:
        with self._lock:
            for sock in self._socks:
                sock.close()
            self._socks.clear()


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed


class _WatchedConnection:
    """An http.client connection whose socket its ``deadline`` can shut down, given
    at most the connect timeout to connect and what is left of the deadline after."""

    def __init__(self, *args: Any, deadline: _Deadline, **kwargs: Any):
        super().__init__(*args, **kwargs)
        create = self._create_connection

        def create_watched(address, timeout, source_address=None):  # noqa: ANN001 (http.client's signature)
            sock = create(address, max(0.001, min(timeout, deadline.left())), source_address)
            deadline.watch(sock)
            sock.settimeout(max(0.001, deadline.left()))
            return sock

        self._create_connection = create_watched


class _WatchedHTTPConnection(_WatchedConnection, http.client.HTTPConnection):
    pass


class _WatchedHTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline):
        super().__init__()
        self.deadline = deadline

    def http_open(self, req):  # noqa: ANN001, ANN201 (urllib's signature)
        return self.do_open(_WatchedHTTPConnection, req, deadline=self.deadline)


if hasattr(http.client, "HTTPSConnection"):

    class _WatchedHTTPSConnection(_WatchedConnection, http.client.HTTPSConnection):
        pass

    class _WatchedHTTPSHandler(urllib.request.HTTPSHandler):
        def __init__(self, deadline: _Deadline):
            super().__init__()
            self.deadline = deadline

        def do_open(self, http_class, req, **kwargs):  # noqa: ANN001, ANN201 (urllib's signature)
            return super().do_open(_WatchedHTTPSConnection, req, deadline=self.deadline, **kwargs)

else:  # a Python built without ssl: https:// URLs fail as urllib says

    def _WatchedHTTPSHandler(deadline: _Deadline) -> urllib.request.BaseHandler:  # noqa: N802
        return urllib.request.BaseHandler()


def read_at_most(stream: Any, limit: int) -> bytes:
    """The first ``limit`` bytes of ``stream`` (a response), read in chunks; the rest
    is left unread (closing the response drops it)."""
    kept = bytearray()
    while len(kept) < limit:
        chunk = stream.read(min(_CHUNK, limit - len(kept)))
        if not chunk:
            break
        kept += chunk
    return bytes(kept)


def run_bounded(
    argv: list[str],
    stdin: bytes,
    deadline: _Deadline,
    *,
    env: dict[str, str] | None = None,
    output_limit: int = OUTPUT_LIMIT,
) -> tuple[int | None, bytes, bytes]:
    """Run ``argv`` with ``stdin`` as its input, in a session (process group) of its
    own; return (exit status, stdout tail, stderr tail), each tail at most
    ``output_limit`` bytes (the rest is read and dropped, never stored).

    At the deadline, or when it is abandoned, the whole process group is killed and
    the leader reaped: the status is then None. The same happens when the command
    exited but processes of its group still hold its output open. A process that
    left the group (``setsid``) and let go of the output is left alone.
    """
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True
    )
    tails = {"stdout": bytearray(), "stderr": bytearray()}
    finished = False
    try:
        finished = _pump(proc, stdin, deadline, tails, output_limit)
    finally:
        if not finished:
            # The leader is not reaped yet, so its pid (the group's id) cannot have
            # been reused: the signal reaches only this command's processes.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            try:
                pipe.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass  # stuck in the kernel: Popen reaps it later
    return (proc.returncode if finished else None), bytes(tails["stdout"]), bytes(tails["stderr"])


def _pump(proc: subprocess.Popen, data: bytes, deadline: _Deadline, tails: dict[str, bytearray], limit: int) -> bool:
    """Feed ``data`` to the command and keep the tails of its output until it exited
    with its output closed (True) or the deadline came (False). Never reaps it."""
    pending = memoryview(data)
    with selectors.DefaultSelector() as sel:
        if pending:
            os.set_blocking(proc.stdin.fileno(), False)
            sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE, "stdin")
        else:
            proc.stdin.close()
        sel.register(proc.stdout.fileno(), selectors.EVENT_READ, "stdout")
        sel.register(proc.stderr.fileno(), selectors.EVENT_READ, "stderr")
        while sel.get_map():
            left = deadline.left()
            if left <= 0:
                return False
            for key, _ in sel.select(min(left, _POLL_S)):
                if key.data == "stdin":
                    try:
                        pending = pending[os.write(key.fd, pending[:_CHUNK]):]
                    except BlockingIOError:
                        continue
                    except OSError:  # BrokenPipeError: it does not read its input, fine
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(key.fd)
                        proc.stdin.close()
                    continue
                chunk = os.read(key.fd, _CHUNK)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                tail = tails[key.data]
                tail += chunk
                if len(tail) > limit:
                    del tail[: len(tail) - limit]
    while not _exited(proc):
        if deadline.left() <= 0:
            return False
        time.sleep(min(0.005, deadline.left()))
    return True


def _exited(proc: subprocess.Popen) -> bool:
    """Whether the command exited, without reaping it (so its group id stays its own)."""
    if not hasattr(os, "waitid"):
        return proc.poll() is not None
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _tail(data: bytes) -> str:
    return data.decode("utf-8", "replace").strip()[-TAIL_CHARS:]


class _HookError(Exception):
    """A hook failure already worded for the operator."""
