"""Crash classification: which known failure is this, and what to do about it.

An ordered table of signatures, first match wins. Each matches a regex over the
run's output (pane tail + log tail + the status error line) and/or the trainer's
exit code. Order matters where failures overlap: an ImportError caused by a
missing ``libcudnn.so.9`` is a missing shared library, not a plain ImportError.
When the output holds a traceback, only the last error report (its whole chain
of exceptions) and what follows it are searched: an earlier warning that
mentions an ImportError must not decide how a later crash is handled.

A playbook's own signatures are checked before the built-in table; a playbook's
``restart.actions`` overrides an action by signature name (applied in
``policy.decide``). A playbook's signature as written in YAML is a
``PlaybookSignature`` (validated with the rest of the playbook by
``dflashctl.config``, which imports it from here); ``from_config`` compiles it
into a ``Signature``.

This module is pure: it never touches a host, the store or the playbook files,
and never imports ``dflashctl.config`` (config depends on it, not the reverse).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from dflashctl.core import contract
from dflashctl.core.logtext import last_error_start

RESTART = "restart"
RESTART_SERIALIZED = "restart_serialized"
STOP = "stop"

# The words a playbook may use (signatures, restart.actions, alerts.min_severity).
Severity = Literal["info", "warning", "error", "critical"]
Action = Literal["restart", "restart_serialized", "stop"]


class PlaybookSignature(BaseModel):
    """A crash signature of this playbook, matched against the error text before the built-in table."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    pattern: str
    """Python regular expression, searched in the traceback / pane tail."""
    action: Action = "restart"
    severity: Severity = "error"
    hint: Optional[str] = None
    """Shown to the operator with the alert."""

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"invalid regular expression '{pattern}': {e}") from None
        return pattern


@dataclass(frozen=True)
class Signature:
    name: str
    pattern: re.Pattern | None  # searched line by line (MULTILINE)
    action: str  # restart | restart_serialized | stop
    severity: str  # info | warning | error | critical
    hint: str | None = None
    exit_code: Callable[[int], bool] | None = None  # matches on the exit code too

    def match(self, text: str, exit_code: int | None) -> str | None:
        """The matched line (or a description of the exit code), or None."""
        if self.pattern is not None:
            found = None
            for found in self.pattern.finditer(text):
                pass  # the last occurrence is the one nearest the crash
            if found is not None:
                return _line_at(text, found.start())
        if self.exit_code is not None and exit_code is not None and self.exit_code(exit_code):
            return f"exit code {exit_code} ({contract.describe_exit(exit_code)})"
        return None


@dataclass(frozen=True)
class Classification:
    name: str
    action: str
    severity: str
    hint: str | None
    matched_line: str | None


def _line_at(text: str, pos: int) -> str:
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    return text[start : end if end >= 0 else len(text)].strip()[:300]


def _re(pattern: str) -> re.Pattern:
    return re.compile(pattern, re.MULTILINE)


def _by_signal(code: int) -> bool:
    return code < 0 or code > 128


BUILTIN_SIGNATURES: tuple[Signature, ...] = (
    Signature(
        "fx_race",
        _re(r"Detected that you are using FX to symbolically trace a dynamo-optimized function"),
        RESTART_SERIALIZED,
        "warning",
        "torch.compile warm-up raced across threads; restarting with a serialized warm-up "
        "(one thread compiles first, the compile cache stays warm)",
    ),
    Signature(
        "recompile_limit",
        _re(r"FailOnRecompileLimitHit|fail_on_recompile_limit_hit|hit config\.(?:accumulated_)?recompile_limit"),
        STOP,
        "error",
        "a compiled function needed more variants than the recompile limit allows (devices x buckets x 3 "
        "+ compile.recompile_margin); raise compile.recompile_margin in the playbook and relaunch "
        "(TORCH_LOGS=recompiles names each variant); past the limit it would have run uncompiled, several times slower",
    ),
    Signature(
        "recompile_after_warmup",
        _re(r"Detected recompile when torch\.compile stance is 'fail_on_recompile'"),
        RESTART,
        "warning",
        "a compiled function recompiled after the warm-up (a guard failed: a shape, dtype or grad mode the "
        "warm-up did not cover), and the trainer refuses to compile while other threads run; restarting "
        "from the last checkpoint. If it repeats, the log's guard-failure lines name what changed: report them",
    ),
    Signature(
        "compile_guard",
        _re(r"GuardOnDataDependentSymNode|torch\._dynamo\.exc\.RecompileError"),
        STOP,
        "error",
        "torch.compile could not guard the trainer's code (a value read from a tensor decides a branch); "
        "a restart would fail the same way: report the log tail with the trainer version",
    ),
    Signature(
        "eager_flex_fallback",
        _re(r"flex_attention called without torch\.compile"),
        STOP,
        "error",
        "the compiled attention fell back to flex_attention's unfused path (it materialises every score: "
        "O(S^2) memory and several times slower), which the trainer refuses; usually a recompile limit or a "
        "graph break: see the log's Dynamo warnings. compile.allow_eager: true accepts the slow path",
    ),
    Signature(
        "nan_loss",
        _re(r"FloatingPointError: loss is (?:nan|inf|-inf)\b"),
        STOP,
        "error",
        "the loss diverged (NaN/inf): lower optim.lr or lengthen optim.warmup_frac, keep optim.grad_clip on, "
        "and check the batch the error names for broken records; a restart resumes the same data from the "
        "last checkpoint and would diverge again",
    ),
    Signature(
        "cuda_device_assert",
        _re(r"device-side assert triggered"),
        STOP,
        "error",
        "a GPU kernel's assertion failed, usually an index out of range (a token id at or past the target's "
        "vocabulary, a label outside it): check the data and model.mask_token_id; the failure is deterministic, "
        "so a restart only fails again (the assertion line above the error names the kernel)",
    ),
    Signature(
        "cuda_illegal_memory_access",
        _re(r"an illegal memory access was encountered|cudaErrorIllegalAddress"),
        RESTART,
        "error",
        "a GPU kernel read or wrote outside its memory (a kernel bug or a failing GPU); restarting from the last "
        "checkpoint. If it repeats at the same step, run once with CUDA_LAUNCH_BLOCKING=1 to name the kernel, "
        "and check `dmesg | grep -i xid` on the host",
    ),
    Signature(
        "cuda_oom",
        _re(r"CUDA out of memory|OutOfMemoryError"),
        STOP,
        "error",
        "GPU memory exhausted: lower data.batch_size or the largest length bucket, or give the "
        "drafter more GPUs; a restart would fail the same way",
    ),
    Signature(
        "xid",
        _re(r"\bXid\b|uncorrectable ECC|GPU has fallen off the bus"),
        STOP,
        "critical",
        "GPU hardware/driver fault: check `dmesg | grep -i xid` and `nvidia-smi -q -d ECC` on the host; "
        "the GPU may need a reset or replacement",
    ),
    Signature(
        "rendezvous_port_in_use",
        _re(r"RendezvousError: [^\n]*EADDRINUSE|EADDRINUSE|[Aa]ddress already in use"),
        STOP,
        "critical",
        "rank 0 could not listen on the rendezvous port (EADDRINUSE): another process holds it, perhaps "
        "another user's; the other ranks refuse to join it. `ss -ltnp 'sport = :PORT'` on rank 0's host shows "
        "who; stop it or set rendezvous.port in the playbook to a free port, then `dflashctl restart RUN`",
    ),
    Signature(
        "rendezvous_refused",
        _re(r"RendezvousError: [^\n]*(did not prove|gave no|not this run's|could not join)"),
        STOP,
        "critical",
        "this rank refused the process at the rendezvous address: it did not prove the run's secret "
        "(rendezvous.key), so it is not this run's rank 0 (another process holds the port?); nothing it sent "
        "was accepted. Check who listens on the rendezvous port, then `dflashctl restart RUN`",
    ),
    Signature(
        "rank_failed",
        _re(r"DistributedError: [^\n]*failed first"),
        RESTART,
        "error",
        "a process of the multi-host run failed or vanished (its host is named); every host is restarted "
        "from the last checkpoint",
    ),
    Signature(
        "nccl_timeout",
        _re(r"Watchdog caught collective operation timeout|NCCL[^\n]*\b[Tt]ime(d)?\s?out"),
        RESTART,
        "error",
        "a collective timed out (a peer died or hung); restarting from the last checkpoint",
    ),
    Signature(
        "missing_shared_library",
        _re(r"lib\S+\.so(\.\d+)*: cannot open shared object file"),
        STOP,
        "critical",
        "a library torch needs is gone from the host (e.g. after a clean-up); reinstall the wheel "
        "that ships it (libcudnn.so.9: nvidia-cudnn-cu12) and run `dflashctl env-audit`",
    ),
    Signature(
        "cudnn_version_mismatch",
        _re(r"cuDNN[^\n]*version[^\n]*(mismatch|incompatib)|cuDNN[^\n]*sublibrar|sublibrary[^\n]*version"),
        STOP,
        "error",
        "two cuDNN versions are mixed on the host (another stack's wheels beside torch's); "
        "run `dflashctl env-audit` and keep the one torch was built with",
    ),
    Signature(
        "cublas_failure",
        _re(r"CUBLAS_STATUS_\w+|CUDNN_STATUS_(?:EXECUTION_FAILED|INTERNAL_ERROR|MAPPING_ERROR)"),
        RESTART,
        "error",
        "a cuBLAS/cuDNN call failed on the GPU (often a transient device fault, sometimes memory pressure); "
        "restarting from the last checkpoint. If it repeats, check `nvidia-smi -q -d ECC` and `dmesg` on the host",
    ),
    Signature(
        "import_error",
        _re(r"\b(ImportError|ModuleNotFoundError)\b"),
        STOP,
        "error",
        "the trainer's Python environment is broken or incomplete; run `dflashctl env-audit`",
    ),
    Signature(
        "disk_full",
        _re(r"No space left on device|ENOSPC"),
        STOP,
        "critical",
        "the run host's disk is full (checkpoints, compile cache, logs); free space, then `dflashctl restart`",
    ),
    Signature(
        "segfault",
        _re(r"Segmentation fault|SIGSEGV|Fatal Python error: Segmentation"),
        RESTART,
        "error",
        "the process crashed in native code; restarting from the last checkpoint",
        exit_code=lambda c: c in (139, -11),
    ),
    Signature(
        "killed_by_signal",
        _re(r"^\s*Killed\s*$|\bterminated by signal\b|\bkilled by signal\b"),
        RESTART,
        "error",
        "the trainer was killed (the host's OOM killer sends SIGKILL: check `dmesg` and host RAM)",
        exit_code=_by_signal,
    ),
    Signature(
        "run_dir_busy",
        _re(r"RunDirBusy: run directory .* is owned by another trainer"),
        STOP,
        "error",
        "another trainer owns the run directory (its lock file): a second one never starts beside it; "
        "find what started it (a go file, a run.sh by hand) before any restart",
        exit_code=lambda c: c == contract.EXIT_RUN_DIR_BUSY,
    ),
    Signature(
        "data_error",
        None,
        STOP,
        "error",
        "the trainer rejected its data (see the log tail); shards fixed in place: `dflashctl restart`; a wrong "
        "`data.shards` in the playbook: fix it and launch again (a restart reuses the config recorded at launch)",
        exit_code=lambda c: c == contract.EXIT_DATA_ERROR,
    ),
    Signature(
        "config_error",
        None,
        STOP,
        "error",
        "the trainer rejected its configuration (see the log tail); fix the playbook, then relaunch",
        exit_code=lambda c: c == contract.EXIT_CONFIG_ERROR,
    ),
)

UNKNOWN = Classification(
    name="unknown",
    action=RESTART,
    severity="error",
    hint="no known signature matched; restarting from the last checkpoint (see the log tail)",
    matched_line=None,
)


def from_config(sig: PlaybookSignature) -> Signature:
    """A playbook signature (already validated: its pattern compiles)."""
    return Signature(sig.name, _re(sig.pattern), sig.action, sig.severity, sig.hint)


def classify(
    text: str | None,
    status_error: str | None = None,
    exit_code: int | None = None,
    extra_signatures: Iterable["PlaybookSignature | Signature"] = (),
) -> Classification:
    """Name a crash from its output, the status error line and the exit code.

    ``extra_signatures`` (a playbook's) are tried before the built-in table.
    Anything unmatched is ``unknown`` (restart).
    """
    start = last_error_start(text)
    if start is not None:
        text = text[start:]
    combined = "\n".join(t for t in (text, status_error) if t)
    table = [s if isinstance(s, Signature) else from_config(s) for s in extra_signatures]
    for sig in [*table, *BUILTIN_SIGNATURES]:
        line = sig.match(combined, exit_code)
        if line is not None:
            return Classification(sig.name, sig.action, sig.severity, sig.hint, line)
    return UNKNOWN


def signature_names(extra_signatures: Iterable["PlaybookSignature | Signature"] = ()) -> list[str]:
    """Every name ``classify`` can return (for validating ``restart.actions`` keys)."""
    return [s.name for s in extra_signatures] + [s.name for s in BUILTIN_SIGNATURES] + [UNKNOWN.name]
