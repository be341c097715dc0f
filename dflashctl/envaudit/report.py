"""An env-audit's result for one host: the snapshot, its findings and torch's build,
with the exit code, the counts, the plan (every fix command in a safe order) and
the JSON form ``dflashctl env-audit --json`` prints (``SCHEMA``, documented in
docs/env-audit.md); ``failed_document`` is that JSON when the audit could not run.

Data only: no I/O, no drawing (the command draws the text form).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from dflashctl.envaudit import program
from dflashctl.envaudit.findings import EXIT_NOT_RUN, Finding, exit_code
from dflashctl.envaudit.snapshot import Snapshot
from dflashctl.envaudit.stack import TorchBuild, protected

SCHEMA = 2  # the "schema" of the JSON document


def plan(findings: list[Finding], snapshot: Snapshot, wheels: str | None = None,
         wheels_from: str | None = None) -> list[tuple[list[str], str]]:
    """Every command of the findings that are not information, each once, in the
    order they must run, the wheels they install fetched first into ``wheels``
    (from ``wheels_from`` on the host when given, not an index) (``program.plan``:
    the findings' commands were proven safe together by ``audit``). (argv, shell line)."""
    return program.plan(findings, snapshot, protected(snapshot), wheels, wheels_from)


@dataclass
class AuditReport:
    target: str  # what was asked for: a playbook or a host name
    host: str
    playbook: str | None
    snapshot: Snapshot
    findings: list[Finding]
    torch: TorchBuild | None
    seconds: float = 0.0
    drift: Any = None  # a detectors.Finding: packages changed since the playbook's last good run
    wheels: str = field(default_factory=program.new_wheels_dir)  # where the printed plan fetches its wheels
    wheels_from: str | None = None  # a directory on the host the plan fetches its wheels from (no index)

    @property
    def exit_code(self) -> int:
        return exit_code(self.findings)

    def counts(self) -> dict[str, int]:
        return {s: sum(f.severity == s for f in self.findings) for s in ("error", "warning", "info")}

    def plan(self, wheels: str | None = None) -> list[tuple[list[str], str]]:
        """The plan, its wheels fetched into ``wheels`` (else this report's own directory)."""
        return plan(self.findings, self.snapshot, wheels or self.wheels, self.wheels_from)

    def to_dict(self) -> dict[str, Any]:
        s = self.snapshot
        return {
            "schema": SCHEMA,
            "target": self.target,
            "host": self.host,
            "playbook": self.playbook,
            "error": None,
            "hostname": s.hostname,
            "python": {"executable": s.python, "version": s.python_version, "prefix": s.prefix,
                       "user_site": s.user_site, "user_site_enabled": s.user_site_enabled, "wrapper": s.wrapper},
            "torch": asdict(self.torch) if self.torch else None,
            "exit_code": self.exit_code,
            "counts": self.counts(),
            "findings": [f.to_dict() for f in self.findings],
            "plan": [line for _, line in self.plan()],
            "drift": {"message": self.drift.message, **self.drift.detail} if self.drift else None,
            "packages": s.packages(),
            "libraries": [asdict(e) for e in s.ldconfig],
            "seconds": round(self.seconds, 3),
        }


def failed_document(target: str, error: str, hint: str | None = None, host: str | None = None,
                    playbook: str | None = None) -> dict[str, Any]:
    """The JSON document of an audit that could not run (exit code 3)."""
    return {"schema": SCHEMA, "target": target, "host": host, "playbook": playbook, "error": error, "hint": hint,
            "exit_code": EXIT_NOT_RUN, "counts": {"error": 0, "warning": 0, "info": 0}, "findings": [], "plan": [],
            "drift": None, "torch": None, "packages": {}}
