"""Every private torch API the trainer touches, in one place.

torch changes its private modules between releases without notice; a trainer that
reaches into them must know which ones, on which versions they were checked, and
fail before the warm-up (minutes of compile) rather than in the middle of it. Each
use below names what it relies on; ``tests/trainer/test_torch_api.py`` tests that
reliance on the torch installed (CPU in CI), and ``check()`` probes every use once
at start-up (trainer.log: ``torch api: ...``), naming any that moved.

| name              | private API                                        | relied on                                   |
|-------------------|----------------------------------------------------|---------------------------------------------|
| config_everywhere | ``torch._dynamo.config._config[name]``             | from 2.12 an assignment is a per-thread     |
|                   | ``.user_override`` (a ContextVar), ``.default``,   | override; the default is what a thread that |
|                   | ``.env_value_default``                             | set nothing (autograd's) reads              |
| counters          | ``torch._dynamo.utils.counters``,                  | frames ok/total, unique_graphs, inductor    |
|                   | ``.compilation_time_metrics``                      | fxgraph cache hit/miss counted per process; |
|                   |                                                    | seconds per compile phase, lists by name    |
| inductor_cache    | ``torch._inductor.runtime.cache_dir_utils``        | ``cache_dir()`` is where this process's     |
|                   | ``.cache_dir``                                     | inductor cache lies                         |
| cache_artifacts   | ``torch.compiler._cache.CacheArtifactManager``     | ``deserialize`` parses a Mega-Cache without |
|                   | ``.deserialize``, ``.populate_caches``             | writing; entries carry ``.key``             |
| flex_warnings     | ``torch.nn.attention.flex_attention``              | the eager-fallback warning is shown once    |
|                   | ``._WARNINGS_SHOWN`` (a set)                       | per process, recorded in that set           |
| aot_compile       | ``torch.compile(fn, fullgraph=True).aot_compile``  | compiles forward AND backward at once for   |
|                   | (experimental; else ``torch._dynamo.aot_compile``  | the example inputs; the result is called    |
|                   | ``.aot_compile_fullgraph``), ``AOTCompiledFunction``|                                             |
|                   | ``.guard_check``, ``.disable_guard_check``,        | without Dynamo (no frame cache), checks its |
|                   | ``._artifacts.guard_manager.check_verbose``        | guards only when asked                      |
| aot_save          | ``AOTCompiledFunction.serialize`` (an              | an ``aot_compile`` result as bytes that     |
|                   | ``AOTCompileSaveResult``: ``.serialized_data``),   | another process of the same torch loads     |
|                   | ``.deserialize(data, f_globals)`` (inside          | without tracing or compiling; the source of |
|                   | ``torch._guards.tracing(TracingContext(None))``),  | every traced function is recorded as line   |
|                   | ``.source_info().inlined_sources``                 | numbers and a sha256 of those lines         |
|                   | (``torch._dynamo.package.InlinedSource``: module,  |                                             |
|                   | firstlineno, lastlineno, checksum)                 |                                             |

Not private but relied on the same way (and tested beside them): Dynamo keeps its
cache entries per code object, unlocked (``trainer.compile``: one code object per
thread), and ``torch.compiler.set_stance("fail_on_recompile")``.

``CHECKED`` lists the releases each was run on and where (docs/trainer.md, "torch
versions"): a torch outside it is not refused, it is said.

This module imports torch only inside its functions: ``trainer.compile_cache`` (which
the controller imports for the key's digest) imports it.
"""

from __future__ import annotations

import contextlib
import re
from contextvars import ContextVar
from typing import Any, Callable, Iterator, Optional

# Releases the private uses were run on: (version, where).
CHECKED = (
    ("2.11", "GPU: H200, torch 2.11.0+cu130 (bench/gpu_session.sh, tests/trainer)"),
    ("2.13", "CPU: CI, torch 2.13.0+cpu (tests/trainer)"),
    ("2.14", "CPU only: a dev machine, torch 2.14.1+cu130 (tests/trainer/test_torch_api.py, tests.harness.compile_race)"),
    ("2.15", "CPU only: a dev machine, torch 2.15.0+cu132 (tests/trainer/test_torch_api.py, tests.harness.compile_race)"),
)


def version_tuple(version: str) -> tuple[int, int]:
    """'2.11.0+cu130' -> (2, 11); anything unreadable -> (0, 0)."""
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def checked_on(version: str) -> bool:
    """Whether torch ``version``'s minor release is one the private uses were run on."""
    return any(version_tuple(version) == version_tuple(v) for v, _ in CHECKED)


# ---------------------------------------------------------------------------- the uses


def dynamo_config():
    import torch._dynamo  # noqa: F401 - the config module hangs off it

    return torch._dynamo.config


def set_everywhere(module, name: str, value: Any) -> None:
    """Set a torch config value for this thread and every other one.

    Up to torch 2.11 a config assignment is process-wide; from 2.12 it is a per-thread
    override (a ContextVar), invisible to worker threads and to autograd's backward
    threads, which then read the default. So the default is changed too."""
    setattr(module, name, value)
    entry = getattr(module, "_config", {}).get(name)
    if entry is not None and isinstance(getattr(entry, "user_override", None), ContextVar):
        entry.default = value
        if hasattr(entry, "env_value_default"):  # an environment default outranks the default
            entry.env_value_default = value


def dynamo_counters() -> dict:
    """Dynamo and inductor counters: the evidence that compiled kernels are in use."""
    from torch._dynamo.utils import counters

    return {
        "frames_ok": int(counters["frames"]["ok"]),
        "frames_total": int(counters["frames"]["total"]),
        "unique_graphs": int(counters["stats"]["unique_graphs"]),
        "fxgraph_cache_hit": int(counters["inductor"]["fxgraph_cache_hit"]),
        "fxgraph_cache_miss": int(counters["inductor"]["fxgraph_cache_miss"]),
    }


def cache_outcomes() -> tuple[int, int]:
    """(compiled, loaded) in this process so far: graphs inductor compiled (FX graph
    cache misses), and graphs loaded from torch's caches instead (FX graph and
    AOTAutograd cache hits; an AOTAutograd hit loads its graphs without the FX graph
    cache counting them)."""
    from torch._dynamo.utils import counters

    return (int(counters["inductor"]["fxgraph_cache_miss"]),
            int(counters["inductor"]["fxgraph_cache_hit"]) + int(counters["aot_autograd"]["autograd_cache_hit"]))


# Phases of a compile as torch times them (``compilation_time_metrics``): Dynamo's frame,
# its bytecode trace and its backend call; inductor's graph compile, which holds its code
# generation and the load of the generated module, which holds the wait for the kernels
# compiled in worker processes. (An ahead-of-time compile runs inductor outside Dynamo's
# frame.)
COMPILE_PHASES = (
    ("dynamo", "_compile.compile_inner"), ("trace", "bytecode_tracing"),
    ("backend", "OutputGraph.call_user_compiler"), ("inductor", "compile_fx_inner"),
    ("codegen", "GraphLowering.codegen"), ("kernels_wait", "async_compile.wait"),
    ("module_load", "PyCodeCache.load_by_key_path"),
)


def compile_seconds() -> dict:
    """Seconds this process spent in each of ``COMPILE_PHASES`` so far (phases nest, so
    they do not add up); a phase that never ran is left out, {} where torch keeps no
    such record."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return {}
    return {name: round(sum(compilation_time_metrics[key]), 3) for name, key in COMPILE_PHASES
            if key in compilation_time_metrics}


def inductor_cache_dir(environ: Optional[dict] = None) -> Optional[str]:
    """Where this process's inductor cache lies (the environment's, if torch cannot say)."""
    import os

    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return cache_dir()
    except Exception:  # noqa: BLE001 - torch absent or moved: the environment's, if any
        return (environ if environ is not None else os.environ).get("TORCHINDUCTOR_CACHE_DIR")


def cache_artifact_manager():
    """torch's Mega-Cache reader; ValueError when this torch has none to inspect with."""
    try:
        from torch.compiler._cache import CacheArtifactManager
    except ImportError as e:
        raise ValueError(f"cannot inspect the artifact's entries with this torch: {e}") from None
    return CacheArtifactManager


def forget_flex_fallback_warning() -> bool:
    """Clear flex_attention's shown-once record of its eager-fallback warning, so the next
    fallback warns (and, under the discipline's filter, raises) again. False when the
    record is not where this torch kept it."""
    from torch.nn.attention import flex_attention as flex_module

    shown = getattr(flex_module, "_WARNINGS_SHOWN", None)
    if isinstance(shown, set):
        shown.discard("flex_attention_performance")
        return True
    return False


def aot_compile(fn: Callable, options: dict, args: tuple, kwargs: dict) -> Callable:
    """``torch.compile(fn, fullgraph=True, **options)`` compiled now for these inputs:
    Dynamo traces once, AOTAutograd lowers the forward and the backward at once (no lazy
    backward compile at the first ``backward()``, on autograd's thread), and the result
    runs without Dynamo: no frame evaluation, no per-code-object cache. Its guards
    (shapes, dtypes, devices, grad mode, constants) are checked only by
    ``aot_guards_pass``; identity guards (which function, which object) are not kept at
    all (they cannot be serialised): the caller's key must tell those apart.

    Through ``torch.compile(...).aot_compile`` where torch has it, else through the
    function that method calls (``torch._dynamo.aot_compile.aot_compile_fullgraph``,
    the inductor backend only). The inputs' gradients are set aside meanwhile
    (``_grads_set_aside``)."""
    import warnings

    import torch

    with warnings.catch_warnings(), _grads_set_aside(args, kwargs):
        # Dynamo reads every tensor's .grad while it saves the guards: a warning per
        # non-leaf input (an activation), about nothing the trainer does.
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
        method = getattr(torch.compile(fn, **{**options, "fullgraph": True}), "aot_compile", None)
        compiled = method((tuple(args), dict(kwargs))) if method is not None \
            else _aot_compile_fullgraph(fn, options, args, kwargs)
    compiled.disable_guard_check()
    return compiled


@contextlib.contextmanager
def _grads_set_aside(args: tuple, kwargs: dict) -> Iterator[None]:
    """The block runs with ``.grad`` None on every leaf tensor among the inputs (a
    module's parameters and buffers too), put back after it. The guards' saved state
    records each input's gradient, and one that is not itself an input is saved as a
    placeholder that ``aot_deserialize`` cannot load (torch 2.13: "assigned grad
    expected to be a Tensor or None but got grad of type _Missing")."""
    import torch

    tensors: list = []

    def collect(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, torch.nn.Module):
            tensors.extend((*value.parameters(), *value.buffers()))
        elif isinstance(value, (tuple, list)):
            for v in value:
                collect(v)
        elif isinstance(value, dict):
            for v in value.values():
                collect(v)

    collect((args, kwargs))
    kept = [(t, t.grad) for t in tensors if t.is_leaf and t.grad is not None]
    for t, _ in kept:
        t.grad = None
    try:
        yield
    finally:
        for t, grad in kept:
            t.grad = grad


def _aot_compile_fullgraph(fn: Callable, options: dict, args: tuple, kwargs: dict) -> Callable:
    import inspect

    import torch
    from torch._dynamo.aot_compile import aot_compile_fullgraph
    from torch._dynamo.hooks import Hooks

    if options.get("backend", "inductor") != "inductor":
        raise ValueError(f"an ahead-of-time compile on torch {torch.__version__} takes the inductor backend only, "
                         f"not {options['backend']!r}")
    backend = torch._TorchCompileInductorWrapper(options.get("mode"), options.get("options"), options.get("dynamic"))
    extra = {"dynamic": options["dynamic"]} \
        if "dynamic" in options and "dynamic" in inspect.signature(aot_compile_fullgraph).parameters else {}
    return aot_compile_fullgraph(fn, (tuple(args), dict(kwargs)), hooks=Hooks(), backend=backend, **extra)


def aot_serialize(fn: Callable) -> bytes:
    """``aot_compile``'s ``fn`` as bytes: its guards, its Dynamo bytecode and its compiled
    forward and backward (inductor's code, bundled), for ``aot_deserialize`` in another
    process of the same torch, Python and GPU."""
    from torch._dynamo.aot_compile import AOTCompiledFunction

    return AOTCompiledFunction.serialize(fn).serialized_data


def aot_deserialize(data: bytes, f_globals: dict) -> Callable:
    """What ``aot_serialize`` saved, ready to call as ``aot_compile`` returns it, its
    globals ``f_globals`` (those of the function compiled). torch refuses (RuntimeError)
    bytes saved by another torch, Python or GPU; other bytes raise what unpickling them
    raises.

    It runs inside a tracing context of its own, dropped after: unpickling the guards
    of a module imported by the traced code (flex_attention's mask functions) installs
    a guard into the current context, and outside a compile there is none (torch:
    "TracingContext.get() must be called within an ongoing trace")."""
    from torch._dynamo.aot_compile import AOTCompiledFunction
    from torch._guards import TracingContext, tracing

    with tracing(TracingContext(None)):
        compiled = AOTCompiledFunction.deserialize(data, f_globals)
    compiled.disable_guard_check()
    return compiled


def aot_stale_source(fn: Callable) -> Optional[str]:
    """The first function traced into ``aot_compile``'s ``fn`` whose source lines differ
    now from those it was compiled from (``module:first-last``), None when none does."""
    import hashlib
    import importlib
    import inspect

    for source in sorted(fn.source_info().inlined_sources, key=lambda s: (s.module, s.firstlineno)):
        where = f"{source.module}:{source.firstlineno}-{source.lastlineno}"
        try:
            lines = inspect.getsourcelines(importlib.import_module(source.module))[0]
        except (ImportError, OSError, TypeError):
            return f"{where} (its source cannot be read)"
        text = "".join(lines[source.firstlineno - 1:source.lastlineno - 1])
        if hashlib.sha256(text.encode()).hexdigest() != source.checksum:
            return where
    return None


def aot_guards_pass(fn: Callable, args: tuple, kwargs: dict) -> bool:
    """Whether the inputs pass the guards ``aot_compile``'s ``fn`` was compiled under."""
    return bool(fn.guard_check(*args, **kwargs))


def aot_guard_failure(fn: Callable, args: tuple, kwargs: dict) -> str:
    """Which of ``fn``'s guards the inputs fail, in Dynamo's words (best effort)."""
    try:
        info = fn._artifacts.guard_manager.check_verbose(fn.prepare_f_locals(*args, **kwargs))
        parts = getattr(info, "verbose_code_parts", None)
        return ("; ".join(map(str, parts)) if parts else str(info))[:500]
    except Exception as e:  # noqa: BLE001 - only words for an error message
        return f"(the guards' failure could not be read: {type(e).__name__})"


# ---------------------------------------------------------------------------- the start-up probe


def _probe_config() -> None:
    cfg = dynamo_config()
    for name in ("recompile_limit", "accumulated_recompile_limit", "fail_on_recompile_limit_hit"):
        if not hasattr(cfg, name):
            raise AttributeError(f"torch._dynamo.config has no {name}")


def _probe_counters() -> None:
    dynamo_counters()
    from torch._dynamo.utils import compilation_time_metrics

    if not isinstance(compilation_time_metrics, dict):
        raise TypeError(f"compilation_time_metrics is a {type(compilation_time_metrics).__name__}, not a dict")


def _probe_cache_dir() -> None:
    from torch._inductor.runtime.cache_dir_utils import cache_dir  # noqa: F401


def _probe_artifacts() -> None:
    manager = cache_artifact_manager()
    for name in ("deserialize", "populate_caches"):
        if not callable(getattr(manager, name, None)):
            raise AttributeError(f"CacheArtifactManager has no {name}")


def _probe_flex_warnings() -> None:
    from torch.nn.attention import flex_attention as flex_module

    if not isinstance(getattr(flex_module, "_WARNINGS_SHOWN", None), set):
        raise AttributeError("torch.nn.attention.flex_attention has no _WARNINGS_SHOWN set")


def _probe_aot_compile() -> None:
    import torch
    from torch._dynamo import aot_compile as module
    from torch._dynamo.aot_compile import AOTCompiledFunction

    if not callable(getattr(torch.compile(lambda x: x, fullgraph=True), "aot_compile", None)):
        from torch._dynamo.hooks import Hooks  # noqa: F401 - what the direct call needs

        if not callable(getattr(module, "aot_compile_fullgraph", None)) or \
                not isinstance(getattr(torch, "_TorchCompileInductorWrapper", None), type):
            raise AttributeError("torch.compile(...) has no aot_compile, and torch._dynamo.aot_compile "
                                 "no aot_compile_fullgraph")
    for name in ("guard_check", "disable_guard_check", "prepare_f_locals"):
        if not callable(getattr(AOTCompiledFunction, name, None)):
            raise AttributeError(f"AOTCompiledFunction has no {name}")


def _probe_aot_save() -> None:
    import dataclasses

    from torch._dynamo.aot_compile import AOTCompiledFunction
    from torch._dynamo.package import InlinedSource
    from torch._guards import TracingContext, tracing  # noqa: F401 - aot_deserialize's context

    for name in ("serialize", "deserialize", "source_info"):
        if not callable(getattr(AOTCompiledFunction, name, None)):
            raise AttributeError(f"AOTCompiledFunction has no {name}")
    fields = {f.name for f in dataclasses.fields(InlinedSource)}
    if not {"module", "firstlineno", "lastlineno", "checksum"} <= fields:
        raise AttributeError(f"torch._dynamo.package.InlinedSource has fields {sorted(fields)}")


PROBES: dict[str, Callable[[], None]] = {
    "config_everywhere": _probe_config,
    "counters": _probe_counters,
    "inductor_cache": _probe_cache_dir,
    "cache_artifacts": _probe_artifacts,
    "flex_warnings": _probe_flex_warnings,
    "aot_compile": _probe_aot_compile,
    "aot_save": _probe_aot_save,
}


def check_one(name: str) -> Optional[str]:
    """What is missing of private use ``name`` on the torch installed (None: present)."""
    try:
        PROBES[name]()
    except Exception as e:  # noqa: BLE001 - any failure means the use moved
        return f"{type(e).__name__}: {e}"[:200]
    return None


def check() -> dict:
    """Probe every private use on the torch installed: ``{torch, checked, moved}`` where
    ``moved`` maps a use's name to what is missing (empty: all present)."""
    import torch

    moved = {name: why for name in PROBES if (why := check_one(name)) is not None}
    return {"torch": torch.__version__, "checked": checked_on(torch.__version__), "moved": moved}


def describe(report: dict) -> str:
    """One line for trainer.log."""
    versions = ", ".join(v for v, _ in CHECKED)
    where = "a release they were checked on" if report["checked"] else f"not one of {versions}: watch the first run"
    if not report["moved"]:
        return f"torch api: {report['torch']}: all {len(PROBES)} private uses present ({where})"
    missing = "; ".join(f"{k}: {v}" for k, v in report["moved"].items())
    return f"torch api: {report['torch']}: {len(report['moved'])} private use(s) moved ({where}): {missing}"
