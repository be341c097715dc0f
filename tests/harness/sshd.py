"""Real OpenSSH servers on loopback addresses, for tests and benchmarks.

``SshEnv`` starts one ``sshd -D`` per test host on its own 127.0.0.x address and a
free port, writes a client key, a known_hosts file, an inventory and an
ssh_config for the OpenSSH client, and stops every server it started by pid.

Hosts (``BASE_HOSTS``):

    jump      plain sshd, AllowTcpForwarding yes, LogLevel DEBUG1 (its log shows
              each direct-tcpip forward: the proof of a route)
    jump2     reached through jump; forwards too
    target    through jump; wrapper `pct exec 200 --` (tests/harness/bin/pct),
              fake nvidia-smi on PATH
    target2   through jump -> jump2 (a chain of two)
    direct    no jump, no wrapper
    stranger  direct, but its host key is deliberately NOT in known_hosts
    local     transport: local (this process's machine)

Each host is its own little machine: a directory ``hosts/<name>/`` holding its
sshd_config, host key, log, ``bin/`` (first on the session PATH, via sshd's
SetEnv), ``home/`` ($HOME of its sessions, so the default workdir ``~/dflash``
expands per host, and no user dotfiles run) and ``tmux/`` ($TMUX_TMPDIR, so tmux
servers of different hosts never meet). Only jumps allow TCP forwarding.

Sessions run as the current user (root in CI) with the inventory's ``python`` set to
the interpreter running the tests, so host-side scripts find the same packages.
"""

from __future__ import annotations

import atexit
import getpass
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

SSHD = "/usr/sbin/sshd"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HARNESS_DIR = Path(__file__).resolve().parent
NVIDIA_SMI_CAPTURES = HARNESS_DIR.parent / "fixtures" / "nvidia-smi"
START_TIMEOUT = 10.0


@dataclass(frozen=True)
class HostSpec:
    name: str
    address: str
    jump: str | None = None
    wrapper: str | None = None
    forwarding: bool = False
    fake_gpu: bool = False
    trusted: bool = True  # its host key is in known_hosts


BASE_HOSTS = (
    HostSpec("jump", "127.0.0.2", forwarding=True),
    HostSpec("jump2", "127.0.0.3", jump="jump", forwarding=True),
    HostSpec("target", "127.0.0.4", jump="jump", wrapper="pct exec 200 --", fake_gpu=True),
    HostSpec("target2", "127.0.0.5", jump="jump2"),
    HostSpec("direct", "127.0.0.6"),
    HostSpec("stranger", "127.0.0.7", trusted=False),
)
EXTRA_HOST_BASE = 20  # extra hosts live at 127.0.0.20, .21, ...


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc), deepest last."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


class Server:
    """One sshd for one test host."""

    def __init__(self, spec: HostSpec, root: Path, authorized_keys: Path):
        self.spec = spec
        self.name = spec.name
        self.address = spec.address
        self.port = free_port(spec.address)
        self.dir = root / "hosts" / spec.name
        self.bin = self.dir / "bin"
        self.home = self.dir / "home"
        self.log_path = self.dir / "sshd.log"
        self.config_path = self.dir / "sshd_config"
        self.host_key = self.dir / "host_ed25519"
        self.proc: subprocess.Popen | None = None
        for d in (self.bin, self.home, self.dir / "tmux"):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir / "tmux", 0o700)  # tmux refuses a socket dir others can enter
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", spec.name, "-f", str(self.host_key)], check=True)
        if spec.wrapper:
            (self.bin / "pct").symlink_to(HARNESS_DIR / "bin" / "pct")
        if spec.fake_gpu:
            self._install_fake_nvidia_smi()
        self.config_path.write_text(self._sshd_config(authorized_keys))

    def _install_fake_nvidia_smi(self) -> None:
        shim = self.bin / "nvidia-smi"
        shim.write_text(
            "#!/bin/sh\n"
            f"FAKE_SMI_CAPTURES={shlex.quote(str(NVIDIA_SMI_CAPTURES))} "
            f"FAKE_SMI_MODE_FILE={shlex.quote(str(self.dir / 'fake-smi'))} "
            f"exec {shlex.quote(sys.executable)} {shlex.quote(str(HARNESS_DIR / 'fake_nvidia_smi.py'))} \"$@\"\n"
        )
        shim.chmod(0o755)

    def _sshd_config(self, authorized_keys: Path) -> str:
        env = {
            "PATH": f"{self.bin}:{SYSTEM_PATH}",
            "HOME": str(self.home),
            "TMUX_TMPDIR": str(self.dir / "tmux"),
            "LANG": "C.UTF-8",
        }
        return "\n".join(
            [
                f"ListenAddress {self.address}:{self.port}",
                f"HostKey {self.host_key}",
                f"PidFile {self.dir / 'sshd.pid'}",
                f"AuthorizedKeysFile {authorized_keys}",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                "StrictModes no",
                "PermitRootLogin prohibit-password",
                f"AllowTcpForwarding {'yes' if self.spec.forwarding else 'no'}",
                "AllowStreamLocalForwarding no",
                "X11Forwarding no",
                "MaxStartups 100:30:200",
                # DEBUG1 on jumps: their log names each direct-tcpip forward.
                f"LogLevel {'DEBUG1' if self.spec.forwarding else 'VERBOSE'}",
                "Subsystem sftp internal-sftp",
                "SetEnv " + " ".join(f"{k}={v}" for k, v in env.items()),
                "",
            ]
        )

    # -- lifecycle -------------------------------------------------------------

    def launch(self) -> None:
        """Start sshd (returns at once; ``wait_ready`` waits for it to listen)."""
        assert self.proc is None or self.proc.poll() is not None, f"{self.name}: sshd already running"
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        # -E, not -e: with -e a session's own sshd process would log debug lines
        # into the client's stderr.
        self.proc = subprocess.Popen(
            [SSHD, "-D", "-E", str(self.log_path), "-f", str(self.config_path)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd for {self.name} exited ({self.proc.returncode}):\n{self.log()[-2000:]}")
            if b"Server listening on" in self._log_bytes()[self._log_offset :]:
                return
            time.sleep(0.02)
        raise RuntimeError(f"sshd for {self.name} did not start within {START_TIMEOUT}s:\n{self.log()[-2000:]}")

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def kill_connections(self) -> list[int]:
        """Cut every open connection to this host (SIGKILL its per-connection sshd
        processes, like a dropped link); the listener keeps accepting new ones."""
        if self.pid is None:
            return []
        killed = []
        for pid in descendants(self.pid):
            if _comm(pid) == "sshd":
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
        return killed

    def stop(self) -> None:
        """Take the host down: its open connections and its listener."""
        if self.pid is None:
            return
        self.kill_connections()
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _log_bytes(self) -> bytes:
        try:
            return self.log_path.read_bytes()
        except FileNotFoundError:  # sshd has not written its first line yet
            return b""

    def log(self) -> str:
        return self._log_bytes().decode(errors="replace")


class SshEnv:
    """A fleet of loopback sshd hosts plus the files a client needs to reach them.

    Attributes: ``root`` (the directory of it all), ``inventory_path`` (YAML),
    ``inventory`` (loaded with dflashctl.config.load_inventory), ``hosts`` (the five
    reachable ssh hosts), ``unknown_host`` ('stranger'), ``client_key``,
    ``known_hosts``, ``ssh_config`` (for the OpenSSH client: ``ssh -F``), ``servers``.
    """

    def __init__(self, root: str | os.PathLike, specs: tuple[HostSpec, ...] = BASE_HOSTS):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.client_key = self.root / "client_ed25519"
        self.authorized_keys = self.root / "authorized_keys"
        self.known_hosts = self.root / "known_hosts"
        self.ssh_config = self.root / "ssh_config"
        self.inventory_path = str(self.root / "inventory.yaml")
        self.local_workdir = self.root / "hosts" / "local" / "work"
        self.servers: dict[str, Server] = {}
        self._next_octet = EXTRA_HOST_BASE
        self.inventory = None
        self.hosts = [s.name for s in specs if s.trusted]
        self.unknown_host = next((s.name for s in specs if not s.trusted), None)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "dflashctl-tests", "-f", str(self.client_key)], check=True)
        self.authorized_keys.write_text((self.root / "client_ed25519.pub").read_text())
        self.known_hosts.write_text("")
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
        atexit.register(self.close)  # also when a bench script is interrupted
        try:
            self._add(specs)
        except BaseException:
            self.close()
            raise

    def _add(self, specs) -> None:
        new = [Server(spec, self.root, self.authorized_keys) for spec in specs]
        for server in new:
            self.servers[server.name] = server
            server.launch()
        for server in new:
            server.wait_ready()
        with open(self.known_hosts, "a") as f:
            for server in new:
                if server.spec.trusted:
                    key = (server.dir / "host_ed25519.pub").read_text().split()[:2]
                    f.write(f"[{server.address}]:{server.port} {' '.join(key)}\n")
        self._write_client_files()

    def add_hosts(
        self, n: int, jump: str | None = "jump", wrapper: str | None = None, fake_gpu: bool = False, prefix: str = "node"
    ) -> list[str]:
        """Start ``n`` more hosts (``node1``...), reached through ``jump`` (None: direct),
        optionally inside the fake `pct` wrapper (e.g. 'pct exec 200 --') and with the
        fake nvidia-smi; returns their names. The inventory file and ``inventory``
        are rewritten to include them."""
        first = sum(1 for name in self.servers if name.startswith(prefix)) + 1
        specs = []
        for i in range(first, first + n):
            if self._next_octet > 254:
                raise ValueError("out of loopback addresses for extra hosts")
            specs.append(HostSpec(f"{prefix}{i}", f"127.0.0.{self._next_octet}", jump=jump, wrapper=wrapper, fake_gpu=fake_gpu))
            self._next_octet += 1
        self._add(tuple(specs))
        self.hosts += [s.name for s in specs]
        return [s.name for s in specs]

    # -- client files ----------------------------------------------------------

    def _write_client_files(self) -> None:
        hosts: dict[str, dict] = {"local": {"transport": "local", "workdir": str(self.local_workdir)}}
        for s in self.servers.values():
            h: dict = {"address": s.address, "port": s.port}
            if s.spec.jump:
                h["jump"] = s.spec.jump
            if s.spec.wrapper:
                h["wrapper"] = s.spec.wrapper
            if s.spec.fake_gpu:
                h["gpus"] = 1
            hosts[s.name] = h
        inventory = {
            "defaults": {
                "user": _user(),
                "identity_file": str(self.client_key),
                "known_hosts": str(self.known_hosts),
                "python": sys.executable,
                "connect_timeout": 5,
                "command_timeout": 60,
            },
            "hosts": hosts,
        }
        with open(self.inventory_path, "w") as f:
            f.write("# Written by tests/harness/sshd.py: loopback sshd test hosts.\n")
            yaml.safe_dump(inventory, f, sort_keys=False)
        lines = [
            "Host *",
            f"  User {_user()}",
            f"  IdentityFile {self.client_key}",
            "  IdentitiesOnly yes",
            f"  UserKnownHostsFile {self.known_hosts}",
            "  StrictHostKeyChecking yes",
            "  BatchMode yes",
            "  LogLevel ERROR",
        ]
        for s in self.servers.values():
            lines += [f"Host {s.name}", f"  HostName {s.address}", f"  Port {s.port}"]
            if s.spec.jump:
                lines.append(f"  ProxyJump {s.spec.jump}")
        self.ssh_config.write_text("\n".join(lines) + "\n")
        self.reload()

    def reload(self):
        """Re-read the inventory file (after editing it, or adding hosts)."""
        from dflashctl.config import load_inventory

        self.inventory = load_inventory(self.inventory_path)
        return self.inventory

    # -- per host ----------------------------------------------------------------

    def server(self, name: str) -> Server:
        return self.servers[name]

    @property
    def sshd_pids(self) -> dict[str, int]:
        """{host: pid of its listening sshd} for the hosts that are up."""
        return {name: s.pid for name, s in self.servers.items() if s.pid is not None}

    def stop(self, name: str) -> None:
        """Take a host down (listener and open connections)."""
        self.servers[name].stop()

    def start(self, name: str) -> None:
        """Bring a stopped host back up on the same address and port."""
        server = self.servers[name]
        server.launch()
        server.wait_ready()

    def kill_connections(self, name: str) -> list[int]:
        """Cut the host's open SSH connections (tunnels through a jump die with the
        jump's); returns the pids killed. New connections are accepted."""
        return self.servers[name].kill_connections()

    def log(self, name: str) -> str:
        """The host's sshd log (jumps log each direct-tcpip forward)."""
        return self.servers[name].log()

    def host_dir(self, name: str) -> Path:
        return self.local_workdir.parent if name == "local" else self.servers[name].dir

    def home(self, name: str) -> Path:
        """$HOME of the host's sessions (this machine's for `local`)."""
        return Path.home() if name == "local" else self.servers[name].home

    def workdir(self, name: str) -> Path:
        """The host's workdir as a path on this machine (it is the same machine)."""
        raw = self.inventory.get(name).workdir
        return Path(str(self.home(name)) + raw[1:]) if raw.startswith("~") else Path(raw)

    def set_smi_mode(self, name: str, mode: str) -> None:
        """Switch the host's fake nvidia-smi between the 'idle' and 'load' captures."""
        assert mode in ("idle", "load"), mode
        (self.servers[name].dir / "fake-smi").write_text(mode + "\n")

    def ssh_argv(self, name: str) -> list[str]:
        """OpenSSH client argv reaching ``name`` (jumps via ProxyJump); append a
        command line to it."""
        return ["ssh", "-F", str(self.ssh_config), name]

    def close(self) -> None:
        """Stop every server this object started (by pid)."""
        for server in reversed(list(self.servers.values())):
            server.stop()

    def __enter__(self) -> "SshEnv":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _user() -> str:
    return getpass.getuser()
