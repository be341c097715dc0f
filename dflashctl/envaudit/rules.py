"""Env-audit rules: pure functions from a ``Snapshot`` to ``Finding``s.

``audit(snapshot)`` runs every rule and returns the findings, worst first. The
rule families, each a module ``rules_<family>``:

    torch          importable, a CUDA build when the playbook wants GPUs, its CUDA
                   libraries found by the loader (or `import torch` itself, --deep);
                   a distribution whose METADATA is empty
    shadowing      a module imported from another copy than the one pip lists
                   (a .pth, the user site, a directory no distribution owns);
                   a name installed twice
    requirements   torch's and the trainer's, at the versions they pin (triton
                   above all); every other distribution's (what `pip check` says)
    integrity      RECORD files missing or changed for torch and what it requires;
                   files listed by more than one distribution
    cuda           wheels built for another CUDA major than torch's; the same
                   shared library from a wheel and from the system, with versions
    environment    LD_PRELOAD, PYTHONPATH entries that shadow something, stray
                   inference stacks, other frameworks, no venv, partial answers

``Finding``, ``Policy``, the codes and the exit codes are in ``findings`` (and
importable from here); what every rule reads is ``context``'s ``_Context``.

No I/O, no clock, no SSH: a rule reads the snapshot and returns findings. Every
fix is exact commands built by ``fixes.Fixer``, which never uninstalls a
protected distribution and never deletes one's files without reinstalling it.
"""

from __future__ import annotations

from dflashctl.core.states import severity_rank
from dflashctl.envaudit.context import _Context
from dflashctl.envaudit.findings import (
    CODES,
    EXIT_CLEAN,
    EXIT_ERRORS,
    EXIT_NOT_RUN,
    EXIT_WARNINGS,
    SUBJECTS,
    Finding,
    IgnoreRule,
    Policy,
    exit_code,
)
from dflashctl.envaudit.program import prove
from dflashctl.envaudit.rules_cuda import _rule_cuda_major, _rule_duplicate_libraries
from dflashctl.envaudit.rules_environment import (
    _rule_environment,
    _rule_ld_preload,
    _rule_pip,
    _rule_pip_stash,
    _rule_pythonpath,
    _rule_stray_stacks,
    _rule_user_site,
)
from dflashctl.envaudit.rules_integrity import _rule_integrity, _rule_relocated_scripts, _rule_shared_files
from dflashctl.envaudit.rules_requirements import (
    _rule_requirements,
    _rule_trainer,
    _rule_triton,
    _rule_unmet,
    unrunnable,
)
from dflashctl.envaudit.rules_shadowing import _rule_duplicate_packages, _rule_shadowed
from dflashctl.envaudit.rules_torch import (
    _rule_broken_metadata,
    _rule_flash_attn,
    _rule_imports,
    _rule_torch,
    _rule_torch_libraries,
)
from dflashctl.envaudit.snapshot import Snapshot

__all__ = [
    "CODES", "EXIT_CLEAN", "EXIT_ERRORS", "EXIT_NOT_RUN", "EXIT_WARNINGS", "RULES", "SUBJECTS", "Finding",
    "IgnoreRule", "Policy", "audit", "exit_code",
]

RULES = (
    _rule_torch,
    _rule_torch_libraries,
    _rule_imports,
    _rule_broken_metadata,
    _rule_shadowed,
    _rule_duplicate_packages,
    _rule_requirements,
    _rule_triton,
    _rule_flash_attn,
    _rule_trainer,
    _rule_unmet,
    _rule_integrity,
    _rule_relocated_scripts,
    _rule_shared_files,
    _rule_cuda_major,
    _rule_duplicate_libraries,
    _rule_ld_preload,
    _rule_user_site,
    _rule_pythonpath,
    _rule_stray_stacks,
    _rule_pip,
    _rule_pip_stash,
    _rule_environment,
)


def audit(snapshot: Snapshot, *, device: str | None = None, host_gpus: int | None = None,
          policy: Policy | None = None) -> list[Finding]:
    """Every finding for a snapshot, worst first. ``device``: the playbook's
    trainer.placement.device (a CPU-only torch is a warning for 'cuda'); ``host_gpus``:
    the inventory's GPU count; ``policy``: what to allow and ignore."""
    policy = policy or Policy()
    context = _Context(snapshot, device, host_gpus, policy)
    findings: list[Finding] = []
    for rule in RULES:
        findings += rule(context)
    for f in findings:
        if f.severity == "warning" and context.only_outside(f.packages):
            f.severity = "info"  # a base interpreter's package (a system-site-packages venv): not the trainer's
    findings = sorted((f for f in findings if not policy.ignores(f)), key=lambda f: -severity_rank(f.severity))
    # A command that cannot be proven safe is left out, with why; on an interpreter the
    # trainer cannot run on, every command is: no package fix makes it run there.
    prove(findings, snapshot, context.protected, refuse=unrunnable(snapshot))
    return findings
