"""What hostile run files cost the supervisor: time per tick and memory.

    .venv/bin/python -m bench.controller.hostile [--ticks 20]

Each scenario appends to a real run directory's metrics.jsonl before every tick,
then does what one supervisor tick does for that run: the real host-side probe
(dflashctl/hosts/remote/probe.py, run by this machine's python as the local transport
runs it), ``parse_probe_host``, ``read_metrics_chunk`` and ``supervisor_core.step``.

    clean        10 good lines per tick (the reference)
    bad-lines    100 bad lines per tick (wrong types, huge numbers, deep nesting)
    10mb-line    one 10 MB line (no newline for 10 MB) then good lines

Prints per scenario: median and max tick time, the peak RSS growth of this
process (VmHWM) over the scenario, and the read position at the end against the
file size (it must always move on). A 150 MB alert hook output is measured by
bench.controller.alerts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from bench.common import vm_hwm_kib
from dflashctl.config import Alerts, Expect, RestartPolicy
from dflashctl.core import contract
from dflashctl.hosts.parsers import read_metrics_chunk
from dflashctl.hosts.probe import ProbeArgs, parse_probe_host, probe_command
from dflashctl.store import Run
from dflashctl.supervise import supervisor_core as core


def good_line(step: int) -> str:
    return contract.Metrics(time=time.time(), step=step, total_steps=10**6, tok_s=1000.0).to_line()


BAD = ['{"v":1,"time":%f,"step":"x","total_steps":1}', '{"v":1,"time":%f,"step":9223372036854775808,"total_steps":1}',
       '{"v":1,"time":%f,"step":1,"total_steps":Infinity}', '{"v":1,"time":%f,"step":1,"tok_s":"fast","total_steps":1}',
       "[" * 5000, "not json at all %f"]


def feed(path: str, scenario: str, tick: int) -> None:
    with open(path, "a") as f:
        if scenario == "bad-lines":
            for i in range(100):
                template = BAD[i % len(BAD)]
                f.write((template % time.time() if "%f" in template else template) + "\n")
        if scenario == "10mb-line" and tick == 0:
            f.write('{"pad": "' + "x" * (10 * 1024 * 1024) + '"}\n')
        for i in range(10):
            f.write(good_line(tick * 10 + i + 1) + "\n")


def run_scenario(scenario: str, ticks: int) -> dict:
    run_dir = tempfile.mkdtemp(prefix=f"bench-hostile-{scenario}-")
    metrics = os.path.join(run_dir, contract.METRICS_FILE)
    open(metrics, "w").close()
    state = core.RunState(run=Run(id="r", playbook="pb", host="local", state="running", created=time.time() - 60,
                                  run_dir=run_dir), args=ProbeArgs(run_dir=run_dir, nvidia_smi=False))
    pol = core.Policy(core.RunPolicy("pb", Expect(), RestartPolicy(), Alerts()), interval=1.0)
    hwm0, times = vm_hwm_kib(), []
    for tick in range(ticks):
        feed(metrics, scenario, tick)
        t0 = time.perf_counter()
        done = subprocess.run(probe_command(sys.executable, [state.args]), capture_output=True, text=True, timeout=60)
        host = parse_probe_host(done.stdout)
        pr = host.runs[0]
        chunk = read_metrics_chunk(pr.metrics_chunk)
        state, writes, actions = core.step(state, core.Probed(pr, 0.0, tuple(chunk.rows), tuple(chunk.rejected)),
                                           time.time(), pol)
        times.append(time.perf_counter() - t0)
    size = os.path.getsize(metrics)
    result = {"scenario": scenario, "ticks": ticks, "median_ms": round(1000 * statistics.median(times), 1),
              "max_ms": round(1000 * max(times), 1), "rss_growth_mib": round((vm_hwm_kib() - hwm0) / 1024, 1),
              "position": state.args.metrics_offset, "file_size": size,
              "stored_step": state.step_max}
    subprocess.run(["rm", "-rf", run_dir])
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ticks", type=int, default=20)
    args = ap.parse_args()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, {os.cpu_count()} cores, "
          f"python {platform.python_version()}")
    results = [run_scenario(s, args.ticks) for s in ("clean", "bad-lines", "10mb-line")]
    for r in results:
        print(f"{r['scenario']:<10} tick median {r['median_ms']:>7.1f} ms  max {r['max_ms']:>7.1f} ms  "
              f"peak RSS +{r['rss_growth_mib']:>5.1f} MiB  position {r['position']}/{r['file_size']}  "
              f"last step {r['stored_step']}")
    print(json.dumps(results))
    return 0 if all(r["position"] == r["file_size"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
