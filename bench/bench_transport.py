"""Transport benchmark on loopback sshd hosts reached through a jump host.

    .venv/bin/python bench/bench_transport.py [--hosts 8] [--repeat 30]

Starts its own test hosts (tests/harness), then measures:

1. fan-out: one command on 1 host, then on N hosts at once, all through the same
   jump, connections already open and reused. Target: N hosts < 2x one host.
   Twice: `hostname` (all CPU: here every "host" shares this machine's cores, so
   N commands cost N times the CPU; the script prints that floor, and the
   client's own CPU per command, which is what a fan-out over real hosts pays
   locally) and `sleep 0.2`
   (waiting, as on real hosts, where the remote work and the network run
   elsewhere: this shows whether the waits overlap).
2. a repeated command on an open, pooled connection versus a fresh OpenSSH
   client process per command (`ssh -F ... node1 CMD`, ProxyJump through the
   jump, so each command pays two handshakes as an ssh one-liner does).
   Target: the reused connection >= 5x cheaper.

Figures are medians in milliseconds. Prints a block to paste into bench/RESULTS.md.
Exit status 0 when the wait-bound fan-out and the reuse targets are met.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dflashctl.transport import Pool, command_line, fanout  # noqa: E402
from tests.harness import SshEnv  # noqa: E402
from tests.harness.sshd import descendants  # noqa: E402


def median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name")), platform.processor())


def cpu_ms(pids: list[int]) -> float:
    """CPU time (user+system, with reaped children) of these processes and their
    descendants: the sshd side of the work."""
    total = 0
    for pid in {p for root in pids for p in [root, *descendants(root)]}:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(x) for x in fields[11:15])
    return total * 1000 / os.sysconf("SC_CLK_TCK")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=8, help="hosts in the fan-out (default 8)")
    parser.add_argument("--repeat", type=int, default=30, help="samples per figure (default 30)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-transport-") as root, SshEnv(root) as env:
        names = env.add_hosts(args.hosts, jump="jump")
        pool = Pool()
        try:
            transports = [pool.get(n, env.inventory) for n in names]
            warm = fanout(transports, lambda t: t.run(["true"]).ok)  # open every connection once
            assert all(v is True for v in warm.values()), warm

            def on(ts, argv):
                results = fanout(ts, lambda t: t.run(argv))
                bad = {n: r for n, r in results.items() if not getattr(r, "ok", False)}
                assert not bad, bad

            figures = {}
            for label, argv in (("hostname", ["hostname"]), ("sleep 0.2", ["sleep", "0.2"])):
                one = median_ms(lambda: on(transports[:1], argv), args.repeat)
                many = median_ms(lambda: on(transports, argv), args.repeat)
                figures[label] = (one, many)

            # CPU per command: this process (the client) and every sshd on the route.
            sshds = [env.sshd_pids["jump"], *(env.sshd_pids[n] for n in names)]
            commands = 10 * len(names)
            before, started = cpu_ms(sshds), time.process_time()
            for _ in range(10):
                on(transports, ["hostname"])
            client_cpu = 1000 * (time.process_time() - started) / commands
            server_cpu = (cpu_ms(sshds) - before) / commands

            node = transports[0]
            reused = median_ms(lambda: node.run(["true"]), args.repeat)
            line = command_line(["true"], timeout=60)  # the very command the transport sends
            ssh = env.ssh_argv(node.name) + [line]
            fresh = median_ms(lambda: subprocess.run(ssh, check=True, stdin=subprocess.DEVNULL), max(5, args.repeat // 3))
        finally:
            pool.close()

    cores = os.cpu_count() or 1
    floor = (client_cpu + server_cpu) * args.hosts / cores
    verdict = lambda ok: "ok" if ok else "MISSED"  # noqa: E731
    rows = []
    for label, (one, many) in figures.items():
        ratio = many / one
        rows.append((f"fan-out `{label}`, 1 host via jump", f"{one:.1f} ms"))
        rows.append((f"fan-out `{label}`, {args.hosts} hosts via jump", f"{many:.1f} ms ({ratio:.2f}x; target < 2x: {verdict(ratio < 2)})"))
    rows.append(("CPU per `hostname`: this client / the sshds", f"{client_cpu:.1f} ms / {server_cpu:.1f} ms"))
    rows.append((f"CPU floor for {args.hosts} hosts sharing {cores} cores", f"{floor:.1f} ms"))
    reuse_ratio = fresh / reused
    rows.append(("`true` on the open pooled connection (via jump)", f"{reused:.1f} ms"))
    rows.append(("`true` with a fresh `ssh` process (ProxyJump)", f"{fresh:.1f} ms ({reuse_ratio:.1f}x; target >= 5x: {verdict(reuse_ratio >= 5)})"))
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print()
    print("markdown for bench/RESULTS.md:")
    print("| measurement | median |")
    print("| --- | --- |")
    for name, value in rows:
        print(f"| {name} | {value} |")
    print(f"\nnproc {cores}, {cpu_model()}, Python {platform.python_version()}, {args.repeat} samples per figure")
    wait_ratio = figures["sleep 0.2"][1] / figures["sleep 0.2"][0]
    return 0 if wait_ratio < 2 and reuse_ratio >= 5 else 1


if __name__ == "__main__":
    sys.exit(main())
