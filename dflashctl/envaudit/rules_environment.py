"""Environment rules: what around the packages changes what the trainer loads.

``ld-preload``; ``pythonpath`` entries that shadow something; ``user-site``
packages; ``stray-stack`` inference stacks and ``other-framework``s; ``no-venv``;
``audit-incomplete``, what the collector could not read.
"""

from __future__ import annotations

import re

from dflashctl.envaudit.context import _Context
from dflashctl.envaudit.findings import Finding
from dflashctl.envaudit.fixes import listing
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
