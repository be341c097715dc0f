"""What the supervisor sees, as values: probe results and metrics lines for the
supervisor core's tables (``make_state``, ``make_policy``, ``probe``, ``metrics``,
``healthy`` at ``T0``) and the detectors' tables (``obs``, ``steps``, ``gpu``,
``HEALTHY``, ``EXPECT`` at ``NOW``). No host, no store, no clock."""

from __future__ import annotations

import random

from dflashctl.config import Alerts, Expect, RestartPolicy
from dflashctl.core import contract
from dflashctl.hosts.parsers import GpuReading
from dflashctl.hosts.probe import ProbeArgs, ProbeResult, ProcessState
from dflashctl.store import Run
from dflashctl.supervise import supervisor_core as core
from dflashctl.supervise.detectors import Sample

# --------------------------------------------------------------------------- the supervisor core's tables

T0 = 1_800_000_000.0
PID = 4242


def make_state(state: str = "running", gpus=(), restart_issued: bool = False) -> core.RunState:
    run = Run(id="r1", playbook="pb", host="gpu1", state=state, created=T0 - 60, run_dir="/runs/r1",
              tmux_session="r1", config={"gpus": list(gpus)} if gpus else {})
    return core.RunState(run=run, args=ProbeArgs(run_dir="/runs/r1", session="r1"), restart_issued=restart_issued)


def make_policy(act: bool = True, expect: dict | None = None, **restart) -> core.Policy:
    restart = {"backoff_initial": 0.0, "jitter": 0.0, "standby": False, **restart}  # standby: its own tests
    expect = {"stall_window": 60.0, "compile_budget": 600.0, "startup_budget": 120.0, **(expect or {})}
    run = core.RunPolicy("pb", Expect(**expect), RestartPolicy(**restart), Alerts())
    return core.Policy(run, act=act, interval=1.0, rng=random.Random(0))


def probe(t: float, phase: str | None = "training", *, step: int = 0, alive: bool = True, state: str = "S",
          session: bool | None = True, exit_code: int | None = None, error: str | None = None,
          log: str = "", started: float = T0 - 50) -> ProbeResult:
    status = None
    if phase is not None:
        status = contract.Status(phase=phase, pid=PID, started=started, step=step, updated=t, error=error)
    return ProbeResult(
        run_dir="/runs/r1", session="r1", host_time=t, session_alive=session, pane_tail="", pane_dead=False,
        status=status, log_tail=log, metrics_offset=0, process=ProcessState(PID, alive, state if alive else None),
        exit_code=exit_code,
    )


def metrics(t: float, step: int, tok_s: float = 1000.0, loss: float | None = None,
            acc: float | None = None) -> contract.Metrics:
    return contract.Metrics(time=t, step=step, total_steps=1000, tok_s=tok_s, phase="training", loss=loss, acc=acc)


def healthy(t: float, step: int, tok_s: float = 1000.0, loss: float | None = None,
            acc: float | None = None) -> core.Probed:
    return core.Probed(probe(t, step=step), lines=(metrics(t, step, tok_s, loss, acc),))


# --------------------------------------------------------------------------- the detectors' tables

NOW = 1_800_000_000.0  # 2027-01-15 08:00:00 UTC
DAY = 86400.0
EXPECT = Expect(stall_window="5m", compile_budget="30m", startup_budget="10m", max_eta="7d")
OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB"
TRACEBACK = f'Traceback (most recent call last):\n  File "loop.py", line 9, in step\n    loss.backward()\n{OOM}\n'


def obs(
    phase: str = contract.PHASE_TRAINING,
    *,
    session_alive: bool | None = True,
    alive: bool = True,
    state: str = "S",
    exit_code: int | None = None,
    error: str | None = None,
    pane: str = "step 1200 ok",
    log: str | None = None,
    gpus: list[GpuReading] | None = None,
    started: float = NOW - 3600,
    step: int = 0,
    updated: float | None = None,
    pane_dead: bool | None = False,
    no_status: bool = False,
    detail: dict | None = None,
) -> ProbeResult:
    status = contract.Status(phase=phase, pid=4242, started=started, step=step, error=error, updated=updated,
                             detail=detail or {})
    return ProbeResult(
        run_dir="/runs/r",
        session="r",
        host_time=NOW,
        session_alive=session_alive,
        pane_tail=pane if session_alive else None,
        pane_dead=pane_dead,
        status=None if no_status else status,
        log_tail=log,
        process=ProcessState(4242, alive, state if alive or state == "Z" else None),
        exit_code=exit_code,
        gpus=gpus,
    )


def steps(*ages: float, tok_s: float = 12800.0, eta_s: float | None = 4 * DAY, first: int = 100) -> list[Sample]:
    """Training samples ``age`` seconds before NOW, one step-block apart."""
    return [
        Sample(time=NOW - age, step=first + 10 * i, tok_s=tok_s, eta_s=eta_s, total_steps=100_000)
        for i, age in enumerate(ages)
    ]


def gpu(mib: float, util: float = 0.0, index: int = 0) -> GpuReading:
    return GpuReading(index=index, memory_used_mib=mib, utilization_pct=util)


HEALTHY = steps(240, 180, 120, 60)
