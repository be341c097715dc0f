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
   instead of once per thread; torch's on-disk AOTAutograd cache is bypassed for it, so
   each compiled variant is saved whole in the compile cache, ``SavedVariants``, and a
   warm start loads it instead of tracing and compiling again).

``compile.unsafe_parallel_warmup`` replaces 2 with every thread's first forward +
backward at the same moment, skips 4, and exists to reproduce the deadlock on a
GPU. Never use it in production.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import sys
import threading
import time
import types
import warnings
import weakref
from typing import Any, Callable, Hashable, Iterable, Iterator, Optional

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
    """Point inductor and triton at the persistent cache; returns the keyed directory.
    Without ``cache_dir`` inductor keeps its own: where the environment says, else
    torch's default, a predictable name in the shared temporary directory
    (``/tmp/torchinductor_<user>``). That one is checked like every other directory the
    trainer uses (``contract.private_dir``: UnsafeDirectory when another user made it
    first; what they put there would be loaded as compiled code)."""
    if not cache_dir:
        inductor = torch_api.inductor_cache_dir()
        if inductor:
            contract.private_dir(inductor, "compile cache (inductor's: TORCHINDUCTOR_CACHE_DIR, else torch's "
                                 "default; compile.cache_dir sets one of your own)")
            keep_flash_kernels(inductor)
        return os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    path = contract.private_dir(os.path.join(os.path.abspath(os.path.expanduser(cache_dir)), cache_key(device)),
                                "compile cache")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    os.environ["TRITON_CACHE_DIR"] = os.path.join(path, "triton")
    keep_flash_kernels(path)
    return path


FLASH_CACHE_ENV = ("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR")


def keep_flash_kernels(path: str) -> None:
    """flash-attention 4 compiles its CuTe kernels again at every start unless its own
    file cache is on (off by default). Turn it on, in ``<path>/flash-attn-cute``: the
    compile cache, keyed by torch, triton and GPU like inductor's, and within it
    flash-attn-4 keys its entries by its own sources and CUTLASS's version. It reads
    these at import, so this runs before anything imports ``flash_attn.cute``; a
    value the user set wins. Its entries are compiled code, as inductor's are, and
    stay on this host (the compile artifacts do not carry them): a directory another
    user could write into (``contract.private_dir``) leaves the cache off, said in
    trainer.log."""
    enabled, where = FLASH_CACHE_ENV
    if where not in os.environ:
        try:
            os.environ[where] = contract.private_dir(os.path.join(path, "flash-attn-cute"),
                                                     "flash-attention 4's kernel cache")
        except (OSError, ValueError) as e:  # UnsafeDirectory: code planted there would run here
            print(f"compile: flash-attention 4's kernel cache stays off: {e}", flush=True)
            return
    os.environ.setdefault(enabled, "1")


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
    code (``code_identity``: an identity guard, which ``aot_compile`` drops), a module
    by its type and its plain attributes (``layer_type``), and the fields of other
    objects (a BlockMask: its tensors, its mask function), a few levels deep. Its
    ``repr`` is the same in every process (``SavedVariants`` keys files by it)."""
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
        return ("fn", code_identity(code))
    if callable(value) and not hasattr(value, "__dict__"):  # a builtin (torch.sin)
        return ("fn", getattr(value, "__module__", None), getattr(value, "__qualname__", None) or id(value))
    if hasattr(value, "__dict__"):
        return (type(value), *((k, signature(v, depth + 1)) for k, v in vars(value).items()))
    return type(value)


_code_identities: dict[int, tuple[types.CodeType, str]] = {}  # id -> (code kept alive, identity)


def code_identity(code: types.CodeType) -> str:
    """``<module file>:<qualname>:<digest>``, the same for the same code in every process:
    the digest is over the bytecode, names, constants (nested code by its identity)
    and argument counts, not over line numbers. Computed once per code object."""
    known = _code_identities.get(id(code))
    if known is None:
        parts = (code.co_code, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars,
                 code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags,
                 tuple(_const_form(c) for c in code.co_consts))
        digest = hashlib.sha256(repr(parts).encode()).hexdigest()[:16]
        qualname = getattr(code, "co_qualname", code.co_name)
        known = _code_identities[id(code)] = (code, f"{os.path.basename(code.co_filename)}:{qualname}:{digest}")
    return known[1]


def _const_form(value: Any) -> str:
    """A code constant as the same text in every process (a frozenset's order is not)."""
    if isinstance(value, types.CodeType):
        return code_identity(value)
    if isinstance(value, frozenset):
        return "frozenset(" + ",".join(sorted(map(_const_form, value))) + ")"
    if isinstance(value, tuple):
        return "(" + ",".join(map(_const_form, value)) + ",)"
    return repr(value)


def options_form(options: dict) -> str:
    """Compile options as the same text in every process (an option's value may be a
    dict: inductor's options)."""
    return json.dumps(options, sort_keys=True, default=repr)


class Shared:
    """``torch.compile(fn, fullgraph=True, **options)`` compiled once per variant, its
    forward and backward together, ahead of the call (``torch_api.aot_compile``), and
    called by every thread without Dynamo: threads share no per-code-object cache, and a
    cold start compiles each graph once instead of once per thread.

    A call takes the first variant of its ``signature`` whose guards pass; a call that
    none serves loads the variants saved for its signature (its first miss only), else
    compiles one and saves it (under a lock), or, once ``freeze_shared`` ran after the
    warm-up, raises ``RecompileAfterWarmup``. The variants of a signature are a tuple
    replaced whole, never reordered: threads read them without a lock. ``compiles``
    counts the variants compiled, ``loaded`` those loaded."""

    def __init__(self, fn: Callable, **options):
        self.name = getattr(fn, "__qualname__", None) or repr(fn)
        self.__name__ = getattr(fn, "__name__", "compiled")  # a method's name, as Dynamo's pickler asks it
        self._fn, self._options = fn, options
        self._variants: dict[Hashable, tuple[Callable, ...]] = {}
        self._lock = threading.Lock()
        self.frozen = False
        self.compiles = self.loaded = 0
        self.saved = SavedVariants(fn, options)
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
            if not self.saved.looked_up(key):
                loaded = self.saved.load(key)
                self._variants[key] = known = (*known, *loaded)
                self.loaded += len(loaded)
                for variant in loaded:
                    if torch_api.aot_guards_pass(variant, args, kwargs):
                        return variant
            variant = torch_api.aot_compile(self._fn, self._options, args, kwargs)
            self._variants[key] = (*known, variant)
            self.compiles += 1
            self.saved.save(key, variant)
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
    key = (fn, options_form(options))
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
    """Variants the ``Shared`` functions alive compiled: one per graph, not per thread."""
    return sum(c.compiles for c in list(_shared))


def shared_loaded() -> int:
    """Variants the ``Shared`` functions alive loaded from the compile cache (``SavedVariants``)."""
    return sum(c.loaded for c in list(_shared))


def saved_variant_files() -> list[str]:
    """The files of every variant the ``Shared`` functions alive loaded or saved."""
    return sorted({path for c in list(_shared) for paths in c.saved.files.values() for path in paths})


# ---------------------------------------------------------------------------- saved variants

SAVED_DIR = "dflash-aot"  # in the inductor cache in use
SAVED_NAME = re.compile(r"[A-Za-z0-9_]{1,60}-[0-9a-f]{32}\.[0-9]{1,4}\.bin")
# Variants of code, shapes or a torch no start has loaded for this long go, and the least
# recently used past this size (each code change leaves the old variants behind; a
# variant of the drill's shapes is tens of MB).
SAVED_KEEP_S = 14 * 86400
SAVED_KEEP_BYTES = 8 << 30
_pruned: set[str] = set()  # directories pruned by this process


def warn(line: str) -> None:
    print(f"warning: {line}", file=sys.stderr, flush=True)


def saved_dir() -> Optional[str]:
    """Where this process saves and loads compiled variants: ``dflash-aot`` in its
    inductor cache, a directory only this user can write (None, with a warning, when
    there is none or it is not that)."""
    base = torch_api.inductor_cache_dir()
    if not base:
        return None
    try:
        return contract.private_dir(os.path.join(base, SAVED_DIR), "saved compiled variants")
    except (OSError, contract.UnsafeDirectory) as e:
        warn(f"compile: compiled variants are neither saved nor loaded: {e}")
        return None


@functools.cache
def _host_kind() -> str:
    return cache_key(torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))


class SavedVariants:
    """The variants of one ``Shared`` function, each saved as a file in ``saved_dir()``:
    ``<name>-<digest>.<n>.bin``, where ``digest`` is over everything a variant's
    validity depends on (``describe``) and ``n`` tells apart the variants of one call
    key whose guards differ (a closure's constant). A file holds one JSON line (that
    description, the sha256 and size of the rest) and ``torch_api.aot_serialize``'s
    bytes. A file that does not load, or was compiled from source that changed since,
    is said in one line and its slot written again."""

    def __init__(self, fn: Callable, options: dict):
        self.fn, self.options = fn, options
        self.files: dict[Hashable, list[str]] = {}  # call key -> files loaded or written for it

    def describe(self, key: Hashable) -> str:
        """Everything a variant of call key ``key`` is valid for: the function, the
        options, the call's signature, torch, triton and the accelerator."""
        return repr((signature(self.fn), options_form(self.options), key, _host_kind()))

    def _stem(self, description: str) -> str:
        name = re.sub(r"[^A-Za-z0-9_]+", "_", getattr(self.fn, "__qualname__", "fn"))[:60]
        return f"{name}-{hashlib.sha256(description.encode()).hexdigest()[:32]}"

    def looked_up(self, key: Hashable) -> bool:
        return key in self.files

    def load(self, key: Hashable) -> list[Callable]:
        """Every variant saved for ``key`` that loads and whose source is unchanged."""
        self.files[key] = []
        directory = saved_dir()
        if directory is None:
            return []
        description, out = self.describe(key), []
        prefix = self._stem(description) + "."
        for name in sorted(n for n in os.listdir(directory) if n.startswith(prefix) and SAVED_NAME.fullmatch(n)):
            path = os.path.join(directory, name)
            try:
                variant = torch_api.aot_deserialize(read_saved(path, description), getattr(self.fn, "__globals__", {}))
                stale = torch_api.aot_stale_source(variant)
            except Exception as e:  # noqa: BLE001 - any unloadable file is compiled again
                warn(f"compile: saved variant {name} is ignored: {_why(e)}")
                continue
            if stale:
                warn(f"compile: saved variant {name} is ignored: compiled from other source ({stale})")
                continue
            self.files[key].append(path)
            _touch(path)  # used: kept by prune_saved
            out.append(variant)
        return out

    def save(self, key: Hashable, variant: Callable) -> None:
        """Write ``variant`` into the first slot of ``key`` that no variant of this process holds."""
        directory = saved_dir()
        if directory is None:
            return
        description = self.describe(key)
        taken, n = set(self.files.setdefault(key, [])), 0
        while (path := os.path.join(directory, f"{self._stem(description)}.{n}.bin")) in taken:
            n += 1
        try:
            payload = torch_api.aot_serialize(variant)
            header = json.dumps({"describe": description, "bytes": len(payload),
                                 "sha256": hashlib.sha256(payload).hexdigest()})
            contract.atomic_write_bytes(path, header.encode() + b"\n" + payload)
        except Exception as e:  # noqa: BLE001 - a variant that cannot be saved is compiled again next start
            warn(f"compile: a variant of {self._stem(description)} is not saved: {_why(e)}")
            return
        self.files[key].append(path)
        if directory not in _pruned:  # once a process, when the directory grew
            _pruned.add(directory)
            prune_saved(directory, time.time(), in_use=[p for paths in self.files.values() for p in paths])


def _touch(path: str) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


def prune_saved(directory: str, now: float, keep_s: float = SAVED_KEEP_S, keep_bytes: int = SAVED_KEEP_BYTES,
                in_use: Iterable[str] = ()) -> list[str]:
    """Remove from ``directory`` the saved variants no start loaded or wrote for
    ``keep_s`` (their mtime), then the least recently used while the rest exceed
    ``keep_bytes``; never one in ``in_use`` nor a file not named as a variant. Returns
    the names removed (each said in one line)."""
    files, in_use = [], set(in_use)
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if not SAVED_NAME.fullmatch(name) or path in in_use:
            continue
        try:
            st = os.stat(path)
        except OSError:
            continue
        files.append((st.st_mtime, st.st_size, name, path))
    kept = sum(size for _, size, _, _ in files) + sum(_size(p) for p in in_use)
    removed = []
    for mtime, size, name, path in sorted(files):  # the least recently used first
        if now - mtime <= keep_s and kept <= keep_bytes:
            break
        try:
            os.unlink(path)
        except OSError:
            continue
        kept -= size
        removed.append(name)
    if removed:
        print(f"compile: removed {len(removed)} saved variant(s) unused for {keep_s / 86400:g} days or past "
              f"{keep_bytes >> 30} GiB from {directory}", flush=True)
    return removed


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _why(error: Exception) -> str:
    """An exception in one line."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200]}" if text else type(error).__name__


def read_saved(path: str, description: str) -> bytes:
    """A saved variant's serialised bytes; ValueError when the file is not one saved for
    ``description``, or is truncated or corrupt."""
    with open(path, "rb") as f:
        data = f.read()
    line, _, payload = data.partition(b"\n")
    header = json.loads(line)
    if not isinstance(header, dict) or header.get("describe") != description:
        raise ValueError("saved for another function, call or torch")
    if header.get("bytes") != len(payload) or header.get("sha256") != hashlib.sha256(payload).hexdigest():
        raise ValueError(f"truncated or corrupt ({len(payload)} bytes, {header.get('bytes')} saved)")
    return payload


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
    """Counters plus ``recompiles``: frames compiled after the warm-up ended (should stay
    0), and the variants ``Shared`` compiled and loaded."""
    c = torch_api.dynamo_counters()
    base = discipline.frames_ok_after_warmup if discipline else None
    c["recompiles"] = None if base is None else c["frames_ok"] - base
    c["shared_compiles"] = shared_compiles()
    c["shared_loaded"] = shared_loaded()
    return c
