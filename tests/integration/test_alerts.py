"""Alert hooks for real: a webhook server on 127.0.0.1, command hooks writing their
stdin to files, failing hooks, rate limiting and a full queue; and hostile hooks
(a webhook trickling a byte a second or answering forever, a command hanging with a
grandchild or printing 150 MB) that must stay within their deadline and memory."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer

import pytest

from dflashctl.config import Alerts
from dflashctl.supervise.alerts import (
    BELOW_MIN_SEVERITY,
    DROPPED,
    HOOK_FAILED,
    QUEUED,
    RATE_LIMITED,
    Alerter,
    make_event,
)
from tests import harness


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


# --------------------------------------------------------------------------- bounded hooks


@pytest.fixture
def hostile_webhook():
    """A real threaded HTTP server on loopback whose ``mode`` picks its answer: ``ok``
    (200), ``trickle_body`` / ``trickle_head`` (one byte a second, in the body or in
    the headers), ``endless`` (a body that never ends, as fast as it goes), or
    ``error`` (503 with a body). ``sent`` counts the bytes of the last answer."""
    received: list[dict] = []
    state = {"mode": "ok", "sent": 0}
    stop = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append(json.loads(body))
            mode, state["sent"] = state["mode"], 0
            try:
                if mode == "ok":
                    self.send_response(200)
                    self.end_headers()
                elif mode == "error":
                    self.send_response(503)
                    self.end_headers()
                    self.wfile.write(b"upstream says: relay down\n")
                elif mode == "trickle_body":
                    self.send_response(200)
                    self.send_header("Content-Length", "1000")
                    self.end_headers()
                    self.trickle(b"x" * 1000)
                elif mode == "trickle_head":
                    self.wfile.write(b"HTTP/1.0 200 OK\r\n")
                    self.trickle(b"X-Slow: " + b"y" * 1000 + b"\r\n\r\n")
                elif mode == "endless":
                    self.send_response(200)
                    self.end_headers()
                    chunk = b"z" * 65536
                    while not stop.is_set() and state["sent"] < 300_000_000:
                        self.wfile.write(chunk)
                        state["sent"] += len(chunk)
            except OSError:
                pass  # the client hung up: what the deadline and the body cap do

        def trickle(self, data: bytes) -> None:
            for i in range(len(data)):
                if stop.is_set():
                    return
                self.wfile.write(data[i:i + 1])
                self.wfile.flush()
                state["sent"] += 1
                stop.wait(1.0)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="test-hostile-webhook", daemon=True)
    thread.start()
    yield {"url": f"http://127.0.0.1:{server.server_port}/hook", "received": received, "state": state}
    stop.set()
    server.shutdown()
    server.server_close()
    thread.join()


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def gone(pid: int) -> bool:
    """The process no longer runs. A zombie whose parent is not this test process
    (a grandchild handed to init) counts as gone: it is init's to reap, not ours."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return True
    state, parent = fields[0], int(fields[1])
    return state in ("Z", "X") and parent != os.getpid()


def kill_leftovers(pids_file) -> None:
    """Cleanup of processes this test started (their pids in ``pids_file``) when the
    code under test left them running; twice, for a hook that a stale worker starts
    after the first pass."""
    for _ in range(2):
        killed = 0
        for pid in pids_file.read_text().split() if pids_file.exists() else []:
            try:
                os.kill(int(pid), signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
        if not killed:
            return
        time.sleep(0.3)


@pytest.mark.parametrize("mode", ["trickle_body", "trickle_head"])
def test_a_trickling_webhook_fails_at_its_deadline_and_later_alerts_still_go(hostile_webhook, mode) -> None:
    hostile_webhook["state"]["mode"] = mode
    failures = Failures()
    alerter = Alerter(Alerts(webhook=hostile_webhook["url"], min_interval=0), failures, timeout=2)
    try:
        started = time.monotonic()
        assert alerter.send(make_event("crash", "error", "first", run_id="r1")) == QUEUED
        assert wait_for(lambda: failures, timeout=6), "the trickling webhook was never given up"
        took = time.monotonic() - started
        assert 1.5 <= took < 3.5, took
        assert hostile_webhook["state"]["sent"] >= 1  # it was trickling, not refused
        assert [f["kind"] for f in failures] == [HOOK_FAILED]
        assert failures[0]["message"] == "alert webhook failed: timed out after 2s (event: crash: first)"
        assert failures[0]["detail"]["hook"] == "webhook" and failures[0]["run_id"] == "r1"

        hostile_webhook["state"]["mode"] = "ok"
        assert alerter.send(make_event("crash", "error", "second", run_id="r1")) == QUEUED
        assert alerter.flush(timeout=5)
        assert [e["message"] for e in hostile_webhook["received"]] == ["first", "second"]
        assert len(failures) == 1
    finally:
        alerter.close(timeout=1)


def test_a_hanging_command_is_killed_with_its_whole_process_group(tmp_path) -> None:
    pids_file = tmp_path / "pids"
    # The hook's shell starts a child shell that forks a grandchild and waits for it;
    # both hold the hook's output pipes open.
    child = f"echo $$ >> {pids_file}; sleep 1000 & echo $! >> {pids_file}; wait"
    command = f"echo $$ >> {pids_file}; sh -c '{child}'; echo never"
    failures = Failures()
    alerter = Alerter(Alerts(command=command), failures, timeout=2)
    try:
        started = time.monotonic()
        alerter.send(make_event("stall", "error", "no step for 9 m", run_id="r2"))
        assert wait_for(lambda: len(pids_file.read_text().split()) == 3 if pids_file.exists() else False, 5)
        pids = [int(p) for p in pids_file.read_text().split()]
        assert wait_for(lambda: failures, timeout=6), "the hanging command was never given up"
        assert time.monotonic() - started < 3.5
        assert wait_for(lambda: all(gone(p) for p in pids), timeout=2), [p for p in pids if not gone(p)]
        assert failures[0]["message"] == (
            "alert command failed: timed out after 2s, its process group killed (event: stall: no step for 9 m)"
        )
        assert alerter.flush(timeout=1)
    finally:
        alerter.close(timeout=1)
        kill_leftovers(pids_file)


def test_one_alerts_hooks_do_not_wait_for_each_other(tmp_path, hostile_webhook) -> None:
    pids_file = tmp_path / "pids"
    failures = Failures()
    command = f"echo $$ >> {pids_file}; exec sleep 1000"
    alerter = Alerter(Alerts(command=command, webhook=hostile_webhook["url"]), failures, timeout=3)
    try:
        started = time.monotonic()
        alerter.send(make_event("crash", "error", "both hooks", run_id="r3"))
        assert wait_for(lambda: hostile_webhook["received"], timeout=1.5), "the webhook waited for the command"
        assert not failures
        assert wait_for(lambda: failures, timeout=5)
        assert 2.5 <= time.monotonic() - started < 4.5
        assert [f["detail"]["hook"] for f in failures] == ["command"]
    finally:
        alerter.close(timeout=1)
        kill_leftovers(pids_file)


def test_a_huge_command_output_keeps_memory_bounded(tmp_path) -> None:
    # A fresh interpreter, so its peak RSS (VmHWM) is this delivery's and not an
    # earlier test's.
    script = r"""
import json, sys
from dflashctl.supervise.alerts import Alerter, make_event
from dflashctl.config import Alerts

def peak_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])

failures = []
command = ("head -c 150000000 /dev/zero; yes 'noise on stderr' | head -c 20000000 >&2; "
           "echo 'mail: relay down' >&2; exit 4")
alerter = Alerter(Alerts(command=command), failures.append, timeout=120)
before = peak_kib()
alerter.send(make_event("crash", "error", "big", run_id="r4"))
delivered = alerter.flush(120)
after = peak_kib()
alerter.close()
print(json.dumps({"growth_kib": after - before, "delivered": delivered, "failures": [f["message"] for f in failures]}))
"""
    root = str(harness.REPO)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=root)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    assert got["delivered"]
    assert got["growth_kib"] < 50 * 1024, f"peak RSS grew {got['growth_kib'] / 1024:.0f} MiB"
    [message] = got["failures"]
    assert message.startswith("alert command failed: exit 4: ")
    assert message.endswith("noise on stderr\nmail: relay down (event: crash: big)")
    assert len(message) < 400  # a short tail, not the output


def test_an_endless_webhook_answer_is_read_only_up_to_the_cap(hostile_webhook) -> None:
    hostile_webhook["state"]["mode"] = "endless"
    failures = Failures()
    with Alerter(Alerts(webhook=hostile_webhook["url"]), failures, timeout=10) as alerter:
        alerter.send(make_event("crash", "error", "endless", run_id="r5"))
        assert alerter.flush(timeout=12)
    assert failures == []  # a 2xx answer: delivered, however long its body
    assert hostile_webhook["state"]["sent"] < 50_000_000  # the client hung up early


def test_a_webhook_error_quotes_the_start_of_its_answer(hostile_webhook) -> None:
    hostile_webhook["state"]["mode"] = "error"
    failures = Failures()
    with Alerter(Alerts(webhook=hostile_webhook["url"]), failures, timeout=5) as alerter:
        alerter.send(make_event("crash", "error", "down", run_id="r6"))
        alerter.flush()
    assert [f["message"] for f in failures] == [
        "alert webhook failed: HTTP 503 Service Unavailable: upstream says: relay down (event: crash: down)"
    ]


def test_dropped_alerts_are_reported_as_hook_failures(tmp_path) -> None:
    go = tmp_path / "go"
    failures = Failures()
    alerts = Alerts(command=f"while [ ! -e {go} ]; do sleep 0.01; done; cat > /dev/null", min_interval=0)
    alerter = Alerter(alerts, failures, queue_size=1)
    try:
        assert alerter.send(make_event("e1", "error", "one", run_id="r7")) == QUEUED
        assert wait_for(lambda: alerter.queued == 0, timeout=5)  # e1 is being delivered
        assert alerter.send(make_event("e2", "error", "two", run_id="r7")) == QUEUED
        assert alerter.send(make_event("e3", "error", "three", run_id="r7")) == DROPPED
        assert [(f["kind"], f["detail"]["hook"], f["detail"]["event"]["kind"]) for f in failures] == [
            (HOOK_FAILED, "command", "e3")
        ]
        assert failures[0]["message"] == (
            "alert command failed: dropped: 1 alerts already wait for this hook (event: e3: three)"
        )
        go.touch()
        assert alerter.flush()
        assert len(failures) == 1
    finally:
        go.touch()
        alerter.close()


def test_close_abandons_a_running_hook_and_reports_what_was_not_sent(tmp_path) -> None:
    pids_file = tmp_path / "pids"
    failures = Failures()
    alerter = Alerter(Alerts(command=f"echo $$ >> {pids_file}; exec sleep 1000", min_interval=0), failures, timeout=60)
    try:
        alerter.send(make_event("crash", "error", "running", run_id="r8"))
        assert wait_for(lambda: pids_file.exists() and pids_file.read_text().strip(), timeout=5)
        pid = int(pids_file.read_text())
        alerter.send(make_event("stall", "error", "waiting", run_id="r8"))
        started = time.monotonic()
        alerter.close(timeout=0.2)
        assert time.monotonic() - started < 2.0
        assert wait_for(lambda: gone(pid), timeout=2)
        assert sorted(f["message"] for f in failures) == [
            "alert command failed: abandoned: the alerts were closed before it finished, "
            "its process group killed (event: crash: running)",
            "alert command failed: not sent: the alerts were closed before its turn (event: stall: waiting)",
        ]
    finally:
        alerter.close(timeout=0.1)
        kill_leftovers(pids_file)


