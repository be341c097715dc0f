"""Stores as the supervisor leaves them, for the status views, the console, their
snapshots and benches: one scene per situation the status console must show
plainly (healthy, compiling, crashed and restarting, unreachable host,
unsupervised, stale data, no runs), all at the fixed time ``NOW`` (``build``); one
8-GPU host's readings (``host_store``) and its CPU and memory (``add_host_readings``,
``host_text``); three runs at the present time (``fill``: one training with a
restart and a regression, one failed, one launching); and ``check_schema``, the
parts of JSON Schema the status schema uses.

Everything is written through the real ``Store`` API into a real SQLite file;
playbooks are real YAML files the runs point at (``playbook_source``).
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

import yaml

from dflashctl.hosts.parsers import GpuReading, read_host_stats
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
        # No metrics line yet, but every poll reads the host: its GPUs hold the
        # compiling trainer's memory, barely busy.
        for ago in (18.0, 3.0):
            store.add_readings("gpu1", NOW - ago, gpus(8, util=2.0, used=20480.0, power=120.0))
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


# --------------------------------------------------------------------------- one host's GPUs


def host_store(tmp_path, observed_ago: float) -> Store:
    """A run holding GPUs 0-1 of an 8-GPU host; GPU 0 runs its trainer, GPU 5 a
    process of nobody's run, the others idle; the newest reading ``observed_ago`` old."""
    store = Store(str(tmp_path / "runs.db"))
    pb = playbook(tmp_path / "playbooks", "prod")
    store.create_run("prod", "gpu1", run_config(pb, placement={"target": [0], "drafter": [1]}), NOW - 1300,
                     run_id=PROD)
    store.transition(PROD, "running", "trainer started (pid 4343, phase training)", NOW - 1250)
    rows = gpus(8)
    for g in rows:
        g["apps"] = []
        if g["index"] > 1:
            g.update(utilization_pct=0.0, memory_used_mib=0.0, power_draw_w=70.0)
    rows[0]["apps"] = [{"pid": 4343, "name": "python3", "used_memory_mib": 88000.0, "role": "trainer"}]
    rows[5].update(utilization_pct=40.0, memory_used_mib=20480.0)
    rows[5]["apps"] = [{"pid": 777, "name": "/usr/bin/python3 notebook.py", "used_memory_mib": 20480.0, "role": None}]
    t = NOW - observed_ago
    store.add_samples(PROD, [{"time": t, "step": 5000, "tok_s": 12800.0, "loss": 2.0, "phase": "training"}],
                      gpu=rows, observed=t)
    beat(store, [PROD], NOW - 3, {"gpu1": {"last_ok": NOW - 3, "error": None, "down_since": None}})
    return store


# --------------------------------------------------------------------------- one host's CPU and memory


def host_text(cpus: int, load1: float, total: int, idle: int, mem_total_kib: int, mem_available_kib: int):
    """/proc text as a Linux host prints it."""
    user = total - idle
    return (f"{load1:.2f} {load1 * 0.9:.2f} {load1 * 0.8:.2f} 3/2113 88231\n",
            f"cpu  {user} 0 0 {idle} 0 0 0 0 0 0",
            f"MemTotal:       {mem_total_kib} kB\nMemAvailable:   {mem_available_kib} kB", cpus)


def add_host_readings(store: Store, run_id: str, *, interval: float = INTERVAL) -> None:
    """Two polls' readings of an 8-GPU host (192 CPUs, 2 TiB), ``interval`` apart, the
    newer one from the poll of the run's newest sample: 23 % busy between them,
    690 GiB of memory used. Parsed from /proc text, as the supervisor stores them;
    each on a copy of that sample (the run's progress is not changed)."""
    (last,) = store.recent_samples(run_id, 1)
    for back, total, idle in ((interval, 9_000_000_000, 7_000_000_000),
                              (0.0, 9_000_000_000 + 288_000, 7_000_000_000 + 221_760)):
        reading, problems = read_host_stats(*host_text(192, 44.31, total, idle, 2_113_929_216, 1_390_411_776))
        assert problems == []
        copy = {k: v for k, v in asdict(last).items() if k not in ("id", "run_id", "gpu", "observed", "host_reading")}
        store.add_samples(run_id, [{**copy, "time": last.time - back}], observed=(last.observed or last.time) - back,
                          host_reading=asdict(reading))


# --------------------------------------------------------------------------- three runs at the present time

RUN_A = "prod-20261129-101500-ab12"
RUN_B = "demo-20261129-101600-cd34"
RUN_C = "smoke-20261129-102300-ef56"
PROD_TOK_S = [12000.0 + 100 * i for i in range(8)]


def fill(store: Store, now: float) -> None:
    """Three runs as the supervisor leaves them: one training on two GPUs (with a
    restart and a regression warning), one failed, one still launching; one
    supervisor ticking for the first."""
    store.create_run("prod", "gpu1", {"trainer": {"train": {"steps": 120000},
                                                  "placement": {"target": [0], "drafter": [1]}}, "gpus": [0, 1]},
                     now - 500, run_id=RUN_A)
    store.transition(RUN_A, "running", "trainer started (pid 9, phase training)", now - 490)
    samples = [
        {"time": now - 80 + 10 * i, "step": 1000 + 50 * i, "tok_s": tok_s, "loss": 2.5 - 0.1 * i,
         "accept_len": 3.0 + 0.1 * i, "eta_s": 5 * 86400 - 100 * i, "phase": "training", "mfu": 0.41 + 0.001 * i}
        for i, tok_s in enumerate(PROD_TOK_S)
    ]
    store.add_samples(RUN_A, samples[:-1], observed=now - 10)
    gpus = [
        GpuReading(index=0, uuid="GPU-0", name="NVIDIA H200", memory_used_mib=90112, memory_total_mib=143771,
                   utilization_pct=100, temperature_c=61, power_draw_w=650.5, power_limit_w=700),
        GpuReading(index=1, uuid="GPU-1", name="NVIDIA H200", memory_used_mib=None, memory_total_mib=143771),
    ]
    store.add_samples(RUN_A, [samples[-1]], gpu=[g.__dict__ for g in gpus], observed=now - 5)
    store.add_restart(RUN_A, now - 300, "crash: CUDA out of memory", signature="cuda_oom")
    store.add_event(RUN_A, "regression", "4.3 Ktok/s = 34% of baseline; ETA 38.2 d > 7 d", now - 100, severity="warning")
    store.heartbeat("s1", pid=1, host="elsewhere", started=now - 600, interval=5.0, now=now - 2, runs=[RUN_A],
                    hosts={"gpu1": {"last_ok": now - 2, "error": None, "down_since": None}})

    store.create_run("demo", "local", {"trainer": {"train": {"steps": 200}}, "gpus": []}, now - 400, run_id=RUN_B)
    store.transition(RUN_B, "running", "trainer started", now - 390)
    store.add_samples(RUN_B, [{"time": now - 380 + i, "step": 10 * i, "tok_s": 900.0, "loss": 4.0, "phase": "training"}
                              for i in range(1, 4)])
    store.transition(RUN_B, "failed", "the trainer ended: crash", now - 50, exit_code=1, exit_reason="crash")

    store.create_run("smoke", "gpu1", {"trainer": {"train": {"steps": 400}}, "gpus": []}, now - 10, run_id=RUN_C)


# --------------------------------------------------------------------------- the status JSON schema


def check_schema(schema: dict, value, where: str = "$") -> None:
    """The parts of JSON Schema the status schema uses: type, const, required, properties, items."""
    kinds = {"object": dict, "array": list, "string": str, "number": (int, float), "integer": int,
             "boolean": bool, "null": type(None)}
    if "const" in schema:
        assert value == schema["const"], where
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        assert any(isinstance(value, kinds[t]) and not (t in ("number", "integer") and isinstance(value, bool))
                   for t in types), f"{where}: {value!r} is not {types}"
    for key in schema.get("required", []):
        assert key in value, f"{where}: no {key}"
    for key, sub in schema.get("properties", {}).items():
        if isinstance(value, dict) and key in value:
            check_schema(sub, value[key], f"{where}.{key}")
    if "items" in schema and isinstance(value, list):
        for i, item in enumerate(value):
            check_schema(schema["items"], item, f"{where}[{i}]")
