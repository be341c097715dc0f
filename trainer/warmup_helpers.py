"""Warm-up helpers: on a cold compile cache, the length buckets' graphs compiled in
processes of their own, side by side, instead of one bucket after another.

A cold start's warm-up compiles each bucket's graphs in turn (trainer/compile.py,
serialized warm-up). Much of it runs on one CPU (Dynamo's trace, inductor's code
generation) or waits on one graph's kernels, so buckets compiled at the same time in
separate processes overlap. A helper is this trainer started again on the same
config, told (``BUCKETS_ENV``) to warm up only some buckets and exit: it writes what
it compiled into the same compile cache (inductor's and Triton's caches, the saved
variants of ``compile.Shared``), and this process then warms those buckets up by
loading it.

- Helpers start only where the warm-up compiles (the compiled GPU path, serialized
  warm-up, not under torch.distributed, no regeneration), for 2 buckets or more, and
  by default one helper for every ``CPUS_PER_HELPER`` CPUs.
- This process keeps the largest bucket: its memory is this process's peak anyway.
  The helpers share the others out, largest first.
- Only a cold cache needs them: when this process's first compiled call loaded from
  the cache and compiled nothing, the helpers are stopped.
- Helpers start with this process, before its imports, so that theirs overlap.
- A helper's GPU memory is capped (``torch.cuda.set_per_process_memory_fraction``)
  at its share of half the memory free when it starts, so a helper that runs short
  fails, not this process; if this process still runs out of memory in its warm-up
  while a helper runs, the helpers are stopped and its job runs again.
- A helper that fails or is stopped costs only time: its buckets are compiled here,
  as without helpers, and the last lines of its log go into trainer.log.
- A helper shares nothing with the run but the compile cache and the bytecode cache:
  its own run directory (a private temporary one, removed with it), no artifacts, no
  checkpoint, no resume. It ends itself when this process is gone.

Standard library only (the helper's side reads its role before torch is imported).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Optional

from dflashctl.core import contract
from trainer import procgroup

BUCKETS_ENV = "DFLASH_WARMUP_HELPER_BUCKETS"  # the buckets a helper warms up, comma-separated
SHARE_ENV = "DFLASH_WARMUP_HELPER_SHARE"  # the helpers sharing half of each GPU's free memory
PARENT_ENV = "DFLASH_WARMUP_HELPER_PARENT"  # the pid a helper ends itself without
CPUS_PER_HELPER = 8  # each process's compile workers want a share of the CPUs
HELPER_LOG = "helper.log"
TAIL_LINES = 8

Job = tuple[str, int, Callable[[], None]]  # (thread name, bucket, forward + backward), as compile.Discipline runs them


# ---------------------------------------------------------------------------- the helper's side


@dataclass(frozen=True)
class Role:
    buckets: tuple[int, ...]
    share: int  # the helpers that share half of each GPU's free memory (``memory_fraction``)


def role(environ=os.environ) -> Optional[Role]:
    """This process's role when a trainer started it as a helper, else None."""
    raw = environ.get(BUCKETS_ENV)
    if raw is None:
        return None
    try:
        buckets = tuple(int(b) for b in raw.split(","))
        share = int(environ.get(SHARE_ENV, "1"))
    except ValueError:
        buckets, share = (), 0
    if not buckets or share < 1:
        raise ValueError(f"{BUCKETS_ENV}={raw!r} / {SHARE_ENV}={environ.get(SHARE_ENV)!r}: expected comma-separated "
                         "bucket lengths and a number of helpers of at least 1")
    return Role(buckets, share)


def end_with_parent(environ=os.environ, every_s: float = 1.0) -> None:
    """A helper whose trainer is gone (killed before it could stop it) ends itself."""
    parent = environ.get(PARENT_ENV)
    if parent:
        procgroup.end_with_parent(int(parent), every_s)


# ---------------------------------------------------------------------------- the trainer's side


def plan(buckets: list[int], wanted: Optional[int], cpus: int) -> list[list[int]]:
    """The buckets each helper warms up: none for fewer than 2 buckets; else ``wanted``
    helpers (``compile.warmup_processes``; None: one per ``CPUS_PER_HELPER`` CPUs), at
    most one per bucket but the largest, which this process keeps. Largest first, dealt
    out in turn."""
    others = sorted(set(buckets), reverse=True)[1:]
    n = min(len(others), cpus // CPUS_PER_HELPER if wanted is None else max(wanted, 0))
    return [others[i::n] for i in range(n)] if n else []


def memory_fraction(devices: list[tuple[int, int]], helpers: int) -> float:
    """A helper's cap on each GPU: half the memory free when it starts, over
    ``helpers``, as a fraction of the device's total (the tightest device's).
    ``devices``: (free, total) bytes."""
    return round(min(0.5 * free / total for free, total in devices) / max(helpers, 1), 4) if devices else 1.0


@dataclass
class Helper:
    buckets: list[int]
    proc: object  # subprocess.Popen
    directory: str
    started: float
    ended: Optional[str] = None  # finished / stopped / failed (exit N)
    seconds: Optional[float] = None

    def log_tail(self, lines: int = TAIL_LINES) -> str:
        return procgroup.log_tail(os.path.join(self.directory, HELPER_LOG), lines)


@dataclass
class Helpers:
    """The helpers of one warm-up; ``arrange`` puts them to use in its jobs."""

    helpers: list[Helper]
    log: Callable[[str], None]
    decided: Optional[str] = None  # 'cold' or 'warm', once a compiled call said which

    @classmethod
    def start(cls, commands: list[tuple[list[int], list[str], dict[str, str], dict[str, str]]],
              log: Callable[[str], None]) -> "Helpers":
        """Start each ``(buckets, argv, env, files)`` in a private temporary directory of
        its own, holding ``files`` (name -> text, 0600) and its output, ``helper.log``;
        ``argv`` names that directory as ``{dir}``."""
        helpers = []
        for buckets, argv, env, files in commands:
            directory = tempfile.mkdtemp(prefix="dflash-warmup-helper-")  # 0700
            try:
                for name, text in files.items():
                    with os.fdopen(os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600),
                                   "w") as f:
                        f.write(text)
                proc = procgroup.start([a.replace("{dir}", directory) for a in argv], env,
                                       log=os.path.join(directory, HELPER_LOG))
            except OSError as e:
                log(f"warm-up helpers: the one for bucket(s) {buckets} did not start ({e}); this process compiles them")
                shutil.rmtree(directory, ignore_errors=True)
                continue
            helpers.append(Helper(buckets, proc, directory, time.monotonic()))
        started = cls(helpers, log)
        _alive.append(started)
        if helpers:
            log(f"warm-up helpers: {len(helpers)} process(es) compile bucket(s) {[h.buckets for h in helpers]} "
                f"beside this one (pids {[h.proc.pid for h in helpers]})")
        return started

    @property
    def buckets(self) -> set[int]:
        return {b for h in self.helpers for b in h.buckets}

    def detail(self) -> dict:
        """For status.json's ``detail`` during the warm-up: the helpers still running."""
        return {contract.STATUS_WARMUP_HELPERS: [h.proc.pid for h in self.running()]}

    def running(self) -> list[Helper]:
        return [h for h in self.helpers if h.ended is None and h.proc.poll() is None]

    def _settle(self, helper: Helper) -> None:
        code = helper.proc.poll()
        if helper.ended is None and code is not None:
            helper.ended, helper.seconds = ("finished" if code == 0 else f"failed (exit {code})",
                                            time.monotonic() - helper.started)

    def stop(self, why: str) -> None:
        """End every helper still running, saying why."""
        stopped = self.running()
        for h in stopped:
            procgroup.end(h.proc)
            h.ended, h.seconds = "stopped", time.monotonic() - h.started
        if stopped:
            self.log(f"warm-up helpers: stopped the one(s) for bucket(s) {[h.buckets for h in stopped]}: {why}")

    def wait(self, should_stop: Callable[[], bool] = lambda: False, poll_s: float = 0.2) -> float:
        """Wait until every helper has exited (or ``should_stop``: they are stopped); say
        how each ended, with a failed one's last log lines. Returns the seconds waited."""
        t0 = time.monotonic()
        while self.running():
            if should_stop():
                self.stop("this trainer is stopping")
                break
            time.sleep(poll_s)
        waited = time.monotonic() - t0
        for h in self.helpers:
            self._settle(h)
            if h.ended and h.ended.startswith("failed"):
                self.log(f"warm-up helpers: the one for bucket(s) {h.buckets} {h.ended} after {h.seconds:.1f}s; "
                         f"this process compiles them. Its last lines: {h.log_tail()}")
        done = [f"{h.buckets} {h.ended} in {h.seconds:.1f}s" for h in self.helpers if h.seconds is not None]
        self.log(f"warm-up helpers: waited {waited:.1f}s for them; {'; '.join(done) or 'none ran'}")
        return waited

    def close(self, why: str = "the warm-up ended") -> None:
        """Stop what still runs and remove the helpers' directories."""
        self.stop(why)
        for h in self.helpers:
            shutil.rmtree(h.directory, ignore_errors=True)
        if self in _alive:
            _alive.remove(self)

    def see(self, compiled: int, loaded: int) -> None:
        """After one of this process's warm-up jobs, with the compiles and cache loads
        counted since the warm-up began: the first compiled call decides. One that loaded
        and compiled nothing means the cache is warm: the helpers are stopped."""
        if self.decided is not None or not (compiled or loaded):
            return
        self.decided = "cold" if compiled else "warm"
        if self.decided == "warm":
            self.stop("the compile cache is warm (this process's first compiled call loaded and compiled nothing)")

    def arrange(self, jobs: list[Job], counts: Callable[[], tuple[int, int]], should_stop: Callable[[], bool],
                out_of_memory: type = MemoryError, reset: Callable[[], None] = lambda: None) -> list[Job]:
        """``jobs`` reordered for the helpers: this process's own buckets first, each job
        followed by ``see(*counts())`` until the cache said cold or warm, and run again
        once if it ran ``out_of_memory`` while a helper ran (the helpers stopped, then
        ``reset``); then the helpers' buckets, the first of them after ``wait``: their
        compiled graphs are in the cache by then, or the helper failed and they compile here."""
        mine = [j for j in jobs if j[1] not in self.buckets]
        theirs = [j for j in jobs if j[1] in self.buckets]

        def own(fn):
            def job():
                try:
                    fn()
                except out_of_memory:
                    if not self.running():
                        raise
                    self.stop("this process ran out of GPU memory in its warm-up; its job runs again")
                    reset()
                    fn()
                self.see(*counts())
            return job

        def first_of_theirs(fn):
            def job():
                self.wait(should_stop)
                fn()
            return job

        arranged = [(name, bucket, own(fn)) for name, bucket, fn in mine]
        arranged += [(name, bucket, first_of_theirs(fn) if i == 0 else fn) for i, (name, bucket, fn) in enumerate(theirs)]
        return arranged


_alive: list[Helpers] = []  # started and not yet closed


def close_all(why: str) -> None:
    """Close every ``Helpers`` of this process still open (a start that ended early)."""
    for helpers in list(_alive):
        helpers.close(why)


def gpu_visible(environ=os.environ) -> bool:
    """Whether this process will see a GPU, told before torch is imported: a driver's
    GPUs listed (NVIDIA's, or ROCm's device) and CUDA_VISIBLE_DEVICES not emptied."""
    if environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    try:
        return bool(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return os.path.exists("/dev/kfd")


def helper_commands(config: dict, groups: list[list[int]], environ=os.environ) -> list[tuple[list[int], list[str], dict[str, str], dict[str, str]]]:
    """``python -m trainer`` once for each group of buckets, on ``config`` (this run's,
    as a dict) with what is the run's alone switched off (compile artifacts, helpers,
    fault injection), in the helper's own directory (``Helpers.start``)."""
    config = json.loads(json.dumps(config))  # a copy
    config["compile"].update(artifacts=False, warmup_processes=0)
    config["fault"] = {}
    files = {"config.json": json.dumps(config)}
    argv = [sys.executable, "-m", "trainer", "--config", "{dir}/config.json", "--run-dir", "{dir}/run", "--resume", "never"]
    commands = []
    for buckets in groups:
        env = {**environ, BUCKETS_ENV: ",".join(map(str, buckets)), SHARE_ENV: str(len(groups)),
               PARENT_ENV: str(os.getpid()),
               # this trainer's package first; the working directory (relative paths in the config) is this process's
               "PYTHONPATH": procgroup.pythonpath(environ)}
        commands.append((buckets, argv, env, files))
    return commands
