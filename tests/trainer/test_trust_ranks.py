"""Red team between the ranks of a multi-host run: real trainer processes on this machine
(gloo on CPU, env:// rendezvous as dflashctl starts them), each with its own run
directory as on its own host, and the attacker a real process too.

- a rank 0 that sends a pickle (a compromised host, holding the run's secret) makes
  rank 1 run nothing: the frame is refused and named;
- a stranger that holds the rendezvous port (after a rank failure), as another user
  where the machine allows: rank 0 says EADDRINUSE (its own signature), rank 1
  refuses the stranger's store, nothing is accepted from it;
- rank 0 killed with SIGKILL is blamed on rank 0 and its host, not on rank 1's;
- a healthy host whose clock is 6 s behind is not blamed for a dead peer;
- a stopped (SIGSTOP) rank 0 ends rank 1 within distributed.timeout + the stated
  margin, naming rank 0.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from dflashctl.core import contract
from dflashctl.core.signatures import classify
from tests.harness import free_port
from tests.harness.tiny import REPO, metrics_at, rank_env, tiny_config, write_config

HOSTS = ("host-a", "host-b", "host-c")  # the inventory names each process is told it runs on


class Ranks:
    """Trainer processes of one run, rank r in ``tmp/r<r>`` with its own key file."""

    def __init__(self, tmp_path, world: int = 2, timeout: float = 20, key: str | None = None, **train):
        self.tmp, self.world, self.port = tmp_path, world, free_port("127.0.0.1")
        self.key = key if key is not None else secrets.token_hex(32)
        cfg = tiny_config(train={"steps": 100000, "log_every": 1, "checkpoint_every": 0, **train},
                          distributed={"timeout": timeout})
        self.config = write_config(tmp_path, cfg)
        self.procs: dict[int, subprocess.Popen] = {}
        self.logs: list = []

    def run_dir(self, rank: int) -> str:
        return str(self.tmp / f"r{rank}")

    def env(self, rank: int, **extra: str) -> dict:
        return rank_env(RANK=str(rank), WORLD_SIZE=str(self.world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port), **{contract.HOST_ENV: HOSTS[rank]}, **extra)

    def write_key(self, rank: int) -> None:
        os.makedirs(self.run_dir(rank), exist_ok=True)
        path = os.path.join(self.run_dir(rank), contract.RENDEZVOUS_KEY_FILE)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.key + "\n")

    def start(self, rank: int, **extra_env: str) -> subprocess.Popen:
        self.write_key(rank)
        self.logs.append(open(self.log_path(rank), "w"))
        self.procs[rank] = subprocess.Popen(
            [sys.executable, "-m", "trainer", "--config", self.config, "--run-dir", self.run_dir(rank)], cwd=REPO,
            stdout=self.logs[-1], stderr=subprocess.STDOUT, env=self.env(rank, **extra_env))
        return self.procs[rank]

    def log_path(self, rank: int) -> str:
        return str(self.tmp / f"rank{rank}.log")

    def output(self, rank: int) -> str:
        with open(self.log_path(rank)) as f:
            return f.read()

    def status(self, rank: int) -> dict:
        with open(os.path.join(self.run_dir(rank), contract.status_file(rank))) as f:
            return json.load(f)

    def wait_training(self, steps: int = 3, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while min(len(metrics_at(os.path.join(self.run_dir(r), contract.metrics_file(r)))) for r in self.procs) < steps:
            assert time.monotonic() < deadline and all(p.poll() is None for p in self.procs.values()), \
                "\n".join(self.output(r)[-2000:] for r in self.procs)
            time.sleep(0.1)

    def close(self) -> None:
        for p in self.procs.values():  # processes this test started
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait(30)
        for f in self.logs:
            f.close()


@pytest.fixture
def ranks(tmp_path):
    made: list[Ranks] = []

    def make(**kw) -> Ranks:
        made.append(Ranks(tmp_path, **kw))
        return made[-1]

    yield make
    for r in made:
        r.close()


# --------------------------------------------------------------------------- a pickle from rank 0

# A rank 0 on a compromised host: it holds the run's secret (it is on the host) and joins
# exactly as the trainer does, then sends the checkpoint as a pickle whose loading runs
# code (it makes a directory). Where the trainer has no authenticated join (older code),
# it joins as torch's env:// does.
EVIL_RANK0 = textwrap.dedent("""
    import datetime, json, os, sys, time
    import torch, torch.distributed as dist
    run_dir, marker = sys.argv[1], sys.argv[2]

    class Evil:
        def __reduce__(self):
            return (os.mkdir, (marker,))

    if not os.path.exists(os.path.join("trainer", "rendezvous.py")):  # the trainer of this checkout
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        store = dist.distributed_c10d._get_default_store()
    else:
        from trainer import rendezvous
        joined = rendezvous.join(run_dir, 30)
        store = joined.store
        dist.init_process_group("gloo", store=store, rank=0, world_size=2, timeout=datetime.timedelta(seconds=30))
        if hasattr(rendezvous, "Signed"):  # the values after the proof, signed as the trainer signs them
            signed = rendezvous.Signed(store, joined.session_key, 0)
            signed.set("info", json.dumps({"host": "host-a", "pid": os.getpid()}))
            signed.set("step", "0")
            signed.set("beat", "")
        else:
            store.set("dflash/info/0", json.dumps({"host": "host-a", "pid": os.getpid()}))
            store.set("dflash/step/0", "0")
            store.add("dflash/beat/0", 1)
    dist.broadcast_object_list([{"model.pt": Evil()}], src=0)
    time.sleep(30)
""")


def test_a_pickle_sent_by_rank_0_is_refused_and_runs_nothing(ranks, tmp_path):
    run = ranks()
    marker = str(tmp_path / "pickle-ran")
    run.write_key(0)
    evil_log = open(str(tmp_path / "evil.log"), "w")
    evil = subprocess.Popen([sys.executable, "-c", EVIL_RANK0, run.run_dir(0), marker], cwd=REPO, stdout=evil_log,
                            stderr=subprocess.STDOUT, env=run.env(0))
    run.procs[99] = evil  # ended with the others
    rank1 = run.start(1)
    code = rank1.wait(120)
    evil_log.close()
    out = run.output(1)
    assert not os.path.exists(marker), "rank 1 ran code that rank 0 sent"
    assert code == contract.EXIT_CRASH, out[-3000:]
    assert "not a dflash frame (a pickle" in out, out[-3000:]
    status = run.status(1)
    assert status["phase"] == contract.PHASE_FAILED and status["detail"]["failed_rank"] == 0
    assert status["detail"]["failed_host"] == "host-a", status


# --------------------------------------------------------------------------- the port taken by a stranger

# Holds the rendezvous port as a TCPStore, as torch's own rank 0 would, and plays rank 0
# as far as it can without the run's secret: a nonce and a made-up proof.
STRANGER = textwrap.dedent("""
    import datetime, secrets, sys, time
    import torch.distributed as dist
    store = dist.TCPStore("0.0.0.0", int(sys.argv[1]), is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    store.set("dflash/auth/nonce/0", secrets.token_hex(16))
    store.set("dflash/auth/proof/0", secrets.token_hex(32))
    print("listening", flush=True)
    time.sleep(120)
""")


# The same stranger as another user, where that user cannot run this checkout's python
# (it lives under a home only root may enter): the machine's python3, a plain listener
# that accepts and answers nothing a TCPStore client expects.
STRANGER_PLAIN = textwrap.dedent("""
    import socket, sys, time
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", int(sys.argv[1])))
    s.listen(16)
    print("listening", flush=True)
    held = []
    s.settimeout(1)
    end = time.time() + 120
    while time.time() < end:
        try:
            c, _ = s.accept()
            c.sendall(b"\\x80\\x04hello")
            held.append(c)
        except OSError:
            pass
""")
SYSTEM_PYTHON = "/usr/bin/python3"


def _other_user() -> tuple[int, int] | str:
    """(uid, gid) of a throwaway second user, or why there is none."""
    if os.geteuid() != 0:
        return "not root: no second user can be made here"
    name = "dflashstranger"
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        made = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                              capture_output=True, text=True)
        if made.returncode != 0:
            return f"useradd failed: {made.stderr.strip()[:200]}"
        entry = pwd.getpwnam(name)
    uid, gid = entry.pw_uid, entry.pw_gid
    try:
        probe = subprocess.run([SYSTEM_PYTHON, "-c", "import socket"], capture_output=True, text=True,
                               timeout=120, cwd="/", preexec_fn=lambda: (os.setgid(gid), os.setuid(uid)))
    except (OSError, subprocess.SubprocessError) as e:
        return f"{SYSTEM_PYTHON} cannot be run as uid {uid} ({e})"
    if probe.returncode != 0:
        return f"{SYSTEM_PYTHON} fails as uid {uid}: {probe.stderr.strip()[-200:]}"
    return uid, gid


@pytest.mark.slow
@pytest.mark.parametrize("who", ["same-user", "other-user"])
def test_a_stranger_on_the_rendezvous_port_is_named_and_refused(ranks, tmp_path, who):
    run = ranks(timeout=15)
    argv = [sys.executable, "-c", STRANGER, str(run.port)]
    preexec = None
    if who == "other-user":
        user = _other_user()
        if isinstance(user, str):
            pytest.skip(user)
        uid, gid = user
        argv = [SYSTEM_PYTHON, "-c", STRANGER_PLAIN, str(run.port)]

        def preexec():  # the stranger is another local user (runs in the child only)
            os.setgid(gid)
            os.setuid(uid)

    stranger_log = open(str(tmp_path / "stranger.log"), "w")
    stranger = subprocess.Popen(argv, cwd="/", stdout=stranger_log, stderr=subprocess.STDOUT, preexec_fn=preexec,
                                env=rank_env())
    run.procs[99] = stranger
    deadline = time.monotonic() + 60
    while "listening" not in open(str(tmp_path / "stranger.log")).read():
        assert stranger.poll() is None and time.monotonic() < deadline, open(str(tmp_path / "stranger.log")).read()
        time.sleep(0.1)
    rank0, rank1 = run.start(0), run.start(1)
    codes = rank0.wait(90), rank1.wait(90)
    stranger_log.close()
    out0, out1 = run.output(0), run.output(1)
    assert codes == (contract.EXIT_CRASH, contract.EXIT_CRASH), (out0[-2000:], out1[-2000:])
    # Rank 0 names the port and the cause, in the signature meant for it.
    assert f"rendezvous port {run.port} on this host is in use by another process (EADDRINUSE)" in out0, out0[-2000:]
    assert classify(out0, run.status(0)["error"], codes[0]).name == "rendezvous_port_in_use"
    # Rank 1 refuses the stranger's store clearly; nothing came from it.
    if who == "same-user":  # a store that plays rank 0 without the secret: it cannot even name the proof's keys
        assert "gave no nonce from every rank" in out1 and "refusing to join" in out1, out1[-2000:]
    else:  # a listener that is no store at all
        assert f"could not join the rendezvous at 127.0.0.1:{run.port}" in out1, out1[-2000:]
    assert classify(out1, run.status(1)["error"], codes[1]).name == "rendezvous_refused"
    assert "distributed: rank 1 of 2" not in out1  # it never joined a process group


# --------------------------------------------------------------------------- blame


def test_rank_0_killed_is_blamed_on_rank_0_and_its_host(ranks):
    run = ranks(timeout=20)
    run.start(0), run.start(1)
    run.wait_training()
    run.procs[0].send_signal(signal.SIGKILL)
    code = run.procs[1].wait(40)
    out = run.output(1)
    assert code == contract.EXIT_CRASH, out[-3000:]
    detail = run.status(1)["detail"]
    assert (detail["failed_rank"], detail["failed_host"]) == (0, "host-a"), detail
    assert "rank 0 on host-a failed first" in out


# A host whose clock is 6 s behind the others: the process's wall clock is shifted at
# start-up (no per-process clock control here: libfaketime is not installed, and the
# machine's clock is shared by every test). Its monotonic clock is untouched, as on a
# real host whose wall clock is off.
SKEW = textwrap.dedent("""
    import time
    _time = time.time
    time.time = lambda: _time() - 6.0
""")


@pytest.mark.slow
def test_a_host_whose_clock_is_behind_is_not_blamed_for_a_dead_peer(ranks, tmp_path):
    skewed = tmp_path / "skewed"
    skewed.mkdir()
    (skewed / "sitecustomize.py").write_text(SKEW)
    run = ranks(world=3, timeout=20)
    run.start(0)
    run.start(1, PYTHONPATH=str(skewed))  # healthy, its clock 6 s behind
    run.start(2)
    run.wait_training(steps=2, timeout=180)
    run.procs[2].send_signal(signal.SIGKILL)
    code = run.procs[0].wait(60)
    out = run.output(0)
    assert code == contract.EXIT_CRASH, out[-3000:]
    detail = run.status(0)["detail"]
    assert (detail["failed_rank"], detail["failed_host"]) == (2, "host-c"), (detail, out[-2000:])


# --------------------------------------------------------------------------- a stranger on the store, after the proof

# A client that reaches the rendezvous port while the run trains, without the secret:
# it writes what a rank writes, under the names a reader of the trainer would guess.
# On the code before the signed store, rank 1's heartbeat (`store.add` on a value that
# is no number) failed and stopped, and rank 0 blamed the healthy rank 1.
WRITER = textwrap.dedent("""
    import datetime, sys
    import torch.distributed as dist
    client = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    client.set("dflash/beat/1", "not a number")
    client.set("dflash/failed/1", "a failure rank 1 never had")
    client.set("dflash/step/1", "0")
    client.set("dflash/info/1", '{"host": "stranger", "pid": 1}')
    print("written", flush=True)
""")


@pytest.mark.slow
def test_a_strangers_writes_to_the_rendezvous_store_are_ignored_named_and_never_blamed(ranks, tmp_path):
    from trainer.distributed import HUNG_MARGIN_S

    timeout = 15
    run = ranks(timeout=timeout)
    run.start(0), run.start(1)
    run.wait_training()
    done = subprocess.run([sys.executable, "-c", WRITER, str(run.port)], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env=rank_env())
    assert "written" in done.stdout, done.stderr[-2000:]
    written = {r: len(metrics_at(os.path.join(run.run_dir(r), contract.metrics_file(r)))) for r in (0, 1)}
    time.sleep(timeout + HUNG_MARGIN_S + 5)  # past the time the watchdog would have blamed a silent rank
    outs = {r: run.output(r) for r in (0, 1)}
    assert all(p.poll() is None for p in run.procs.values()), (outs[0][-2000:], outs[1][-2000:])
    assert "failed first" not in outs[0] + outs[1]
    for r in (0, 1):  # both still train
        assert len(metrics_at(os.path.join(run.run_dir(r), contract.metrics_file(r)))) > written[r] + 3
    # Named in the log, by its name, as a stranger's write on the port.
    assert "rendezvous store at 127.0.0.1:" in outs[0] and "dflash/beat/1 holds no rank of this run writes it: " \
        "a stranger's write, ignored (no rank is blamed for it)" in outs[0], outs[0][-3000:]


def test_a_value_not_signed_with_the_starts_key_or_replayed_is_refused_and_named():
    """Whoever learns a signed name (by watching the wire) still cannot write there:
    a value without the key's HMAC, or an older value of the rank written again."""
    import datetime

    import torch.distributed as dist

    from trainer.rendezvous import Signed

    port = free_port("127.0.0.1")
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    key = secrets.token_bytes(32)
    said: list[str] = []
    rank1, rank0 = Signed(server, key, 1), Signed(server, key, 0, "127.0.0.1:%d" % port, say=said.append)
    name = rank1.name("failed", 1)
    assert name != "dflash/failed/1" and Signed(server, secrets.token_bytes(32), 1).name("failed", 1) != name
    server.set(name, b"1 " + b"0" * 64 + b" boom")  # the form, not the key
    assert rank0.get("failed", 1) is None and rank0.tampered("failed", 1, 60)
    rank1.set("failed", "the real failure")
    old = server.get(name)
    assert rank0.get("failed", 1)[1] == "the real failure"
    rank1.set("failed", "a later word")
    assert rank0.get("failed", 1)[1] == "a later word"
    server.set(name, old)  # an older value written again
    assert rank0.get("failed", 1) is None
    Signed(server, secrets.token_bytes(32), 1).set("failed", "signed with another start's key")
    assert rank0.get("failed", 1) is None
    assert len(said) == 1 and said[0].startswith(f"warning: rendezvous store at 127.0.0.1:{port}: {name} holds a "
                                                 "value not signed with this start's key"), said
    assert set(rank0.strangers) == {name}


# Writes over the proof's names torch's users would guess, as fast as it can, from the
# moment rank 0's store listens, before rank 1 joins: on the code before, a rank read the
# stranger's nonce or proof and refused its healthy peer ("did not prove"), a signature
# that stops the run.
PROOF_WRITER = textwrap.dedent("""
    import datetime, secrets, sys, time
    import torch.distributed as dist
    print("ready", flush=True)
    end = time.time() + float(sys.argv[2])
    client = None
    while client is None and time.time() < end:
        try:
            client = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=2))
        except Exception:
            time.sleep(0.05)
    print("connected", flush=True)
    while time.time() < end:
        for r in (0, 1):
            client.set(f"dflash/auth/nonce/{r}", secrets.token_hex(16))
            client.set(f"dflash/auth/proof/{r}", secrets.token_hex(32))
        time.sleep(0.005)
""")


@pytest.mark.slow
def test_a_stranger_writing_over_the_proof_is_ignored_named_and_stops_nothing(ranks, tmp_path):
    run = ranks(timeout=240)  # rank 0's store waits this long for rank 1, started only once the writer is in
    writer = subprocess.Popen([sys.executable, "-c", PROOF_WRITER, str(run.port), "150"], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=rank_env())
    try:
        assert writer.stdout.readline().strip() == b"ready"
        run.start(0)
        assert writer.stdout.readline().strip() == b"connected"  # to rank 0's store, writing before rank 1 joins
        run.start(1)
        run.wait_training(steps=5, timeout=240)
        deadline = time.monotonic() + 30
        while "dflash/auth/proof/1 holds no rank of this run writes it" not in run.output(0):
            assert time.monotonic() < deadline, run.output(0)[-3000:]
            time.sleep(0.5)
        assert writer.poll() is None  # it was writing all along
        assert all(run.procs[r].poll() is None for r in (0, 1))
        assert "did not prove" not in run.output(0) + run.output(1)
    finally:
        writer.kill()  # the process this test started
        writer.wait(30)


# --------------------------------------------------------------------------- a hung peer


@pytest.mark.slow
@pytest.mark.parametrize("stopped", [0, 1])
def test_a_stopped_rank_ends_the_other_within_the_timeout_and_margin_naming_it(ranks, stopped):
    from trainer.distributed import HUNG_MARGIN_S

    timeout, other = 15, 1 - stopped
    run = ranks(timeout=timeout)
    run.start(0), run.start(1)
    run.wait_training()
    run.procs[stopped].send_signal(signal.SIGSTOP)  # rank 0's process holds the store: it stops too
    since = time.monotonic()
    try:
        code = run.procs[other].wait(timeout + HUNG_MARGIN_S + 30)
    except subprocess.TimeoutExpired:
        code = None
    took = time.monotonic() - since
    out = run.output(other)
    assert code == contract.EXIT_CRASH and took <= timeout + HUNG_MARGIN_S, (code, took, out[-3000:])
    detail = run.status(other)["detail"]
    assert (detail["failed_rank"], detail["failed_host"]) == (stopped, HOSTS[stopped]), detail
    assert classify(out, run.status(other)["error"], code).name == "rank_failed"


# --------------------------------------------------------------------------- the key and the port, controller side


def test_each_start_writes_a_fresh_key_mode_0600_never_in_run_sh(tmp_path):
    from dflashctl.config import load_inventory
    from dflashctl.hosts import deploy
    from dflashctl.runs.runhost import host_transport, new_rendezvous_key, run_files

    config = {"python": sys.executable, "workdir": str(tmp_path), "env": {}, "gpus": [],
              "trainer": tiny_config(), "compile_cache": None,
              "distributed": {"address": "127.0.0.1", "port": 29555, "hosts": [
                  {"rank": 0, "host": "local", "python": sys.executable, "workdir": str(tmp_path), "env": {}},
                  {"rank": 1, "host": "local", "python": sys.executable, "workdir": str(tmp_path), "env": {}}]}}
    first, second = new_rendezvous_key(), new_rendezvous_key()
    assert first != second and len(bytes.fromhex(first)) == 32
    files = run_files("r1", str(tmp_path / "run"), config, "dflash", rank=1, rendezvous_key=first)
    assert files[contract.RENDEZVOUS_KEY_FILE].strip() == first
    assert first not in files["run.sh"] and first not in files[contract.CONFIG_FILE]
    transport = host_transport("local", load_inventory(None))
    deploy.write_run_files(transport, str(tmp_path / "run"), files)
    path = tmp_path / "run" / contract.RENDEZVOUS_KEY_FILE
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)
    assert path.read_text().strip() == first


def test_the_port_check_binds_as_torch_does_time_wait_is_free_a_listener_is_eaddrinuse():
    from dflashctl.config import load_inventory
    from dflashctl.runs.runhost import host_transport, rendezvous_port_problem

    transport = host_transport("local", load_inventory(None))
    port = free_port("127.0.0.1")
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen(1)
    assert "EADDRINUSE" in (rendezvous_port_problem(transport, sys.executable, port) or "")
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()  # the side that closes first keeps the connection in TIME_WAIT on this port
    client.close()
    server.close()
    assert rendezvous_port_problem(transport, sys.executable, port) is None  # torch could listen on it now
