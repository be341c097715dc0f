"""Transport benchmark on loopback sshd hosts reached through a jump host.

    .venv/bin/python -m bench.controller.transport [--hosts 16] [--repeat 30] [--keepalive 1]

Starts its own test hosts (tests/harness), then measures:

1. fan-out: one command on 1 host, then on N hosts at once (a supervisor tick
   polls every host once), all through the same jump, connections already open
   and reused; with SSH keepalives off, then on (every ``--keepalive`` seconds on
   every connection, jump included). Target: N hosts < 2x one host.
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
3. a wedged connection (its sshd process SIGSTOPped, TCP still up): how long the
   next command takes, direct and through the wedged jump, and how much of that
   is the reconnection itself (the rest is ``connect_timeout``, the wait that
   tells a wedged connection from a slow one; ``--wedge-timeout``).

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

import yaml

from bench.common import cpu_model, cpu_ms, median_ms, print_markdown, ssh_hosts
from dflashctl.hosts.transport import Pool, command_line, fanout


def set_defaults(env, **values) -> None:
    """Change the test inventory's `defaults:` (every host), then reload it."""
    with open(env.inventory_path) as f:
        raw = yaml.safe_load(f)
    raw["defaults"].update(values)
    with open(env.inventory_path, "w") as f:
        yaml.safe_dump(raw, f, sort_keys=False)
    env.reload()


def wedged_ms(env, transport, wedged, server: str, repeat: int) -> list[float]:
    """How long a command takes on ``transport`` right after ``server``'s side of
    ``wedged``'s connection (``transport`` itself, or its jump) is SIGSTOPped."""
    times = []
    for _ in range(repeat):
        transport.run(["true"])
        frozen = env.freeze_connection(server, wedged.ssh_transport().sock.getsockname()[1])
        assert frozen, f"no sshd process to freeze on {server}"
        try:
            started = time.perf_counter()
            result = transport.run(["true"])
            times.append((time.perf_counter() - started) * 1000)
            assert result.notes, "the wedge went unnoticed"
        finally:
            env.thaw(frozen)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=16, help="hosts in the fan-out (default 16)")
    parser.add_argument("--repeat", type=int, default=30, help="samples per figure (default 30)")
    parser.add_argument("--keepalive", type=float, default=1.0, help="seconds between keepalives when on (default 1)")
    parser.add_argument("--wedge-timeout", type=float, default=1.0,
                        help="connect_timeout for the wedged-connection figures (default 1)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-transport-") as root, ssh_hosts(root) as env:
        names = env.add_hosts(args.hosts, jump="jump")

        def on(ts, argv):
            results = fanout(ts, lambda t: t.run(argv))
            bad = {n: r for n, r in results.items() if not getattr(r, "ok", False)}
            assert not bad, bad

        figures = {}
        for keepalive in (0.0, args.keepalive):
            set_defaults(env, keepalive=keepalive)
            pool = Pool()
            try:
                transports = [pool.get(n, env.inventory) for n in names]
                warm = fanout(transports, lambda t: t.run(["true"]).ok)  # open every connection once
                assert all(v is True for v in warm.values()), warm
                for label, argv in (("hostname", ["hostname"]), ("sleep 0.2", ["sleep", "0.2"])):
                    one = median_ms(lambda: on(transports[:1], argv), args.repeat)
                    many = median_ms(lambda: on(transports, argv), args.repeat)
                    figures[(label, keepalive)] = (one, many)
            finally:
                pool.close()

        pool = Pool()
        try:
            transports = [pool.get(n, env.inventory) for n in names]
            on(transports, ["true"])

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

        # Wedged connections, each on a pool of its own.
        set_defaults(env, keepalive=args.keepalive, connect_timeout=args.wedge_timeout)
        samples = max(3, args.repeat // 6)
        wedge = {}
        for label, name, server in (("direct", "direct", "direct"), ("via a wedged jump", names[0], "jump")):
            pool = Pool()
            try:
                transport = pool.get(name, env.inventory)
                wedged = pool.get(server, env.inventory)
                times = wedged_ms(env, transport, wedged, server, samples)
            finally:
                pool.close()
            wedge[label] = statistics.median(times)

    cores = os.cpu_count() or 1
    floor = (client_cpu + server_cpu) * args.hosts / cores
    verdict = lambda ok: "ok" if ok else "MISSED"  # noqa: E731
    rows = []
    for (label, keepalive), (one, many) in figures.items():
        ratio = many / one
        ka = f"keepalive every {keepalive:g}s" if keepalive else "keepalive off"
        rows.append((f"fan-out `{label}`, 1 host via jump, {ka}", f"{one:.1f} ms"))
        rows.append((f"fan-out `{label}`, {args.hosts} hosts via jump, {ka}",
                     f"{many:.1f} ms ({ratio:.2f}x; target < 2x: {verdict(ratio < 2)})"))
    rows.append(("CPU per `hostname`: this client / the sshds", f"{client_cpu:.1f} ms / {server_cpu:.1f} ms"))
    rows.append((f"CPU floor for {args.hosts} hosts sharing {cores} cores", f"{floor:.1f} ms"))
    reuse_ratio = fresh / reused
    rows.append(("`true` on the open pooled connection (via jump)", f"{reused:.1f} ms"))
    rows.append(("`true` with a fresh `ssh` process (ProxyJump)", f"{fresh:.1f} ms ({reuse_ratio:.1f}x; target >= 5x: {verdict(reuse_ratio >= 5)})"))
    waited = args.wedge_timeout * 1000
    # Through a wedged jump, two waits: the target's session request, then the tunnel through the jump.
    for label, total in wedge.items():
        waits = 2 if "jump" in label else 1
        rows.append((f"`true` right after its connection wedged, {label} (connect_timeout {args.wedge_timeout:g}s)",
                     f"{total:.1f} ms ({waits} x {waited:.0f} ms waiting + {total - waits * waited:.1f} ms reconnecting)"))
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print()
    print("markdown for bench/RESULTS.md:")
    print_markdown(rows)
    print(f"\nnproc {cores}, {cpu_model()}, Python {platform.python_version()}, {args.repeat} samples per figure")
    wait_ratio = figures[("sleep 0.2", args.keepalive)][1] / figures[("sleep 0.2", args.keepalive)][0]
    return 0 if wait_ratio < 2 and reuse_ratio >= 5 else 1


if __name__ == "__main__":
    sys.exit(main())
