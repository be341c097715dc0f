"""Crash classification: which known failure is this, and what to do about it.

An ordered table of signatures, first match wins. Each matches a regex over the
run's output (pane tail + log tail + the status error line) and/or the trainer's
exit code. Order matters where failures overlap: an ImportError caused by a
missing ``libcudnn.so.9`` is a missing shared library, not a plain ImportError.
When the output holds a traceback, only the last error report (its whole chain
of exceptions) and what follows it are searched: an earlier warning that
mentions an ImportError must not decide how a later crash is handled.

The output can be cut off: a full disk ends trainer.log mid-word ("No sp"), a
killed tmux server takes the pane with it. So ``classify`` also weighs what the
host says besides the output (``Evidence``): the free disk of the run directory
and the trainer's disk-full exit code (``disk_full`` however the log was cut),
the kernel's count of OOM kills since the process was last seen healthy (a
SIGKILL is ``host_oom`` on the kernel's word), and a tmux server gone with the
session (``tmux_server_gone``).

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
from dflashctl.core.units import fmt_bytes

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


def _sigkill(code: int | None) -> bool:
    return code in (-9, 137)


DISK_FULL_BYTES = 64 << 20  # free space under which a run directory's disk counts as full
DISK_FULL_FRACTION = 0.01  # ... or under this share of it, on a disk smaller than 6.4 GiB


@dataclass(frozen=True)
class Evidence:
    """What the host says of a crash besides the process's output (which a full disk
    or a killed tmux server cuts off). None: not known."""

    run_dir: str | None = None
    disk_free: int | None = None  # bytes free to the trainer on the run directory's filesystem
    disk_total: int | None = None
    oom_kills: int | None = None  # the kernel's OOM kills since the process was last seen healthy
    tmux_server_gone: bool | None = None  # the session went, and its tmux server with it

    def disk_full(self) -> bool:
        if self.disk_free is None:
            return False
        limit = DISK_FULL_BYTES
        if self.disk_total:
            limit = min(limit, int(self.disk_total * DISK_FULL_FRACTION))
        return self.disk_free <= limit

    def disk_words(self) -> str | None:
        """'/w/runs/r1 has 0 B free of 1 MiB' (None: the free disk is not known)."""
        if self.disk_free is None:
            return None
        where = self.run_dir or "the run directory"
        of = f" of {fmt_bytes(self.disk_total)}" if self.disk_total else ""
        return f"{where} has {fmt_bytes(self.disk_free)} free{of}"


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
        _re(r"No space left on device|ENOSPC|Disk quota exceeded|EDQUOT"),
        STOP,
        "critical",
        "the run host's disk is full (checkpoints, compile cache, logs); a restart would fail the "
        "same way. Free space there (old run directories under the workdir, fewer train.keep_checkpoints, the "
        "compile cache), then `dflashctl restart RUN`",
        exit_code=lambda c: c == contract.EXIT_DISK_FULL,
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

HOST_OOM = Signature(
    "host_oom",
    None,
    RESTART,
    "error",
    "the kernel's OOM killer ended the trainer (the host, or its container's memory limit, ran out of RAM); "
    "restarting from the last checkpoint. If it repeats: `dmesg | grep -i oom` on the host names the biggest "
    "users; lower data.batch_size or the data workers, or stop what else runs there",
)

TMUX_SERVER_GONE = Signature(
    "tmux_server_gone",
    None,
    RESTART,
    "error",
    "the run's tmux server is gone with the trainer (`tmux kill-server`, the OOM killer, or a session clean-up "
    "such as systemd-logind's KillUserProcesses=yes); restarting from the last checkpoint. If it repeats, "
    "check `loginctl show-user` and `dmesg` on the host",
)

EVIDENCE_SIGNATURES = (HOST_OOM, TMUX_SERVER_GONE)  # matched on the host's word, not on the output

UNKNOWN = Classification(
    name="unknown",
    action=RESTART,
    severity="error",
    hint="no known signature matched: the log tail (`dflashctl logs RUN`) says what failed",
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
    evidence: Evidence | None = None,
) -> Classification:
    """Name a crash from its output, the status error line, the exit code and what
    the host says besides (``evidence``, see the module docstring).

    ``extra_signatures`` (a playbook's) are tried first. Then a full disk: whatever
    the output says, a restart would fail the same way. Then the built-in table; a
    SIGKILL or an unknown crash the kernel's OOM killer or a tmux server's end
    explains is named so. Anything else unmatched is ``unknown`` (restart).
    """
    evidence = evidence or Evidence()
    start = last_error_start(text)
    if start is not None:
        text = text[start:]
    combined = "\n".join(t for t in (text, status_error) if t)
    table = [s if isinstance(s, Signature) else from_config(s) for s in extra_signatures]
    for sig in table:
        line = sig.match(combined, exit_code)
        if line is not None:
            return Classification(sig.name, sig.action, sig.severity, sig.hint, line)
    found = next(((sig, line) for sig in BUILTIN_SIGNATURES
                  if (line := sig.match(combined, exit_code)) is not None), None)
    if evidence.disk_full() or (found is not None and found[0].name == "disk_full"):
        return _disk_full(evidence, found[1] if found is not None and found[0].name == "disk_full" else None)
    if found is None or found[0].name == "killed_by_signal":
        if evidence.oom_kills and (found is not None or _sigkill(exit_code) or exit_code is None):
            return _named(HOST_OOM, f"the kernel counted {evidence.oom_kills} OOM kill(s) since the trainer was "
                                    f"last seen healthy" + (f"; {found[1]}" if found is not None else ""))
        if found is None and exit_code is None and evidence.tmux_server_gone:
            return _named(TMUX_SERVER_GONE, "the tmux session and its server are gone; no exit code was written")
    if found is not None:
        sig, line = found
        return Classification(sig.name, sig.action, sig.severity, sig.hint, line)
    return UNKNOWN


def _named(sig: Signature, line: str) -> Classification:
    return Classification(sig.name, sig.action, sig.severity, sig.hint, line)


def _disk_full(evidence: Evidence, line: str | None) -> Classification:
    """``disk_full`` with the path and the free space, where the host said them."""
    sig = next(s for s in BUILTIN_SIGNATURES if s.name == "disk_full")
    words = evidence.disk_words()
    rest = sig.hint.split("; ", 1)[1]
    if words is None:
        hint = sig.hint
    elif evidence.disk_full():
        hint = f"the run host's disk is full: {words}; {rest}"
    else:  # space came back since (a partial checkpoint removed): it may fill again
        hint = f"a write on the run host ran out of space; {words} now; {rest}"
    return Classification(sig.name, sig.action, sig.severity, hint, line or (f"free disk: {words}" if words else None))


def signature_names(extra_signatures: Iterable["PlaybookSignature | Signature"] = ()) -> list[str]:
    """Every name ``classify`` can return (for validating ``restart.actions`` keys)."""
    return ([s.name for s in extra_signatures] + [s.name for s in BUILTIN_SIGNATURES]
            + [s.name for s in EVIDENCE_SIGNATURES] + [UNKNOWN.name])
