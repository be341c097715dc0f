"""What the benches share: timing and this machine's counters, figures printed as
tables, fake hosts and throwaway runs for the controller benches, trainer processes
and their figures for the trainer benches, and the GPU helpers.

Only the standard library is imported here at the top: the controller benches run
where torch is not installed, the trainer benches where the controller's
dependencies may not be. Everything else is imported inside the function that needs
it. Run the benches from the repository root (``python -m bench.trainer.NAME``), which
puts ``dflashctl``, ``trainer`` and ``tests`` on the path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = {"tiny": 512, "small": 4096}  # presets with a small vocabulary; the qwen3-* presets have 151936


# --------------------------------------------------------------------------- timing and waiting


def median_ms(fn, repeat: int) -> float:
    """Median wall time of ``repeat`` calls of ``fn``, in milliseconds."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def wait_for(predicate, timeout: float, what: str):
    """``predicate()``'s first true value, polled every 0.1 s; exits the bench after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise SystemExit(f"timed out after {timeout:g}s waiting for {what}")


# --------------------------------------------------------------------------- this machine


def cpu_model() -> str:
    import platform

    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name")), platform.processor())


def proc_cpu_s(pid: int, children: bool = False) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat, fields 14 and 15),
    with ``children`` its reaped children's too (fields 16 and 17)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15 if children else 13]) / os.sysconf("SC_CLK_TCK")


def cpu_ms(pids: list[int]) -> float:
    """CPU time (user+system, with reaped children) of these processes and their
    descendants, in milliseconds: the sshd side of the work."""
    from tests.harness.sshd import descendants

    total = 0.0
    for pid in {p for root in pids for p in [root, *descendants(root)]}:
        try:
            total += proc_cpu_s(pid, children=True)
        except OSError:
            continue
    return total * 1000


def vm_hwm_kib() -> int:
    """This process's peak resident set so far (VmHWM), in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


# --------------------------------------------------------------------------- printing figures


def print_markdown(rows: list[tuple[str, str]], value_header: str = "median") -> None:
    """(measurement, figure) rows as a table to paste into bench/RESULTS.md."""
    print(f"| measurement | {value_header} |")
    print("| --- | --- |")
    for name, value in rows:
        print(f"| {name} | {value} |")


def print_modes(results: list[dict], columns: list[tuple[str, str, int]], each: str) -> None:
    """The restart benches' table: a row per mode (standby, cold), the median of each
    column's list (header, key, width), then every value of ``each``."""
    print(f"{'mode':<10} " + " ".join(f"{header:>{width}}" for header, _, width in columns) + "  each")
    for r in results:
        print(f"{'standby' if r['standby'] else 'cold':<10} "
              + " ".join(f"{statistics.median(r[key]):>{width}.2f}" for _, key, width in columns) + f"  {r[each]}")


# --------------------------------------------------------------------------- fake hosts and throwaway runs


def ssh_hosts(root: str | os.PathLike):
    """Real OpenSSH servers on loopback (tests/harness ``SshEnv``: a jump host,
    ``target`` behind it running every command through ``pct exec 200 --``, ``direct``,
    ``add_hosts(n, jump=...)`` for more); a context manager that stops them all."""
    from tests.harness import SshEnv

    return SshEnv(root)


def local_inventory(path: str | os.PathLike, hosts: dict[str, str]):
    """An inventory of ``transport: local`` hosts (name -> work directory), written to
    ``path`` and loaded: run hosts that are this machine."""
    import yaml

    from dflashctl.config import load_inventory

    Path(path).write_text(yaml.safe_dump({"hosts": {name: {"transport": "local", "workdir": str(workdir)}
                                                    for name, workdir in hosts.items()}}))
    return load_inventory(str(path))


def launch(root: Path, inventory, playbook: dict, tag: str = ""):
    """A run of ``playbook`` (the YAML's fields) launched as `dflashctl launch` does, into
    a store of its own: (store, run, playbooks folder). The playbook is written to
    ``root/playbooks{tag}/bench.yaml``, the store is ``root/runs{tag}.db``."""
    import yaml

    from dflashctl.config import load_playbook
    from dflashctl.hosts.bundle import build_bundle
    from dflashctl.launch import launch_run
    from dflashctl.store import Store

    playbooks = root / f"playbooks{tag}"
    playbooks.mkdir()
    path = playbooks / "bench.yaml"
    path.write_text(yaml.safe_dump(playbook))
    store = Store(str(root / f"runs{tag}.db"))
    run_id = launch_run(load_playbook(str(path), inventory=inventory), inventory, store, bundle=build_bundle()).run_id
    return store, store.get_run(run_id), str(playbooks)


@contextlib.contextmanager
def supervising(sup, name: str | None = None):
    """The supervisor ``sup`` looping in a thread of this process for the block; then
    stopped and joined."""
    stop = threading.Event()
    thread = threading.Thread(target=sup.run, args=(stop,), daemon=True, name=name)
    thread.start()
    try:
        yield thread
    finally:
        stop.set()
        thread.join(60)


def end_sessions(inventory, host: str, run) -> None:
    """Kill the run's tmux session and its standby's (the tmux socket of $DFLASHCTL_TMUX_SOCKET)."""
    from dflashctl.hosts.tmux import Tmux
    from dflashctl.runs.runhost import standby_session

    tmux = Tmux(inventory.get(host), inventory)
    tmux.kill(run.tmux_session)
    tmux.kill(standby_session(run.tmux_session))


def run_status(run_dir: str) -> dict:
    """The run directory's status.json, or {} while there is none."""
    from dflashctl.core import contract

    try:
        return json.loads(Path(run_dir, contract.STATUS_FILE).read_text())
    except (OSError, ValueError):
        return {}


def restart_arguments(doc: str) -> argparse.ArgumentParser:
    """The options of a restart bench (bench.controller.standby, restart, restart_wrapper)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--bucket", type=int, default=128)
    p.add_argument("--restarts", type=int, default=3)
    p.add_argument("--interval", type=float, default=0.5, help="supervisor poll interval (detection delay)")
    p.add_argument("--json", action="store_true")
    return p


def restart_trainer(args) -> dict:
    """A run that checkpoints every 4 steps and logs every step, for ``restart_arguments``."""
    return {"model": {"preset": args.preset, "drafter_layers": 2, "block_size": 8},
            "data": {"buckets": [args.bucket], "batch_size": 1, "max_anchors": 16},
            "placement": {"device": args.device, "target": [0], "drafter": [0]},
            "train": {"steps": 1_000_000, "log_every": 1, "checkpoint_every": 4}}


def both_modes(one_mode, args, name: str) -> list[dict] | None:
    """``one_mode(root, standby, args)`` with the standby on, then off, each in a fresh
    temporary directory, on the tmux socket ``bench-NAME-PID`` (unless
    $DFLASHCTL_TMUX_SOCKET names one). With ``args.json`` the results are printed as one
    JSON line and None is returned; else the results, for the bench's table."""
    from dflashctl.hosts.tmux import SOCKET_ENV

    os.environ.setdefault(SOCKET_ENV, f"bench-{name}-{os.getpid()}")
    results = []
    for standby in (True, False):
        with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as root:
            results.append(one_mode(Path(root), standby, args))
    if args.json:
        print(json.dumps(results))
        return None
    return results


def crash_after_checkpoint(store, run_id: str, run_dir: str, i: int, standby: bool):
    """Once the run has trained a step past a checkpoint (and, with ``standby``, its
    standby has done its imports): SIGKILL its trainer (every bench host is this
    machine) and wait until the supervisor's restart ``i`` reached its first step.
    Returns (the time of the kill, that restart row)."""
    from dflashctl.core import contract

    wait_for(lambda: store.get_run(run_id).state == "running" and run_status(run_dir).get("phase") == "training"
             and (run_status(run_dir).get("step") or 0) % 4 >= 1, 600, "a trained step past a checkpoint")
    if standby:
        wait_for(lambda: Path(run_dir, contract.STANDBY_FILE).exists()
                 and json.loads(Path(run_dir, contract.STANDBY_FILE).read_text())["pid"] != run_status(run_dir)["pid"],
                 600, "the standby's imports")
        time.sleep(1.0)
    killed_at = time.time()
    os.kill(run_status(run_dir)["pid"], signal.SIGKILL)
    row = wait_for(lambda: len(store.restarts(run_id)) > i and store.restarts(run_id)[i].time_to_first_step_s
                   is not None and store.restarts(run_id)[i], 600, f"restart {i + 1}'s first step")
    return killed_at, row


# --------------------------------------------------------------------------- trainer processes


def queue_depth(run_dir: str) -> int:
    """How many batches the target may run ahead of the drafters (the run's placement.queue_depth)."""
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            return int(json.load(f)["placement"]["queue_depth"])
    except (OSError, ValueError, KeyError, TypeError):
        return 2


def add_share_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--share", choices=["auto", "shared", "per_thread"],
                   help="how threads call compiled code (compile.share; default: the trainer's, auto)")


def apply_share(cfg: dict, args) -> dict:
    """``cfg`` with ``--share`` (``add_share_argument``) in its compile section, if given."""
    if getattr(args, "share", None):
        cfg.setdefault("compile", {})["share"] = args.share
    return cfg


def add_shape_arguments(p: argparse.ArgumentParser) -> None:
    """The options that shape the trainer config (reference_config); bench.trainer.reference
    and bench.trainer.multigpu take them."""
    p.add_argument("--config", help="trainer config JSON (or a dict with a 'trainer' key); overrides the reference shape")
    p.add_argument("--preset", default="qwen3-0.6b", help="target preset with random weights (default qwen3-0.6b)")
    p.add_argument("--drafter-layers", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step (default 16)")
    p.add_argument("--anchors", type=int, default=512, help="anchors per sequence (default 512)")
    p.add_argument("--bucket", type=int, default=2048, help="sequence length (default 2048)")
    p.add_argument("--layer-types", help="drafter layers as a comma list of full/sliding (default: all full)")
    p.add_argument("--mask-builder", choices=["direct", "compiled", "eager"],
                   help="how BlockMasks are built (default: the trainer's default)")
    p.add_argument("--eager-layers", action="store_true",
                   help="compile only flex_attention and the loss, not whole drafter layers (compile.drafter_layers: false)")
    p.add_argument("--loss-chunk", type=int, help="query positions per loss chunk (default: the trainer's)")
    p.add_argument("--target-gpus", metavar="LIST", help="GPU indices of the target threads, e.g. 0 or 0,1 "
                   "(default 0; the same list as --drafter-gpus shares those GPUs)")
    p.add_argument("--drafter-gpus", metavar="LIST", help="GPU indices of the drafter replicas (default 0)")
    p.add_argument("--loss-kernel", choices=["auto", "triton", "inductor"],
                   help="each compiled loss chunk's kernel (default: the trainer's, auto)")
    p.add_argument("--target-compile", choices=["on", "off"],
                   help="compile the target's decoder layers (compile.target; default: the trainer's default)")
    p.add_argument("--log-every", type=int, default=1,
                   help="steps per metrics line (default 1; the trainer's own default is 10): a line's "
                        "bookkeeping runs in the coordinator while the drafters launch their next step")
    p.add_argument("--residual", choices=["float32", "compute"],
                   help="the drafter's residual stream dtype (model.residual; default: the trainer's)")
    p.add_argument("--flex-kernel", choices=["auto", "triton", "default", "flash"],
                   help="flex_attention's kernel configuration (compile.flex_kernel; default: the trainer's, auto)")
    add_share_argument(p)
    p.add_argument("--steps", type=int, help="steps per run (default 20; 6 with --cpu-smoke)")
    p.add_argument("--timeout", type=float, default=1500, help="seconds per run before it is killed")
    p.add_argument("--cpu-smoke", action="store_true", help="a tiny CPU run of the whole bench")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="profile N steps after 5 (train.profile_steps); prints each run's profile.txt")


def reference_config(args) -> dict:
    """The trainer config of ``add_shape_arguments``' options (the reference shape by default)."""
    if args.cpu_smoke:
        cfg = {
            "model": {"preset": "tiny", "drafter_layers": 2, "block_size": 8},
            "data": {"buckets": [256], "max_anchors": 16, "batch_size": 2},
            "placement": {"device": "cpu", "target": [0], "drafter": [0]},
        }
    elif args.config:
        with open(args.config) as f:
            cfg = json.load(f)
        cfg = cfg.get("trainer", cfg)
    else:
        cfg = {
            "model": {"preset": args.preset, "drafter_layers": args.drafter_layers, "block_size": 16},
            "data": {"buckets": [args.bucket], "max_anchors": args.anchors, "batch_size": args.batch_size},
            "placement": {"device": "cuda", "target": [0], "drafter": [0], "queue_depth": 2},
            "compile": {"enabled": "on"},
        }
        if args.layer_types:
            cfg["model"]["layer_types"] = args.layer_types.split(",")
    if args.mask_builder:
        cfg.setdefault("compile", {})["mask_builder"] = args.mask_builder
    cfg.setdefault("train", {})
    cfg["train"].update({"steps": args.steps or (6 if args.cpu_smoke else 20), "log_every": getattr(args, "log_every", 1),
                         "checkpoint_every": 0})
    if getattr(args, "residual", None):
        cfg.setdefault("model", {})["residual"] = args.residual
    if args.eager_layers:
        cfg.setdefault("compile", {})["drafter_layers"] = False
    if getattr(args, "target_compile", None):
        cfg.setdefault("compile", {})["target"] = args.target_compile == "on"
    if getattr(args, "flex_kernel", None):
        cfg.setdefault("compile", {})["flex_kernel"] = args.flex_kernel
    if args.loss_chunk:
        cfg["train"]["loss_chunk"] = args.loss_chunk
    if getattr(args, "loss_kernel", None):
        cfg["train"]["loss_kernel"] = args.loss_kernel
    for role in ("target", "drafter"):
        if getattr(args, f"{role}_gpus", None):
            cfg.setdefault("placement", {})[role] = [int(g) for g in getattr(args, f"{role}_gpus").split(",")]
    if args.profile:
        cfg["train"].update({"profile_steps": args.profile, "profile_after": 5})
    return apply_share(cfg, args)


def write_shard(directory: str, cfg: dict, samples: int, *, spread: bool = False, name: str = "bench.jsonl") -> str:
    """A shard of random token ids (64 prompt tokens, the rest response), seeded: each
    sample fills the largest bucket, or with ``spread`` the lengths are spread over
    every bucket (each bucket gets batches)."""
    buckets = sorted(cfg["data"]["buckets"])
    vocab = VOCAB.get(cfg["model"].get("preset"), 151936) - 1  # the last id is the drafter's MASK
    rng = random.Random(0)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, name), "w") as f:
        for i in range(samples):
            n = buckets[-1]
            if spread:
                hi = buckets[i % len(buckets)]
                lo = buckets[i % len(buckets) - 1] + 1 if i % len(buckets) else min(hi, 160)
                n = rng.randint(lo, hi)
            ids = [rng.randrange(1, vocab) for _ in range(n)]
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * 64 + [1] * (n - 64)}) + "\n")
    return directory


def run_once(name: str, cfg: dict, work: str, cache_dir: str, timeout: float, *, run_dir: str | None = None,
             resume: bool = False, artifact_from: str | None = None) -> dict:
    """One ``python -m trainer`` process and its figures. ``run_dir`` (default
    ``work/name``) is resumed when ``resume``; ``artifact_from`` names an earlier run
    directory whose compile_cache/ is copied into this one before the start."""
    run_dir = run_dir or os.path.join(work, name)
    if artifact_from:
        shutil.rmtree(os.path.join(run_dir, "compile_cache"), ignore_errors=True)
        shutil.copytree(os.path.join(artifact_from, "compile_cache"), os.path.join(run_dir, "compile_cache"))
    cfg = json.loads(json.dumps(cfg))
    cfg.setdefault("compile", {})["cache_dir"] = cache_dir
    config_path = os.path.join(work, f"{name}.json")
    with open(config_path, "w") as f:
        json.dump(cfg, f)
    log_path = os.path.join(work, f"{name}.log")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    start = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "trainer", "--config", config_path, "--run-dir", run_dir,
                                 "--resume", "auto" if resume else "never"], cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT, env=env)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # every thread's stack into the log (faulthandler)
            time.sleep(3)
            proc.kill()
            code = "timeout"
    metrics = []
    if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            metrics = [json.loads(line) for line in f if line.strip()]
    metrics = [m for m in metrics if m["time"] >= start]  # a resumed run's directory holds the earlier lines too
    status = {}
    if os.path.exists(os.path.join(run_dir, "status.json")):
        with open(os.path.join(run_dir, "status.json")) as f:
            status = json.load(f)
    # After the first steps' allocator and cache effects, and before the last ones: the target
    # runs up to queue_depth batches ahead, so in a run's last steps it has finished and the
    # drafter has the GPU to itself (a 6-step run's steps 4-6 ran ~20 % faster than steady).
    every = max(1, int(cfg.get("train", {}).get("log_every", 1)))
    tail = -(-(max(queue_depth(run_dir), 1) + 1) // every)  # in metrics lines of ``every`` steps
    steady = metrics[len(metrics) // 2:len(metrics) - tail]
    throughput_steady = bool(steady)
    steady = steady or metrics[len(metrics) // 2:] or metrics

    def med(key):
        values = [m[key] for m in steady if m.get(key) is not None]
        return statistics.median(values) if values else None

    def med_each(key):  # per element of a list-valued field (one per drafter replica or queue)
        if not steady or not all(m.get(key) for m in steady):
            return None
        return [statistics.median(v) for v in zip(*(m[key] for m in steady))]

    result = {
        "run": name,
        "exit_code": code,
        "wall_s": round(time.time() - start, 1),
        "start_to_first_step_s": round(metrics[0]["time"] - start, 1) if metrics else None,
        "warmup_s": (metrics[-1].get("warmup_s") if metrics else None),
        "steps": len(metrics),
        "throughput_steady": throughput_steady,  # false: too few steps, the figures below include the tail
        "tok_s": med("tok_s"),
        "seq_tok_s": med("seq_tok_s"),
        "samples_s": med("samples_s"),
        "anchors_s": med("anchors_s"),
        "step_ms": med("step_ms"),
        "mfu": med("mfu"),
        "mfu_measured": med("mfu_measured"),
        "mfu_drafter": med("mfu_drafter"),
        "tflops": med("tflops"),
        "mfu_peak": metrics[-1].get("mfu_peak") if metrics else None,
        "loss": metrics[-1]["loss"] if metrics else None,
        # The last tenth of the run's metrics lines: what a training-quality comparison reads.
        "loss_last_tenth": mean_of(metrics[-max(1, len(metrics) // 10):], "loss"),
        "acc_last_tenth": mean_of(metrics[-max(1, len(metrics) // 10):], "acc"),
        "attention_path": metrics[-1].get("attention_path") if metrics else None,
        "dynamo": metrics[-1].get("dynamo") if metrics else None,
        "time_ms": metrics[-1].get("time_ms") if metrics else None,
        "gpu_mem": metrics[-1].get("gpu_mem") if metrics else None,
        "tok_s_per_drafter": med_each("tok_s_per_drafter"),
        "queue_depth": med_each("queue_depth"),
        "replica_checksums": metrics[-1].get("replica_checksums") if metrics else None,
        "first_step_ms": metrics[0].get("step_ms") if metrics else None,
        "recompiles": (metrics[-1].get("dynamo") or {}).get("recompiles") if metrics else None,
        "compile_cache": metrics[-1].get("compile_cache") if metrics else None,
        "compile_cache_detail": metrics[-1].get("compile_cache_detail") if metrics else None,
        "startup_s": metrics[-1].get("startup_s") if metrics else None,
        "last_step": metrics[-1]["step"] if metrics else None,
        "run_dir": run_dir,
        "status": status.get("phase"),
        "error": status.get("error"),
    }
    if code != 0:
        with open(log_path) as f:
            result["log_tail"] = f.read()[-(12000 if code == "timeout" else 2000):]
    return result


def mean_of(lines: list[dict], key: str):
    """The mean of ``key`` over the lines that have it (5 decimals), or None."""
    values = [m[key] for m in lines if m.get(key) is not None]
    return round(statistics.fmean(values), 5) if values else None


def cold_then_warm(work: str, cold: int, warm: int, tag: str = ""):
    """(kind, i, cache dir) for ``cold`` starts, each in a fresh compile cache, then
    ``warm`` starts on the last cold start's cache."""
    cache = None
    for kind, i in [("cold", i) for i in range(cold)] + [("warm", i) for i in range(warm)]:
        if kind == "cold":
            cache = os.path.join(work, f"cache-{tag}{i}")
            shutil.rmtree(cache, ignore_errors=True)
        yield kind, i, cache


def finish(summary: dict, work: str, keep: bool, ok: bool) -> int:
    """Print a bench's summary line, remove its temporary work directory unless it is
    to be kept, and give the exit status."""
    print(json.dumps(summary), flush=True)
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


# --------------------------------------------------------------------------- GPU helpers (torch imported here only)


def sync(device) -> None:
    """Wait for the GPU's queued work (a no-op on the CPU): before reading a clock."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reference_anchors(batch: int, ctx: int, anchors: int, block_size: int, device):
    """(anchors, valid) of a batch of full-length sequences (64 prompt tokens, the rest
    supervised), seeded: the masks every bench builds."""
    import torch

    from trainer.anchors import sample_anchors

    torch.manual_seed(0)
    loss_mask = torch.ones(batch, ctx, dtype=torch.bool, device=device)
    loss_mask[:, :64] = False
    return sample_anchors(loss_mask, anchors, block_size)
