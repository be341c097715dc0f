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

Failure: every collective waits at most ``distributed.timeout`` seconds. Each
process beats a heartbeat (time, step, host, pid) into the rendezvous store every
second; when a collective fails, the process names the rank that failed first (one
that recorded its own failure, else one whose heartbeat stopped or whose process is
gone, else the one furthest behind), writes status ``failed`` with that rank and its
host, and exits with the crash code. This module never decides anything about the
model or the data; it only moves tensors and names failures. It imports torch only
inside its functions: train.run reads the file names before torch is imported.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from dflashctl import contract

ENV_KEYS = ("RANK", "WORLD_SIZE")
HEARTBEAT_S = 1.0
STALE_S = 4.0  # a heartbeat this old: that process is gone or frozen
BLAME_WAIT_S = 8.0  # after a failed collective, how long to wait for a culprit to show


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
class Group:
    """This process's place in the run and the collectives the trainer uses."""

    rank: int
    world: int
    local_rank: int
    backend: str
    timeout_s: float
    device: "torch.device"  # noqa: F821 - torch is imported lazily
    host: str = field(default_factory=host_name)
    step: int = 0  # last finished step, published in the heartbeat
    last_allreduce_s: float = 0.0
    extras: list = field(default_factory=list)  # per step: values summed over ranks with the gradients
    summed: list = field(default_factory=list)  # ... and their sums, after the all-reduce
    _stop: threading.Event = field(default_factory=threading.Event)

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def init(cls, cfg, device) -> "Group":
        import torch
        import torch.distributed as dist

        backend = cfg.distributed.backend
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = datetime.timedelta(seconds=cfg.distributed.timeout)
        dist.init_process_group(backend=backend, timeout=timeout)
        g = cls(rank=dist.get_rank(), world=dist.get_world_size(), local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                backend=backend, timeout_s=cfg.distributed.timeout, device=device)
        g._beat()
        threading.Thread(target=g._heartbeat_loop, name=f"heartbeat-rank{g.rank}", daemon=True).start()
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

    def broadcast_object(self, obj):
        import torch

        box = [obj]
        self._collective("broadcast_object", lambda: torch.distributed.broadcast_object_list(
            box, src=0, device=self.device if self.backend == "nccl" else None))
        return box[0]

    def broadcast_checkpoint(self, path: Optional[str], scratch_dir: str) -> Optional[str]:
        """Rank 0's checkpoint ``path`` (or None) as a directory this rank can load:
        rank 0 returns ``path``; the others receive its files into ``scratch_dir``."""
        files = None
        if self.rank == 0 and path is not None:
            files = {name: open(os.path.join(path, name), "rb").read() for name in sorted(os.listdir(path))
                     if os.path.isfile(os.path.join(path, name))}
        files = self.broadcast_object(files)
        if self.rank == 0 or files is None:
            return path
        os.makedirs(scratch_dir, exist_ok=True)
        for name, data in files.items():
            with open(os.path.join(scratch_dir, name), "wb") as f:
                f.write(data)
        return scratch_dir

    # ------------------------------------------------------------------ heartbeat and blame

    def _store(self):
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()

    def _beat(self) -> None:
        self._store().set(f"dflash/hb/{self.rank}", f"{time.time()} {self.step} {self.host} {os.getpid()}")

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the store is gone (its host died): the collective will say so
                return

    def record_failure(self, message: str) -> None:
        """Tell the others this rank failed by itself (best effort), so they name it."""
        self._stop.set()
        try:
            self._store().set(f"dflash/failed/{self.rank}", f"{time.time()} {message[:300]}")
        except Exception:  # noqa: BLE001 - the store may be gone too
            pass

    def _peers(self) -> dict[int, tuple[Optional[float], int, str, int, Optional[str]]]:
        """rank -> (heartbeat time, step, host, pid, own failure message) of every other rank."""
        store, out = self._store(), {}
        for r in range(self.world):
            if r == self.rank:
                continue
            beat, failed = None, None
            if store.check([f"dflash/hb/{r}"]):
                beat = store.get(f"dflash/hb/{r}").decode()
            if store.check([f"dflash/failed/{r}"]):
                failed = store.get(f"dflash/failed/{r}").decode().split(" ", 1)[1]
            t, step, host, pid = beat.split(" ") if beat else (None, "-1", "?", "0")
            out[r] = (float(t) if t else None, int(step), host, int(pid), failed)
        return out

    def blame(self) -> tuple[Optional[int], Optional[str], str]:
        """(rank, host, why) of the rank that failed first, as far as can be told."""
        deadline = time.monotonic() + BLAME_WAIT_S
        while True:
            try:
                peers = self._peers()
            except Exception:  # noqa: BLE001 - the store's host (rank 0, or torchrun's agent) is unreachable
                return (0, None, "the rendezvous store is unreachable") if self.rank != 0 else (None, None, "store gone")
            now = time.time()
            for r, (t, step, host, pid, failed) in sorted(peers.items()):
                if failed:
                    return r, host, f"it failed: {failed}"
            for r, (t, step, host, pid, failed) in sorted(peers.items()):
                if host == self.host and pid and not _alive(pid):
                    return r, host, f"its process (pid {pid}) is gone"
                if t is None or now - t > STALE_S:
                    return r, host, "its heartbeat stopped"
            if time.monotonic() > deadline:
                behind = min(peers.items(), key=lambda kv: kv[1][1])
                if behind[1][1] < self.step:
                    return behind[0], behind[1][2], f"it is behind (step {behind[1][1]}, this rank {self.step})"
                return None, None, "no peer is known to have failed"
            time.sleep(0.25)

    def failure(self, what: str, error: BaseException) -> DistributedError:
        self._stop.set()
        rank, host, why = self.blame()
        who = f"rank {rank} on {host or '?'} failed first ({why})" if rank is not None else f"cause unknown ({why})"
        return DistributedError(f"{what} failed on rank {self.rank} after step {self.step}: {who}; "
                                f"torch: {type(error).__name__}: {str(error).strip().splitlines()[0][:300] if str(error).strip() else ''}",
                                failed_rank=rank, failed_host=host)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

