"""Env-audit rules: pure functions from a ``Snapshot`` to ``Finding``s.

``audit(snapshot)`` runs every rule and returns the findings, worst first:

    torch          importable, a CUDA build when the playbook wants GPUs, its CUDA
                   libraries found by the loader (or `import torch` itself, --deep)
    metadata       a distribution whose METADATA is empty
    shadowing      a module imported from another copy than the one pip lists
                   (a .pth, the user site, a directory no distribution owns);
                   a name installed twice
    requirements   torch's and the trainer's, at the versions they pin (triton
                   above all); every other distribution's (what `pip check` says)
    integrity      RECORD files missing or changed for torch and what it requires;
                   files listed by more than one distribution
    CUDA           wheels built for another CUDA major than torch's; the same
                   shared library from a wheel and from the system, with versions
    environment    LD_PRELOAD, PYTHONPATH entries that shadow something, stray
                   inference stacks, other frameworks, no venv, partial answers

``Policy`` is the inventory host's and the playbook's ``env_audit:`` section: names
allowed beside the trainer, and findings to ignore, by code and subject.

No I/O, no clock, no SSH: a rule reads the snapshot and returns findings. Every
fix is exact commands built by ``fixes.Fixer``, which never uninstalls a
protected distribution and never deletes one's files without reinstalling it.
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from packaging.utils import canonicalize_name

from dflashctl.core.contract import did_you_mean
from dflashctl.core.errors import ConfigError
from dflashctl.core.states import severity_rank
from dflashctl.envaudit.fixes import Fixer, Removal, index_args, listing, only_inits, short_path
from dflashctl.envaudit.program import prove
from dflashctl.envaudit.snapshot import LIB_PREFIXES, TRAINER_MODULES, Dist, LibEntry, ModuleSpec, Snapshot
from dflashctl.envaudit.stack import (
    WHEEL_SONAMES,
    ReqCheck,
    component,
    cuda_major,
    protected,
    release_of,
    required_by,
    requirement_checks,
    same_soname,
    torch_build,
    unmet_requirements,
    wheel_sonames,
)

# Finding codes, one per kind of problem (documented in docs/env-audit.md; env_audit.ignore names them).
CODES = (
    "torch-missing", "torch-import", "torch-cpu-build", "broken-metadata", "shadowed", "duplicate-package",
    "missing-requirement", "requirement-version", "triton-version", "unmet-requirement", "missing-files",
    "shared-files", "cuda-major", "duplicate-library", "ld-preload", "user-site", "pythonpath", "stray-stack",
    "other-framework", "no-venv", "audit-incomplete", "audit-failed", "drift", "stale-dist-info",
    "trainer-requirement",
)
# What an ignore rule may match besides the code: a glob over the finding's packages,
# libraries (sonames) or paths; every one of the finding's values must match.
SUBJECTS = {"package": "packages", "library": "libraries", "path": "paths"}
EXIT_CLEAN, EXIT_WARNINGS, EXIT_ERRORS, EXIT_NOT_RUN = 0, 1, 2, 3

# Inference / serving stacks that pin their own torch, triton and CUDA wheels: beside
# a trainer they are where conflicting versions come from.
STRAY_STACKS = {
    "sglang": "SGLang",
    "sgl-kernel": "SGLang kernels",
    "vllm": "vLLM",
    "vllm-flash-attn": "vLLM flash-attention",
    "flashinfer": "FlashInfer",
    "flashinfer-python": "FlashInfer",
    "flashinfer-cubin": "FlashInfer",
    "flashinfer-jit-cache": "FlashInfer",
    "xformers": "xFormers",
    "tensorrt-llm": "TensorRT-LLM",
    "lmdeploy": "LMDeploy",
    "exllamav2": "ExLlamaV2",
    "mlc-llm": "MLC LLM",
}
# Other frameworks with their own CUDA libraries: harmless unless the trainer imports them.
OTHER_FRAMEWORKS = re.compile(
    r"^(jax-cuda\d+-(plugin|pjrt)|tensorflow|tensorflow-gpu|cupy-cuda\w+|paddlepaddle-gpu|mxnet-cu\w+)$")
TRITON_NAMES = ("triton", "pytorch-triton")

# A soname with its version (libcudnn.so.9): the name a library is loaded by, the
# unversioned link (libcudnn.so) being for builds.
_VERSIONED_SONAME = re.compile(r"\.so\.\d+(?:\.\d+)*$")
_FILE_VERSION = re.compile(r"\.so\.(\d+(?:\.\d+)*)$")


# --------------------------------------------------------------------------- findings


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


# --------------------------------------------------------------------------- context


class _Context:
    """What every rule needs, computed once per audit."""

    def __init__(self, snapshot: Snapshot, device: str | None, host_gpus: int | None, policy: Policy):
        self.s = snapshot
        self.device = device
        self.host_gpus = host_gpus
        self.policy = policy
        self.installed = snapshot.installed()
        self.torch = torch_build(snapshot)
        self.checks = requirement_checks(snapshot)
        self.protected = protected(snapshot, self.checks)
        self.allowed = {canonicalize_name(a) for a in policy.allow}
        self.fixer = Fixer(snapshot, self.protected)
        declared: dict[str, Dist] = {}
        for d in snapshot.dists:
            for m in d.modules:
                if d.key:
                    declared.setdefault(m, d)
        self.declared = declared  # module -> the first named distribution listing it

    def finding(self, severity: str, code: str, message: str, *, fix: str | None = None,
                argv: Iterable[list[str]] = (), packages: Iterable[str] = (), libraries: Iterable[str] = (),
                paths: Iterable[str] = (), remove: Iterable[str] = (), detail: dict[str, Any] | None = None) -> Finding:
        argv = self.fixer.commands([list(a) for a in argv])
        return Finding(severity, code, message, fix, [self.fixer.shell(a) for a in argv], argv, list(packages),
                       list(libraries), list(paths), list(remove), detail or {})

    def is_protected(self, d: Dist | None) -> bool:
        return d is not None and d.key in self.protected

    def module_is_vital(self, module: str) -> bool:
        """The trainer imports it: torch, triton, transformers, or a module of what they require."""
        return module in TRAINER_MODULES or self.is_protected(self.declared.get(module))

    def inside(self, d: Dist) -> bool:
        """``d`` lies in the environment itself (under its prefix), not in a directory
        PYTHONPATH, the user site or a .pth adds."""
        prefix = (self.s.prefix or "").rstrip("/")
        return not prefix or not d.location or d.location == prefix or d.location.startswith(prefix + "/")

    def shadows(self, d: Dist | None) -> bool:
        """``d`` is imported from outside the environment ahead of a copy of its own inside it."""
        return d is not None and not self.inside(d) and any(self.inside(o) for o in self.s.copies(d.name) if o is not d)

    def only_outside(self, names: list[str]) -> bool:
        """Every copy of every one of ``names`` lies outside the environment (in a
        system-site-packages venv's base), and none is torch's or the trainer's."""
        if not names or (self.s.prefix or "") == (self.s.base_prefix or ""):
            return False
        copies = [d for n in names for d in self.s.copies(n)]
        return bool(copies) and all(not self.inside(d) and d.key not in self.protected for d in copies)

    def torch_requirement(self, name: str) -> ReqCheck | None:
        return next((c for c in self.checks if canonicalize_name(c.requirement.name) == canonicalize_name(name)), None)

    def removal_fix(self, removal: Removal, why_remove: str = "") -> str:
        parts = []
        uninstalled = [n for n in removal.names if n not in removal.detached]
        if removal.names:
            verbs = ([f"uninstall {', '.join(uninstalled)}"] if uninstalled else []) + \
                ([f"detach {', '.join(removal.detached)}"] if removal.detached else [])
            parts.append(" and ".join(verbs) + (f" ({why_remove})" if why_remove else ""))
        if removal.why:
            parts.append(removal.why)
        if removal.kept:
            parts.append(f"keep {', '.join(removal.kept)} (torch or the trainer requires them)")
        if removal.blocked:
            parts.append(f"do not uninstall {', '.join(removal.blocked)}: it shares files with a distribution whose "
                         "metadata is broken, which could not be put back")
        return "; ".join(parts)

    def source(self, variable: str) -> str:
        where = self.s.env_sources.get(variable)
        return f" (set by {where})" if where else ""

    def where_from(self, entry: str | None) -> str:
        """How a sys.path entry got there, in words ('' when it is an ordinary one)."""
        if not entry or entry in self.s.site_packages:
            return ""
        named = re.compile(r"(?:^|[\s'\"])" + re.escape(entry) + r"/?(?:$|[\s'\"])", re.M)
        for p in self.s.pth:
            if entry in p.adds or named.search(p.text):
                return f", put on sys.path by {p.file}"
        if any(os.path.normpath(e.path) == entry for e in self.s.pythonpath):
            return f", a PYTHONPATH entry{self.source('PYTHONPATH')}"
        if entry == self.s.user_site:
            return ", the user site-packages"
        return ""


CRASH_TEXT = "OSError: {soname}: cannot open shared object file: No such file or directory"


def crash_signature(soname: str) -> tuple[str, str]:
    """The error `import torch` prints without ``soname``, and the crash signature
    the supervisor will file it under (the same table classifies real crashes)."""
    from dflashctl.core.signatures import classify

    text = CRASH_TEXT.format(soname=soname)
    return text, classify(text).name


# --------------------------------------------------------------------------- torch


def _rule_torch(c: _Context) -> list[Finding]:
    s = c.s
    if c.torch is None:
        where = f"{s.python or 'the host python'} ({s.prefix or '?'})"
        spec = s.modules.get("torch") if s.asked else None
        listed = [d.label() + f" at {d.location}" for d in s.copies("torch")]
        if spec is not None and spec.namespace:
            why = f"torch is only a directory without __init__.py ({spec.entry}/torch: what an uninstall left)"
        elif listed:
            why = f"pip lists {listing(listed, 2)}, but torch cannot be imported"
        else:
            why = "torch is not installed"
        return [c.finding("error", "torch-missing", f"{why} for {where}: the trainer cannot start",
                          fix="install torch into that environment, or point the inventory's python: at the "
                              "interpreter of the environment that has it", packages=["torch"])]
    findings = []
    deep = s.deep or {}
    if deep.get("error"):
        text = deep["error"]
        soname = re.search(r"(lib\S+?\.so(?:\.\d+)*): cannot open shared object file", text)
        from dflashctl.core.signatures import classify

        findings.append(c.finding(
            "error", "torch-import", f"`import torch` fails on the host: {text} (crash signature "
            f"{classify(text).name}): the trainer cannot start",
            fix="the other findings name what is missing or mixed: fix those, then audit again with --deep",
            packages=["torch"], libraries=[soname.group(1)] if soname else [],
            detail={"error": text, "crash_signature": classify(text).name}))
    fix = ("install a CUDA build of torch (pip install torch from the CUDA index matching the driver), "
           "or set trainer.placement.device: cpu")
    if c.torch.cuda is None and c.device == "cuda":
        # A warning, not an error: the trainer refuses this itself at start, with a
        # configuration error (exit 2) that the supervisor does not retry.
        findings.append(c.finding(
            "warning", "torch-cpu-build",
            f"{c.torch.label} is not a CUDA build (read from {c.torch.source}), but the playbook "
            "says trainer.placement.device: cuda: the trainer will refuse to start", fix=fix, packages=["torch"]))
    elif c.torch.cuda is None and c.device == "auto" and c.host_gpus:
        findings.append(c.finding(
            "warning", "torch-cpu-build",
            f"{c.torch.label} is not a CUDA build (read from {c.torch.source}): with "
            f"trainer.placement.device: auto the trainer runs on the CPU of a host with {c.host_gpus} GPUs",
            fix=fix, packages=["torch"]))
    elif c.torch.cuda is None:
        findings.append(c.finding("info", "torch-cpu-build",
                                  f"{c.torch.label}: a CPU build (read from {c.torch.source})", packages=["torch"]))
    return findings


def _provider(c: _Context, soname: str) -> ReqCheck | None:
    """The requirement of torch whose wheel ships ``soname``."""
    for check in c.checks:
        d = check.installed
        if d is not None and d.libs is not None and any(p.rsplit("/", 1)[-1] == soname for p in d.libs):
            return check
        comp = component(d) if d is not None else component(Dist(check.requirement.name, ""))
        pattern = WHEEL_SONAMES.get(comp or "")
        if pattern and re.match(pattern.format(major=r"\d+") + "$", soname):
            return check
    return None


def _rule_torch_libraries(c: _Context) -> list[Finding]:
    """The libraries torch's CUDA library needs, looked up as the loader does: one
    found nowhere makes `import torch` fail (unless --deep imported it)."""
    if c.torch is None or (c.s.deep or {}).get("version"):
        return []
    missing_reqs = {canonicalize_name(ch.requirement.name) for ch in c.checks if ch.installed is None}
    findings = []
    for lib in c.s.torch_libs.values():
        if lib.path is not None:
            continue
        provider = _provider(c, lib.soname)
        if provider is not None and canonicalize_name(provider.requirement.name) in missing_reqs:
            continue  # the missing-requirement finding says it, with this consequence
        text, signature = crash_signature(lib.soname)
        elf = c.s.torch_elf or {}
        argv = []
        if provider is not None and provider.installed is not None:
            argv = [c.fixer.reinstall(provider.installed)]
        elif provider is not None:
            argv = [c.fixer.install([provider.spec])]
        findings.append(c.finding(
            "error", "torch-import",
            f"`import torch` will fail with '{text}' (crash signature {signature}): {elf.get('file', 'torch')} "
            f"needs {lib.soname} and the loader finds it nowhere (LD_LIBRARY_PATH, RUNPATH "
            f"{elf.get('runpath') or elf.get('rpath') or '-'}, the ldconfig cache, nvidia/*/lib on sys.path)",
            fix=(f"put back the wheel that ships it ({provider.spec})" if provider else
                 "reinstall torch's CUDA wheels (python -m pip install --force-reinstall torch==VERSION)"),
            argv=argv, packages=[provider.requirement.name] if provider else ["torch"], libraries=[lib.soname],
            detail={"soname": lib.soname, "crash_signature": signature}))
    return findings


def _rule_broken_metadata(c: _Context) -> list[Finding]:
    """A dist-info with an empty METADATA: pip cannot see it, nobody can check what it requires."""
    findings = []
    for d in c.s.dists:
        if d.name:
            continue
        imported = [m for m in d.modules if c.s.owner(m) is d]
        vital = [m for m in imported if c.module_is_vital(m)]
        argv, fix = [], f"remove {d.metadata} and reinstall the package it belonged to"
        if d.unreadable and "PermissionError" in (d.error or ""):
            findings.append(c.finding(
                "error", "broken-metadata",
                f"{d.metadata}: permission denied reading its METADATA ({d.error.removeprefix('metadata: ')}): "
                "the user the trainer runs as cannot see this package, and pip fails on it",
                fix=f"make {d.metadata} readable by that user (chmod -R a+rX), or audit as the user who installed it",
                paths=[d.metadata or ""], detail={"metadata": d.metadata, "error": d.error}))
            continue
        if d.unreadable and d.metadata and "torch" not in vital:
            findings.append(c.finding(
                "error", "broken-metadata",
                f"{d.metadata}: METADATA cannot be read ({d.error.removeprefix('metadata: ')}): pip reads every "
                "installed METADATA and fails on this one, so every pip command (any fix) fails while it is there",
                fix="remove that dist-info directory first (its files stay where they are); reinstall the package it "
                "belonged to afterwards if you use it",
                argv=[["rm", "-r", "--", d.metadata]], paths=[d.metadata],
                detail={"metadata": d.metadata, "modules": d.modules, "error": d.error}))
            continue
        if "torch" in vital and c.torch is not None and c.torch.version != "?":
            again = Dist("torch", c.torch.version)
            argv = [["rm", "-r", "--", d.metadata], c.fixer.reinstall(again)] if d.metadata else \
                [c.fixer.reinstall(again)]
            fix = (f"remove the broken dist-info, then reinstall torch {c.torch.version} (the version its "
                   "torch/version.py says) over its files")
        listed = [x.label() + f" at {x.location}" for m in vital for x in c.s.copies(m)]
        findings.append(c.finding(
            "error" if vital else "info", "broken-metadata",
            f"{d.metadata or d.location}: METADATA has no name"
            + (f"; it owns {listing(imported)}, which the trainer imports from it" if imported else "")
            + ": pip cannot see, check or repair it, and what it requires is unknown"
            + (f" (pip lists {listing(listed, 2)} instead, which is not what is imported)" if listed else ""),
            fix=fix, argv=argv, packages=["torch"] if "torch" in vital else [],
            paths=[d.metadata] if d.metadata else [], detail={"metadata": d.metadata, "modules": d.modules}))
    return findings


# --------------------------------------------------------------------------- shadowing


def _rule_shadowed(c: _Context) -> list[Finding]:
    """A module imported from another copy than the one pip lists first for it: the
    import system's answer (find_spec) against the distributions' RECORDs."""
    s = c.s
    if not s.asked:
        return []
    pythonpath = {os.path.normpath(e.path) for e in s.pythonpath}
    groups: dict[tuple[int, str], list[ModuleSpec]] = {}
    for name, spec in s.modules.items():
        if spec is None or spec.origin is None or spec.error:
            continue
        listed = c.declared.get(name)
        if listed is None:
            continue
        owner = s.owner(name)
        if owner is listed or (owner is not None and not owner.name):
            continue  # the normal case; a nameless owner is broken-metadata's
        if owner is None and (listed.editable or _under(spec.origin, listed, name)):
            continue  # an editable install, or files it made after it was installed
        if spec.entry in pythonpath:
            continue  # the pythonpath rule reports PYTHONPATH entries
        groups.setdefault((listed.index, f"{owner.index if owner else -1}|{spec.entry}"), []).append(spec)
    findings = []
    for specs in groups.values():
        listed = c.declared[specs[0].name]
        owner = s.owner(specs[0].name)
        entry = specs[0].entry
        names = [sp.name for sp in specs]
        vital = any(c.module_is_vital(n) for n in names) or c.is_protected(owner)
        same = owner is not None and owner.key == listed.key and owner.version == listed.version
        severity = ("warning" if same else "error") if vital else "info"
        what = owner.label() + f" at {owner.location}" if owner else "files no installed distribution lists"
        origin = specs[0].origin
        code = "user-site" if entry == s.user_site else "shadowed"
        argv = []
        if code == "user-site":
            fix = (f"set PYTHONNOUSERSITE=1 for the trainer (the inventory's env: for host {s.host}), or move "
                   f"{s.user_site} aside; do not pip uninstall (pip removes whichever copy it finds first)")
        elif owner is None and entry in s.site_packages:
            fix = f"these files are no distribution's (a copy made by hand, or what an uninstall left): reinstall {listed.name}"
            argv = [c.fixer.reinstall(listed)]
        else:
            fix = f"take {entry} off the trainer's sys.path{c.where_from(entry)}"
        findings.append(c.finding(
            severity, code,
            f"{listing(names, 4)} {'is' if len(names) == 1 else 'are'} imported from {origin} ({what}, under "
            f"{entry}{c.where_from(entry)}), not from {listed.label()} in {listed.location} that pip lists",
            fix=fix, argv=argv, packages=[listed.name] + ([owner.name] if owner and owner.key != listed.key else []),
            paths=[entry] if entry else [],
            detail={"modules": names, "origin": origin, "entry": entry, "listed": listed.label(),
                    "imported": owner.label() if owner else None}))
    return findings


def _under(origin: str, dist: Dist, module: str) -> bool:
    base = (dist.location or "").rstrip("/")
    return bool(base) and (origin.startswith(f"{base}/{module}/") or origin.startswith(f"{base}/{module}."))


def _rule_duplicate_packages(c: _Context) -> list[Finding]:
    """One name installed more than once (another site directory, a .pth-added one,
    the user site). When the user site's copy is the one imported ahead of another,
    that is the user-site finding (the fix is PYTHONNOUSERSITE, not pip)."""
    copies: dict[str, list[Dist]] = {}
    for d in c.s.dists:
        if d.key:
            copies.setdefault(d.key, []).append(d)
    findings = []
    user = c.s.user_site
    for key, dists in copies.items():
        if len(dists) < 2:
            continue
        imported = c.installed.get(key)
        stale = [d for d in dists if d is not imported and imported is not None and d.location == imported.location]
        for d in stale:
            findings.append(c.finding(
                "warning", "stale-dist-info",
                f"{d.metadata} is a second dist-info of {d.name} ({d.version}) beside the one of {imported.label()} "
                f"that owns the files Python imports, in the same directory {d.location}: what a half-finished "
                "upgrade leaves; pip acts on whichever it finds first",
                fix=f"remove that one dist-info directory (not `pip uninstall`: it would delete {imported.name}'s "
                    "files its RECORD lists too)",
                argv=[["rm", "-r", "--", d.metadata]] if d.metadata else [], packages=[d.name],
                paths=[d.metadata] if d.metadata else [], detail={"stale": d.version, "live": imported.version}))
        dists = [d for d in dists if d not in stale]
        if len(dists) < 2:
            continue
        others = [d for d in dists if d is not imported]
        parts = [f"{d.label()} at {d.location}" + (" (imported)" if d is imported and c.s.asked else "")
                 + c.where_from(os.path.normpath(d.location or "")) for d in dists]
        differ = len({d.version for d in dists}) > 1
        vital = key in c.protected
        detail = {"copies": [{"version": d.version, "location": d.location} for d in dists]}
        if c.s.asked and imported is not None and imported.location == user and user and \
                any(d.location != user for d in others):
            findings.append(c.finding(
                ("error" if differ else "warning") if vital else "info", "user-site",
                f"user site-packages {user} shadows {', '.join(d.label() for d in others)}: Python imports "
                f"the user copy ({imported.label()}) first",
                fix=(f"set PYTHONNOUSERSITE=1 for the trainer (the inventory's env: for host {c.s.host}), or move "
                     f"{user} aside; do not pip uninstall (pip removes whichever copy it finds first)"),
                packages=[imported.name], paths=[user], detail={**detail, "modules": imported.modules}))
            continue
        only_user = all(d.location == user for d in others)
        severity = "warning" if vital and differ and not only_user else "info"
        findings.append(c.finding(
            severity, "duplicate-package",
            f"{dists[0].name} is installed {len(dists)} times: {'; '.join(parts)}"
            + (": the copy imported depends on sys.path order, and pip acts on the first" if differ else ""),
            fix=(f"take {imported.location} off the trainer's sys.path{c.where_from(imported.location)}: it shadows "
                 f"the environment's own {', '.join(d.label() for d in others)}"
                 if c.shadows(imported) else
                 f"remove the copy that is not imported ({listing([d.location or '?' for d in others], 3)}): "
                 "delete its dist-info and the files its RECORD lists, or take its directory off sys.path")
            if severity == "warning" else None,
            packages=[dists[0].name], paths=[d.location for d in others if d.location], detail=detail))
    return findings


# --------------------------------------------------------------------------- requirements


def _library_consequence(c: _Context, dist_name: str, version: str | None = None) -> str:
    """What a missing wheel of torch's CUDA libraries means for `import torch`."""
    comp = component(Dist(dist_name, ""))
    pattern = WHEEL_SONAMES.get(comp or "")
    if pattern is None:
        return ""
    major = (release_of(version) or (None,))[0] if version else None
    sonames = [n for n in c.s.torch_libs if re.match(pattern.format(major=major or r"\d+") + "$", n)]
    if not sonames:
        # No loader answer (a capture, a CPU build): the soname the wheel's version names.
        guess = {"cudnn": "libcudnn.so.{}", "nccl": "libnccl.so.{}"}.get(comp or "")
        if guess is None or major is None or c.torch is None or c.torch.cuda is None:
            return ""
        guess = guess.format(major)
        text, signature = crash_signature(guess)
        return (f": torch loads {guess} from this wheel, so `import torch` fails with '{text}' (crash "
                f"signature {signature})")
    lost = [n for n in sonames if c.s.torch_libs[n].path is None]
    if lost:
        text, signature = crash_signature(lost[0])
        return f": `import torch` fails with '{text}' (crash signature {signature})"
    found = c.s.torch_libs[sonames[0]]
    return f"; torch still finds {found.soname} at {found.path} ({found.via})"


def _rule_requirements(c: _Context) -> list[Finding]:
    """Missing requirements of torch / the trainer, and versions they do not accept:
    one finding per package and version range, naming every requirer."""
    failing: dict[tuple[str, str], list[ReqCheck]] = {}
    for check in c.checks:
        name = canonicalize_name(check.requirement.name)
        if not check.satisfied and name not in TRITON_NAMES:  # triton has a rule of its own
            failing.setdefault((name, str(check.requirement.specifier)), []).append(check)
    findings = []
    for group in failing.values():
        check, name = group[0], group[0].requirement.name
        also = f" (also required by {', '.join(g.chain for g in group[1:])})" if group[1:] else ""
        detail = {"chains": [g.chain for g in group], "requirement": check.spec}
        shadow = next((g.requirer for g in group if c.shadows(g.requirer)), None)
        if shadow is not None:
            own = [d.label() for d in c.s.copies(shadow.name) if c.inside(d)]
            found = f"{check.installed.label()} is installed" if check.installed else "it is not installed"
            findings.append(c.finding(
                "warning", "requirement-version" if check.installed else "missing-requirement",
                f"{check.chain} requires {check.spec}; {found}{also}: that is what {shadow.label()} at "
                f"{shadow.location}{c.where_from(shadow.location)} asks for, a copy that shadows the environment's "
                f"own {listing(own, 2)}",
                fix=f"take {shadow.location} off the trainer's sys.path first (then audit again); installing what "
                    "the shadowing copy asks for would change the environment for a copy it does not hold",
                packages=[name], paths=[shadow.location or ""], detail={**detail, "shadow": shadow.label()}))
            continue
        if check.installed is None:
            pinned = next((sp.version for sp in check.requirement.specifier if sp.operator == "=="), None)
            findings.append(c.finding(
                "error", "missing-requirement",
                f"{check.chain} requires {check.spec}, which is not installed{also}"
                + _library_consequence(c, name, pinned),
                fix=f"install {check.spec}", argv=[c.fixer.install([check.spec])], packages=[name], detail=detail))
            continue
        # A binary wheel pinned by torch (CUDA libraries) at another version breaks
        # at load time; a pure-Python one usually just works, so it is a warning.
        binary = canonicalize_name(name).startswith(("nvidia-", "cuda-"))
        findings.append(c.finding(
            "error" if binary else "warning", "requirement-version",
            f"{check.chain} requires {check.spec}; {check.installed.label()} is installed{also}",
            fix=f"install {check.spec}", argv=[c.fixer.install([check.spec])], packages=[name],
            detail={**detail, "installed": check.installed.version}))
    return findings


def _rule_triton(c: _Context) -> list[Finding]:
    """torch.compile generates Triton kernels with the Triton torch was released with;
    another version fails to compile or falls back to slow paths."""
    check = next((ch for ch in c.checks
                  if ch.chain == "torch" and canonicalize_name(ch.requirement.name) in TRITON_NAMES), None)
    findings = []
    if check is not None and not check.satisfied:
        found = f"{check.installed.label()} is installed" if check.installed else "none is installed"
        others = [d.label() for k, d in c.installed.items() if k in TRITON_NAMES and d is not check.installed]
        if others and check.installed is None:
            found = f"{listing(others)} is installed instead"
        pinners = [n for n in required_by(c.s, check.installed.name)
                   if canonicalize_name(n) != "torch"] if check.installed else []
        why = f" (also required by {', '.join(pinners)})" if pinners else ""
        findings.append(c.finding(
            "error", "triton-version",
            f"torch {c.torch.version} requires {check.spec}; {found}{why}: torch.compile kernels "
            "will fail to build or fall back to slow paths",
            fix=f"install {check.spec}", argv=[c.fixer.install([check.spec])], packages=[check.requirement.name],
            detail={"requirement": check.spec, "installed": check.installed.version if check.installed else None}))
    both = [c.installed[k] for k in TRITON_NAMES if k in c.installed]
    if len(both) > 1:
        wanted = canonicalize_name(check.requirement.name) if check else "triton"
        removal = c.fixer.removal([d.name for d in both if d.key != wanted])
        findings.append(c.finding(
            "error", "triton-version",
            f"{' and '.join(d.label() for d in both)} are both installed: both provide the `triton` module "
            "and the one found first on sys.path wins",
            fix=c.removal_fix(removal, f"torch requires {wanted}"), argv=removal.argv,
            packages=[d.name for d in both], remove=removal.names))
    return findings


def _rule_unmet(c: _Context) -> list[Finding]:
    """What `pip check` reports for the distributions the trainer does not import
    (those it does are the requirement rules'), with what that means for the trainer."""
    by_requirer: dict[str, list] = {}
    for unmet in unmet_requirements(c.s):
        if unmet.requirer.key in c.protected:
            continue
        by_requirer.setdefault(unmet.requirer.key, []).append(unmet)
    findings = []
    for items in by_requirer.values():
        requirer = items[0].requirer
        pins_trainer = [u.requirement.name for u in items if canonicalize_name(u.requirement.name) in c.protected]
        message = (f"{requirer.label()} requires {listing([u.describe() for u in items], 4)}: {requirer.name} "
                   "will not work as installed; the trainer does not import it")
        if pins_trainer:
            message += (f". Installing what it asks for would replace the trainer's {', '.join(pins_trainer)}")
            removal = c.fixer.removal([requirer.name])
            fix = c.removal_fix(removal, "it pins versions of the trainer's stack") + \
                ", or give it an environment of its own"
            findings.append(c.finding("warning", "unmet-requirement", message, fix=fix, argv=removal.argv,
                                      packages=[requirer.name], remove=removal.names,
                                      detail={"unmet": [str(u.requirement) for u in items]}))
        else:
            findings.append(c.finding("info", "unmet-requirement", message,
                                      fix=f"install what {requirer.name} requires if you use it",
                                      packages=[requirer.name], detail={"unmet": [str(u.requirement) for u in items]}))
    return findings


# --------------------------------------------------------------------------- the trainer's own needs

TRAINER_PYTHON = (3, 10)
TRAINER_NEEDS = {"torch": "2.6", "transformers": "4.51"}  # the oldest versions the trainer runs with
# Model families the trainer builds with transformers: the drafter is Qwen3 layers, and so
# is every built-in target preset (trainer/target.py).
TRAINER_MODEL_FAMILIES = ("qwen3",)
# The Triton each torch minor was released with (what its Linux wheels pin).
TRITON_FOR_TORCH = {(2, 6): "3.2.0", (2, 7): "3.3.1", (2, 8): "3.4.0", (2, 9): "3.5.0", (2, 10): "3.6.0"}


def _rule_trainer(c: _Context) -> list[Finding]:
    """What the trainer itself needs: Python >= 3.10, torch >= 2.6, transformers >=
    4.51 with the Qwen3 classes, safetensors, and Triton where torch is a CUDA build."""
    s, findings = c.s, []
    py = release_of(s.python_version or "")
    if py and py[:2] < TRAINER_PYTHON:
        findings.append(c.finding(
            "error", "trainer-requirement",
            f"{s.python} is Python {s.python_version}: the trainer needs Python "
            f"{'.'.join(map(str, TRAINER_PYTHON))} or newer",
            fix="point the inventory's python: at a Python 3.10+ environment (with torch and transformers)",
            detail={"python": s.python_version}))
    if c.torch is not None and c.torch.version != "?" and _older(c.torch.version, TRAINER_NEEDS["torch"]):
        spec = f"torch>={TRAINER_NEEDS['torch']}"
        findings.append(c.finding(
            "error", "trainer-requirement", f"{c.torch.label} is older than the torch {TRAINER_NEEDS['torch']} "
            "the trainer needs (torch.compile and FlexAttention as it uses them)",
            fix=f"install {spec} built for the same CUDA",
            argv=[c.fixer.pip("install", *index_args(c.torch.version), spec, names=["torch"])], packages=["torch"],
            detail={"installed": c.torch.version, "requirement": spec}))
    tr = c.installed.get("transformers")
    spec = f"transformers>={TRAINER_NEEDS['transformers']}"
    why, argv = None, [c.fixer.install([spec])]
    if tr is None:
        why = "transformers is not installed"
    elif _older(tr.version, TRAINER_NEEDS["transformers"]):
        why = f"{tr.label()} is older than the transformers {TRAINER_NEEDS['transformers']} the trainer needs"
    elif s.transformers_models is not None and not set(TRAINER_MODEL_FAMILIES) <= set(s.transformers_models):
        missing = sorted(set(TRAINER_MODEL_FAMILIES) - set(s.transformers_models))
        why = f"{tr.label()} has no {', '.join(missing)} model classes (transformers/models/{missing[0]}/), " \
              "which the drafter and the target presets are built from"
    if why:
        fix = f"install {spec}"
        if tr is not None and c.shadows(tr):
            fix, argv = (f"take {tr.location} off the trainer's sys.path{c.where_from(tr.location)}: that copy "
                         "shadows the environment's own"), []
        findings.append(c.finding("error", "trainer-requirement", f"{why}: the trainer cannot start", fix=fix,
                                  argv=argv, packages=["transformers"], detail={"requirement": spec}))
    if "safetensors" not in c.installed:
        findings.append(c.finding(
            "error", "trainer-requirement", "safetensors is not installed: the trainer reads and writes its "
            "checkpoints and exports with it", fix="install safetensors",
            argv=[c.fixer.install(["safetensors"])], packages=["safetensors"]))
    triton_pinned = any(canonicalize_name(ch.requirement.name) in TRITON_NAMES for ch in c.checks
                        if ch.chain == "torch")
    if c.torch is not None and c.torch.cuda and not triton_pinned and not any(k in c.installed for k in TRITON_NAMES):
        release = release_of(c.torch.version) or ()
        version = TRITON_FOR_TORCH.get(tuple(release[:2]))
        findings.append(c.finding(
            "error", "trainer-requirement", f"{c.torch.label} is a CUDA build but no Triton is installed: "
            "torch.compile cannot generate the trainer's GPU kernels",
            fix=f"install triton=={version} (the Triton torch {'.'.join(map(str, release[:2]))} was released "
                "with)" if version else "install the Triton this torch was released with",
            argv=[c.fixer.install([f"triton=={version}"])] if version else [], packages=["triton"]))
    return findings


def _older(version: str, than: str) -> bool:
    mine, theirs = release_of(version), release_of(than)
    return bool(mine and theirs) and mine[:len(theirs)] < theirs


# --------------------------------------------------------------------------- integrity


_CODE_SUFFIXES = (".py", ".pyc", ".pth", ".pyd")


def _imported(rel: str) -> bool:
    """Whether a RECORD path is something Python imports or loads: inside the
    distribution's own directory (not ``../../bin/`` scripts), code or a library,
    not data (a CA bundle an image patched, say)."""
    name = rel.rsplit("/", 1)[-1]
    return not rel.startswith("../") and (name.endswith(_CODE_SUFFIXES) or ".so" in name or name.startswith(LIB_PREFIXES))


def _rule_integrity(c: _Context) -> list[Finding]:
    """RECORD files missing or of another size (or, for a file another RECORD lists
    too, another sha256): an error for torch and what it
    requires when a file it imports or loads is affected (their code must all be
    there), a warning when only its scripts or data are, information for others."""
    owners_of: dict[str, list[int]] = {}
    for group in c.s.shared:
        for path in group.paths:
            owners_of[path] = group.owners
    findings = []
    for d in c.s.dists:
        if d.denied_count and d.name:
            vital = c.is_protected(d) and c.installed.get(d.key) is d
            findings.append(c.finding(
                ("error" if any(_imported(r) for r in d.denied) else "warning") if vital else "info",
                "missing-files", f"{d.label()}: permission denied: {d.denied_count} file(s) its RECORD lists cannot "
                f"be read by this user ({listing(d.denied, 3)})",
                fix="make them readable by the user the trainer runs as (chmod -R a+rX on the package's "
                    "directories), not a reinstall", packages=[d.name],
                detail={"denied": d.denied, "denied_count": d.denied_count}))
        if not (d.missing_count or d.changed_count) or not d.name:
            continue
        live = c.installed.get(d.key)
        if live is not None and live is not d and live.location == d.location:
            continue  # a stale second dist-info: the stale-dist-info finding says it, and removes only that
        vital = c.is_protected(d) and c.installed.get(d.key) is d
        parts = []
        if d.missing_count:
            parts.append(f"{d.missing_count} file(s) its RECORD lists are missing ({listing(d.missing, 3)})")
        if d.changed_count:
            parts.append(f"{d.changed_count}{'' if parts else ' file(s) its RECORD lists'} have another size "
                         f"or sha256 than recorded ({listing(d.changed, 3)})")
        sharers = set()
        for rel in [*d.missing, *d.changed]:
            full = os.path.normpath(os.path.join(d.location or "", rel))
            sharers |= {i for i in owners_of.get(full, []) if i != d.index}
        shared_with = [o.label() for i in sorted(sharers) if (o := c.s.dist(i)) is not None]
        consequence = ""
        gone = [rel.rsplit("/", 1)[-1] for rel in d.missing if rel.rsplit("/", 1)[-1].startswith(LIB_PREFIXES)]
        other = [rel.rsplit("/", 1)[-1] for rel in d.changed if rel.rsplit("/", 1)[-1].startswith(LIB_PREFIXES)]
        lost_libs = gone + other
        if vital and gone:
            text, signature = crash_signature(gone[0])
            consequence = f": `import torch` fails with '{text}' (crash signature {signature})"
        elif vital and other:
            consequence = (f": torch loads a {other[0]} that is not the one this wheel installed (another build's: "
                           "a version mismatch when it loads, or at the first call into it)")
        message = (f"{d.label()}{' (torch or the trainer requires it)' if vital else ''}: {'; '.join(parts)}"
                   + (f"; {listing(shared_with, 3)} also list{'s' if len(shared_with) == 1 else ''} them "
                      "(installed over it, or its uninstall deleted them)" if shared_with else "")
                   + consequence)
        breaks_import = any(_imported(rel) for rel in [*d.missing, *d.changed])
        if vital and not breaks_import:
            message += ": it still imports (only its command-line scripts or data files differ)"
        fix, argv = f"reinstall {d.spec()} over itself", [c.fixer.reinstall(d)]
        if not c.inside(d):
            fix, argv = (f"it lies outside this environment ({d.location}: the base interpreter's, or a directory "
                         "added to sys.path): this environment's pip does not change it; repair it with the pip of "
                         "the interpreter it belongs to, or leave it"), []
        elif c.fixer.target(d.name) is not d:
            fix, argv = (f"another copy of {d.name} comes first on sys.path, and pip acts on that one: "
                         "see the duplicate-package finding"), []
        findings.append(c.finding(
            ("error" if breaks_import else "warning") if vital else "info", "missing-files", message,
            fix=fix, argv=argv, packages=[d.name],
            libraries=sorted(set(lost_libs)),
            detail={"missing": d.missing, "missing_count": d.missing_count, "changed": d.changed,
                    "changed_count": d.changed_count, "shared_with": shared_with}))
    return findings


def _rule_shared_files(c: _Context) -> list[Finding]:
    """Files listed by more than one distribution: an uninstall of one deletes them
    from under the others."""
    findings = []
    for group in c.s.shared:
        dists = [d for i in group.owners if (d := c.s.dist(i)) is not None]
        if len(dists) < 2:
            continue
        keep = [d for d in dists if c.is_protected(d) or not d.name]
        others = [d for d in dists if d not in keep]
        shown = [short_path(p, dists[0]) for p in group.paths]
        mixed = bool(keep and others)
        inits = only_inits(group)
        severity = "warning" if mixed and not inits else "info"
        message = (f"{group.count} file(s) are listed by {' and '.join(d.label() for d in dists)} "
                   f"({listing(shown, 3)}): uninstalling one deletes them for the other"
                   + ("s" if len(dists) > 2 else ""))
        fix = None
        if mixed:
            removal = c.fixer.removal([d.name for d in others])
            message += f"; {listing([d.name for d in keep], 3)} {'is' if len(keep) == 1 else 'are'} the trainer's"
            fix = (f"never uninstall {', '.join(d.name for d in others)} alone: follow it with "
                   + "; ".join(c.fixer.shell(a) for a in removal.argv[1:])) if len(removal.argv) > 1 else None
        findings.append(c.finding(severity, "shared-files", message, fix=fix,
                                  packages=[d.name or "?" for d in dists], paths=group.paths,
                                  detail={"owners": [d.label() for d in dists], "count": group.count}))
    return findings


# --------------------------------------------------------------------------- CUDA


def _rule_cuda_major(c: _Context) -> list[Finding]:
    """Wheels built for another CUDA major than torch's."""
    if c.torch is None or c.torch.cuda_major is None:
        return []
    torch_major = c.torch.cuda_major
    twins = [c.installed[k] for k in c.protected if k in c.installed]
    conflicts, strays = [], []
    for d in c.installed.values():
        major = cuda_major(d)
        if d.key == "torch" or major is None or major == torch_major or d.key in c.allowed:
            continue
        check = c.torch_requirement(d.name)
        if check is not None and not check.satisfied:
            continue  # the requirement rules report it, with torch's version to install
        twin = next((t for t in twins if t is not d and same_soname(d, t) and cuda_major(t) == torch_major), None)
        (conflicts if twin else strays).append((d, major, twin))
    findings = []
    for d, major, twin in conflicts:
        removal = c.fixer.removal([d.name])
        users = required_by(c.s, d.name)
        findings.append(c.finding(
            "error", "cuda-major",
            f"{d.label()} is built for CUDA {major} but torch for CUDA {c.torch.cuda}; it ships the same "
            f"library as {twin.label()} that torch requires (same soname): whichever a process loads first "
            f"is used everywhere in it" + (f"; required by {', '.join(users)}" if users else ""),
            fix=c.removal_fix(removal, "check first that nothing else you run from this environment needs it"),
            argv=removal.argv, packages=[d.name], remove=removal.names,
            detail={"cuda_major": major, "torch_cuda": c.torch.cuda, "same_library_as": twin.name,
                    "reinstalled": [x.name for x in removal.reinstalled]}))
    if strays:
        names = [d.name for d, _, _ in strays]
        removal = c.fixer.removal(names)
        listed = []
        for d, m, _ in strays:
            users = required_by(c.s, d.name)
            listed.append(f"{d.label()} (CUDA {m}" + (f", for {', '.join(users)})" if users else ")"))
        findings.append(c.finding(
            "warning", "cuda-major",
            f"{len(strays)} wheel(s) built for another CUDA major than torch's CUDA {c.torch.cuda}: {listing(listed)}",
            fix=c.removal_fix(removal, "check first that nothing else you run from this environment needs them"),
            argv=removal.argv, packages=names, remove=removal.names,
            detail={"torch_cuda": c.torch.cuda, "wheels": {d.name: m for d, m, _ in strays},
                    "reinstalled": [x.name for x in removal.reinstalled]}))
    return findings


def file_version(path: str) -> tuple[int, ...] | None:
    """The version in a library's file name (libcudnn.so.9.19.0 -> (9, 19, 0))."""
    m = _FILE_VERSION.search(path.rsplit("/", 1)[-1])
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def compare_versions(a: tuple[int, ...] | None, b: tuple[int, ...] | None) -> str:
    """'same' | 'differ' | 'unknown': two copies of a library, compared on the
    release numbers both carry (a soname's major alone says nothing)."""
    if not a or not b or len(a) < 2 or len(b) < 2:
        return "unknown"
    n = min(len(a), len(b))
    return "same" if a[:n] == b[:n] else "differ"


def _torch_loads(c: _Context, d: Dist, soname: str, ld_hits: list[str]) -> tuple[str | None, str] | None:
    """(the file torch loads for ``soname``, how that is known) when ``d`` is the
    wheel torch requires; None when torch does not load this wheel's library."""
    if not c.is_protected(d):
        return None
    for path in (c.s.deep or {}).get("loaded") or []:
        if path.rsplit("/", 1)[-1] == soname or path.rsplit("/", 1)[-1].startswith(soname + "."):
            return path, "mapped by `import torch` (--deep)"
    lib = c.s.torch_libs.get(soname)
    if lib is not None and lib.path is not None:
        return lib.path, f"the loader's order: {lib.via}"
    elf = c.s.torch_elf or {}
    if ld_hits and not (elf.get("rpath") and not elf.get("runpath")):
        return ld_hits[0], "LD_LIBRARY_PATH is searched before torch's RUNPATH"
    return None, "torch's libraries find their NVIDIA wheels through their RUNPATH"


def _rule_duplicate_libraries(c: _Context) -> list[Finding]:
    """The same soname from a wheel and from the system's ldconfig cache: compared
    by version, and by which copy the loader gives torch."""
    system: dict[str, list[LibEntry]] = {}
    for e in c.s.ldconfig:
        if _VERSIONED_SONAME.search(e.soname):
            system.setdefault(e.soname, []).append(e)
    torch_major = c.torch.cuda_major if c.torch else None
    findings = []
    for d in c.installed.values():
        if torch_major is not None and cuda_major(d) not in (None, torch_major):
            continue  # a wheel for another CUDA: the cuda-major rule reports it
        shared = wheel_sonames(d, system)
        if not shared:
            continue
        names = sorted(shared)
        sys_paths = [system[n][0].path for n in names]
        ld_hits = _on_ld_library_path(c.s, names)
        wheel_release = release_of(d.version)
        versions = {n: compare_versions(
            wheel_release, file_version(c.s.ldconfig_real.get(system[n][0].path, system[n][0].path))) for n in names}
        loads = {n: _torch_loads(c, d, n, [h for h in ld_hits if h.endswith("/" + n)]) for n in names}
        other = {n: pick[0] for n, pick in loads.items()
                 if pick is not None and pick[0] is not None and not _is_in(pick[0], d)}
        if other:
            severity = "warning" if all(versions[n] == "same" for n in other) else "error"
        else:
            severity = "warning" if any(v == "differ" for v in versions.values()) else "info"
        system_versions = sorted({".".join(map(str, v)) for n in names
                                  if (v := file_version(c.s.ldconfig_real.get(system[n][0].path, ""))) and len(v) > 1})
        said = {"same": f"the same version ({d.version} / {listing(system_versions, 2)})",
                "differ": f"different versions: the wheel's {d.version}, the system's {listing(system_versions, 2)}",
                "unknown": "versions not comparable (the system files' names carry only the soname)"}
        verdict = "differ" if "differ" in versions.values() else "same" if "same" in versions.values() else "unknown"
        message = (f"{listing(names, 3)} installed twice: by the wheel {d.label()} and in the system library cache "
                   f"({listing(sys_paths, 2)}), {said[verdict]}. ")
        pick = next((p for p in loads.values() if p is not None), None)
        if other:
            n, path = next(iter(other.items()))
            message += f"torch loads {path} ({loads[n][1]}), not the wheel's copy"
        elif pick is not None:
            message += f"torch loads the wheel's copy ({pick[1]})"
        else:
            message += "torch does not require this wheel"
        fix = None
        if other and ld_hits:
            fix = (f"take {listing(sorted({h.rsplit('/', 1)[0] for h in ld_hits}), 2)} off LD_LIBRARY_PATH for the "
                   f"trainer{c.source('LD_LIBRARY_PATH')}")
        elif other:
            fix = f"make torch load {d.name}'s copy (nothing in LD_PRELOAD / LD_LIBRARY_PATH ahead of it)"
        elif severity == "warning":
            fix = ("nothing loads the system copy into the trainer while LD_PRELOAD and LD_LIBRARY_PATH leave it "
                   "out: keep it so, or bring the system copy to the wheel's version")
        findings.append(c.finding(
            severity, "duplicate-library", message, fix=fix, packages=[d.name], libraries=names, paths=sys_paths,
            detail={"sonames": names, "system": sys_paths, "wheel": d.name, "versions": versions,
                    "ld_library_path": ld_hits, "torch_loads": {n: p[0] for n, p in loads.items() if p}}))
    for soname, entries in system.items():
        paths = list(dict.fromkeys(e.path for e in entries))
        if len(paths) < 2:
            continue
        on_ld = [p for p in paths if _dir(p) in c.s.ld_library_path]
        loaded = on_ld[0] if on_ld else paths[0]
        why = "it is on LD_LIBRARY_PATH" if on_ld else "it comes first in the cache"
        real = [file_version(c.s.ldconfig_real.get(p, p)) for p in paths]
        differ = any(compare_versions(real[0], r) == "differ" for r in real[1:])
        findings.append(c.finding(
            "warning" if differ else "info", "duplicate-library",
            f"{soname} is in the system library cache {len(paths)} times ({', '.join(paths)}); {loaded} "
            f"is the one loaded ({why})"
            + ("; their versions differ: one of them does not match the installed driver or toolkit" if differ else ""),
            libraries=[soname], paths=paths, detail={"sonames": [soname], "system": paths}))
    return findings


def _is_in(path: str, d: Dist) -> bool:
    base = (d.location or "").rstrip("/")
    return bool(base) and path.startswith(base + "/")


def _dir(path: str) -> str:
    return path.rsplit("/", 1)[0]


def _on_ld_library_path(s: Snapshot, sonames: list[str]) -> list[str]:
    """Files with these sonames in LD_LIBRARY_PATH directories (searched before any RUNPATH)."""
    hits = []
    for directory in s.ld_library_path:
        listed = s.ld_library_libs.get(directory)
        if listed is None:  # a capture: only the ldconfig cache tells what the directory holds
            listed = [e.soname for e in s.ldconfig if _dir(e.path) == directory.rstrip("/")]
        hits += [f"{directory.rstrip('/')}/{n}" for n in sonames if n in listed]
    return hits


# --------------------------------------------------------------------------- environment


def _rule_ld_preload(c: _Context) -> list[Finding]:
    libs = [p for p in c.s.ld_preload if p.rsplit("/", 1)[-1].startswith(LIB_PREFIXES)]
    if not libs:
        return []
    return [c.finding("warning", "ld-preload",
                      f"LD_PRELOAD forces {', '.join(libs)} into every process, ahead of the copies torch requires"
                      + c.source("LD_PRELOAD"),
                      fix="unset LD_PRELOAD for the trainer", libraries=[p.rsplit("/", 1)[-1] for p in libs],
                      paths=libs, detail={"ld_preload": libs})]


def _rule_user_site(c: _Context) -> list[Finding]:
    """Packages the trainer can import from the user site (~/.local) that shadow
    nothing (those that do are the shadowing rule's): worth knowing, not a problem."""
    s = c.s
    if not (s.user_site and s.user_site_enabled and s.user_site in s.sys_path):
        return []
    rest = [d for d in s.dists if d.location == s.user_site and len(s.copies(d.name)) == 1]
    if not rest:
        return []
    return [c.finding(
        "info", "user-site",
        f"{len(rest)} package(s) from user site-packages {s.user_site} are importable by the trainer: "
        f"{listing([d.label() for d in rest])}",
        fix=f"set PYTHONNOUSERSITE=1 for the trainer (the inventory's env: for host {s.host}) to leave them out",
        packages=[d.name for d in rest], paths=[s.user_site])]


def _rule_pythonpath(c: _Context) -> list[Finding]:
    """PYTHONPATH entries that shadow something (an entry that shadows nothing is not reported)."""
    findings = []
    for entry in c.s.pythonpath:
        if not entry.exists or not entry.shadows:
            continue
        vital = [m for m in entry.shadows if c.module_is_vital(m)]
        findings.append(c.finding(
            "error" if vital else "warning", "pythonpath",
            f"PYTHONPATH entry {entry.path}{c.source('PYTHONPATH')} shadows {listing(entry.shadows)}: the trainer "
            "imports those from there instead of from its environment",
            fix="remove it from PYTHONPATH for the trainer", packages=entry.shadows, paths=[entry.path],
            detail={"path": entry.path, "shadows": entry.shadows}))
    return findings


def _rule_stray_stacks(c: _Context) -> list[Finding]:
    strays = [d for k, d in c.installed.items() if k in STRAY_STACKS and k not in c.allowed]
    findings = []
    if strays:
        removal = c.fixer.removal([d.name for d in strays])
        stacks = sorted({STRAY_STACKS[d.key] for d in strays})
        fix = c.removal_fix(removal)
        fix = (fix + ", or give the trainer an environment of its own (the inventory's python:)") if fix else \
            "give the trainer an environment of its own (the inventory's python:)"
        findings.append(c.finding(
            "warning", "stray-stack",
            f"{', '.join(stacks)} installed beside the trainer ({listing([d.label() for d in strays])}): "
            "these stacks pin their own torch, triton and CUDA wheels",
            fix=fix, argv=removal.argv, packages=[d.name for d in strays], remove=removal.names))
    others = [d for k, d in c.installed.items() if OTHER_FRAMEWORKS.match(k) and k not in c.allowed]
    if others:
        findings.append(c.finding(
            "info", "other-framework",
            f"other GPU frameworks in the trainer's environment: {listing([d.label() for d in others])}; "
            "harmless unless imported with the trainer (they load their own CUDA libraries)",
            packages=[d.name for d in others]))
    return findings


def _rule_environment(c: _Context) -> list[Finding]:
    s = c.s
    findings = []
    if s.prefix and s.base_prefix and s.prefix == s.base_prefix:
        findings.append(c.finding(
            "info", "no-venv",
            f"the trainer's python ({s.python}) is not in a virtual environment: packages installed for "
            "anything else on the host land beside the trainer's",
            fix="create a venv for the trainer and point the inventory's python: at it"))
    for line in ([f"ldconfig: {s.ldconfig_error}"] if s.ldconfig_error else []) + s.errors:
        findings.append(c.finding("info", "audit-incomplete", f"could not read everything: {line}"))
    return findings


RULES = (
    _rule_torch,
    _rule_torch_libraries,
    _rule_broken_metadata,
    _rule_shadowed,
    _rule_duplicate_packages,
    _rule_requirements,
    _rule_triton,
    _rule_trainer,
    _rule_unmet,
    _rule_integrity,
    _rule_shared_files,
    _rule_cuda_major,
    _rule_duplicate_libraries,
    _rule_ld_preload,
    _rule_user_site,
    _rule_pythonpath,
    _rule_stray_stacks,
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
    prove(findings, snapshot, context.protected)  # a command that cannot be proven safe is left out, with why
    return findings
