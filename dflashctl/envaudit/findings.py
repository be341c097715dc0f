"""Findings, their codes and exit codes, and the policy that leaves some out.

``Finding`` is one problem a rule found, with its fix as exact commands.
``Policy`` is the inventory host's and the playbook's ``env_audit:`` section: names
allowed beside the trainer, and findings to ignore, by code and subject.
"""

from __future__ import annotations

import fnmatch
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from packaging.utils import canonicalize_name

from dflashctl.core.contract import did_you_mean
from dflashctl.core.errors import ConfigError
from dflashctl.core.states import severity_rank

# Finding codes, one per kind of problem (documented in docs/env-audit.md; env_audit.ignore names them).
CODES = (
    "torch-missing", "torch-import", "torch-cpu-build", "broken-metadata", "shadowed", "duplicate-package",
    "missing-requirement", "requirement-version", "triton-version", "unmet-requirement", "missing-files",
    "shared-files", "cuda-major", "duplicate-library", "ld-preload", "user-site", "pythonpath", "stray-stack",
    "other-framework", "no-venv", "audit-incomplete", "audit-failed", "drift", "stale-dist-info",
    "trainer-requirement", "import-error", "pip-unusable", "relocated-scripts", "pip-stash", "flash-attn",
)
# What an ignore rule may match besides the code: a glob over the finding's packages,
# libraries (sonames) or paths; every one of the finding's values must match.
SUBJECTS = {"package": "packages", "library": "libraries", "path": "paths"}
EXIT_CLEAN, EXIT_WARNINGS, EXIT_ERRORS, EXIT_NOT_RUN = 0, 1, 2, 3


@dataclass
class Finding:
    severity: str  # info | warning | error
    code: str  # the rule: stray-stack, cuda-major, duplicate-library, ...
    message: str
    fix: str | None = None  # what to do, in words
    commands: list[str] = field(default_factory=list)  # exact commands, in order, typed on the host (wrapper first)
    argv: list[list[str]] = field(default_factory=list)  # the same commands as argument lists, run inside the host
    packages: list[str] = field(default_factory=list)
    libraries: list[str] = field(default_factory=list)  # sonames
    paths: list[str] = field(default_factory=list)
    remove: list[str] = field(default_factory=list)  # what the commands uninstall (never a protected package)
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def exit_code(findings: Iterable[Finding]) -> int:
    """0 clean (info at most), 1 warnings, 2 errors (3, the audit could not run, is the caller's)."""
    worst = max((severity_rank(f.severity) for f in findings), default=0)
    return EXIT_ERRORS if worst >= severity_rank("error") else \
        EXIT_WARNINGS if worst >= severity_rank("warning") else EXIT_CLEAN

# --------------------------------------------------------------------------- policy


@dataclass
class IgnoreRule:
    """Leave out findings of ``code`` whose subjects all match the globs given."""

    code: str
    package: str | None = None
    library: str | None = None
    path: str | None = None

    def matches(self, finding: Finding) -> bool:
        if finding.code != self.code:
            return False
        for subject, attribute in SUBJECTS.items():
            pattern = getattr(self, subject)
            if pattern is None:
                continue
            values = getattr(finding, attribute)
            if subject == "package":
                values, pattern = [canonicalize_name(v) for v in values], canonicalize_name(pattern)
            if not values or not all(fnmatch.fnmatchcase(v, pattern) for v in values):
                return False
        return True


@dataclass
class Policy:
    """An ``env_audit:`` section (the inventory host's, the playbook's, or both merged)."""

    allow: list[str] = field(default_factory=list)  # packages not reported as stray stacks or frameworks
    ignore: list[IgnoreRule] = field(default_factory=list)

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None, source: str | None = None, where: str = "env_audit") -> "Policy":
        """``{allow: [names], ignore: [code | {code: CODE, package|library|path: GLOB}]}``;
        a ConfigError names every bad key by its YAML path under ``where``."""
        raw = raw or {}
        problems: list[str] = []
        if not isinstance(raw, dict):
            raise ConfigError([f"{where}: expected a mapping with allow: and ignore:"], source=source)
        for key in raw:
            if key not in ("allow", "ignore"):
                problems.append(f"{where}.{key}: unknown key{did_you_mean(key, ['allow', 'ignore'])}")
        allow = raw.get("allow") or []
        if not isinstance(allow, list) or not all(isinstance(v, str) for v in allow):
            problems.append(f"{where}.allow: expected a list of names")
            allow = []
        ignore = raw.get("ignore") or []
        rules: list[IgnoreRule] = []
        if not isinstance(ignore, list):
            problems.append(f"{where}.ignore: expected a list of finding codes or {{code: ..., package: ...}}")
            ignore = []
        for i, item in enumerate(ignore):
            at = f"{where}.ignore[{i}]"
            if isinstance(item, str):
                item = {"code": item}
            if not isinstance(item, dict):
                problems.append(f"{at}: expected a finding code or {{code: ..., package|library|path: GLOB}}")
                continue
            bad = [k for k in item if k != "code" and k not in SUBJECTS]
            problems += [f"{at}.{k}: unknown key{did_you_mean(k, ['code', *SUBJECTS])}" for k in bad]
            code = item.get("code")
            if not isinstance(code, str):
                problems.append(f"{at}.code: required: the finding code to ignore")
            elif code not in CODES:
                problems.append(f"{at}: unknown finding '{code}'{did_you_mean(code, CODES)}")
            subjects = {k: v for k, v in item.items() if k in SUBJECTS}
            problems += [f"{at}.{k}: expected a name or a glob" for k, v in subjects.items() if not isinstance(v, str)]
            valid = isinstance(code, str) and code in CODES and all(isinstance(v, str) for v in subjects.values())
            if valid and not bad:
                rules.append(IgnoreRule(code, **subjects))
        if problems:
            raise ConfigError(problems, source=source)
        return cls(list(allow), rules)

    def merged(self, other: "Policy") -> "Policy":
        return Policy([*self.allow, *other.allow], [*self.ignore, *other.ignore])

    def ignores(self, finding: Finding) -> bool:
        return any(rule.matches(finding) for rule in self.ignore)
