"""Alert hooks: a command (event JSON on stdin) and/or a webhook (JSON POST).

``Alerter.send`` never blocks the supervisor: events go through a bounded queue
to one named worker thread. A full queue drops the event and counts it; the
count rides along on the next delivered event (``dropped``). Events of one kind
for one run are rate-limited to one per ``min_interval`` (a more severe one
always goes through); suppressed ones are counted the same way (``suppressed``). A hook
that fails is reported back through ``on_hook_failure`` as an event of its own.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any, Callable

from dflashctl import __version__
from dflashctl.detectors import SEVERITIES, severity_at_least

if TYPE_CHECKING:
    from dflashctl.config import Alerts

HOOK_FAILED = "alert_hook_failed"

QUEUED = "queued"
BELOW_MIN_SEVERITY = "below_min_severity"
RATE_LIMITED = "rate_limited"
DROPPED = "dropped"
NO_HOOK = "no_hook"


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
    def __init__(
        self,
        alerts: "Alerts",
        on_hook_failure: Callable[[dict[str, Any]], None] | None = None,
        *,
        queue_size: int = 100,
        timeout: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.alerts = alerts
        self.on_hook_failure = on_hook_failure
        self.timeout = timeout
        self.clock = clock
        self.dropped = 0  # total, for status displays
        self.suppressed = 0
        self._lock = threading.Lock()
        self._dropped_since = 0
        self._suppressed_since: dict[tuple, int] = {}
        self._last_sent: dict[tuple, tuple[float, str]] = {}  # (run, kind) -> (clock, severity)
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._worker: threading.Thread | None = None
        if self.has_hooks:
            self._worker = threading.Thread(target=self._run, name="dflashctl-alerts", daemon=True)
            self._worker.start()

    @property
    def has_hooks(self) -> bool:
        return bool(self.alerts.command) or bool(self.alerts.webhook)

    # ----------------------------------------------------------------- caller side

    def send(self, event: dict[str, Any]) -> str:
        """Queue ``event`` (see ``make_event``) for the hooks; returns at once with
        queued, below_min_severity, rate_limited, dropped or no_hook."""
        if not self.has_hooks:
            return NO_HOOK
        if not severity_at_least(event["severity"], self.alerts.min_severity):
            return BELOW_MIN_SEVERITY
        kind = (event.get("run_id"), event["kind"])
        with self._lock:
            now = self.clock()
            last = self._last_sent.get(kind)
            if last is not None and now - last[0] < self.alerts.min_interval and not _more_severe(event["severity"], last[1]):
                self._suppressed_since[kind] = self._suppressed_since.get(kind, 0) + 1
                self.suppressed += 1
                return RATE_LIMITED
            out = dict(event)
            if self._suppressed_since.get(kind):
                out["suppressed"] = self._suppressed_since.pop(kind)
            if self._dropped_since:
                out["dropped"] = self._dropped_since
            try:
                self._queue.put_nowait(out)
            except queue.Full:
                self._dropped_since += 1
                self.dropped += 1
                return DROPPED
            self._dropped_since = 0
            self._last_sent[kind] = (now, event["severity"])
            return QUEUED

    @property
    def queued(self) -> int:
        """Events waiting for the worker (not counting the one it is delivering)."""
        return self._queue.qsize()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued event went through its hooks (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Deliver what is queued (up to ``timeout``), then stop the worker."""
        if self._worker is None:
            return
        self.flush(timeout)
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass  # flush timed out: the daemon worker ends with the process
        self._worker.join(timeout=1.0)
        self._worker = None

    def __enter__(self) -> "Alerter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------------- worker side

    def _run(self) -> None:
        while True:
            event = self._queue.get()
            try:
                if event is None:
                    return
                self._deliver(event)
            finally:
                self._queue.task_done()

    def _deliver(self, event: dict[str, Any]) -> None:
        body = json.dumps(event, default=str).encode()
        if self.alerts.command:
            self._guard("command", event, self._run_command, body, event)
        if self.alerts.webhook:
            self._guard("webhook", event, self._post, body)

    def _guard(self, hook: str, event: dict[str, Any], fn: Callable, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # any failure of a hook is reported, never raised in the worker
            self._failed(hook, event, f"{type(e).__name__}: {e}" if not isinstance(e, _HookError) else str(e))

    def _run_command(self, body: bytes, event: dict[str, Any]) -> None:
        command = self.alerts.command
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        env = {
            **os.environ,
            "DFLASHCTL_ALERT_KIND": str(event["kind"]),
            "DFLASHCTL_ALERT_SEVERITY": str(event["severity"]),
            "DFLASHCTL_ALERT_MESSAGE": str(event["message"]),
        }
        try:
            p = subprocess.run(argv, input=body, capture_output=True, timeout=self.timeout, env=env)
        except subprocess.TimeoutExpired:
            raise _HookError(f"timed out after {self.timeout:g}s") from None
        if p.returncode != 0:
            tail = p.stderr.decode("utf-8", "replace").strip()[-300:]
            raise _HookError(f"exit {p.returncode}" + (f": {tail}" if tail else ""))

    def _post(self, body: bytes) -> None:
        request = urllib.request.Request(
            self.alerts.webhook,
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", "User-Agent": f"dflashctl/{__version__}"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                response.read()
        except urllib.error.HTTPError as e:
            raise _HookError(f"HTTP {e.code} {e.reason}") from None
        except urllib.error.URLError as e:
            raise _HookError(f"cannot reach the webhook: {e.reason}") from None

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


class _HookError(Exception):
    """A hook failure already worded for the operator."""


def _more_severe(severity: str, than: str) -> bool:
    return SEVERITIES.index(severity) > SEVERITIES.index(than)
