"""env-audit benchmark: one audit of a large environment.

    .venv/bin/python -m bench.controller.envaudit [--dists 400] [--record-lines 20000] [--repeat 5]

Builds a real venv (no pip) whose site-packages hold ``--dists`` distributions
written as an installer writes them (files, METADATA with requirements between
them, RECORD with hashes and sizes), one of them a torch whose RECORD lists
``--record-lines`` files, plus files shared by two wheels. Then, ``--repeat``
times, the audit as `dflashctl env-audit` runs it on a host reached through the
local transport, and reports medians of:

- collector: what the host-side script spends (it times itself): reading every
  distribution and checking every RECORD file on disk, find_spec for every
  top-level module, torch's files, ldconfig;
- rules: parsing the answer and every rule, on the controller;
- audit time: the two together, the figure with a target (< 1 s);
- round trip: the whole ``audit_host`` call, with the python start-up on the host
  and the transport (not counted in the target: CLI and interpreter start-up).

Prints a block to paste into bench/RESULTS.md. Exit status 0 when the target is met.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import print_markdown
from dflashctl import envaudit as ea
from dflashctl.hosts.transport import connect
from tests.harness.envs import CUDNN12, Venv, cudnn_files, torch_files, write_dist

TARGET_S = 1.0


def build(root: Path, dists: int, record_lines: int) -> Venv:
    env = Venv(root / "venv")
    torch = torch_files()
    for i in range(record_lines - len(torch) - 4):  # the dist-info's own 4 rows make up the rest
        torch[f"torch/_generated/mod{i // 500}/part{i}.py"] = f"X = {i}\n"
    write_dist(env.site, "torch", "2.7.0+cu126", torch, [f"{CUDNN12[0]}=={CUDNN12[1]}", "sympy>=1.13.3"])
    write_dist(env.site, *CUDNN12, cudnn_files("cudnn-cu12"))
    write_dist(env.site, "sympy", "1.14.0", {"sympy/__init__.py": ""})
    for i in range(dists - 3):
        name = f"pkg-{i:03d}"
        requires = [f"pkg-{(i * 7) % (dists - 3):03d}>=0.1", 'colorama; sys_platform == "win32"']
        files = {f"pkg_{i:03d}/__init__.py": "", f"pkg_{i:03d}/core.py": "def f():\n    return 1\n",
                 f"pkg_{i:03d}/data/table.json": "{}\n"}
        write_dist(env.site, name, f"1.{i % 10}.0", files, requires)
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dists", type=int, default=400)
    parser.add_argument("--record-lines", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-envaudit-") as tmp:
        started = time.monotonic()
        env = build(Path(tmp), args.dists, args.record_lines)
        built = time.monotonic() - started
        inventory = env.inventory(Path(tmp))
        host = inventory.get("box")
        collector, rules, total, round_trip = [], [], [], []
        report = None
        for _ in range(args.repeat):
            t0 = time.monotonic()
            result = connect(host.name, inventory).run(ea.audit_command(host), timeout=120)
            t1 = time.monotonic()
            snapshot = ea.parse_snapshot(result.stdout, "box")
            findings = ea.audit(snapshot)
            t2 = time.monotonic()
            collector.append(snapshot.seconds)
            rules.append(t2 - t1)
            total.append(snapshot.seconds + (t2 - t1))
            round_trip.append(t2 - t0)
            report = (snapshot, findings)
        snapshot, findings = report
        torch = snapshot.owner("torch")

    audit_s = statistics.median(total)
    verdict = "ok" if audit_s < TARGET_S else "MISSED"
    print("## env-audit: one audit of a large environment (`bench.controller.envaudit`)\n")
    print(f"Command: `.venv/bin/python -m bench.controller.envaudit --dists {args.dists} --record-lines "
          f"{args.record_lines} --repeat {args.repeat}` (medians of {args.repeat} audits).\n")
    print(f"Date: {time.strftime('%a %b %d %H:%M UTC %Y', time.gmtime())}. Hardware: {os.cpu_count()} CPU(s), "
          f"{platform.platform()}, Python {platform.python_version()}; load average "
          f"{os.getloadavg()[0]:.1f}. Environment built in {built:.1f} s: {len(snapshot.dists)} distributions "
          f"(torch's RECORD: {torch.files} lines), {len(snapshot.modules)} modules looked up, "
          f"{sum(d.files or 0 for d in snapshot.dists)} RECORD files checked; {len(findings)} finding(s).\n")
    print_markdown([
        ("collector on the host (RECORDs, find_spec, torch, ldconfig)", f"{statistics.median(collector) * 1000:.0f} ms"),
        ("parse + every rule on the controller", f"{statistics.median(rules) * 1000:.0f} ms"),
        ("audit time (the two)", f"{audit_s * 1000:.0f} ms (target < {TARGET_S * 1000:.0f} ms: {verdict})"),
        ("round trip (python start-up and transport included)", f"{statistics.median(round_trip) * 1000:.0f} ms"),
    ])
    return 0 if verdict == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
