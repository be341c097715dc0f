"""Alert hooks for real: a webhook server on 127.0.0.1, command hooks writing their
stdin to files, failing hooks, rate limiting and a full queue."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from dflashctl.alerts import (
    BELOW_MIN_SEVERITY,
    DROPPED,
    HOOK_FAILED,
    NO_HOOK,
    QUEUED,
    RATE_LIMITED,
    Alerter,
    make_event,
)
from dflashctl.config import Alerts


@pytest.fixture
def webhook():
    """A real HTTP server on loopback recording POSTs; ``status`` sets its answer."""
    received: list[dict] = []
    state = {"status": 200}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append({"path": self.path, "type": self.headers["Content-Type"], "event": json.loads(body)})
            self.send_response(state["status"])
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, name="test-webhook", daemon=True)
    thread.start()
    yield {"url": f"http://127.0.0.1:{server.server_port}/hook", "received": received, "state": state}
    server.shutdown()
    server.server_close()
    thread.join()


class Failures(list):
    """Collects on_hook_failure events (called from the alert worker thread)."""

    def __call__(self, event):
        self.append(event)


def lines(path) -> list[dict]:
    return [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []


def test_webhook_and_command_receive_the_event(tmp_path, webhook) -> None:
    out = tmp_path / "alerts.jsonl"
    failures = Failures()
    alerts = Alerts(command=f"cat >> {out}; echo >> {out}", webhook=webhook["url"])
    with Alerter(alerts, failures) as alerter:
        event = make_event("crash", "error", "trainer process 4242 is gone", run_id="prod-1", host="gpu1", now=5.0)
        assert alerter.send(event) == QUEUED
        assert alerter.flush()
    assert webhook["received"] == [{"path": "/hook", "type": "application/json", "event": event}]
    assert lines(out) == [event]
    assert failures == []


def test_command_as_argument_list_gets_stdin_and_environment(tmp_path) -> None:
    out = tmp_path / "event.json"
    script = (
        "import os, sys, json; e = json.load(sys.stdin); "
        f"e['env'] = os.environ['DFLASHCTL_ALERT_SEVERITY']; open({str(out)!r}, 'w').write(json.dumps(e))"
    )
    with Alerter(Alerts(command=[sys.executable, "-c", script])) as alerter:
        alerter.send(make_event("stall", "critical", "no new step for 7 m", run_id="r"))
        alerter.flush()
    got = json.loads(out.read_text())
    assert (got["kind"], got["message"], got["env"]) == ("stall", "no new step for 7 m", "critical")


def test_failing_hooks_come_back_as_events(tmp_path, webhook) -> None:
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    failures = Failures()
    webhook["state"]["status"] = 500
    for alerts in (
        Alerts(command="echo 'mail: relay refused' >&2; exit 3"),
        Alerts(webhook=webhook["url"]),
        Alerts(webhook=f"http://127.0.0.1:{closed}/hook"),
    ):
        with Alerter(alerts, failures, timeout=5) as alerter:
            alerter.send(make_event("crash", "error", "trainer process 4242 is gone", run_id="prod-1"))
            alerter.flush()
    assert [f["kind"] for f in failures] == [HOOK_FAILED] * 3
    assert all(f["severity"] == "warning" and f["run_id"] == "prod-1" for f in failures)
    assert failures[0]["message"] == (
        "alert command failed: exit 3: mail: relay refused (event: crash: trainer process 4242 is gone)"
    )
    assert failures[1]["message"].startswith("alert webhook failed: HTTP 500")
    assert failures[2]["message"].startswith("alert webhook failed: cannot reach the webhook")
    assert str(closed) not in failures[2]["message"]  # webhook URLs may hold a token: never repeated
    assert failures[0]["detail"]["event"]["message"] == "trainer process 4242 is gone"


def test_severity_filter_and_rate_limit(tmp_path) -> None:
    out = tmp_path / "alerts.jsonl"
    clock = [1000.0]
    alerts = Alerts(command=f"cat >> {out}; echo >> {out}", min_severity="warning", min_interval="1m")
    with Alerter(alerts, clock=lambda: clock[0]) as alerter:
        send = lambda kind, sev, run="a": alerter.send(make_event(kind, sev, f"{kind} {sev}", run_id=run))  # noqa: E731
        assert send("regression", "info") == BELOW_MIN_SEVERITY
        assert send("regression", "warning") == QUEUED
        clock[0] += 30
        assert send("regression", "warning") == RATE_LIMITED
        assert send("regression", "warning", run="b") == QUEUED  # another run
        assert send("crash", "error") == QUEUED  # another kind
        assert send("regression", "error") == QUEUED  # worse than the last one sent: goes through
        clock[0] += 30
        assert send("regression", "error") == RATE_LIMITED
        clock[0] += 31
        assert send("regression", "warning") == QUEUED
        alerter.flush()
        assert alerter.suppressed == 2
    got = [(e["run_id"], e["kind"], e["severity"], e.get("suppressed")) for e in lines(out)]
    assert got == [
        ("a", "regression", "warning", None),
        ("b", "regression", "warning", None),
        ("a", "crash", "error", None),
        ("a", "regression", "error", 1),
        ("a", "regression", "warning", 1),
    ]


def test_full_queue_drops_without_blocking_and_says_so(tmp_path) -> None:
    out, go = tmp_path / "alerts.jsonl", tmp_path / "go"
    # The hook waits for `go`, so the worker is busy while the caller keeps sending.
    alerts = Alerts(command=f"while [ ! -e {go} ]; do sleep 0.01; done; cat >> {out}; echo >> {out}", min_interval=0)
    alerter = Alerter(alerts, queue_size=1)
    try:
        assert alerter.send(make_event("e1", "error", "one")) == QUEUED
        while alerter.queued:  # until the worker took e1 and is blocked in the hook
            time.sleep(0.01)
        assert alerter.send(make_event("e2", "error", "two")) == QUEUED
        assert alerter.send(make_event("e3", "error", "three")) == DROPPED
        assert alerter.send(make_event("e4", "error", "four")) == DROPPED
        go.touch()
        assert alerter.flush()
        assert alerter.send(make_event("e5", "error", "five")) == QUEUED
        assert alerter.flush()
    finally:
        go.touch()
        alerter.close()
    assert [(e["kind"], e.get("dropped")) for e in lines(out)] == [("e1", None), ("e2", None), ("e5", 2)]
    assert alerter.dropped == 2


def test_no_hooks_no_thread() -> None:
    alerter = Alerter(Alerts())
    assert alerter.send(make_event("crash", "critical", "x")) == NO_HOOK
    assert alerter._worker is None
    alerter.close()
    with pytest.raises(ValueError, match="severity 'fatal'"):
        make_event("crash", "fatal", "x")
