"""Auditing a host: the one round trip (the collector, dflashctl/hosts/remote/audit.py,
run by the host's python through its transport: jump hosts, container wrapper,
the run's environment), then the rules, as the CLI and the launcher ask for it.

The collector runs with the python that runs the trainer, without ``-I``: a user
site-packages directory or a PYTHONPATH is exactly what is being audited. Its
argument names the libraries to follow (``LIB_PREFIXES``) and the modules to look
up, so the collector and the rules cannot disagree about them.

The policy is the inventory host's ``env_audit:`` merged with the playbook's.

This module only connects, collects and stores; it never judges (``rules``) and
never draws (the ``env-audit`` command). A host that cannot be reached raises; a
host where the collector gives no answer raises ``TransportError`` (the launcher's
preflight turns that into an error finding).
"""

from __future__ import annotations

import json
import shlex
import time
from typing import TYPE_CHECKING, Sequence

from dflashctl.core.contract import did_you_mean
from dflashctl.core.errors import ConfigError, DflashError, TransportError, UnreachableError, first_line
from dflashctl.envaudit.drift import drift_since_good_run, open_existing_store
from dflashctl.envaudit.findings import Finding, Policy
from dflashctl.envaudit.report import AuditReport
from dflashctl.envaudit.rules import audit
from dflashctl.hosts.transport.limits import AUDIT
from dflashctl.envaudit.snapshot import ASKED_MODULES, LIB_PREFIXES, Snapshot, parse_snapshot
from dflashctl.envaudit.stack import torch_build
from dflashctl.hosts import remote

if TYPE_CHECKING:
    from dflashctl.config import Host, Inventory, Playbook
    from dflashctl.hosts.transport import Transport
    from dflashctl.store import Store

DEFAULT_TIMEOUT = 60.0


DEEP_TIMEOUT = 120.0


def collector_argument(deep: bool = False, deep_timeout: float = DEEP_TIMEOUT, imports: Sequence[str] = ()) -> str:
    """The collector's one JSON argument (``imports``: with ``deep``, modules
    imported besides the trainer's own)."""
    argument: dict = {"lib_prefixes": list(LIB_PREFIXES), "modules": list(ASKED_MODULES)}
    if deep:
        argument.update(deep=True, deep_timeout=deep_timeout, imports=[m for m in imports if m.isidentifier()])
    return json.dumps(argument)


def audit_command(host: "Host", deep: bool = False, imports: Sequence[str] = ()) -> list[str]:
    """argv running the collector with the python that runs the trainer (split as
    launch splits it): ``[*python, "-c", <collector text>, <JSON argument>]``."""
    return [*shlex.split(host.python), "-c", remote.source("audit"), collector_argument(deep, imports=imports)]


def collect(transport: "Transport", env: dict[str, str] | None = None, timeout: float = DEFAULT_TIMEOUT,
            deep: bool = False, imports: Sequence[str] = ()) -> Snapshot:
    """The one round trip: run the collector on the host, parse its answer."""
    argv = audit_command(transport.host, deep, imports)
    result = transport.run(argv, env=env, timeout=timeout + (DEEP_TIMEOUT if deep else 0), check=False, limit=AUDIT)
    try:
        snapshot = parse_snapshot(result.stdout, transport.host.name)
    except (ValueError, KeyError, TypeError):
        raise TransportError(
            transport.host.name, f"{argv[0]} -c <env-audit script>",
            "the env-audit script gave no answer"
            + (" (is python: right in the inventory?)" if result.exit_code else ""),
            exit_code=result.exit_code, stderr_tail=result.stderr[-2000:],
            hint=f"check that {transport.host.python} runs on {transport.host.name}",
        ) from None
    if _release(snapshot.python_version) < AUDITED_PYTHON:
        raise TransportError(
            transport.host.name, f"{argv[0]} -c <env-audit script>",
            f"{snapshot.python or transport.host.python} is Python {snapshot.python_version}: too old to be audited "
            f"(the audit needs Python {'.'.join(map(str, AUDITED_PYTHON))} for importlib.metadata; the trainer "
            "needs 3.10)", hint="point the inventory's python: at the Python 3.10+ environment the trainer runs in")
    snapshot.wrapper = list(transport.host.wrapper or [])
    return snapshot


AUDITED_PYTHON = (3, 8)  # the oldest Python whose packages the collector can list (importlib.metadata)


def _release(version: str | None) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in (version or "").split(".")[:2])
    except ValueError:
        return AUDITED_PYTHON  # a version that is not numbers: not judged here


def policy_for(host: "Host", inventory: "Inventory", playbook: "Playbook | None") -> Policy:
    """The inventory host's env_audit: merged with the playbook's (each checked, errors naming their file)."""
    policy = Policy.from_dict(getattr(host, "env_audit", None) or {}, inventory.source,
                              where=f"hosts.{host.name}.env_audit")
    if playbook is not None:
        policy = policy.merged(Policy.from_dict(playbook.env_audit, playbook.source))
    return policy


def _env_sources(host: "Host", playbook: "Playbook | None") -> dict[str, str]:
    sources = {}
    for var in ("PYTHONPATH", "LD_LIBRARY_PATH", "LD_PRELOAD"):
        if playbook is not None and var in playbook.env:
            sources[var] = f"playbook {playbook.name} env"
        elif var in (host.env or {}):
            sources[var] = f"inventory hosts.{host.name}.env"
        else:
            sources[var] = "the host's environment"
    return sources


def audit_host(
    host_name: str,
    inventory: "Inventory",
    playbook: "Playbook | None" = None,
    *,
    target: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    deep: bool = False,
    store: "Store | None" = None,
    imports: Sequence[str] = (),
) -> AuditReport:
    """Collect a host's snapshot (with the playbook's environment, when given) and
    audit it; with a playbook and a store, the drift since its last good run.
    ``deep``: the trainer's imports (and ``imports``) tried in a fresh interpreter."""
    from dflashctl.hosts.transport import connect

    host = inventory.get(host_name)
    policy = policy_for(host, inventory, playbook)
    started = time.monotonic()
    snapshot = collect(connect(host.name, inventory), env=dict(playbook.env) if playbook else None,
                       timeout=timeout, deep=deep, imports=imports)
    snapshot.env_sources = _env_sources(host, playbook)
    device = playbook.trainer.placement.device if playbook else None
    findings = audit(snapshot, device=device, host_gpus=host.gpus, policy=policy)
    report = AuditReport(target or host_name, host.name, playbook.name if playbook else None, snapshot, findings,
                         torch_build(snapshot), time.monotonic() - started)
    if playbook is not None and store is not None:
        report.drift = drift_since_good_run(store, playbook.name, host.name, snapshot.packages(),
                                            playbook.restart.healthy_after)
    return report


def resolve_target(
    name: str, inventory: "Inventory", playbooks_dir: str | None = None
) -> tuple[str, "Playbook | None"]:
    """PLAYBOOK|HOST -> (host name, playbook or None). A playbook of that name wins
    over a host of that name (it says more: its environment and GPU placement)."""
    from dflashctl.config import list_playbooks, load_playbook

    is_path = "/" in name or name.endswith((".yaml", ".yml"))
    playbooks = list_playbooks(playbooks_dir)
    if is_path or name in playbooks:
        pb = load_playbook(name, playbooks_dir, inventory)
        return pb.host, pb
    if name in inventory.hosts:
        return name, None
    raise ConfigError(
        f"'{name}' is neither a playbook nor a host{did_you_mean(name, [*playbooks, *inventory.hosts])}",
        hint=f"playbooks: {', '.join(playbooks)}; hosts in {inventory.source}: {', '.join(inventory.hosts)}",
    )


def audit_target(name: str, inventory: "Inventory", playbooks_dir: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT, deep: bool = False, store: "Store | None" = None) -> AuditReport:
    host, playbook = resolve_target(name, inventory, playbooks_dir)
    return audit_host(host, inventory, playbook, target=name, timeout=timeout, deep=deep, store=store)


def record_snapshot(store: "Store", report: AuditReport, now: float, run_id: str | None = None) -> int:
    """Store the package set (name -> version) for drift checks (``drift``)."""
    return store.add_env_snapshot(report.host, now, report.snapshot.packages(), kind="packages", run_id=run_id)


def preflight(playbook: "Playbook", inventory: "Inventory", store: "Store | None" = None,
              now: float | None = None, *, dry_run: bool = False) -> list[Finding]:
    """The launcher's preflight: the audit of the playbook's host, with the
    trainer's imports tried as ``--deep`` tries them (an import that fails is an
    error), as findings (errors block a launch unless forced), each with its fix commands. An
    unreachable host raises (the launch cannot go on anyway); a host where the
    collector fails is an error finding. With a store, the package set is recorded
    for drift checks.

    ``dry_run``: the audit still runs (the collector only reads the host), nothing
    is recorded, an unreachable host is a finding too, and the drift since the
    playbook's last good run (from ``store``, else the default store when its file
    exists) is one more finding, code ``drift``."""
    try:
        opened = open_existing_store() if dry_run and store is None else None
    except DflashError:
        opened = None  # a dry run shows what it can
    try:
        report = audit_host(playbook.host, inventory, playbook, store=(store or opened) if dry_run else None,
                            deep=True)
    except TransportError as e:
        if isinstance(e, UnreachableError) and not dry_run:
            raise
        first = first_line(e)
        return [Finding("error", "audit-failed", f"cannot audit {playbook.host}: {first}",
                        fix=e.hint or "run `dflashctl env-audit` for details", detail={"stderr": e.stderr_tail})]
    finally:
        if opened is not None:
            opened.close()
    if dry_run:
        drift = [Finding(report.drift.severity, "drift", report.drift.message, detail=report.drift.detail)] \
            if report.drift else []
        return report.findings + drift
    if store is not None:
        record_snapshot(store, report, time.time() if now is None else now)
    return report.findings
