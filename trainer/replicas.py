"""The drafter replicas' maths: gradients averaged, parameters copied, checksums compared.

The coordinator (the main thread, trainer/train.py) runs these between steps: the
replicas' gradients summed onto the master copy (replica 0) in replica order, the
optimiser step, then the master's parameters copied into every other replica, so all
stay bit-identical; ``replica_checksums`` proves it in the metrics line.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def sync_all(devices: list[torch.device]) -> None:
    for dev in set(devices):
        _sync(dev)


def trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def reduce_gradients(replicas: list) -> None:
    """Average the replicas' gradients onto replica 0 (the master), in replica order."""
    master = trainable(replicas[0])
    if len(replicas) == 1:
        return
    for replica in replicas[1:]:
        for pm, pr in zip(master, trainable(replica)):
            if pr.grad is None:
                continue
            g = pr.grad.to(pm.device, non_blocking=True)
            if pm.grad is None:
                pm.grad = g.clone()
            else:
                pm.grad.add_(g)
    scale = 1.0 / len(replicas)
    for pm in master:
        if pm.grad is not None:
            pm.grad.mul_(scale)


@torch.no_grad()
def broadcast_parameters(replicas: list) -> None:
    """Copy the master's parameters into every other replica (exact copies: bit-identical)."""
    master = trainable(replicas[0])
    for replica in replicas[1:]:
        for pm, pr in zip(master, trainable(replica)):
            pr.copy_(pm, non_blocking=True)
    for replica in replicas:
        replica.zero_grad(set_to_none=True)


def optimizer_step(replicas: list, devices: list[torch.device], optimizer, scheduler, grad_clip: float,
                   across: Optional[Callable[[list], None]] = None) -> tuple[float, float, float]:
    """The coordinator's part of a step: all-reduce, clip, AdamW, schedule, copy to replicas.

    ``across(master_params)``, when given, averages the master's gradients over the
    processes of a torch.distributed run (trainer/distributed.py), after the
    in-process reduction; its time counts as all-reduce time.
    Returns (allreduce seconds, optimiser seconds, gradient norm before clipping).
    """
    from trainer.optim import clip_grads

    t0 = time.monotonic()
    reduce_gradients(replicas)
    sync_all(devices)
    if across is not None:
        across(trainable(replicas[0]))
    t1 = time.monotonic()
    grad_norm = clip_grads(trainable(replicas[0]), grad_clip)
    optimizer.step()
    scheduler.step()
    broadcast_parameters(replicas)
    sync_all(devices)
    return t1 - t0, time.monotonic() - t1, grad_norm


def build_models(cfg, target_devices: list[torch.device], drafter_devices: list[torch.device], dtype: torch.dtype):
    """(targets, replicas): one frozen target per device (threads on a device share it) and one
    drafter replica per drafter thread, all equal to replica 0 (the master copy)."""
    from trainer.model import Drafter
    from trainer.target import build_target

    by_device: dict = {}
    for dev in target_devices:
        if dev not in by_device:
            by_device[dev] = build_target(cfg.model, dev, dtype)
    targets = [by_device[d] for d in target_devices]
    torch.manual_seed(cfg.train.seed)
    replicas = []
    for dev in drafter_devices:
        shared = by_device.get(dev, targets[0])  # the frozen embed/lm_head of a target on this device, if any
        # Built on its device: the weights' initialisation runs there (on a GPU, milliseconds
        # instead of most of a second of CPU random numbers, then no copy).
        with dev:
            replicas.append(Drafter(cfg.model, targets[0].config, shared.embed_tokens, shared.lm_head).to(dev))
    broadcast_parameters(replicas)
    return targets, replicas


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHECKSUM_SLICE = 1 << 22  # elements per slice: bounds the int64 temporaries to ~100 MB


@torch.no_grad()
def replica_checksums(replicas: list) -> list[str]:
    """Per replica, a checksum of its trainable weights' bits: a position-weighted
    integer sum computed on the replica's own device in slices, one host sync per
    replica. Bit-identical replicas give equal strings; any differing bit changes
    it (all but surely)."""
    out = []
    for replica in replicas:
        acc = None
        for i, p in enumerate(trainable(replica), start=1):
            flat = p.detach().contiguous().view(-1)
            ints = flat.view(_INT_OF_SIZE[flat.element_size()])
            for start in range(0, ints.numel(), _CHECKSUM_SLICE):
                part = ints[start:start + _CHECKSUM_SLICE].to(torch.int64)
                weights = (torch.arange(start, start + part.numel(), device=part.device) % 65521) + i
                term = (part * weights).sum()  # int64, wraps
                acc = term if acc is None else acc + term
        out.append(f"{int(acc) & (2 ** 64 - 1):016x}")
    return out


def replicas_identical(replicas: list) -> bool:
    master = trainable(replicas[0])
    return all(torch.equal(pm.detach().cpu(), pr.detach().cpu())
               for replica in replicas[1:] for pm, pr in zip(master, trainable(replica)))
