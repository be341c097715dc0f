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
    lxc       direct; wrapper `lxc-attach -n ct300 --` (tests/harness/bin/lxc-attach)
              enters a long-lived pid+mount+UTS namespace that the harness holds
              (a reaping init started with `unshare --pid --fork --mount-proc`),
              so processes started through it outlive the call, as in a real
              LXC container
    fresh     direct; wrapper `docker run --rm ct-fresh` (tests/harness/bin/docker)
              runs each call in a NEW pid namespace: everything it started dies
              when the call returns (the wrapper `check` must refuse)
    aliased   NOT in the inventory: reached through a ~/.ssh/config alias with
              ProxyJump through jump (``write_ssh_home``)
    local     transport: local (this process's machine)

Each host is its own little machine: a directory ``hosts/<name>/`` holding its
sshd_config, host key, log, ``bin/`` (first on the session PATH, via sshd's
SetEnv), ``home/`` ($HOME of its sessions, so the default workdir ``~/dflash``
expands per host, and no user dotfiles run) and ``tmux/`` ($TMUX_TMPDIR, so tmux
servers of different hosts never meet). Only jumps allow TCP forwarding.

Sessions run as the current user (root in CI) with the inventory's ``python`` set to
the interpreter running the tests, so host-side scripts find the same packages.

A wedged connection (the server's session process stops answering, TCP still up)
is ``freeze_connection``: SIGSTOP to the per-connection sshd processes that hold
one client's TCP connection (found by its port, through /proc), SIGCONT to thaw.
Everything is started on 127.0.0.x and stopped by pid.
"""

from __future__ import annotations

import atexit
import getpass
import os
import random
import shlex
import shutil
import signal
import socket
import struct
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
    container: str | None = None  # 'lxc': a long-lived namespace the wrapper enters
    in_inventory: bool = True  # False: reached only through ~/.ssh/config (write_ssh_home)


CONTAINER = "ct300"  # the name `lxc-attach -n` takes on the lxc host
FRESH_IMAGE = "ct-fresh"  # the image (and hostname) of the fresh host's `docker run --rm`
ALIAS = "gpu-alias"  # the ~/.ssh/config alias of the aliased host
ALIAS_JUMP = "gw"  # the ~/.ssh/config alias of jump

BASE_HOSTS = (
    HostSpec("jump", "127.0.0.2", forwarding=True),
    HostSpec("jump2", "127.0.0.3", jump="jump", forwarding=True),
    HostSpec("target", "127.0.0.4", jump="jump", wrapper="pct exec 200 --", fake_gpu=True),
    HostSpec("target2", "127.0.0.5", jump="jump2"),
    HostSpec("direct", "127.0.0.6"),
    HostSpec("stranger", "127.0.0.7", trusted=False),
    HostSpec("aliased", "127.0.0.9", in_inventory=False),
    HostSpec("lxc", "127.0.0.10", wrapper=f"lxc-attach -n {CONTAINER} --", container="lxc"),
    HostSpec("fresh", "127.0.0.11", wrapper=f"docker run --rm {FRESH_IMAGE}"),
)
EXTRA_HOST_BASE = 20  # extra hosts live at 127.0.0.20, .21, ...


# Where free_port looks: below the kernel's ephemeral range (what bind(0) and every
# outgoing connection are given), so that no connection of another test takes the port
# between this check and the bind of the process it is meant for.
PORTS_FROM = 20000
_RANDOM = random.SystemRandom()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(address: str) -> int:
    """A port on ``address`` that nothing holds now, for a process started next to bind.
    Chosen at random below the ephemeral range: a port that bind(0) gives comes from that
    range, where any outgoing connection (another test's ssh, a rendezvous client) may be
    given it before the process binds it (seen as EADDRINUSE on a loaded machine)."""
    low = _ephemeral_low()
    for _ in range(100 if low - PORTS_FROM > 1000 else 0):
        # Not the module's generator: a test that seeds it would hand two callers one port.
        port = _RANDOM.randrange(PORTS_FROM, low)
        try:
            # Free on every address (what a rendezvous binds), not only on ``address``: no
            # listen, so nothing is reachable through it.
            for where in (address, ""):
                with socket.socket() as s:
                    s.bind((where, port))
        except OSError:
            continue
        return port
    with socket.socket() as s:  # no room below the range: the kernel's choice
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


# Per-connection server processes: `sshd` up to OpenSSH 9.7, `sshd-session` after.
SSHD_COMMS = ("sshd", "sshd-session")


def _socket_inodes(address: str, port: int, peer_port: int | None) -> set[int]:
    """Inodes of the TCP sockets at address:port (from /proc/net/tcp), only those
    connected from ``peer_port`` when given."""
    found = set()
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            local, remote, inode = fields[1], fields[2], int(fields[9])
            l_ip, l_port = local.split(":")
            r_port = int(remote.split(":")[1], 16)
            if (socket.inet_ntoa(struct.pack("<I", int(l_ip, 16))), int(l_port, 16)) != (address, port):
                continue
            if r_port == 0 or (peer_port is not None and r_port != peer_port):
                continue  # the listening socket, or another client's connection
            found.add(inode)
    return found


def _holds_socket(pid: int, inodes: set[int]) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and int(target[8:-1]) in inodes:
            return True
    return False


# The init of a test container: pid 1 of its namespace, reaping every orphan that
# the namespace's processes leave (as a real container's init does).
_CONTAINER_INIT = """\
import os, time
while True:
    try:
        os.wait()
    except ChildProcessError:
        time.sleep(0.5)
"""


class Container:
    """A long-lived pid + mount + UTS namespace (hostname ``name``) held by a reaping
    init; ``pid`` is that init's pid here, which `nsenter -t PID` enters."""

    def __init__(self, name: str, pid_file: Path):
        self.name = name
        self.pid_file = pid_file
        self.proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", "--uts",
             "sh", "-c", 'hostname "$0" && exec "$1" -c "$2"', name, sys.executable, _CONTAINER_INIT],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        )
        self.pid = self._init_pid()
        pid_file.write_text(f"{self.pid}\n")

    def _init_pid(self) -> int:
        mine = os.readlink("/proc/self/ns/pid")
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"container {self.name} did not start: {self.proc.stderr.read().decode()[-2000:]}")
            for pid in descendants(self.proc.pid):
                try:
                    if os.readlink(f"/proc/{pid}/ns/pid") != mine and _comm(pid).startswith("python"):
                        return pid
                except OSError:
                    pass
            time.sleep(0.02)
        raise RuntimeError(f"container {self.name}: no init within {START_TIMEOUT}s")

    def stop(self) -> None:
        """End the namespace: killing its init kills every process in it."""
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.pid_file.unlink(missing_ok=True)


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
        self.container: Container | None = None
        for d in (self.bin, self.home, self.dir / "tmux"):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir / "tmux", 0o700)  # tmux refuses a socket dir others can enter
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", spec.name, "-f", str(self.host_key)], check=True)
        if spec.wrapper:
            tool = shlex.split(spec.wrapper)[0]
            (self.bin / tool).symlink_to(HARNESS_DIR / "bin" / tool)
        if spec.fake_gpu:
            self._install_fake_nvidia_smi()
        if spec.container == "lxc":
            # Outlives sshd restarts (stop/start), as a container outlives its host's sshd.
            self.container = Container(CONTAINER, self.dir / f"{CONTAINER}.pid")
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
            "FAKE_CT_DIR": str(self.dir),  # where the fake lxc-attach finds a container's init pid
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

    def connection_pids(self, client_port: int | None = None) -> list[int]:
        """The per-connection sshd processes serving the TCP connection from
        ``client_port`` (every connection's when None)."""
        if self.pid is None:
            return []
        sessions = [pid for pid in descendants(self.pid) if _comm(pid) in SSHD_COMMS]
        if client_port is None:
            return sessions
        inodes = _socket_inodes(self.address, self.port, client_port)
        return [pid for pid in sessions if _holds_socket(pid, inodes)]

    def kill_connections(self) -> list[int]:
        """Cut every open connection to this host (SIGKILL its per-connection sshd
        processes, like a dropped link); the listener keeps accepting new ones."""
        if self.pid is None:
            return []
        killed = []
        for pid in descendants(self.pid):
            if _comm(pid) in SSHD_COMMS:
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
        # The listener is frozen first: a connection it accepted between the sweep of its
        # per-connection processes and its own exit would outlive it (they survive their
        # listener), and the host would stay reachable through that one connection.
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.kill_connections()
        self.proc.kill()  # SIGKILL ends a stopped process too; its backlog is refused
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
        self.hosts = [s.name for s in specs if s.trusted and s.in_inventory]
        self.unknown_host = next((s.name for s in specs if not s.trusted), None)
        self.aliased_host = next((s.name for s in specs if not s.in_inventory), None)
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
            if not s.spec.in_inventory:
                continue
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

    def freeze_connection(self, name: str, client_port: int | None = None) -> list[int]:
        """Wedge an open connection: SIGSTOP the sshd processes serving the one from
        ``client_port`` (all of the host's when None). TCP stays up, the kernel still
        ACKs, the server answers nothing; new connections are served. Returns the
        pids, for ``thaw``."""
        pids = self.servers[name].connection_pids(client_port)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        return pids

    @staticmethod
    def thaw(pids: list[int]) -> None:
        """SIGCONT what ``freeze_connection`` stopped."""
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def container_pid(self, name: str) -> int:
        """The host pid of the init of ``name``'s container (the lxc host's)."""
        return self.servers[name].container.pid

    def write_ssh_home(self, home: str | os.PathLike) -> Path:
        """A $HOME whose ~/.ssh holds what a user who reaches the aliased host with
        `ssh gpu-alias` has: a config with ``Host gw`` (jump) and ``Host gpu-alias``
        (HostName, User, Port, IdentityFile, ProxyJump gw, ServerAliveInterval 7,
        ConnectTimeout 4), and a chain: ``Host j2`` (jump2) and ``Host chained``
        (target2, ProxyJump gw,j2); their keys in ~/.ssh/known_hosts and the client
        key as ~/.ssh/id_ed25519. Returns ``home``."""
        home = Path(home)
        ssh = home / ".ssh"
        ssh.mkdir(parents=True, exist_ok=True, mode=0o700)
        key = ssh / "id_ed25519"
        shutil.copyfile(self.client_key, key)
        key.chmod(0o600)
        jump, aliased = self.servers["jump"], self.servers[self.aliased_host]
        jump2, target2 = self.servers["jump2"], self.servers["target2"]

        def entry(alias: str, server: Server, *extra: str) -> str:
            lines = [f"Host {alias}", f"  HostName {server.address}", f"  Port {server.port}", f"  User {_user()}",
                     "  IdentityFile ~/.ssh/id_ed25519", *(f"  {line}" for line in extra)]
            return "\n".join(lines) + "\n"

        (ssh / "config").write_text(
            entry(ALIAS_JUMP, jump)
            + entry(ALIAS, aliased, f"ProxyJump {ALIAS_JUMP}", "ServerAliveInterval 7", "ConnectTimeout 4")
            + entry("j2", jump2)
            + entry("chained", target2, f"ProxyJump {ALIAS_JUMP},j2")
        )
        lines = []
        for server in (jump, aliased, jump2, target2):
            key_type, blob = (server.dir / "host_ed25519.pub").read_text().split()[:2]
            lines.append(f"[{server.address}]:{server.port} {key_type} {blob}\n")
        (ssh / "known_hosts").write_text("".join(lines))
        return home

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
        """Stop every server and container this object started (by pid)."""
        for server in reversed(list(self.servers.values())):
            server.stop()
            if server.container is not None:
                server.container.stop()

    def __enter__(self) -> "SshEnv":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _user() -> str:
    return getpass.getuser()
