"""Scenes for the status console (no tests here): stores as the supervisor leaves them, one per situation the status console must
show plainly (healthy, compiling, crashed and restarting, unreachable host,
unsupervised, stale data, no runs), all at the fixed time ``NOW``, for the
console's tests and snapshots (tests/test_tui.py, tests/test_tui_snapshots.py)
and its bench (bench/bench_status.py).

Everything is written through the real ``Store`` API into a real SQLite file;
playbooks are real YAML files the runs point at (``playbook_source``).
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from dflashctl.store import Store

NOW = 1_800_000_000.0  # 2027-01-15 08:00:00 UTC
INTERVAL = 15.0
H200 = "NVIDIA H200"

PROD = "prod-20270115-074000-ab12"
DEMO = "demo-20270115-073000-cd34"
SMOKE = "smoke-20270115-075000-ef56"
OLD = "prod-20270114-120000-0a0a"

SCENES = ("healthy", "compiling", "restarting", "unreachable", "unsupervised", "stale", "empty")


def playbook(directory: Path, name: str, **expect) -> str:
    """A real playbook file (host gpu1, 8 GPUs: target 0-4, drafters 5-7)."""
    raw = {
        "host": "gpu1",
        "trainer": {"model": {"preset": "tiny"}, "train": {"steps": 120000},
                    "placement": {"target": [0, 1, 2, 3, 4], "drafter": [5, 6, 7]}},
        "poll_interval": f"{INTERVAL:g}s",
        "expect": {"baseline_tok_s": 13000, "compile_budget": "45m", "startup_budget": "10m", "stall_window": "5m",
                   **expect},
    }
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(path)


def gpus(n: int = 8, util: float = 97.0, used: float = 90112.0, temp: float = 61.0, power: float = 650.0,
         wobble: int = 0) -> list[dict]:
    return [{"index": i, "uuid": f"GPU-{i}", "name": H200, "memory_used_mib": used - 1024 * (i % 3),
             "memory_total_mib": 143771.0, "utilization_pct": max(0.0, util - 3 * ((i + wobble) % 4)),
             "temperature_c": temp + i % 5, "power_draw_w": power - 10 * (i % 4), "power_limit_w": 700.0}
            for i in range(n)]


def run_config(source: str, steps: int = 120000, placement: dict | None = None) -> dict:
    placement = placement or {"target": [0, 1, 2, 3, 4], "drafter": [5, 6, 7]}
    held = sorted({*placement.get("target", []), *placement.get("drafter", [])})
    return {"trainer": {"train": {"steps": steps}, "placement": placement}, "gpus": held,
            "playbook_source": source}


def beat(store: Store, runs: list[str], last_tick: float, hosts: dict, *, pid: int = 4242, stopped: bool = False,
         supervisor: str = "sup-1") -> None:
    store.heartbeat(supervisor, pid=pid, host="ops", started=NOW - 3600, interval=INTERVAL, now=last_tick,
                    runs=runs, hosts=hosts, stopped=stopped)


def training(store: Store, run_id: str, start: float, end: float, *, step0: int = 1000, every: float = 10.0,
             tok_s: float = 12800.0, steps_per_s: float = 5.0, gpu_every: int = 1, noisy_eta: bool = False,
             observed_lag: float = 1.0) -> None:
    """Training samples every ``every`` seconds from ``start`` to ``end`` (trainer's
    clock = local clock here), each with GPU readings."""
    t, i = start, 0
    rows = []
    while t <= end + 1e-6:
        step = step0 + int((t - start) * steps_per_s)
        eta = (120000 - step) / steps_per_s * ((2.8 if i % 2 else 1.0) if noisy_eta else 1.0)
        rows.append((t, {"time": t, "step": step, "tok_s": tok_s + 150 * ((i * 7) % 5 - 2), "loss": 2.4 - 0.0001 * i,
                         "accept_len": 3.1 + 0.001 * i, "eta_s": eta, "phase": "training", "mfu": 0.41},
                     gpus(wobble=i) if i % gpu_every == 0 else None))
        t += every
        i += 1
    for t, sample, gpu in rows:
        store.add_samples(run_id, [sample], gpu=gpu, observed=t + observed_lag)


def build(scene: str, root: Path) -> Store:
    """The store of one scene, under ``root`` (runs.db, playbooks/)."""
    store = Store(str(root / "runs.db"))
    pbs = root / "playbooks"
    prod_pb = playbook(pbs, "prod")
    up = {"gpu1": {"last_ok": NOW - 4, "error": None, "down_since": None, "skew_s": 0.0}}
    if scene == "empty":
        return store

    # A finished run of the same playbook, always there: history in the list.
    store.create_run("prod", "gpu1", run_config(prod_pb), NOW - 72000, run_id=OLD, claim_gpus=False)
    store.transition(OLD, "running", "trainer started (pid 1000, phase compiling)", NOW - 71900)
    training(store, OLD, NOW - 71000, NOW - 70000, every=100.0, gpu_every=1000)
    store.transition(OLD, "done", "the trainer ended: done", NOW - 69000, exit_code=0, exit_reason="done")

    if scene == "compiling":
        store.create_run("prod", "gpu1", run_config(prod_pb), NOW - 800, run_id=PROD)
        store.transition(PROD, "running", "trainer started (pid 4343, phase compiling)", NOW - 720)
        beat(store, [PROD], NOW - 3, up)
        # The probe's GPU readings arrive with samples only: none while compiling.
        return store

    store.create_run("prod", "gpu1", run_config(prod_pb), NOW - 1300, run_id=PROD)
    store.transition(PROD, "running", "trainer started (pid 4343, phase compiling)", NOW - 1250)
    if scene == "healthy":
        training(store, PROD, NOW - 600, NOW - 5, step0=1000, noisy_eta=True)
        store.add_event(PROD, "supervisor", "supervisor pid 4242 attached", NOW - 1240)
        beat(store, [PROD, DEMO], NOW - 3, {**up, "local": {"last_ok": NOW - 3, "error": None, "down_since": None}})
        demo_pb = playbook(pbs, "demo", baseline_tok_s=None)
        store.create_run("demo", "local", run_config(demo_pb, 300, {"device": "cpu"}), NOW - 120, run_id=DEMO)
        store.transition(DEMO, "running", "trainer started (pid 777, phase starting)", NOW - 115)
        store.add_samples(DEMO, [{"time": NOW - 100 + 10 * i, "step": 10 * i, "tok_s": 900.0 + 5 * i,
                                  "loss": 4.0 - 0.1 * i, "accept_len": 0.5 + 0.2 * i, "phase": "training"}
                                 for i in range(1, 10)], observed=NOW - 8)
        return store
    if scene == "restarting":
        training(store, PROD, NOW - 900, NOW - 300, step0=1000)
        store.add_event(PROD, "crash", "crash: CUDA out of memory (cuda_oom)", NOW - 290, severity="error",
                        detail={"signature": "cuda_oom"})
        store.add_restart(PROD, NOW - 280, "crash: CUDA out of memory", signature="cuda_oom", step_before=4000)
        store.transition(PROD, "restarting", "restart 1/5 in 10 s: crash: CUDA out of memory", NOW - 281)
        beat(store, [PROD], NOW - 2, up)
        return store
    if scene == "unreachable":
        training(store, PROD, NOW - 900, NOW - 200, step0=1000)
        down = {"gpu1": {"last_ok": NOW - 190, "error": "connection refused", "down_since": NOW - 160}}
        store.add_event(PROD, "unreachable", "gpu1 unreachable for 2.7 m: connection refused", NOW - 30,
                        severity="error")
        store.transition(PROD, "lost", "host gpu1 unreachable", NOW - 130)
        beat(store, [PROD], NOW - 5, down)
        return store
    if scene == "unsupervised":
        training(store, PROD, NOW - 900, NOW - 310, step0=1000)
        beat(store, [PROD], NOW - 300, {"gpu1": {"last_ok": NOW - 300, "error": None, "down_since": None}})
        return store
    if scene == "stale":
        training(store, PROD, NOW - 900, NOW - 120, step0=1000)
        beat(store, [PROD], NOW - 4, {"gpu1": {"last_ok": NOW - 120, "error": None, "down_since": None}})
        return store
    raise ValueError(scene)


def utc() -> None:
    """Clock times drawn in UTC, whatever this machine's zone (snapshots compare text)."""
    os.environ["TZ"] = "UTC"
    import time

    time.tzset()
