"""The trainer's main: read top to bottom.

Phases written to status.json: starting -> compiling -> training (-> checkpointing)
-> done | stopped | failed. Exit codes: dflashctl.core.contract (EXIT_*).

Fault injection (``fault:`` in the config; for tests and drills, never production),
checked at each step boundary once ``after_steps`` optimiser steps are done:

- ``exit``: print ``message`` to stderr, write status ``failed`` with its signature,
  exit with ``exit_code`` at once (no checkpoint), as a crash would;
- ``hang``: stop making progress (status stays ``training``, no metrics) until a
  signal arrives, as a deadlock would;
- ``slow``: every step from then on takes ``factor`` times as long;
- ``raise_in_thread``: drafter thread 0 raises ``RuntimeError(message)``: the run
  must end ``failed`` with that signature.

With ``once: true`` (default) the fault fires in the first process of a run only: a
marker file ``fault_fired.json`` in the run directory disarms it, so a restart from
the last checkpoint recovers.

Started by torchrun (RANK, WORLD_SIZE, ... set), every process runs this same main
on its own devices and joins one process group: trainer/distributed.py says which
files each rank writes (rank 0 keeps the single-process names and the checkpoints;
rank q > 0 writes ``status.rank<q>.json`` and ``metrics.rank<q>.jsonl``), how the
gradients are all-reduced and how a failed peer is named. A stop request (signal)
on any rank stops every rank after the same step.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import sys
import threading
import time
import traceback
from typing import Callable, Optional

from dflashctl.core import contract
from dflashctl.core.contract import Metrics, Status, error_signature
from trainer import procgroup, warmup_helpers
from trainer.config import ConfigError, TrainerConfig

FAULT_MARKER = "fault_fired.json"


# ---------------------------------------------------------------------------- small helpers


class StatusFile:
    """status.json, kept in memory and rewritten atomically on every change."""

    def __init__(self, run_dir: str, filename: str = contract.STATUS_FILE):
        self.run_dir, self.filename = run_dir, filename
        self.status = Status(phase=contract.PHASE_STARTING, pid=os.getpid(), started=time.time())
        self.lock = threading.Lock()

    def set(self, phase: Optional[str] = None, *, blocking: bool = True, **changes) -> bool:
        """Apply and write; with ``blocking=False`` (a signal handler, which may have
        interrupted this very method on the same thread) skip when the lock is held."""
        if not self.lock.acquire(blocking=blocking):
            return False
        try:
            if phase:
                self.status.phase = phase
            for key, value in changes.items():
                setattr(self.status, key, value)
            self.status.updated = time.time()
            contract.atomic_write_text(os.path.join(self.run_dir, self.filename), self.status.to_json())
            return True
        finally:
            self.lock.release()


class StopRequest:
    """SIGTERM/SIGINT: the first asks for checkpoint-then-exit, a second exits at once.

    During the start-up (imports, models, the compile warm-up: ``at_once``) there is
    nothing of this process to save, so the first already exits, within a second,
    with no checkpoint; not while the target writes the data (its shards are kept
    whole) and not in a distributed run (its ranks stop together)."""

    def __init__(self, status: StatusFile):
        self.event = threading.Event()
        self.signals = 0  # SIGTERM/SIGINT received by this process
        self.signal_name: Optional[str] = None
        self.status = status
        self.pipeline = None  # stopped by run() when training ends in an exception
        self.group = None  # the torch.distributed group, when there is one (trainer/distributed.py)
        self.at_once = True  # a first signal exits now: no step made, nothing to save

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        self.signals += 1
        if self.signals > 1 or (self.at_once and self.group is None):  # a second signal, or during start-up
            print(f"{signal.Signals(signum).name} received: stopping now (no checkpoint: "
                  f"{'a second signal' if self.signals > 1 else 'no step made yet'})", file=sys.stderr, flush=True)
            self.status.set(contract.PHASE_STOPPED, blocking=False,
                            detail={"signal": signal.Signals(signum).name, "checkpoint": False})
            os._exit(contract.EXIT_STOPPED)
        self.signal_name = signal.Signals(signum).name
        self.event.set()
        print(f"{self.signal_name} received: checkpoint, then stop", file=sys.stderr, flush=True)

    def is_set(self) -> bool:
        return self.event.is_set()


def log(line: str) -> None:
    print(line, flush=True)


def process_start_time() -> Optional[float]:
    """Unix time this process was started (Linux /proc), to a clock tick, or None where
    that is not known or not believable (clock steps in a container).

    /proc/self/stat gives the start in clock ticks since boot; the time since boot is
    CLOCK_BOOTTIME's (the clock the kernel counts that start on). /proc/stat's btime
    would do as well but is whole seconds: up to a second early."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, in clock ticks
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - age if 0 <= age < 3600 else None


class Startup:
    """Where the time from process start to the first training step goes: seconds per
    phase, in order (``process``: interpreter start and the trainer's argument and
    config handling, up to ``train``). The restart downtime the controller sees is
    the sum, plus its own detection and relaunch."""

    def __init__(self):
        from trainer import standby

        now = time.time()
        self.start = standby.went_at or process_start_time() or now  # a standby starts when it takes over
        self.last = now
        self.phases: dict[str, float] = {"process": round(now - self.start, 2)}

    def mark(self, phase: str) -> None:
        now = time.time()
        self.phases[phase] = round(now - self.last, 2)
        self.last = now

    def total(self) -> float:
        return round(self.last - self.start, 2)


def resolve_devices(cfg: TrainerConfig, offset: int = 0):
    """(kind, target devices, drafter devices); ``offset`` shifts the GPU indices (several
    torch.distributed processes on one host, see trainer/distributed.py)."""
    import copy

    import torch

    p = copy.deepcopy(cfg.placement)
    p.target, p.drafter = [g + offset for g in p.target], [g + offset for g in p.drafter]
    kind = p.device if p.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cpu":  # indices only count threads: every one runs on the CPU
        return kind, [torch.device("cpu")] * len(p.target), [torch.device("cpu")] * len(p.drafter)
    if not torch.cuda.is_available():
        raise ConfigError(["placement.device: 'cuda' but torch sees no GPU (use 'auto' or 'cpu')"])
    n = torch.cuda.device_count()
    problems = [f"placement.{role}[{i}]: GPU {g} does not exist (this host has {n})"
                for role, ids in (("target", p.target), ("drafter", p.drafter)) for i, g in enumerate(ids) if not 0 <= g < n]
    if problems:
        raise ConfigError(problems)
    return kind, [torch.device("cuda", g) for g in p.target], [torch.device("cuda", g) for g in p.drafter]


def fault_armed(cfg: TrainerConfig, run_dir: str) -> bool:
    f = cfg.fault
    return f.kind is not None and not (f.once and os.path.exists(os.path.join(run_dir, FAULT_MARKER)))


def mark_fault(cfg: TrainerConfig, run_dir: str, step: int) -> None:
    contract.atomic_write_text(os.path.join(run_dir, FAULT_MARKER),
                               json.dumps({"kind": cfg.fault.kind, "step": step, "time": time.time()}))


def fault_signature(message: str) -> str:
    """``Type: text`` messages keep their type ("torch.OutOfMemoryError: CUDA out of memory")."""
    m = re.match(r"([A-Za-z_][\w.]*): (.*)", message)
    if m and m.group(1).rsplit(".", 1)[-1][:1].isupper():
        return error_signature(m.group(1), m.group(2))
    return error_signature("InjectedFault", message)


# ---------------------------------------------------------------------------- main


def run(cfg: TrainerConfig, run_dir: str, resume: str = "auto", install_signals: bool = True) -> int:
    """Train per ``cfg`` in ``run_dir``; returns the process exit code (contract.EXIT_*)."""
    from trainer import distributed

    os.makedirs(run_dir, exist_ok=True)
    status = StatusFile(run_dir, distributed.status_file(distributed.env_rank()))
    stop = StopRequest(status)
    if install_signals and threading.current_thread() is threading.main_thread():
        stop.install()  # before the first status: a stop from then on is handled (and said)
    status.set(contract.PHASE_STARTING)
    try:
        return train(cfg, run_dir, resume, status, stop)
    except Exception as e:  # noqa: BLE001 - every failure ends as status + exit code, never a hang
        code = report_failure(e, status, stop, traceback.format_exc())
        if stop.pipeline is not None:
            stop.pipeline.stop(timeout=5.0)
        return code
    finally:
        warmup_helpers.close_all("this start ended before its warm-up did")


def report_failure(e: BaseException, status: StatusFile, stop: StopRequest, trace: Optional[str]) -> int:
    """The failure's message on stderr, status ``failed`` with its signature (and, in a
    distributed run, the rank that failed first); returns the exit code to end with."""
    from trainer import distributed
    from trainer.data import DataError

    thread = getattr(e, "_dflash_thread", None)
    sig = error_signature(type(e).__name__, str(e))
    failed = ({"failed_rank": e.failed_rank, "failed_host": e.failed_host}
              if isinstance(e, distributed.DistributedError) else {})
    if stop.group is not None:
        failed = {"rank": stop.group.rank, "world_size": stop.group.world, **failed}
        if not isinstance(e, distributed.DistributedError):
            stop.group.record_failure(f"{type(e).__name__}: {e}")
    expected = isinstance(e, (DataError, ConfigError))  # the user's input: a message, no traceback
    code = (contract.EXIT_DATA_ERROR if isinstance(e, DataError)
            else contract.EXIT_CONFIG_ERROR if isinstance(e, ConfigError)
            else contract.EXIT_DISK_FULL if contract.disk_full_error(e) else contract.EXIT_CRASH)
    if not expected and trace:  # the traceback goes to trainer.log, where crash signatures are matched
        print(getattr(e, "_dflash_traceback", None) or trace, file=sys.stderr)
    where = f" in thread {thread}" if thread else ""
    print(f"error{where}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    try:
        status.set(contract.PHASE_FAILED, error=sig, detail={**status.status.detail, "exit_code": code, **failed,
                                                             "message": str(e)[:500], **({"thread": thread} if thread else {})})
    except OSError as written:  # a full disk takes status.json too: the exit code still says why
        print(f"error: status.json not written: {written}", file=sys.stderr, flush=True)
    return code


def checkpoint_limit(model) -> int:
    """The most bytes a checkpoint sent by rank 0 may hold: the trainable fp32 master
    copy and AdamW's two moments, twice over, plus room for the small files."""
    return 8 * 4 * sum(p.numel() for p in model.trainable_parameters()) + (64 << 20)


def will_compile(cfg: TrainerConfig) -> bool:
    """Whether this start's warm-up compiles, told before torch is imported: the
    compiled attention path (``compile.enabled`` on, or auto with a GPU in sight)."""
    c = cfg.compile
    return (c.enabled == "on" or (c.enabled == "auto" and cfg.placement.device != "cpu"
                                  and warmup_helpers.gpu_visible()))


def data_index_dir(run_dir: str) -> str | None:
    """Where the shards' scans are kept (trainer/data/index.py); None, said in
    trainer.log, where that directory cannot be made this user's alone."""
    from trainer.data import index

    try:
        return index.directory(run_dir)
    except (OSError, ValueError) as e:  # UnsafeDirectory: what another user put there is not read
        log(f"data: the shards' scans are not kept: {e}")
        return None


SCAN_WORKERS_MAX = 32


def scan_progress(status: StatusFile, log_every_s: float = 30.0) -> Callable[[dict], None]:
    """A first scan of the data spread over processes, as it goes: phase ``indexing``
    with status.json's ``detail.data`` every few seconds (the supervisor judges it by
    that beat, contract.PHASE_INDEXING), a line in trainer.log every ``log_every_s``."""
    last = {"status": 0.0, "log": time.monotonic()}

    def show(p: dict) -> None:
        now = time.monotonic()
        if now - last["status"] >= contract.REGENERATE_BEAT_S / 2:
            status.set(contract.PHASE_INDEXING, detail={**(status.status.detail or {}), "data": p}, blocking=False)
            last["status"] = now
        if now - last["log"] >= log_every_s:
            log(f"data: {p['shards_done']}/{p['shards']} shard(s) scanned, {p['bytes_done'] / 1e6:,.0f} of "
                f"{p['bytes'] / 1e6:,.0f} MB, {p['elapsed_s']:.0f}s")
            last["log"] = now

    return show


def log_index_use(dataset) -> None:
    """Which shards' scans were read back, and why the others were scanned."""
    dataset = getattr(dataset, "base", dataset)  # the training part of a data set with samples held out
    rescanned, kept = getattr(dataset, "rescanned", None), getattr(dataset, "kept", 0)
    if rescanned is None or not (kept or rescanned):
        return
    why = "; ".join(rescanned[:3]) + (f"; {len(rescanned) - 3} more" if len(rescanned) > 3 else "")
    log(f"data: {kept} of {kept + len(rescanned)} shard scan(s) read from <run>/data-index"
        + (f"; {len(rescanned)} scanned ({why})" if rescanned else ""))


def helper_plan(cfg: TrainerConfig, compiles: bool, multi: bool) -> list[list[int]]:
    """The buckets each warm-up helper compiles (trainer/warmup_helpers.py); none where
    helpers do not fit: a warm-up that is not serialized, under torch.distributed, with
    regeneration (the shards are written by this start), or where the warm-up compiles
    nothing and the config did not ask for helpers by number."""
    c, wanted = cfg.compile, cfg.compile.warmup_processes
    if (multi or cfg.data.regenerate is not None or wanted == 0 or (wanted is None and not compiles)
            or not c.serialized_warmup or c.unsafe_parallel_warmup):
        return []
    return warmup_helpers.plan(cfg.data.buckets, wanted, procgroup.cpus())


def train(cfg: TrainerConfig, run_dir: str, resume: str, status: StatusFile, stop: StopRequest) -> int:
    # ---------------------------------------------------------------- torch, devices, seeds
    startup = Startup()
    from trainer import bytecode as bytecode_mod
    from trainer import compile_cache, distributed, imports

    try:
        helper = warmup_helpers.role()  # started by another trainer to warm up some buckets only
    except ValueError as e:
        raise ConfigError([str(e)]) from None
    if helper:
        warmup_helpers.end_with_parent()

    hidden = imports.hide_unused()
    bytecode = bytecode_mod.keep(cfg.compile.cache_dir)  # before the imports it speeds up
    if bytecode_mod.drop_if_outdated(bytecode, os.environ.get(contract.ARTIFACT_GENERATION_ENV)):
        log(f"compile_cache: bytecode cache {bytecode} emptied (compile artifacts were removed on the controller)")
    travelled = (compile_cache.load_bytecode(run_dir, bytecode, compile_cache.pre_import_fields(cfg))
                 if cfg.compile.artifacts else None)
    if travelled:
        log(f"compile_cache: bytecode {travelled}")
    # One process a host compiles ahead: under torch.distributed the host's other ranks share its cache.
    # A warm-up helper's trainer compiled ahead already.
    ahead = (None if travelled or helper or os.environ.get("LOCAL_RANK", "0") != "0"
             else bytecode_mod.compile_ahead(bytecode))
    # Warm-up helpers start now: their imports overlap this process's.
    groups = [] if helper else helper_plan(cfg, will_compile(cfg), distributed.requested())
    helpers = warmup_helpers.Helpers.start(warmup_helpers.helper_commands(cfg.to_dict(), groups), log) if groups else None
    try:  # an import that fails ends the bytecode compile it started, too
        package_map = imports.remember_package_map(cfg.compile.cache_dir)
        imports.prehash_triton()
        import torch

        from trainer import checkpoint
        from trainer import compile as compile_mod
        from trainer import torch_api
        from trainer import pipeline as pl
        from trainer.anchors import sample_anchors
        from trainer.attention import FLEX_COMPILED, paths_ran, select_attention_path
        from trainer.data import build_source
        from trainer.loss import resolve_kernel
        from trainer.optim import build_optimizer, build_scheduler
        from trainer.profiling import StepProfiler
        from trainer.step import compute_loss
        from trainer.target import default_dtype
    except BaseException:
        bytecode_mod.stop_ahead(ahead)
        raise

    imports.show_again(hidden)
    ahead_state = bytecode_mod.stop_ahead(ahead)
    startup.mark("import")
    log(f"imports: installed-package map {package_map}; kept from importing: {', '.join(hidden) or 'nothing'}"
        + (f"; bytecode compiled ahead by worker processes ({ahead_state})" if ahead_state else ""))
    multi = distributed.requested()
    kind, target_devs, drafter_devs = resolve_devices(cfg, distributed.device_offset(cfg.placement) if multi else 0)
    main_dev = drafter_devs[0]
    group = stop.group = distributed.Group.init(cfg, main_dev, run_dir) if multi else None
    if group:  # a peer that hung: this process ends with it named, whatever its main thread waits on
        group.on_hung = lambda error: report_failure(error, status, stop, None)
    rank, world = (group.rank, group.world) if group else (0, 1)
    if group:
        if not group.authenticated:
            log("distributed: no rendezvous key: the rendezvous is not authenticated (a run started by hand)")
        log(f"distributed: rank {rank} of {world} ({group.backend}, local rank {group.local_rank}, host {group.host}), "
            f"collective timeout {cfg.distributed.timeout:g}s")
    try:
        cache = compile_mod.setup_cache(cfg.compile.cache_dir, main_dev)
    except contract.UnsafeDirectory as e:  # refused before anything is compiled into it or loaded from it
        raise ConfigError([f"UnsafeDirectory: {e}"]) from None
    gpus = sorted({d for d in target_devs + drafter_devs if d.type == "cuda"}, key=str)
    if helper and gpus:  # short of memory, the helper fails, not its trainer
        fraction = warmup_helpers.memory_fraction([torch.cuda.mem_get_info(d) for d in gpus], helper.share)
        for dev in gpus:
            torch.cuda.set_per_process_memory_fraction(fraction, dev)
        log(f"warm-up helper: at most {fraction:.3f} of the memory of {[str(d) for d in gpus]}")
    compute_dtype = default_dtype(cfg.model, main_dev)
    random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    path = select_attention_path(main_dev, cfg.compile.enabled, cfg.compile.allow_eager,
                                 cfg.compile.mask_builder, cfg.compile.flex_kernel)
    if helpers and path.name != FLEX_COMPILED and cfg.compile.warmup_processes is None:
        helpers.close(f"this start compiles nothing (attention {path.name})")
        helpers = None
    try:
        loss_kernel = resolve_kernel(cfg.train.loss_kernel, main_dev) if path.name == FLEX_COMPILED else "eager"
    except ValueError as e:
        raise ConfigError([str(e)]) from None
    log(f"devices: target {[str(d) for d in target_devs]}, drafter {[str(d) for d in drafter_devs]}; "
        f"compute {compute_dtype}, residual {cfg.model.residual}; attention {path.describe()}; "
        f"loss {loss_kernel}; compile cache {cache}"
        + (f"; bytecode cache {bytecode}" if bytecode else ""))
    startup.mark("devices")

    # ---------------------------------------------------------------- target(s) and drafter replicas
    targets, replicas = pl.build_models(cfg, target_devs, drafter_devs, compute_dtype)
    if path.name == FLEX_COMPILED:
        # Unsafe on purpose: every thread compiles its own copy at the same moment.
        share = compile_mod.set_sharing("per_thread" if cfg.compile.unsafe_parallel_warmup else cfg.compile.share)
        why = torch_api.check_one("aot_compile") if cfg.compile.share == "auto" and share == "per_thread" else None
        log(f"compile: {'each graph compiled once, shared by every thread' if share == 'shared' else 'a compiled copy per thread'}"
            f" (compile.share {cfg.compile.share}{f'; aot_compile: {why}' if why else ''})")
    if path.name == FLEX_COMPILED and cfg.compile.drafter_layers:
        for replica in replicas:
            replica.compile_layers()
    first, master = targets[0], replicas[0]
    optimizer = build_optimizer(master.trainable_parameters(), cfg, main_dev)
    scheduler = build_scheduler(optimizer, cfg)
    startup.mark("models")

    # ---------------------------------------------------------------- data
    if cfg.data.regenerate is not None:  # the target writes the responses first (trainer/data/regenerate.py)
        from trainer.data.regenerate import ensure_regenerated

        cfg.run_dir = run_dir
        status.set(contract.PHASE_REGENERATING)
        stop.at_once = False  # the shards are written whole: a stop waits for the one being written
        written = ensure_regenerated(cfg, str(first.device), log, target=first, should_stop=stop.is_set,
                                     on_progress=lambda p: status.set(
                                         detail={**(status.status.detail or {}), "regenerate": p}, blocking=False))
        if written is None:  # a stop asked while the target wrote: its shards are kept, nothing to checkpoint
            status.set(contract.PHASE_STOPPED, detail={"signal": stop.signal_name, "checkpoint": False,
                                                       "regenerate": "stopped"})
            return contract.EXIT_STOPPED
        stop.at_once = True
        status.set(contract.PHASE_STARTING)  # the startup budget counts again from here
        startup.mark("regenerate")
    # After the regeneration: its decoding (a KV cache one token longer every step) would
    # recompile a compiled layer at every step until the recompile limit.
    if path.name == FLEX_COMPILED and cfg.compile.target:
        for target in {id(t): t for t in targets}.values():  # threads on one device share a target
            target.compile_layers()
    source = build_source(cfg, first.vocab_size, master.mask_token_id, index_dir=data_index_dir(run_dir),
                          workers=min(procgroup.cpus(), SCAN_WORKERS_MAX), progress=scan_progress(status), log=log)
    log(f"data: {len(source.dataset)} samples, {source.order.per_epoch} batches per epoch, buckets "
        f"{source.buckets_used()}, {source.dataset.errors.count} bad records skipped, {source.dataset.short} too short")
    log_index_use(source.dataset)
    if status.status.phase == contract.PHASE_INDEXING:
        status.set(contract.PHASE_STARTING)  # the startup budget counts again from here
    startup.mark("data")

    # ---------------------------------------------------------------- resume
    start_step, tokens_total, first_batch = 0, 0, 0
    latest = checkpoint.latest(run_dir) if resume == "auto" and rank == 0 else None
    if group:  # rank 0 decides; the others load the same checkpoint, sent over the group
        latest = group.broadcast_checkpoint(latest, os.path.join(run_dir, f".resume-rank{rank}"),
                                            checkpoint_limit(master))
    if latest:
        meta = checkpoint.load(latest, master, optimizer, scheduler)
        if int(meta.get("world_size", 1)) != world:
            raise ConfigError([f"resume: checkpoint {os.path.basename(latest)} was written by a run of "
                               f"{meta.get('world_size', 1)} process(es); this run has {world} (WORLD_SIZE). "
                               "Resume it with the same number of processes, or start a new run directory"])
        start_step, tokens_total = int(meta["step"]), int(meta.get("tokens", 0))
        first_batch = source.order.resume_from(meta["data"])
        pl.broadcast_parameters(replicas)
        log(f"resumed from {latest}: step {start_step}, data epoch {meta['data']['epoch']} "
            f"position {meta['data']['position']}")
    total_steps = cfg.train.steps
    status.set(step=start_step)
    startup.mark("checkpoint")
    if start_step >= total_steps:
        status.set(contract.PHASE_DONE, step=start_step)
        log(f"nothing to do: checkpoint step {start_step} >= train.steps {total_steps}")
        return contract.EXIT_DONE

    n_devices = len(set(target_devs) | set(drafter_devs))
    discipline = compile_mod.Discipline(cfg, n_devices + len(replicas), enabled=path.name == FLEX_COMPILED,
                                        guard_eager_flex=path.name == FLEX_COMPILED and not cfg.compile.allow_eager)
    pipe = pl.Pipeline(cfg=cfg, source=source, targets=targets, target_devices=target_devs, replicas=replicas,
                       drafter_devices=drafter_devs, attention_path=path, discipline=discipline,
                       compute_loss=compute_loss, sample_anchors=sample_anchors, start_step=start_step,
                       total_steps=total_steps, first_batch=first_batch, compute_dtype=compute_dtype,
                       rank=rank, world=world)
    replicas_ran = lambda steps_done: first_batch + (steps_done - start_step) * len(replicas) * world  # noqa: E731
    if group:
        group.step = start_step
        group.broadcast_parameters(master.trainable_parameters())  # bit-identical from the first step
        pl.broadcast_parameters(replicas)

    def save(steps_done: int) -> None:
        if rank != 0:  # rank 0 writes the drafter and the optimiser; every rank holds the same
            return
        status.set(contract.PHASE_CHECKPOINTING)
        checkpoint.save(run_dir, steps_done, master, optimizer, scheduler, source.order.state(replicas_ran(steps_done)),
                        extra={"tokens": tokens_total, "config": cfg.to_dict(), "data_fingerprint": source.fingerprint(),
                               "world_size": world},
                        keep=cfg.train.keep_checkpoints)

    # ---------------------------------------------------------------- compile: artifacts, then warm-up before threads run free
    log(torch_api.describe(torch_api.check()))  # a private use that moved is named before the warm-up
    discipline.enter_thread()  # for every thread: the pipeline's, and torch's own backward threads
    if discipline.enabled:
        log(f"compile: a new thread sees {discipline.check_in_force()}")  # raises if it does not see the limits
    artifacts = compile_cache.Outcome()
    cache_fields: dict = {}
    if path.name == FLEX_COMPILED and cfg.compile.artifacts:
        status.set(contract.PHASE_COMPILING, detail={"mode": discipline.mode, "compile_cache": "loading"})
        cache_fields = compile_cache.key_fields(cfg, target_devs + drafter_devs)
        artifacts = compile_cache.load(run_dir, cache_fields)
        log(f"compile_cache: {artifacts.status}"
            + (f" (loaded {artifacts.bytes / 2**20:.1f} MiB in {artifacts.load_s:.1f}s)" if artifacts.loaded else "")
            + (f" ({artifacts.note})" if artifacts.note else "")
            + ("" if artifacts.status == "hit" else f"; key {artifacts.key}, {cache_fields}"))
    artifacts.bytecode = travelled
    startup.mark("compile_cache")
    status.set(contract.PHASE_COMPILING, detail={"mode": discipline.mode, "compile_cache": artifacts.status})
    jobs = pl.warmup_jobs(pipe)
    if helper:
        jobs = [job for job in jobs if job[1] in helper.buckets]
        log(f"warm-up helper: bucket(s) {list(helper.buckets)} only, for the trainer that started it")
    elif helpers:
        def totals() -> tuple[int, int]:  # graphs compiled, graphs loaded: torch's caches and the shared variants
            compiled, loaded = torch_api.cache_outcomes()
            return compiled + compile_mod.shared_compiles(), loaded + compile_mod.shared_loaded()

        base = totals()

        def counts() -> tuple[int, int]:  # since the warm-up began
            compiled, loaded = totals()
            return compiled - base[0], loaded - base[1]

        def reset() -> None:  # what a warm-up job that ran out of memory may have left
            for replica in replicas:
                replica.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()

        jobs = helpers.arrange(jobs, counts, stop.is_set, out_of_memory=torch.OutOfMemoryError, reset=reset)
    try:
        discipline.warmup(jobs, lambda progress: status.set(
            detail={"mode": discipline.mode, "compile_cache": artifacts.status, **progress,
                    **(helpers.detail() if helpers else {})}), should_stop=stop.is_set)
    finally:
        if helpers:
            helpers.close()
    log(f"compile: {discipline.mode} warm-up {discipline.warmup_s:.1f}s, {torch_api.dynamo_counters()}, "
        f"{compile_mod.shared_compiles()} graph(s) compiled once for every thread, "
        f"{compile_mod.shared_loaded()} loaded from the compile cache; compile seconds by phase "
        f"{torch_api.compile_seconds()}")
    startup.mark("warmup")
    if helper:  # its compiled graphs are in the cache: the trainer that started it trains
        status.set(contract.PHASE_DONE)
        return contract.EXIT_DONE
    save_pending = artifacts.status != "off" and rank == 0

    def save_artifacts_once_locked() -> None:
        """After the warm-up locked recompiles (in this thread or, without serialized
        warm-up, in the step that compiled the last shape): save what was compiled."""
        nonlocal save_pending
        if not save_pending or discipline.frames_ok_after_warmup is None:
            return
        save_pending = False
        if compile_cache.should_save(artifacts, torch_api.dynamo_counters()["fxgraph_cache_miss"]
                                     + compile_mod.shared_compiles()):
            compile_cache.save_in_background(run_dir, cache_fields, cfg, artifacts, log, bytecode_prefix=bytecode)

    save_artifacts_once_locked()

    # ---------------------------------------------------------------- training
    status.set(contract.PHASE_TRAINING, detail={"warmup_s": round(discipline.warmup_s, 2), "compile_mode": discipline.mode,
                                                "compile_cache": artifacts.status})
    metrics_path = os.path.join(run_dir, distributed.metrics_file(rank))
    flops = pl.flop_model(cfg, first, master)
    peak, measured_peak, peak_name = pl.peak_flops(main_dev)
    fault, slow_factor = (cfg.fault if fault_armed(cfg, run_dir) else None), 1.0
    stop.pipeline = pipe
    # The warm-up ran these replicas' first batches: step 1's window begins with those passes.
    handed_from = min((h.started for h in pipe.handoff.values()), default=None)
    if pipe.handoff:
        log(f"warm-up: replica(s) {sorted(pipe.handoff)} ran their first batch: step {start_step + 1} uses it")
    stop.at_once = False  # steps are made from here on: a stop checkpoints them first
    if not stop.is_set() or group:  # a signal during start-up or warm-up: straight to the checkpoint
        pipe.start()  # (distributed: after one step that every rank takes)
    window = pl.Window() if handed_from is None else pl.Window(start=handed_from)
    train_start = last_release = window.start  # a step's period: from one release of the drafters to the next
    slow_period = None  # fault kind=slow: the normal period, measured when it fires
    steps_done, last_saved = start_step, (start_step if latest else None)
    profiler = StepProfiler(run_dir, start_step + cfg.train.profile_after, cfg.train.profile_steps, log)
    global_loss: list[float] = []  # per step of the window: the mean loss over every replica of every rank
    global_tokens = 0  # query tokens of the window, over every rank

    for step in range(start_step, total_steps):
        profiler.before(step)
        # ---- fault injection (tests and drills; see the module docstring)
        if fault is not None and step >= fault.after_steps:
            mark_fault(cfg, run_dir, step)
            if fault.kind == "exit":
                print(fault.message, file=sys.stderr, flush=True)
                status.set(contract.PHASE_FAILED, error=fault_signature(fault.message),
                           detail={"fault": "exit", "exit_code": fault.exit_code, "message": fault.message[:500]})
                os._exit(fault.exit_code)
            if fault.kind == "hang":
                log(f"fault: hanging before step {step + 1}")
                # Wait in slices: a signal the kernel hands to another thread never wakes a
                # wait without a timeout, and the handler only runs once this thread wakes.
                while not stop.event.wait(0.2):
                    pass
            if fault.kind == "raise_in_thread":
                pipe.inject_raise = fault.message
            slow_factor = fault.factor if fault.kind == "slow" else 1.0
            fault = None  # fired

        # ---- wait for every replica's gradients
        # (distributed: every rank finishes the step, then all stop together after it)
        reports = pipe.collect(step, should_stop=(lambda: False) if group else stop.is_set)
        if reports is None:
            break  # stop requested: the step in flight is dropped, the last finished one is saved
        for rep in reports:
            if not math.isfinite(rep.loss):
                raise FloatingPointError(f"loss is {rep.loss} at step {step + 1} (replica {rep.replica}, batch {rep.index})")

        # ---- all-reduce onto the master copy, clip, AdamW, copy back into every replica
        if group:  # summed over ranks with the gradients: loss, tokens, stop requests
            group.extras = [sum(r.loss for r in reports), float(sum(r.query_tokens for r in reports)),
                            1.0 if stop.is_set() else 0.0]
        allreduce_s, optim_s, grad_norm = pl.optimizer_step(replicas, drafter_devs, optimizer, scheduler, cfg.optim.grad_clip,
                                                            across=group.allreduce_gradients if group else None)
        step_tokens = sum(r.query_tokens for r in reports)
        stop_after = stop.is_set()  # one process: its own request, read once per step
        if group:
            loss_sum, step_tokens, stops = group.summed
            # Every rank decides on the same all-reduced count: a signal that lands after
            # this step's all-reduce rides the next one, so no rank leaves a collective early.
            stop_after = stops > 0
            step_tokens = int(round(step_tokens))
            global_loss.append(loss_sum / (len(replicas) * world))
            global_tokens += step_tokens
            if stops > 0 and not stop.is_set():
                stop.signal_name = "stop requested on another rank"
                stop.event.set()
        if slow_factor > 1:  # holding the release stalls every thread, so the whole run slows by the factor
            slow_period = slow_period or (time.monotonic() - train_start) / (step + 1 - start_step)
            time.sleep(max(0.0, last_release + slow_factor * slow_period - time.monotonic()))
        pipe.release(step)
        now = time.monotonic()
        step_s, last_release = now - last_release, now
        steps_done = step + 1
        tokens_total += step_tokens
        if group:
            group.step = steps_done
        window.add(reports, allreduce_s, optim_s, step_s, grad_norm, end=now)
        profiler.after(steps_done)
        if step == start_step:
            startup.mark("first_step")
            log(f"startup: first step {startup.total():.1f}s after process start: {startup.phases}")
            status.set(detail={**status.status.detail, "startup_s": startup.phases})
        save_artifacts_once_locked()

        # ---- metrics
        if steps_done % cfg.train.log_every == 0 or steps_done == total_steps:
            f = pl.window_fields(window, len(replicas), flops, peak, len(set(drafter_devs)), len(set(target_devs)),
                                 n_devices if kind == "cuda" else 0, measured_peak)
            eta_s = (total_steps - steps_done) * (window.end - window.start) / max(1, window.steps)
            if group:
                dist_fields = {"rank": rank, "world_size": world, "loss_rank": f["loss"], "tok_s_rank": f["tok_s"],
                               "param_checksum": pl.replica_checksums([master])[0],
                               "dist_allreduce_ms": round(1000 * group.last_allreduce_s, 2)}
                f = {**f, "loss": sum(global_loss) / len(global_loss),
                     "tok_s": global_tokens / max(1e-9, window.end - window.start)}
                global_loss, global_tokens = [], 0
            extra = {
                **f["extra"], "lr": scheduler.get_last_lr()[0], "queue_depth": pipe.queue_depths(),
                **({"replica_checksums": pl.replica_checksums(replicas)} if len(replicas) > 1 else {}),
                **pl.target_stats(pipe, now - train_start), "attention_path": path.name,
                "attention_calls": paths_ran(), "dynamo": compile_mod.counters_report(discipline),
                "gpu_mem": pl.gpu_memory(target_devs + drafter_devs), "data_errors": source.dataset.errors.count,
                "gpus": {"target": [str(d) for d in target_devs], "drafter": [str(d) for d in drafter_devs]},
                "epoch": source.order.state(replicas_ran(steps_done))["epoch"], "mfu_peak_flops": peak,
                "mfu_peak": peak_name, "warmup_s": round(discipline.warmup_s, 2), "elapsed_s": round(now - train_start, 2),
                "compile_cache": artifacts.status, "compile_cache_detail": artifacts.summary(),
                "startup_s": startup.phases, **(dist_fields if group else {}),
            }
            m = Metrics(time=time.time(), step=steps_done, total_steps=total_steps, tokens=tokens_total,
                        tok_s=f["tok_s"], loss=f["loss"], acc=f["acc"], accept_len=f["accept_len"], eta_s=eta_s, extra=extra)
            contract.append_line(metrics_path, m.to_line())
            log(f"step {steps_done}/{total_steps} loss {f['loss']:.4f} acc {f['acc'] or 0:.3f} accept_len "
                f"{f['accept_len'] or 0:.2f} tok/s {f['tok_s']:.0f} eta {eta_s:.0f}s")
            status.set(contract.PHASE_TRAINING, step=steps_done)
            window = pl.Window(start=last_release)

        # ---- checkpoint
        if cfg.train.checkpoint_every and steps_done % cfg.train.checkpoint_every == 0 and steps_done < total_steps:
            save(steps_done)
            last_saved = steps_done
            status.set(contract.PHASE_TRAINING, step=steps_done)
        if stop_after:
            break

    # ---------------------------------------------------------------- shutdown
    profiler.close()
    stragglers = pipe.stop(timeout=5.0)
    if stragglers:
        log(f"warning: threads still running at shutdown: {stragglers}")
    if steps_done != (last_saved if last_saved is not None else start_step):  # no step since: nothing to save
        save(steps_done)
    if stop.is_set():
        status.set(contract.PHASE_STOPPED, step=steps_done, detail={"signal": stop.signal_name, "checkpoint": steps_done})
        log(f"stopped at step {steps_done} ({stop.signal_name}); checkpoint saved")
        return contract.EXIT_STOPPED
    if group:
        group.close()
    status.set(contract.PHASE_DONE, step=steps_done)
    log(f"done: {steps_done} steps, {tokens_total} tokens")
    return contract.EXIT_DONE
