"""Environment audit: what the trainer's Python on a host will actually load, and
what in it would break a run.

One round trip per host: the collector (dflashctl/hosts/remote/audit.py, stdlib only)
runs with the host's python and asks its import system; it prints a JSON
snapshot, and everything after that is pure. The rooms:

    snapshot   the data: ``Snapshot``, ``Dist``, ``ModuleSpec``, ``parse_snapshot``
    stack      the torch Python imports and its build, each wheel's CUDA major,
               the requirement tree, every distribution's unmet requirements
    fixes      exact commands for the host's python, uninstalls simulated first
    findings   ``Finding``, its codes, the exit codes, ``Policy`` (env_audit: of a
               host and a playbook)
    context    what every rule reads, computed once per audit
    rules_*    the rules by family: torch, shadowing, requirements, integrity, cuda,
               environment
    rules      ``audit(snapshot) -> [Finding]``: every family's rules, worst first,
               their commands kept only where ``program`` proves them safe
    program    the plan as a program over a model of the environment: ``prove`` keeps a
               finding's commands only where the whole plan stays safe, ``plan`` renders
               it (wheels fetched first, installed with --no-index)
    report     ``AuditReport``: one host's result, its exit code, plan and JSON form
    apply      ``env-audit --apply``: the plan run step by step, audited after each, a
               failed step undone (dflashctl/hosts/remote/envsave.py saves what it removes)
    drift      the package set against the playbook's last good run (the store)
    host       the round trip and the entry points: ``audit_target`` (the CLI),
               ``preflight`` (the launcher), ``record_snapshot`` (drift checks)

This package never imports torch (the collector reads torch's files on the host,
or imports it in a subprocess there with --deep) and never draws: the
``env-audit`` command prints the report.
"""

from dflashctl.envaudit.drift import drift_since_good_run, last_good_run
from dflashctl.envaudit.findings import CODES, EXIT_NOT_RUN, Finding, IgnoreRule, Policy, exit_code
from dflashctl.envaudit.fixes import Fixer, Removal
from dflashctl.envaudit.host import (
    DEFAULT_TIMEOUT,
    audit_command,
    audit_host,
    audit_target,
    collect,
    collector_argument,
    policy_for,
    preflight,
    record_snapshot,
    resolve_target,
)
from dflashctl.envaudit.report import SCHEMA, AuditReport, failed_document, plan
from dflashctl.envaudit.rules import audit
from dflashctl.envaudit.snapshot import (
    ASKED_MODULES,
    LIB_PREFIXES,
    TRAINER_MODULES,
    Dist,
    LibEntry,
    LoadedLib,
    LoaderFile,
    ModuleSpec,
    PathEntry,
    PthFile,
    SharedFiles,
    Snapshot,
    parse_ldconfig,
    parse_snapshot,
)
from dflashctl.envaudit.stack import (
    TRAINER_ROOTS,
    ReqCheck,
    TorchBuild,
    Unmet,
    component,
    cuda_major,
    protected,
    required_by,
    requirement_checks,
    torch_build,
    unmet_requirements,
)

__all__ = [
    "ASKED_MODULES", "CODES", "DEFAULT_TIMEOUT", "EXIT_NOT_RUN", "LIB_PREFIXES", "SCHEMA", "TRAINER_MODULES",
    "TRAINER_ROOTS", "AuditReport", "Dist", "Finding", "Fixer", "IgnoreRule", "LibEntry", "LoadedLib", "LoaderFile", "ModuleSpec",
    "PathEntry", "Policy", "PthFile", "Removal", "ReqCheck", "SharedFiles", "Snapshot", "TorchBuild", "Unmet",
    "audit", "audit_command", "audit_host", "audit_target", "collect", "collector_argument", "component",
    "cuda_major", "drift_since_good_run", "exit_code", "failed_document", "last_good_run", "parse_ldconfig",
    "parse_snapshot", "plan", "policy_for", "preflight", "protected", "record_snapshot", "required_by",
    "requirement_checks", "resolve_target", "torch_build", "unmet_requirements",
]
