"""Environment rules: what around the packages changes what the trainer loads.

``ld-preload``; ``pythonpath`` entries that shadow something; ``user-site``
packages; ``stray-stack`` inference stacks and ``other-framework``s; ``no-venv``;
``audit-incomplete``, what the collector could not read.
"""

from __future__ import annotations

import re

from dflashctl.envaudit.context import _Context
from dflashctl.envaudit.findings import Finding
from dflashctl.envaudit.fixes import index_args, listing
from dflashctl.envaudit.snapshot import LIB_PREFIXES

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


PIP_WHEEL = "pip-VERSION-py3-none-any.whl"


def _rule_pip(c: _Context) -> list[Finding]:
    """pip unable to act: missing or broken in this python (every fix runs it), or
    a protected distribution without a RECORD (pip can neither uninstall nor
    upgrade it, so no fix can replace it)."""
    findings = []
    problem, fixer = c.fixer.pip_problem, c.fixer
    if problem is not None:
        repair = fixer.pip_repair()
        what = "pip is not installed in this environment (a venv made by uv or --without-pip)" \
            if problem == "missing" else f"pip is broken: {problem}"
        if repair:
            fix = ("remove its dist-info first (`ensurepip` does nothing while one is there), then "
                   if problem != "missing" else "") + "put pip back with ensurepip; every fix command needs it"
        else:
            carry = f"/tmp/{PIP_WHEEL}"
            fix = (f"this python has no ensurepip (Debian ships it in python3-venv): carry pip's wheel ({PIP_WHEEL} "
                   f"from PyPI) to the host as {carry}"
                   + ("" if problem == "missing" else ", remove the broken pip's dist-info")
                   + f", and run `{fixer.shell([fixer.python, carry + '/pip', 'install', '--no-index', carry])}` "
                   "(pip runs from its own wheel)")
        findings.append(c.finding(
            "info" if problem == "missing" and repair else "warning", "pip-unusable",
            f"{what}: no fix can run until it works", fix=fix, argv=repair, packages=["pip"],
            detail={"problem": problem}))
    for d in c.installed.values():
        if d.files is not None or not d.name or not c.is_protected(d) or not d.metadata or d.metadata.endswith(".egg-info"):
            continue
        argv = [fixer.pip("install", "--ignore-installed", "--no-deps", *index_args(d.version), d.spec(),
                          names=[d.name])] if d.version and c.inside(d) else []
        findings.append(c.finding(
            "warning", "pip-unusable",
            f"{d.label()} has no RECORD ({d.metadata}; installed by {d.installer or 'a tool that writes none'}, or "
            f"copied): pip can neither uninstall nor upgrade it, so no fix that replaces {d.name} can run",
            fix=(f"install the same {d.spec()} over it without uninstalling it first (--ignore-installed): pip "
                 "writes its files and a dist-info with a RECORD"
                 if argv else f"reinstall {d.name} with the tool that installed it"),
            argv=argv, packages=[d.name], paths=[d.metadata], detail={"installer": d.installer}))
    return findings


def _rule_pip_stash(c: _Context) -> list[Finding]:
    """pip's ``~name`` stash directories in a site directory: what a pip killed
    mid-step had moved aside (nothing imports from them; the package they came
    from is missing its files, which missing-files says)."""
    if not c.s.stashes:
        return []
    return [c.finding(
        "warning", "pip-stash",
        f"{len(c.s.stashes)} stash director{'y' if len(c.s.stashes) == 1 else 'ies'} of pip left in site-packages "
        f"({listing(c.s.stashes, 3)}): what a pip killed during an install or uninstall had moved aside",
        fix="remove them once the packages they came from are whole again (see missing-files)",
        argv=[["rm", "-r", "--", p] for p in c.s.stashes], paths=list(c.s.stashes))]


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
