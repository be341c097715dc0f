"""The trainer past one process: torch.distributed, as started by torchrun.

When ``RANK`` and ``WORLD_SIZE`` are set (torchrun sets them, with ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``), every process runs the
threaded pipeline on its own host's GPUs and joins one process group (NCCL on GPU,
gloo on CPU). Without them nothing here is used and the trainer is the single
process it always was.

Per step, after the in-process reduction across a process's drafter replicas, the
master copy's gradients are flattened into ONE buffer (with the step's loss sum and
token count appended) and all-reduced once, then divided by the world size: every
process then takes the same AdamW step on the same gradients, so the drafter stays
bit-identical across processes (the metrics carry a checksum to show it).

Files in the run directory: rank 0 writes ``status.json``, ``metrics.jsonl``,
checkpoints (drafter and optimiser) and compile artifacts, exactly as a single
process does; rank ``q > 0`` writes only ``status.rank<q>.json`` and
``metrics.rank<q>.jsonl`` (its own figures). Rank 0's metrics carry the global
figures: ``tok_s`` and ``tokens`` are the sums over ranks, ``loss`` the mean over
every replica of every rank. A resume is decided by rank 0 and its checkpoint is
sent to the others over the process group (a host need not see rank 0's disk); a
checkpoint written by another world size is refused (exit: configuration error).

GPU placement: the indices in ``placement`` are per process. When several processes
share a host (``LOCAL_WORLD_SIZE > 1``), local rank ``L`` adds ``L * n`` to them,
``n`` being the largest index in its placement plus one: two processes with
``target: [0], drafter: [0]`` use GPU 0 and GPU 1.

Joining: the store at ``MASTER_ADDR:MASTER_PORT`` is opened and every rank proves
this start's secret on it before the process group exists (trainer/rendezvous.py);
what rank 0 sends later (the checkpoint to resume from) is one authenticated frame
of data (trainer/wire.py), never a pickle, checked against bounds on receipt.

Failure: every collective waits at most ``distributed.timeout`` seconds. Each
process adds one to its own counter in the store every second (``dflash/beat/R``);
a watchdog thread in every process reads every other counter and the store itself
over its own connection, and notes on its OWN monotonic clock when each last moved,
so no host's clock is compared with another's. A peer whose counter has not moved
for ``distributed.timeout`` (stopped, hung, its NIC dead), or a store that has not
answered for as long (rank 0's process, where it lives, is stopped or gone), ends
this process within ``distributed.timeout + HUNG_MARGIN_S``, failed, naming that
rank and its host: a collective blocked in NCCL or gloo is not waited for. When a
collective fails, the process names the rank that failed first (one that recorded
its own failure in this start's store, else one whose process is gone, else one
whose counter stopped, else rank 0 when the store is gone, else the one furthest
behind), writes status ``failed`` with that rank and its host, and exits with the
crash code. This module never decides anything about the model or the data; it
only moves tensors and names failures. It imports torch only inside its functions:
train.run reads the file names before torch is imported.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from dflashctl.core import contract

ENV_KEYS = ("RANK", "WORLD_SIZE")
HEARTBEAT_S = 1.0
WATCH_S = 1.0  # how often the watchdog reads the others' counters
WATCH_IO_S = 2.0  # each of its store calls waits at most this long
STALE_S = 4.0  # a counter unmoved this long, when a collective failed: that process is gone or frozen
BLAME_WAIT_S = 8.0  # after a failed collective, how long to wait for a culprit to show
# A rank that stops answering ends every other process within distributed.timeout plus
# this: a beat missed (HEARTBEAT_S), the watchdog's poll (WATCH_S), one store call
# timing out (WATCH_IO_S), writing the status, and slack for a loaded machine.
HUNG_MARGIN_S = 10.0
INFO_WAIT_S = 60.0  # how long init waits for every rank's host and pid
STRANGER_LOOK_EVERY = 5  # watchdog readings between two looks for writes to the names strangers would guess
MAX_HOST_CHARS = 200


def requested() -> bool:
    """True when the environment asks for a distributed run (torchrun, or its variables set by hand)."""
    return all(os.environ.get(k) for k in ENV_KEYS) and int(os.environ["WORLD_SIZE"]) > 1


status_file, metrics_file = contract.status_file, contract.metrics_file


def host_name() -> str:
    """The name failures are reported with: the inventory's name of this host when
    dflashctl started the process (``DFLASHCTL_HOST``), else the machine's."""
    return os.environ.get(contract.HOST_ENV) or socket.gethostname()


def env_rank() -> int:
    return int(os.environ.get("RANK", "0")) if requested() else 0


class DistributedError(RuntimeError):
    """A collective failed (a peer died, hung past the timeout, or failed itself)."""

    def __init__(self, message: str, failed_rank: Optional[int] = None, failed_host: Optional[str] = None):
        super().__init__(message)
        self.failed_rank, self.failed_host = failed_rank, failed_host


def device_offset(placement) -> int:
    """GPU index offset of this process (see the module docstring)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local_world <= 1:
        return 0
    return int(os.environ.get("LOCAL_RANK", "0")) * (max(list(placement.target) + list(placement.drafter)) + 1)


@dataclass
class Peer:
    """What this process knows of another rank: host and pid (from the store, at
    init), and when, on this process's monotonic clock, its counter last moved."""

    host: str = "?"
    pid: int = 0
    count: int = -1
    moved: float = field(default_factory=time.monotonic)


@dataclass
class Group:
    """This process's place in the run and the collectives the trainer uses."""

    rank: int
    world: int
    local_rank: int
    backend: str
    timeout_s: float
    device: "torch.device"  # noqa: F821 - torch is imported lazily
    host: str = field(default_factory=host_name)
    step: int = 0  # last finished step, published beside the heartbeat
    last_allreduce_s: float = 0.0
    extras: list = field(default_factory=list)  # per step: values summed over ranks with the gradients
    summed: list = field(default_factory=list)  # ... and their sums, after the all-reduce
    session_key: bytes = b""  # tags every frame between ranks (trainer/rendezvous.py)
    authenticated: bool = False
    store: object = None  # the raw store (the process group prefixes its own keys)
    signed: object = None  # rendezvous.Signed: this start's values on it, bound to the session key
    peers: dict = field(default_factory=dict)  # rank -> Peer
    store_seen: float = field(default_factory=time.monotonic)  # when the watchdog's store last answered
    on_hung: Optional[Callable[["DistributedError"], None]] = None  # ends the process (train.run sets it)
    _stop: threading.Event = field(default_factory=threading.Event)
    _ending: threading.Lock = field(default_factory=threading.Lock)  # one failure report per process
    _ending_since: Optional[float] = None
    _readings: int = 0  # of the watchdog (observe)

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def init(cls, cfg, device, run_dir: str = ".") -> "Group":
        import torch
        import torch.distributed as dist

        from trainer import rendezvous

        backend = cfg.distributed.backend
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = datetime.timedelta(seconds=cfg.distributed.timeout)
        joined = rendezvous.join(run_dir, cfg.distributed.timeout)  # nothing is accepted from a peer before this
        dist.init_process_group(backend=backend, timeout=timeout, store=joined.store, rank=joined.rank,
                                world_size=joined.world)
        g = cls(rank=joined.rank, world=joined.world, local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                backend=backend, timeout_s=cfg.distributed.timeout, device=device, session_key=joined.session_key,
                authenticated=joined.authenticated, store=joined.store,
                signed=rendezvous.Signed(joined.store, joined.session_key, joined.rank, joined.where,
                                         authenticated=joined.authenticated))
        g._meet()
        g._beat()
        threading.Thread(target=g._heartbeat_loop, name=f"heartbeat-rank{g.rank}", daemon=True).start()
        threading.Thread(target=g._observe_loop, name=f"observer-rank{g.rank}", daemon=True).start()
        threading.Thread(target=g._watchdog_loop, name=f"watchdog-rank{g.rank}", daemon=True).start()
        return g

    def close(self) -> None:
        """Orderly end (every rank done): leave the group."""
        import torch.distributed as dist

        self._stop.set()
        try:
            dist.barrier(device_ids=[self.device.index]) if self.backend == "nccl" else dist.barrier()
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the run is over; a peer already gone must not turn done into failed
            pass

    # ------------------------------------------------------------------ collectives

    def _collective(self, what: str, fn):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - every collective failure becomes one named error
            raise self.failure(what, e) from e

    def allreduce_gradients(self, params: list) -> None:
        """Average ``params``' gradients over all ranks, in one flat buffer; ``extras``
        (floats set by the caller for this step) ride along and are summed into ``summed``."""
        import torch

        t0 = time.monotonic()
        ref = params[0]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).to(torch.float32) for g in grads]
                         + [torch.tensor(self.extras, dtype=torch.float32, device=ref.device)])
        self._collective("all_reduce", lambda: torch.distributed.all_reduce(flat))
        n = flat.numel() - len(self.extras)
        self.summed = flat[n:].tolist()
        flat = flat[:n].div_(self.world)
        offset = 0
        for p, g in zip(params, grads):
            part = flat[offset:offset + g.numel()].view_as(g).to(g.dtype)
            if p.grad is None:
                p.grad = part.clone()
            else:
                p.grad.copy_(part)
            offset += g.numel()
        self.last_allreduce_s = time.monotonic() - t0

    def broadcast_parameters(self, params: list) -> None:
        """Rank 0's values into every rank's ``params`` (start and resume)."""
        import torch

        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            self._collective("broadcast", lambda: torch.distributed.broadcast(flat, src=0))
            offset = 0
            for p in params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    def broadcast_bytes(self, data: Optional[bytes], limit: int) -> bytes:
        """Rank 0's ``data`` on every rank: its length (refused past ``limit`` before
        anything is allocated), then the bytes. The framing is the one torch's object
        broadcast uses, so a peer that sends a pickle is read as bytes and refused."""
        import torch

        dev = self.device if self.backend == "nccl" else torch.device("cpu")
        size = torch.tensor([len(data) if self.rank == 0 else 0], dtype=torch.long, device=dev)
        self._collective("broadcast", lambda: torch.distributed.broadcast(size, src=0))
        n = int(size.item())
        if not 0 <= n <= limit:
            raise DistributedError(f"rank 0 sent a {n}-byte message; at most {limit} bytes are accepted here "
                                   "(refused before reading it)", failed_rank=0, failed_host=self.peer_host(0))
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 and n
               else torch.empty(n, dtype=torch.uint8))
        if n:
            moved = buf.to(dev)
            self._collective("broadcast", lambda: torch.distributed.broadcast(moved, src=0))
            buf = moved.cpu()
        return data if self.rank == 0 else buf.numpy().tobytes()

    def broadcast_checkpoint(self, path: Optional[str], scratch_dir: str, limit: int) -> Optional[str]:
        """Rank 0's checkpoint ``path`` (or None) as a directory this rank can load:
        rank 0 returns ``path``; the others receive its files (one authenticated frame
        of at most ``limit`` bytes, plain file names) into ``scratch_dir``."""
        from trainer import wire

        frame = None
        if self.rank == 0:
            files = None if path is None else {
                name: open(os.path.join(path, name), "rb").read() for name in sorted(os.listdir(path))
                if os.path.isfile(os.path.join(path, name))}
            frame = wire.pack_files(files, self.session_key)
        frame = self.broadcast_bytes(frame, limit)
        if self.rank == 0:
            return path
        try:
            files = wire.unpack_files(frame, self.session_key)
            return None if files is None else wire.write_files(files, scratch_dir)
        except wire.WireError as e:
            raise DistributedError(f"the checkpoint rank 0 on {self.peer_host(0)} sent is refused: {e}",
                                   failed_rank=0, failed_host=self.peer_host(0)) from None

    # ------------------------------------------------------------------ heartbeat, watchdog and blame

    def peer_host(self, rank: int) -> str:
        return self.peers[rank].host if rank in self.peers else "?"

    def _meet(self) -> None:
        """Every rank's host and pid, once (what blame names later, even when the
        store is gone with rank 0's process)."""
        self.signed.set("info", json.dumps({"host": self.host[:MAX_HOST_CHARS], "pid": os.getpid()}))
        keys = [self.signed.name("info", r) for r in range(self.world) if r != self.rank]
        self.store.wait(keys, datetime.timedelta(seconds=min(INFO_WAIT_S, self.timeout_s)))
        for r in range(self.world):
            if r != self.rank:
                got = self.signed.get("info", r)
                self.peers[r] = _peer_info(got[1] if got else "")

    def _beat(self) -> None:
        """The step and the heartbeat, signed (``rendezvous.Signed``): only ever set,
        never read back or added to, so nothing a stranger writes can stop it."""
        self.signed.set("step", str(int(self.step)))
        self.signed.set("beat", "")

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the store is gone (its host died): the watchdog will say so
                return

    def _watch_client(self):
        """A connection of the watchdog's own, with a short timeout: a call on the
        shared one waits up to distributed.timeout when the store's process is stopped."""
        import torch.distributed as dist

        client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                               timeout=datetime.timedelta(seconds=WATCH_IO_S), wait_for_workers=False)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):  # torchrun's store: its prefix
            client = dist.PrefixStore(f"/worker/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", client)
        return client

    def observe(self, client) -> None:
        """One watchdog reading: every other rank's signed counter; a move is dated on
        this clock. A stranger's value moves nothing (and is named); so is a write to
        the names strangers would guess, looked for by rank 0 every few readings."""
        beats = {r: self.signed.get("beat", r, client) for r in self.peers}
        now = time.monotonic()
        self.store_seen = now
        for r, got in beats.items():
            peer = self.peers[r]
            if got is not None and got[0] != peer.count:
                peer.count, peer.moved = got[0], now
        self._readings += 1
        if self.rank == 0 and self._readings % STRANGER_LOOK_EVERY == 1:  # one rank looks: the store's own
            self.signed.look_for_strangers(range(self.world), client)

    def _quiet(self, rank: int, now: float, limit: float) -> bool:
        """Whether ``rank``'s heartbeat has not moved for ``limit`` seconds, and no
        stranger wrote over it meanwhile (then its silence may be the stranger's doing:
        never a reason to blame it)."""
        return now - self.peers[rank].moved > limit and not self.signed.tampered("beat", rank, limit)

    def hung(self, now: float) -> Optional[tuple[int, str]]:
        """(rank, why) of a rank that stopped answering for distributed.timeout, or None."""
        quiet = now - self.store_seen
        if self.rank != 0 and quiet > self.timeout_s:
            return 0, f"the rendezvous store in its process has not answered for {quiet:.0f}s (stopped or unreachable)"
        for r, peer in sorted(self.peers.items()):
            if self._quiet(r, now, self.timeout_s):
                return r, f"its heartbeat has not moved for {now - peer.moved:.0f}s (stopped, hung or unreachable)"
        return None

    def _observe_loop(self) -> None:
        """Reads the others' counters once per WATCH_S. A store call on a stopped store
        process never returns (torch applies no timeout to ``add``): this thread then
        waits, and the watchdog, which never touches the store, sees the readings age."""
        client = None
        while not self._stop.wait(WATCH_S):
            try:
                client = client or self._watch_client()
                self.observe(client)
            except Exception:  # noqa: BLE001 - no answer is the evidence; a new connection is tried next time
                client = None

    def _watchdog_loop(self) -> None:
        while not self._stop.wait(WATCH_S):
            found = self.hung(time.monotonic())
            if found is None or self._stop.is_set():
                continue
            reporting = self._ending_since is not None and time.monotonic() - self._ending_since < BLAME_WAIT_S + 5
            if not self._ending.acquire(blocking=False) and reporting:
                continue  # a failed collective is being reported (and ends the process)
            rank, why = found
            error = DistributedError(f"watchdog on rank {self.rank} after step {self.step}: rank {rank} on "
                                     f"{self.peer_host(rank)} failed first ({why}); distributed.timeout "
                                     f"{self.timeout_s:g}s", failed_rank=rank, failed_host=self.peer_host(rank))
            if self.on_hung is not None:
                self.on_hung(error)  # writes the status and says the error
            else:
                print(f"error: DistributedError: {error}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(contract.EXIT_CRASH)

    def record_failure(self, message: str) -> None:
        """Tell the others this rank failed by itself (best effort), so they name it."""
        self._stop.set()
        try:
            self.signed.set("failed", message[:300])
        except Exception:  # noqa: BLE001 - the store may be gone too
            pass

    def _failed(self, client) -> dict[int, str]:
        """rank -> its own failure message, of this start (the store lives as long as
        rank 0's process); signed by that rank, else not believed."""
        said = {r: self.signed.get("failed", r, client) for r in self.peers}
        return {r: got[1][:300] for r, got in said.items() if got is not None}

    def _steps(self, client) -> dict[int, int]:
        out = {}
        for r in self.peers:
            got = self.signed.get("step", r, client)
            out[r] = int(got[1]) if got is not None and got[1].isdigit() and len(got[1]) < 20 else -1
        return out

    def blame(self) -> tuple[Optional[int], Optional[str], str]:
        """(rank, host, why) of the rank that failed first, as far as can be told."""
        deadline, client = time.monotonic() + BLAME_WAIT_S, None
        while True:
            if self.rank != 0 and time.monotonic() - self.store_seen > STALE_S:  # a call would never return
                return 0, self.peer_host(0), (f"its process, which holds the rendezvous store, has not answered "
                                              f"for {time.monotonic() - self.store_seen:.0f}s")
            try:  # over a connection of its own
                client = client or self._watch_client()
                failed, steps = self._failed(client), self._steps(client)
            except Exception:  # noqa: BLE001 - the store lives in rank 0's process: it is gone or unreachable
                if self.rank != 0:
                    return 0, self.peer_host(0), "its process, which holds the rendezvous store, is gone or unreachable"
                return None, None, "store gone"
            now = time.monotonic()
            for r in sorted(failed):
                return r, self.peer_host(r), f"it failed: {failed[r]}"
            for r, peer in sorted(self.peers.items()):
                if peer.host == self.host and peer.pid and not _alive(peer.pid):
                    return r, peer.host, f"its process (pid {peer.pid}) is gone"
            # The counter that stopped first, dated on this clock: a peer that only began
            # its own failure report later is not the culprit.
            for r, peer in sorted(self.peers.items(), key=lambda kv: kv[1].moved):
                if self._quiet(r, now, STALE_S):
                    return r, peer.host, f"its heartbeat stopped ({now - peer.moved:.0f}s without a beat)"
            if time.monotonic() > deadline:
                behind = min(steps.items(), key=lambda kv: kv[1], default=None)
                if behind is not None and behind[1] < self.step:
                    return behind[0], self.peer_host(behind[0]), f"it is behind (step {behind[1]}, this rank {self.step})"
                return None, None, "no peer is known to have failed"
            time.sleep(0.25)

    def failure(self, what: str, error: BaseException) -> DistributedError:
        # The heartbeat goes on while this process finds the culprit: stopping it here
        # would make this rank look dead to the others before the one that died.
        if not self._ending.acquire(blocking=False):
            while True:  # the watchdog is ending this process, naming the rank that hung
                time.sleep(60)
        self._ending_since = time.monotonic()
        rank, host, why = self.blame()
        who = f"rank {rank} on {host or '?'} failed first ({why})" if rank is not None else f"cause unknown ({why})"
        return DistributedError(f"{what} failed on rank {self.rank} after step {self.step}: {who}; "
                                f"torch: {type(error).__name__}: {str(error).strip().splitlines()[0][:300] if str(error).strip() else ''}",
                                failed_rank=rank, failed_host=host)


def _peer_info(raw: str) -> Peer:
    """A rank's host and pid as it wrote them (bounded; anything else is a '?')."""
    try:
        info = json.loads(raw[:4096])
        host, pid = info.get("host"), info.get("pid")
    except (ValueError, UnicodeDecodeError, AttributeError):
        return Peer()
    return Peer(host=host[:MAX_HOST_CHARS] if isinstance(host, str) and host.isprintable() else "?",
                pid=pid if isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < 1 << 31 else 0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
