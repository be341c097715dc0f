"""The compile discipline of the threaded trainer (docs/trainer.md, "Compile discipline").

torch.compile is not thread safe: concurrent first compiles of flex_attention
forward and backward in several threads deadlock with no error. So:

1. length buckets are fixed (config), so shapes are known up front;
2. every device x bucket forward AND backward is compiled before the threads run
   free, one at a time (``serialized_warmup``; progress goes to status.json in the
   ``compiling`` phase), or, with ``serialized_warmup: false``, every step runs under
   one global lock until each device x bucket has been through once;
3. the recompile limits cover devices x buckets with a margin, are set in every
   thread (Dynamo's config is per thread from torch 2.12), and hitting one raises
   instead of silently running uncompiled;
4. after the warm-up ``set_stance("fail_on_recompile")``: a new shape raises;
5. the eager flex_attention fallback warning is an error, and Dynamo's counters are
   reported in every metrics line;
6. ``TORCHINDUCTOR_CACHE_DIR`` lives under ``compile.cache_dir``, in a sub-directory
   keyed by torch version, triton version and GPU model (entries are valid for the
   same three only); what the warm-up compiled also travels with the run directory
   (trainer/compile_cache.py), loaded before the warm-up on a host whose key matches.

7. no two threads share Dynamo's cache of one code object: Dynamo keeps its cache
   entries in a list on the code object and reorders it on every hit, with no lock, so
   two threads looking up one code object can each skip the entry the other just moved
   and recompile (then ``fail_on_recompile`` raises) long after the warm-up. Either
   every thread (a "lane": one target or drafter thread, named as the thread) calls a
   compiled copy of its own (``PerLane``: one code object per lane; the default), or
   every graph is compiled once, ahead of its call, and called without Dynamo by every
   thread (``Shared``, ``compile.share: shared``: a cold start compiles each graph once
   instead of once per thread, but torch's on-disk AOTAutograd cache is bypassed for
   it, so a warm start compiles again).

``compile.unsafe_parallel_warmup`` replaces 2 with every thread's first forward +
backward at the same moment, skips 4, and exists to reproduce the deadlock on a
GPU. Never use it in production.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
import types
import warnings
import weakref
from typing import Any, Callable, Hashable, Iterator, Optional

import torch

from dflashctl.core import contract
from trainer import torch_api

EAGER_FLEX_WARNING = "flex_attention called without torch.compile"
# Each compiled function sees at most 3 variants per bucket and device: a drafter
# layer is compiled for full and for sliding attention (different mask functions)
# and once more for the first layer (its input, from the frozen embedding, needs
# no gradient); the loss for its full chunk and its last, shorter one.
_VARIANTS = 3


# ---------------------------------------------------------------------------- cache


def cache_key(device: torch.device) -> str:
    """'torch-2.11.0+cu130_triton-3.6.0_NVIDIA-H200': what a cache entry is valid for."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    key = f"torch-{torch.__version__}_triton-{triton_version}_{gpu}"
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", key)


def setup_cache(cache_dir: Optional[str], device: torch.device) -> Optional[str]:
    """Point inductor and triton at the persistent cache; returns the keyed directory."""
    if not cache_dir:
        return os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    path = contract.private_dir(os.path.join(os.path.abspath(os.path.expanduser(cache_dir)), cache_key(device)),
                                "compile cache")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    os.environ["TRITON_CACHE_DIR"] = os.path.join(path, "triton")
    return path


# ---------------------------------------------------------------------------- one code object per lane

_lane = threading.local()


@contextlib.contextmanager
def lane(name: str) -> Iterator[None]:
    """Run the block as lane ``name``: the warm-up compiles, in the main thread, the
    code that the thread of that name runs later."""
    prior = getattr(_lane, "name", None)
    _lane.name = name
    try:
        yield
    finally:
        _lane.name = prior


def current_lane() -> str:
    return getattr(_lane, "name", None) or threading.current_thread().name


def own_code(fn: Callable, tag: str) -> types.FunctionType:
    """A copy of the function ``fn`` whose code object is its own (named ``<name>__<tag>``)."""
    tag = re.sub(r"[^A-Za-z0-9_]+", "_", tag)
    code = fn.__code__
    changes: dict[str, Any] = {"co_name": f"{code.co_name}__{tag}"}
    if hasattr(code, "co_qualname"):  # Python 3.11+
        changes["co_qualname"] = f"{code.co_qualname}__{tag}"
    copy = types.FunctionType(code.replace(**changes), fn.__globals__, changes["co_name"], fn.__defaults__,
                              fn.__closure__)
    copy.__kwdefaults__ = getattr(fn, "__kwdefaults__", None)
    copy.__dict__.update(getattr(fn, "__dict__", {}))
    return copy


class PerLane:
    """``torch.compile(fn, **options)`` once per lane, each on a code object of its own.

    Call it as ``fn``; the lane is ``lane()``'s, else the calling thread's name. A lane's
    compiled copy is made at its first call (under a lock) and kept."""

    def __init__(self, fn: Callable, **options):
        self.fn, self.options = fn, options
        self._compiled: dict[str, Callable] = {}
        self._lock = threading.Lock()

    def for_lane(self, name: str) -> Callable:
        compiled = self._compiled.get(name)
        if compiled is None:
            with self._lock:
                compiled = self._compiled.get(name)
                if compiled is None:
                    compiled = torch.compile(own_code(self.fn, name), **self.options)
                    self._compiled[name] = compiled
        return compiled

    def __call__(self, *args, **kwargs):
        return self.for_lane(current_lane())(*args, **kwargs)

    @property
    def lanes(self) -> list[str]:
        return sorted(self._compiled)


# ---------------------------------------------------------------------------- one compile shared by every thread

_SCALARS = (str, int, float, bool, type(None), torch.dtype, torch.device)
_shared: "weakref.WeakSet[Shared]" = weakref.WeakSet()
_shared_by_fn: dict[tuple, "Shared"] = {}
_shared_lock = threading.Lock()
_sharing = "per_thread"


class RecompileAfterWarmup(RuntimeError):
    """A call after the warm-up that no compiled variant serves (``fail_on_recompile``'s
    error for ``Shared``): a new shape or mode would compile while other threads run."""


def signature(value: Any, depth: int = 0) -> Hashable:
    """What tells two calls' variants apart before their guards are checked: each
    tensor's shape, dtype, device and grad flag, scalars by value, a function by its
    code object (an identity guard, which ``aot_compile`` drops), a module by its type
    and its plain attributes (``layer_type``), and the fields of other objects (a
    BlockMask: its tensors, its mask function), a few levels deep."""
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.dtype, value.device, value.requires_grad)
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, torch.nn.Module):
        return (type(value), tuple(sorted((k, v) for k, v in vars(value).items()
                                          if not k.startswith("_") and isinstance(v, _SCALARS))))
    if depth > 4:
        return type(value)
    if isinstance(value, (tuple, list)):
        return (type(value), *(signature(v, depth + 1) for v in value))
    if isinstance(value, dict):
        return (dict, *((k, signature(v, depth + 1)) for k, v in value.items()))
    code = getattr(value, "__code__", None)
    if code is not None:
        return ("fn", id(code))
    if callable(value) and not hasattr(value, "__dict__"):  # a builtin (torch.sin)
        return ("fn", id(value))
    if hasattr(value, "__dict__"):
        return (type(value), *((k, signature(v, depth + 1)) for k, v in vars(value).items()))
    return type(value)


class Shared:
    """``torch.compile(fn, fullgraph=True, **options)`` compiled once per variant, its
    forward and backward together, ahead of the call (``torch_api.aot_compile``), and
    called by every thread without Dynamo: threads share no per-code-object cache, and a
    cold start compiles each graph once instead of once per thread.

    A call takes the first variant of its ``signature`` whose guards pass; a call that
    none serves compiles one (under a lock) or, once ``freeze_shared`` ran after the
    warm-up, raises ``RecompileAfterWarmup``. The variants of a signature are a tuple
    replaced whole, never reordered: threads read them without a lock."""

    def __init__(self, fn: Callable, **options):
        self.name = getattr(fn, "__qualname__", None) or repr(fn)
        self.__name__ = getattr(fn, "__name__", "compiled")  # a method's name, as Dynamo's pickler asks it
        self._fn, self._options = fn, options
        self._variants: dict[Hashable, tuple[Callable, ...]] = {}
        self._lock = threading.Lock()
        self.frozen = False
        self.compiles = 0
        _shared.add(self)

    def __call__(self, *args, **kwargs):
        key = (signature(args), signature(kwargs), torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        for variant in self._variants.get(key, ()):
            if torch_api.aot_guards_pass(variant, args, kwargs):
                return variant(*args, **kwargs)
        return self._compile(key, args, kwargs)(*args, **kwargs)

    def _compile(self, key: Hashable, args: tuple, kwargs: dict) -> Callable:
        with self._lock:
            known = self._variants.get(key, ())
            for variant in known:  # another thread compiled it meanwhile
                if torch_api.aot_guards_pass(variant, args, kwargs):
                    return variant
            if self.frozen:
                why = torch_api.aot_guard_failure(known[0], args, kwargs) if known else "no variant of these shapes"
                raise RecompileAfterWarmup(f"{self.name}: a call after the warm-up that no compiled variant "
                                           f"serves: {why}")
            variant = torch_api.aot_compile(self._fn, self._options, args, kwargs)
            self._variants[key] = (*known, variant)
            self.compiles += 1
            return variant

    def __reduce__(self):
        # Dynamo pickles the guarded objects' state while it compiles; a layer whose
        # forward is this object is among them. Its name stands for it there.
        return (str, (f"<compiled once: {self.name}>",))


def set_sharing(mode: str) -> str:
    """How ``thread_safe_compile`` compiles from now on (``compile.share``): 'shared' or
    'per_thread'; 'auto' is 'shared' where this torch has ``aot_compile``. Returns the
    mode in force."""
    global _sharing
    if mode == "auto":
        mode = "per_thread" if torch_api.check_one("aot_compile") else "shared"
    if mode not in ("shared", "per_thread"):
        raise ValueError(f"compile.share: {mode!r} is not one of auto, shared, per_thread")
    _sharing = mode
    return mode


def sharing() -> str:
    """The mode ``set_sharing`` put in force ('shared' or 'per_thread')."""
    return _sharing


def thread_safe_compile(fn: Callable, **options) -> Callable:
    """A compiled ``fn`` safe to call from every thread: ``Shared`` or ``PerLane``, as
    ``set_sharing`` chose. One ``Shared`` per function and options in the process: the
    replicas of every drafter thread call the same one, so each graph compiles once."""
    if _sharing != "shared":
        return PerLane(fn, **options)
    key = (fn, repr(sorted(options.items())))  # an option's value may be a dict (inductor's options)
    with _shared_lock:
        compiled = _shared_by_fn.get(key)
        if compiled is None:
            compiled = _shared_by_fn[key] = Shared(fn, **options)
    return compiled


def freeze_shared(frozen: bool = True) -> None:
    """After the warm-up (True): every ``Shared`` raises instead of compiling. A new
    run in this process (False): they may compile again."""
    for compiled in list(_shared):
        compiled.frozen = frozen


def shared_compiles() -> int:
    """Variants the ``Shared`` functions alive hold: one per graph, not per thread."""
    return sum(c.compiles for c in list(_shared))


# ---------------------------------------------------------------------------- settings in every thread


def seen_in_new_thread(read: Callable[[], Any]) -> Any:
    """What ``read()`` returns in a thread that set nothing itself."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(read()), name="settings-check", daemon=True)
    thread.start()
    thread.join(30)
    return out[0] if out else None


# ---------------------------------------------------------------------------- limits, stance


def recompile_limit(n_devices: int, n_buckets: int, margin: int) -> int:
    return n_devices * n_buckets * _VARIANTS + margin


class Discipline:
    """The compile settings, applied for every thread by ``enter_thread`` (called in main,
    before any thread starts), and their state."""

    def __init__(self, cfg, n_devices: int, enabled: bool, guard_eager_flex: bool):
        self.enabled = enabled
        self.mode = ("unsafe_parallel" if cfg.compile.unsafe_parallel_warmup
                     else "serialized" if cfg.compile.serialized_warmup else "locked_first_steps")
        self.limit = recompile_limit(n_devices, len(cfg.data.buckets), cfg.compile.recompile_margin)
        self.guard_eager_flex = guard_eager_flex
        self.lock = threading.Lock()
        self._pending: set[tuple[str, int]] = set()  # (thread, bucket) not yet through fwd+bwd
        self.frames_ok_after_warmup: Optional[int] = None
        self.warmup_s = 0.0
        freeze_shared(False)  # a run before this one in the process froze what it compiled

    def settings(self) -> dict[str, Any]:
        """The Dynamo settings the discipline relies on, by name."""
        return {"recompile_limit": self.limit, "accumulated_recompile_limit": max(256, self.limit * 8),
                # Past the limit Dynamo would silently run the frame eagerly (dense attention).
                "fail_on_recompile_limit_hit": True}

    def enter_thread(self) -> None:
        """Apply the settings for every thread, this one and those torch starts itself
        (autograd's backward threads); call in main before any thread starts. Calling it
        again in a thread is harmless."""
        cfg = torch_api.dynamo_config()
        for name, value in self.settings().items():
            torch_api.set_everywhere(cfg, name, value)
        if self.guard_eager_flex:
            warnings.filterwarnings("error", message=EAGER_FLEX_WARNING)  # the filter list is process-wide

    def check_in_force(self) -> dict[str, Any]:
        """The settings as a thread that set nothing itself sees them; raises if any is
        not the discipline's (a worker would silently run with torch's defaults)."""
        cfg = torch_api.dynamo_config()
        wanted = self.settings()
        seen = seen_in_new_thread(lambda: {name: getattr(cfg, name) for name in wanted}) or {}
        wrong = {k: seen.get(k) for k, v in wanted.items() if seen.get(k) != v}
        if wrong:
            raise RuntimeError(f"compile discipline: a new thread sees {wrong} instead of "
                               f"{ {k: wanted[k] for k in wrong} } (torch {torch.__version__})")
        return seen

    def lock_recompiles(self) -> None:
        """After the warm-up: any new compile raises instead of racing other threads."""
        self.frames_ok_after_warmup = torch_api.dynamo_counters()["frames_ok"]
        if self.enabled and self.mode != "unsafe_parallel":
            torch.compiler.set_stance("fail_on_recompile")
            freeze_shared()

    # ---- serialized warm-up

    def warmup(self, jobs: list[tuple[str, int, Callable[[], None]]],
               report: Callable[[dict], None], should_stop: Callable[[], bool] = lambda: False) -> float:
        """Run ``(thread, bucket, fn)`` jobs one at a time (forward + backward each), then
        lock recompiles. ``thread`` is the name of the thread that will run that shape
        (``drafter-1@cuda:6``). ``report`` gets ``{device, bucket, seconds, done, total}``
        before and after each job, for status.json. Returns the total seconds.

        With ``serialized_warmup: false`` nothing runs here: each (thread, bucket) is
        compiled by its thread's first step of that bucket, under the global lock.
        """
        start = time.monotonic()
        if self.mode == "locked_first_steps":  # the threads compile, one at a time (step_guard)
            self._pending = {(d, b) for d, b, _ in jobs}
            return 0.0
        if self.mode == "unsafe_parallel":
            self.warmup_s = self._parallel_first_calls(jobs)
            return self.warmup_s
        for i, (device, bucket, fn) in enumerate(jobs):
            if should_stop():
                break
            t0 = time.monotonic()
            report({"device": device, "bucket": bucket, "seconds": 0.0, "done": i, "total": len(jobs)})
            with lane(device):  # compiles the code that thread runs later
                fn()
            report({"device": device, "bucket": bucket, "seconds": round(time.monotonic() - t0, 2),
                    "done": i + 1, "total": len(jobs)})
        self.warmup_s = time.monotonic() - start
        self.lock_recompiles()
        return self.warmup_s

    def _parallel_first_calls(self, jobs: list[tuple[str, int, Callable[[], None]]]) -> float:
        """The discipline switched off, on purpose: per bucket, the target jobs one by
        one (their output feeds the others), then every other job in its own thread,
        all released at once by a barrier, so the first compiles of flex_attention
        forward and backward overlap. Never returns if they deadlock."""
        start = time.monotonic()
        for bucket in dict.fromkeys(b for _, b, _ in jobs):
            mine = [(name, fn) for name, b, fn in jobs if b == bucket]
            for name, fn in mine:
                if name.startswith("target"):
                    with lane(name):
                        fn()
            rest = [(name, fn) for name, fn in mine if not name.startswith("target")]
            gate = threading.Barrier(len(rest))
            errors: list[BaseException] = []

            def first_call(name, fn):
                gate.wait()
                try:
                    with lane(name):
                        fn()
                except BaseException as e:  # re-raised below, in the calling thread
                    errors.append(e)

            threads = [threading.Thread(target=first_call, args=(name, fn), name=f"warmup-{name}", daemon=True)
                       for name, fn in rest]
            for t in threads:
                t.start()
            for t in threads:
                while t.is_alive():  # in slices, so SIGTERM's handler still runs in this thread
                    t.join(0.2)
            if errors:
                raise errors[0]
        return time.monotonic() - start

    # ---- locked first steps (serialized_warmup: false)

    def step_guard(self, thread: str, bucket: int):
        """A context for one step: the global lock while any thread x bucket is still cold."""
        return _StepGuard(self, (thread, bucket))


class _StepGuard:
    def __init__(self, discipline: Discipline, key):
        self.d, self.key, self.locked = discipline, key, False

    def __enter__(self):
        if self.d.mode == "locked_first_steps" and self.d._pending:
            self.d.lock.acquire()
            self.locked = True
        return self

    def __exit__(self, exc_type, *_):
        if self.locked:
            if exc_type is None:
                self.d._pending.discard(self.key)
                if not self.d._pending:  # the last cold shape is compiled: lock the cache
                    self.d.lock_recompiles()
            self.d.lock.release()
        return False


# ---------------------------------------------------------------------------- counters


def counters_report(discipline: Optional[Discipline]) -> dict:
    """Counters plus ``recompiles``: frames compiled after the warm-up ended (should stay 0)."""
    c = torch_api.dynamo_counters()
    base = discipline.frames_ok_after_warmup if discipline else None
    c["recompiles"] = None if base is None else c["frames_ok"] - base
    c["shared_compiles"] = shared_compiles()
    return c
