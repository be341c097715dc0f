"""A host's readings of one poll: its GPUs with whose processes run there, its CPU and memory.

Stored on every poll that answers, whatever the host's runs wrote: a run starting,
compiling, checkpointing, stalled or restarting still shows its GPUs.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Iterable

from dflashctl.core import contract
from dflashctl.hosts.probe import HostProbe, ProbeResult
from dflashctl.supervise.supervisor_core.writes import Readings


def owners(results: Iterable[tuple[str, ProbeResult]]) -> dict[int, tuple[str, str]]:
    """pid -> (run id, ``trainer``, ``standby`` or ``warm-up helper``) of every run
    process a host's answer names."""
    out: dict[int, tuple[str, str]] = {}
    for run_id, pr in results:
        for pid in contract.warmup_helper_pids(pr.status):
            out[pid] = (run_id, "warm-up helper")
        if pr.standby_pid:
            out[pr.standby_pid] = (run_id, "standby")
        for pid in ((pr.status.pid if pr.status else None), (pr.process.pid if pr.process else None)):
            if pid:
                out[pid] = (run_id, "trainer")
    return out


def host_gpu_rows(answer: HostProbe, owned: dict[int, tuple[str, str]]) -> list[dict] | None:
    """Every GPU of the host (idle ones too), each with its compute processes (pid,
    name, MiB; ``role`` trainer or standby and ``run_id`` for a run's own, else
    None: a foreign process)."""
    rows = []
    for g in answer.gpus or []:
        apps = []
        for a in answer.compute_apps or []:
            if a.gpu_uuid and a.gpu_uuid == g.uuid:
                run_id, role = owned.get(a.pid or 0, (None, None))
                apps.append({"pid": a.pid, "name": a.process_name, "used_memory_mib": a.used_memory_mib,
                             "role": role, "run_id": run_id})
        rows.append({**g.__dict__, "apps": apps})
    return rows or None


def host_readings(host: str, answer: HostProbe, results: Iterable[tuple[str, ProbeResult]],
                  observed: float) -> Readings | None:
    """The write of one host's answer (None: it read neither GPUs nor CPU and memory)."""
    gpu = host_gpu_rows(answer, owners(results))
    reading = asdict(answer.host) if answer.host is not None else None
    if gpu is None and reading is None:
        return None
    return Readings(host, observed, gpu, reading)
