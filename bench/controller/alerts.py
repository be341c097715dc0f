"""Alert hook benchmark: what hostile hooks cost the supervisor's process.

    .venv/bin/python -m bench.controller.alerts [--mb 150] [--deadline 3] [--burst 100]

Each scenario runs in a fresh interpreter (so its peak RSS, VmHWM, is its own) with
a real command hook or a real HTTP server on 127.0.0.1:

1. big output: a command hook printing ``--mb`` MB on stdout (and a few MB on
   stderr, then failing): wall time to deliver, peak RSS growth of the process,
   length of the stored failure message. Target: growth < 50 MiB.
2. trickle: a webhook answering one byte a second, hook deadline ``--deadline``
   seconds: time until the failure is reported, then time for the next alert to a
   good server to arrive. Target: failure within deadline + 1 s.
3. burst: ``--burst`` alerts sent at once to a good webhook and a command hook:
   the caller's time per ``send`` (max and median), time until all are delivered.
   Then the same burst against a webhook that never answers: ``send`` still
   returns at once, and ``close(0.5)`` ends in bounded time with every alert
   reported as a failure.

A scenario that does not finish within ``--limit`` seconds is reported as such
(the alert code under test blocked). Prints one line per figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from bench.common import REPO, vm_hwm_kib
from dflashctl.config import Alerts
from dflashctl.supervise.alerts import Alerter, make_event


def serve(mode: dict) -> tuple[ThreadingHTTPServer, str, list]:
    """A loopback webhook: ``mode['answer']`` is ok, trickle (a byte a second) or
    silent (reads the request, never answers)."""
    received: list = []
    stop = mode.setdefault("stop", threading.Event())

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            received.append(time.monotonic())
            try:
                if mode["answer"] == "ok":
                    self.send_response(200)
                    self.end_headers()
                elif mode["answer"] == "trickle":
                    self.send_response(200)
                    self.send_header("Content-Length", "100000")
                    self.end_headers()
                    while not stop.wait(1.0):
                        self.wfile.write(b"x")
                        self.wfile.flush()
                else:
                    stop.wait()
            except OSError:
                pass

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="bench-webhook", daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}/hook", received


# --------------------------------------------------------------------------- scenarios (child side)


def big_output(args) -> dict:
    failures: list = []
    command = (f"head -c {args.mb * 1_000_000} /dev/zero; yes 'noise on stderr' | head -c 5000000 >&2; "
               "echo 'mail: relay down' >&2; exit 4")
    alerter = Alerter(Alerts(command=command), failures.append, timeout=max(60.0, args.limit))
    before = vm_hwm_kib()
    started = time.monotonic()
    alerter.send(make_event("crash", "error", "big output"))
    delivered = alerter.flush(args.limit)
    took = time.monotonic() - started
    growth = vm_hwm_kib() - before
    alerter.close(0.5)
    return {"delivered": delivered, "seconds": took, "rss_growth_mib": growth / 1024,
            "failure_message_chars": max((len(f["message"]) for f in failures), default=0)}


def trickle(args) -> dict:
    mode = {"answer": "trickle"}
    server, url, received = serve(mode)
    failures: list = []
    alerter = Alerter(Alerts(webhook=url, min_interval=0), failures.append, timeout=args.deadline)
    started = time.monotonic()
    alerter.send(make_event("crash", "error", "trickled"))
    while not failures and time.monotonic() - started < args.limit:
        time.sleep(0.01)
    failed_after = time.monotonic() - started if failures else None
    mode["answer"] = "ok"
    sent = time.monotonic()
    alerter.send(make_event("crash", "error", "next"))
    delivered = alerter.flush(args.limit)
    next_took = time.monotonic() - sent
    mode["stop"].set()
    alerter.close(0.5)
    server.shutdown()
    return {"failure_reported_s": failed_after, "next_alert_delivered": delivered, "next_alert_s": next_took,
            "failure": failures[0]["detail"]["error"] if failures else None}


def burst(args) -> dict:
    mode = {"answer": "ok"}
    server, url, received = serve(mode)
    failures: list = []
    alerter = Alerter(Alerts(webhook=url, command="cat > /dev/null", min_interval=0), failures.append,
                      timeout=args.deadline)
    before = vm_hwm_kib()
    send_s, statuses = [], []
    started = time.monotonic()
    for i in range(args.burst):
        t = time.perf_counter()
        statuses.append(alerter.send(make_event(f"kind{i}", "error", f"alert {i}", run_id="bench")))
        send_s.append(time.perf_counter() - t)
    delivered = alerter.flush(args.limit)
    all_took = time.monotonic() - started
    alerter.close(0.5)
    good = {"send_max_ms": max(send_s) * 1000, "send_median_us": statistics.median(send_s) * 1e6,
            "queued": statuses.count("queued"), "all_delivered": delivered, "all_delivered_s": all_took,
            "webhook_received": len(received), "failures": len(failures),
            "rss_growth_mib": (vm_hwm_kib() - before) / 1024}

    mode["answer"] = "silent"
    failures = []
    alerter = Alerter(Alerts(webhook=url, min_interval=0), failures.append, timeout=args.deadline)
    send_s = []
    for i in range(args.burst):
        t = time.perf_counter()
        alerter.send(make_event(f"kind{i}", "error", f"alert {i}", run_id="bench"))
        send_s.append(time.perf_counter() - t)
    t = time.monotonic()
    alerter.close(0.5)
    close_s = time.monotonic() - t
    mode["stop"].set()
    server.shutdown()
    hung = {"send_max_ms": max(send_s) * 1000, "close_s": close_s, "failures_reported": len(failures)}
    return {"good": good, "hung_webhook": hung}


SCENARIOS = {"big_output": big_output, "trickle": trickle, "burst": burst}


# --------------------------------------------------------------------------- driver


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=150, help="MB the big-output hook prints")
    parser.add_argument("--deadline", type=float, default=3.0, help="hook deadline (s) for trickle and burst")
    parser.add_argument("--burst", type=int, default=100, help="alerts in the burst")
    parser.add_argument("--limit", type=float, default=60.0,
                        help="seconds a scenario may take before it counts as blocked")
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), help=argparse.SUPPRESS)  # the child's side
    args = parser.parse_args()
    if args.scenario:
        print(json.dumps(SCENARIOS[args.scenario](args)))
        return 0

    ok = True
    for name in SCENARIOS:
        argv = [sys.executable, "-m", "bench.controller.alerts", "--scenario", name, "--mb", str(args.mb),
                "--deadline", str(args.deadline), "--burst", str(args.burst), "--limit", str(args.limit)]
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=3 * args.limit + 30, cwd=REPO)
        except subprocess.TimeoutExpired:
            print(f"{name}: did not finish within {3 * args.limit + 30:.0f}s (blocked)")
            ok = False
            continue
        if p.returncode != 0:
            print(f"{name}: failed\n{p.stderr[-2000:]}")
            ok = False
            continue
        figures = json.loads(p.stdout.strip().splitlines()[-1])
        for key, value in _flat(figures):
            print(f"{name}.{key}: {_fmt(value)}")
        if name == "big_output":
            ok &= figures["delivered"] and figures["rss_growth_mib"] < 50
        elif name == "trickle":
            ok &= figures["failure_reported_s"] is not None and figures["failure_reported_s"] < args.deadline + 1
            ok &= bool(figures["next_alert_delivered"])
        else:
            ok &= figures["good"]["all_delivered"] and figures["hung_webhook"]["close_s"] < 3
    print("targets met" if ok else "targets NOT met")
    return 0 if ok else 1


def _flat(d: dict, prefix: str = ""):
    for key, value in d.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _fmt(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    sys.exit(main())
