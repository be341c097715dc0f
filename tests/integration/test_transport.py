"""Transport against real OpenSSH servers on loopback (see tests/harness)."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import fabric
import paramiko
import pytest

from dflashctl.config import Inventory
from dflashctl.core.errors import CommandTimeout, TransportError, UnreachableError
from dflashctl.hosts.transport import (
    KILL_AFTER,
    LocalTransport,
    Pool,
    Result,
    SSHTransport,
    connect,
    fanout,
)
from tests.harness import free_port
from tests.harness.hostile import HOSTILE

ECHO_ARGV = "import json, sys; sys.stdout.write(json.dumps(sys.argv[1:]))"
ROUTED = ["local", "direct", "jump2", "target", "target2"]


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def variant(ssh_env, base: str, **changes):
    """A copy of an inventory host with some settings changed."""
    return ssh_env.inventory.get(base).model_copy(update=changes)


# --------------------------------------------------------------------------- argv arrives intact


@pytest.mark.parametrize("name", ROUTED)
def test_hostile_argv_arrives_byte_exact(ssh_env, name):
    t = connect(name, ssh_env.inventory)
    printed = t.run(["printf", "%s\\0", *HOSTILE])
    assert printed.stdout_bytes.split(b"\0")[:-1] == [a.encode() for a in HOSTILE]
    # The same through the host's python: sys.argv is what we sent.
    assert json.loads(t.run_script(ECHO_ARGV, HOSTILE).stdout) == HOSTILE


def test_target_runs_inside_the_container_wrapper_through_the_jump(ssh_env):
    t = connect("target", ssh_env.inventory)
    assert t.describe_route() == "jump -> target [pct exec 200 --]"
    assert t.run(["hostname"]).stdout.strip() == "ct200"  # set by the fake pct's namespace
    target = ssh_env.server("target")
    assert f"target {target.address} port {target.port}" in ssh_env.log("jump")


def test_jump_chain_of_two_forwards_through_both_jumps(ssh_env):
    t = connect("target2", ssh_env.inventory)
    assert t.describe_route() == "jump -> jump2 -> target2"
    assert t.run(["sh", "-c", "echo $HOME"]).stdout.strip() == str(ssh_env.home("target2"))
    jump2, target2 = ssh_env.server("jump2"), ssh_env.server("target2")
    assert f"target {jump2.address} port {jump2.port}" in ssh_env.log("jump")
    assert f"target {target2.address} port {target2.port}" in ssh_env.log("jump2")
    assert "direct-tcpip" not in ssh_env.log("target2")


def test_only_jump_hosts_forward_tcp(ssh_env):
    direct = connect("direct", ssh_env.inventory)
    direct.run(["true"])
    jump = ssh_env.server("jump")
    with pytest.raises(paramiko.ChannelException) as caught:
        direct.ssh_transport().open_channel("direct-tcpip", (jump.address, jump.port), ("127.0.0.1", 0), timeout=5)
    assert caught.value.code == paramiko.OPEN_FAILED_ADMINISTRATIVELY_PROHIBITED


def test_env_values_and_cwd_are_not_interpreted(ssh_env):
    t = connect("target", ssh_env.inventory)
    weird = "$(echo no) `no` 'q' \"dq\" \n ü"
    r = t.run(["sh", "-c", 'printf %s "$WEIRD"'], env={"WEIRD": weird})
    assert r.stdout == weird
    home = ssh_env.home("target")
    (home / "a dir $(x)").mkdir(exist_ok=True)
    assert t.run(["pwd"], cwd="~/a dir $(x)").stdout.strip() == f"{home}/a dir $(x)"
    assert t.run(["pwd"], cwd="~").stdout.strip() == str(home)
    with pytest.raises(TransportError, match="can't cd"):
        t.run(["pwd"], cwd="/no/such/dir")


def test_inventory_env_is_applied_and_call_env_wins(ssh_env):
    host = variant(ssh_env, "direct", name="direct-env", env={"A": "from inventory", "B": "inv"})
    with SSHTransport(host, ssh_env.inventory, pool=Pool()) as t:
        r = t.run(["sh", "-c", 'echo "$A|$B"'], env={"B": "call"})
    assert r.stdout.strip() == "from inventory|call"


# --------------------------------------------------------------------------- stdin


@pytest.mark.parametrize("name", ["local", "target"])
def test_stdin_bytes_arrive_exactly_then_eof(ssh_env, name):
    data = os.urandom(3 * 1024 * 1024) + bytes(range(256))
    t = connect(name, ssh_env.inventory)
    assert t.run(["cat"], input=data).stdout_bytes == data
    assert t.run(["sha256sum"], input=data).stdout.split()[0] == hashlib.sha256(data).hexdigest()
    # Without input, stdin is empty (never this process's stdin): cat ends at once.
    assert t.run(["cat"], timeout=10).stdout_bytes == b""


def _arguments_holding(needle: bytes, until: threading.Event) -> list[str]:
    """Every process of this machine (the loopback hosts' too) whose arguments held
    ``needle`` while ``until`` was not set: what a host's ``ps`` shows every user."""
    seen = []
    while not until.is_set():
        for pid in os.listdir("/proc"):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if needle in f.read():
                        seen.append(pid)
            except OSError:
                continue
        time.sleep(0.01)
    return seen


@pytest.mark.parametrize("name", ["local", "target"])
def test_env_values_travel_on_stdin_never_in_any_process_arguments(ssh_env, name):
    secret = f"tok-{os.urandom(8).hex()}"
    t = connect(name, ssh_env.inventory)
    done = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        watcher = pool.submit(_arguments_holding, secret.encode(), done)
        try:
            r = t.run(["sh", "-c", 'printf "%s|" "$TOKEN"; sleep 1; cat'], env={"TOKEN": secret}, input=b"own\n\ninput\n")
        finally:
            done.set()
        seen = watcher.result()
    # The command had the value and all of its own stdin, blank line included; no process's arguments held it.
    assert r.stdout == f"{secret}|own\n\ninput\n" and seen == []
    assert secret not in r.command


@pytest.mark.parametrize("name", ["local", "target"])
def test_stdout_goes_to_a_sink_as_it_arrives_and_a_full_sink_ends_the_command(ssh_env, name):
    t = connect(name, ssh_env.inventory)
    data = os.urandom(2 * 1024 * 1024)
    pieces: list[bytes] = []
    result = t.run(["cat"], input=data, stdout_sink=lambda chunk: pieces.append(chunk) is None)
    assert b"".join(pieces) == data and result.stdout_bytes == b"" and len(pieces) > 1
    taken = [0]

    def up_to_1mib(chunk: bytes) -> bool:
        taken[0] += len(chunk)
        return taken[0] <= 1 << 20

    started = time.monotonic()
    result = t.run(["sh", "-c", "exec cat /dev/zero"], timeout=60, check=False, stdout_sink=up_to_1mib)
    assert result.exit_code != 0 and time.monotonic() - started < 20  # ended at once, not at the timeout
    assert taken[0] < 4 << 20


# --------------------------------------------------------------------------- failures carry data


def test_failed_command_carries_host_command_exit_code_and_stderr(ssh_env):
    t = connect("target", ssh_env.inventory)
    with pytest.raises(TransportError) as caught:
        t.run(["sh", "-c", "echo first >&2; echo the-cause >&2; exit 3"])
    e = caught.value
    assert (e.host, e.remote_exit_code) == ("target", 3)
    assert "the-cause" in e.stderr_tail and "echo first" in e.command
    r = t.run(["sh", "-c", "exit 4"], check=False)
    assert isinstance(r, Result) and (r.exit_code, r.ok) == (4, False)


@pytest.mark.parametrize("name", ["local", "target"])
def test_timeout_kills_the_command_on_the_host(ssh_env, tmp_path, name):
    pid_file = tmp_path / "pid"
    t = connect(name, ssh_env.inventory)
    started = time.monotonic()
    with pytest.raises(CommandTimeout) as caught:
        t.run(["sh", "-c", 'echo $$ > "$1"; exec sleep 60', "sh", str(pid_file)], timeout=1)
    assert time.monotonic() - started < 1 + KILL_AFTER + 3
    assert "killed on the host" in str(caught.value)
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(pid)


@pytest.mark.parametrize("name", ["local", "direct"])
def test_timeout_kills_a_command_that_ignores_sigterm(ssh_env, tmp_path, name):
    pid_file = tmp_path / "pid"
    t = connect(name, ssh_env.inventory)
    with pytest.raises(CommandTimeout):
        t.run(["sh", "-c", 'trap "" TERM; echo $$ > "$1"; while :; do sleep 0.2; done', "sh", str(pid_file)], timeout=1)
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(pid)


# --------------------------------------------------------------------------- host keys


def test_unknown_host_key_is_refused_with_how_to_trust_it(ssh_env):
    before = ssh_env.known_hosts.read_text()
    stranger = ssh_env.server(ssh_env.unknown_host)
    with pytest.raises(UnreachableError) as caught:
        connect(ssh_env.unknown_host, ssh_env.inventory).run(["true"])
    e = caught.value
    assert "unknown host key" in str(e) and "refused" in str(e)
    assert f"ssh-keyscan -p {stranger.port} {stranger.address} >> {ssh_env.known_hosts}" in e.hint
    assert "trust_on_first_use: true" in e.hint
    assert ssh_env.known_hosts.read_text() == before


def test_trust_on_first_use_records_the_key(ssh_env, tmp_path):
    known = tmp_path / "ssh" / "known_hosts"  # neither the file nor its directory exist yet
    stranger = ssh_env.server(ssh_env.unknown_host)
    host = variant(ssh_env, ssh_env.unknown_host, trust_on_first_use=True, known_hosts=str(known))
    with SSHTransport(host, ssh_env.inventory, pool=Pool()) as t:
        assert t.run(["echo", "hi"]).stdout == "hi\n"
    key_type, key = (stranger.dir / "host_ed25519.pub").read_text().split()[:2]
    assert known.read_text() == f"[{stranger.address}]:{stranger.port} {key_type} {key}\n"
    # Once recorded, strict checking accepts it.
    strict = variant(ssh_env, ssh_env.unknown_host, known_hosts=str(known))
    with SSHTransport(strict, ssh_env.inventory, pool=Pool()) as t:
        assert t.run(["true"]).ok


def test_changed_host_key_is_refused(ssh_env, tmp_path):
    direct = ssh_env.server("direct")
    other = (ssh_env.server("jump").dir / "host_ed25519.pub").read_text().split()[:2]
    known = tmp_path / "known_hosts"
    known.write_text(f"[{direct.address}]:{direct.port} {' '.join(other)}\n")
    host = variant(ssh_env, "direct", known_hosts=str(known))
    with pytest.raises(UnreachableError, match="CHANGED") as caught:
        SSHTransport(host, ssh_env.inventory, pool=Pool()).run(["true"])
    assert "ssh-keygen" in caught.value.hint


def test_gateways_are_host_key_checked_too(ssh_env, tmp_path):
    jump = ssh_env.server("jump")
    known = tmp_path / "known_hosts"
    lines = ssh_env.known_hosts.read_text().splitlines()
    known.write_text("".join(f"{l}\n" for l in lines if not l.startswith(f"[{jump.address}]:")))
    hosts = {n: h.model_copy(update={"known_hosts": str(known)}) for n, h in ssh_env.inventory.hosts.items()}
    inventory = Inventory(hosts=hosts, source="test")
    pool = Pool()
    try:
        with pytest.raises(UnreachableError, match="unknown host key") as caught:
            pool.get("target", inventory).run(["true"])
        # The host asked for is named, and the hop that failed, with the jump's own hint.
        assert caught.value.host == "target" and "jump host 'jump' unreachable" in str(caught.value)
        assert "ssh-keyscan" in caught.value.hint and str(jump.port) in caught.value.hint
    finally:
        pool.close()


# --------------------------------------------------------------------------- unreachable


def test_wrong_port_fails_fast_with_address_and_route(ssh_env):
    port = free_port("127.0.0.6")
    host = variant(ssh_env, "direct", name="wrong-port", port=port)
    with pytest.raises(UnreachableError) as caught:
        SSHTransport(host, ssh_env.inventory, pool=Pool()).run(["true"])
    assert f"connection refused at 127.0.0.6:{port}" in str(caught.value)
    assert "(direct)" in str(caught.value)


def test_wrong_port_behind_a_jump_names_the_jump(ssh_env):
    port = free_port("127.0.0.4")
    host = variant(ssh_env, "target", name="target-wrong-port", port=port)
    with pytest.raises(UnreachableError) as caught:
        SSHTransport(host, ssh_env.inventory).run(["true"])
    text = str(caught.value)
    assert f"jump host 'jump' could not connect to 127.0.0.4:{port}" in text and "via jump" in text


def test_silent_host_fails_within_connect_timeout(ssh_env):
    # A listening socket that never answers: the TCP connect succeeds, the SSH
    # banner never comes (a hung sshd, a firewall that accepts and drops).
    with socket.socket() as silent:
        silent.bind(("127.0.0.8", 0))
        silent.listen(8)
        host = variant(ssh_env, "direct", name="silent", address="127.0.0.8", port=silent.getsockname()[1], connect_timeout=1.0)
        started = time.monotonic()
        with pytest.raises(UnreachableError) as caught:
            SSHTransport(host, ssh_env.inventory, pool=Pool()).run(["true"])
        elapsed = time.monotonic() - started
    assert elapsed < 1.0 + 1.5
    assert "no answer within 1s (connect_timeout)" in str(caught.value)
    assert "127.0.0.8" in str(caught.value)


def test_stopped_host_is_unreachable_then_reconnects_when_back(ssh_env):
    t = connect("direct", ssh_env.inventory)
    t.run(["true"])
    ssh_env.stop("direct")
    try:
        with pytest.raises(UnreachableError, match="connection refused"):
            t.run(["true"])
    finally:
        ssh_env.start("direct")
    assert t.run(["echo", "back"]).stdout == "back\n"


def test_cut_connections_are_reopened_through_the_whole_chain(ssh_env):
    t = connect("target2", ssh_env.inventory)
    t.run(["true"])
    assert ssh_env.kill_connections("jump")  # the tunnels to jump2 and target2 ride on it
    assert t.run(["echo", "again"]).stdout == "again\n"


def test_a_tunnel_refused_by_a_jump_connection_that_closed_under_us_drops_it_for_one_more_try(ssh_env):
    # The moment the test above can hit at random: the jump's sshd session is gone, and
    # the tunnel request meets EOF before paramiko's reader marked the connection dead.
    # The failure is handed to the decision as Connection.open raises it then.
    t = connect("target2", ssh_env.inventory)
    t.run(["true"])
    jump2 = connect("jump2", ssh_env.inventory)
    old = jump2.connection()
    assert old.transport.is_active()
    error = t._connect_failure(EOFError(), (jump2, old), 5.0, 0.01)
    assert error.gateway_dropped, str(error)
    assert "the jump host's connection closed" in str(error) and "dropped it" in str(error)
    assert not old.is_connected and jump2.connection() is not old
    assert t.run(["echo", "again"]).stdout == "again\n"


# --------------------------------------------------------------------------- reuse, concurrency, fan-out


def test_connections_are_pooled_per_host(ssh_env):
    target = connect("target", ssh_env.inventory)
    assert connect("target", ssh_env.inventory) is target
    target.run(["true"])
    connection = target.ssh_transport()
    jump_connection = connect("jump", ssh_env.inventory).ssh_transport()
    logins_before = ssh_env.log("jump").count("Accepted publickey")
    for name in ("target", "jump2", "target2", "jump"):
        connect(name, ssh_env.inventory).run(["true"])
    assert target.ssh_transport() is connection
    # Every route through jump rides on the one pooled jump connection.
    assert connect("jump", ssh_env.inventory).ssh_transport() is jump_connection
    assert ssh_env.log("jump").count("Accepted publickey") == logins_before


def test_many_concurrent_commands_share_one_connection(ssh_env):
    t = connect("target", ssh_env.inventory)
    # More at once than sshd's MaxSessions (10): the transport queues them.
    with ThreadPoolExecutor(16) as ex:
        outs = list(ex.map(lambda i: t.run(["sh", "-c", f"sleep 0.3; echo {i}"]).stdout, range(24)))
    assert outs == [f"{i}\n" for i in range(24)]


def test_fanout_one_dead_host_does_not_spoil_the_others(ssh_env):
    dead = SSHTransport(variant(ssh_env, "direct", name="dead", port=free_port("127.0.0.6")), ssh_env.inventory, pool=Pool())
    items = [connect("target", ssh_env.inventory), "target2", "jump2", dead]
    results = fanout(items, lambda t: t.run(["hostname"]).stdout.strip(), inventory=ssh_env.inventory)
    assert list(results) == ["target", "target2", "jump2", "dead"]
    assert results["target"] == "ct200"
    assert results["target2"] == results["jump2"] == socket.gethostname()
    assert isinstance(results["dead"], UnreachableError) and "connection refused" in str(results["dead"])


def test_fanout_first_use_of_a_shared_gateway_does_not_race(ssh_env):
    # A fresh pool: all three open their gateway (jump) at the same moment.
    pool = Pool()
    try:
        names = ["target", "jump2", "target2"]
        barrier = threading.Barrier(len(names))

        def go(t):
            barrier.wait()
            return t.run(["true"]).ok

        results = fanout([pool.get(n, ssh_env.inventory) for n in names], go)
        assert results == {n: True for n in names}
    finally:
        pool.close()


def test_local_transport_runs_here(ssh_env, tmp_path):
    t = connect("local", ssh_env.inventory)
    assert isinstance(t, LocalTransport) and t.describe_route() == "local"
    assert t.run(["pwd"], cwd=str(tmp_path)).stdout.strip() == str(tmp_path)
    assert t.run(["sh", "-c", "echo $PPID"]).stdout.strip() != str(os.getpid())  # ran under sh/timeout


# --------------------------------------------------------------------------- fabric connections


def test_connections_are_fabric_connections_with_the_jump_as_gateway(ssh_env):
    pool = Pool()
    try:
        target, jump = pool.get("target", ssh_env.inventory), pool.get("jump", ssh_env.inventory)
        target.run(["true"])
        connection = target.connection()
        assert isinstance(connection, fabric.Connection) and connection.client.get_transport() is target.ssh_transport()
        assert connection.gateway is jump.connection()  # the jump's own pooled Connection
        # Unknown keys are refused on every hop (fabric's default would accept them).
        for c in (connection, connection.gateway):
            assert isinstance(c.client._policy, paramiko.MissingHostKeyPolicy)
            assert type(c.client._policy).__name__ == "_Refuse"
            assert c.client.get_host_keys().lookup(f"[{c.host}]:{c.port}") is not None
        assert connection.transport.packetizer._Packetizer__keepalive_interval == 15  # the default keepalive
    finally:
        pool.close()


def test_keepalive_zero_sends_none(ssh_env):
    with SSHTransport(variant(ssh_env, "direct", name="no-keepalive", keepalive=0), ssh_env.inventory, pool=Pool()) as t:
        t.run(["true"])
        assert t.ssh_transport().packetizer._Packetizer__keepalive_interval == 0


# --------------------------------------------------------------------------- messages that say what to do


def test_a_missing_identity_file_is_named_with_what_to_do(ssh_env, tmp_path):
    missing = tmp_path / "no_such_key"
    host = variant(ssh_env, "direct", name="no-key", identity_file=str(missing))
    with pytest.raises(UnreachableError) as caught:
        SSHTransport(host, ssh_env.inventory, pool=Pool()).run(["true"])
    assert f"identity file {missing} not found" in str(caught.value)
    assert "identity_file:" in caught.value.hint and "no-key" in caught.value.hint


def test_a_missing_wrapper_is_named_and_the_script_is_not_printed(ssh_env):
    host = variant(ssh_env, "direct", name="no-wrapper", wrapper=["lxc-nowhere", "-n", "ct1", "--"])
    with SSHTransport(host, ssh_env.inventory, pool=Pool()) as t, pytest.raises(TransportError) as caught:
        t.run_script("import sys\n" + "# a long script\n" * 50 + "print(sys.argv)", ["one"])
    e = caught.value
    assert e.remote_exit_code == 127
    assert "container wrapper `lxc-nowhere -n ct1 --`" in e.hint and "`wrapper:`" in e.hint
    assert "a long script" not in str(e) and "-byte argument>" in e.command and "one" in e.command


def test_a_missing_python_is_named(ssh_env):
    host = variant(ssh_env, "target", name="no-python", python="/opt/nowhere/python3")
    with SSHTransport(host, ssh_env.inventory) as t, pytest.raises(TransportError) as caught:
        t.run_script("print(1)")
    assert caught.value.remote_exit_code == 127
    assert "python `/opt/nowhere/python3` is not found inside host 'no-python''s container" in caught.value.hint
    assert "`python:`" in caught.value.hint


def test_a_handshake_that_stalls_after_the_banner_says_so_without_paramiko_words(ssh_env):
    with socket.socket() as silent:
        silent.bind(("127.0.0.8", 0))
        silent.listen(8)
        accepted = []

        def banner_only():
            c, _ = silent.accept()
            accepted.append(c)
            c.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")

        threading.Thread(target=banner_only, daemon=True).start()
        host = variant(ssh_env, "direct", name="mute", address="127.0.0.8", port=silent.getsockname()[1],
                       connect_timeout=1.0)
        with pytest.raises(UnreachableError) as caught:
            SSHTransport(host, ssh_env.inventory, pool=Pool()).run(["true"])
        for c in accepted:
            c.close()
    first = str(caught.value).splitlines()[0]
    assert first.endswith("no answer within 1s (connect_timeout)")
    assert "No existing session" not in str(caught.value)
