"""Torch rules: whether the trainer's python imports torch, and reads every METADATA.

``torch-missing`` and ``torch-cpu-build``: torch importable, a CUDA build when the
playbook wants GPUs. ``torch-import``: its CUDA libraries found by the loader (or
`import torch` itself, --deep). ``broken-metadata``: a distribution whose METADATA
is empty or cannot be read. ``flash-attn``: which attention kernels flash-attn-4 gives
the drafter (``compile.flex_kernel: auto``), and a release the trainer refuses.
"""

from __future__ import annotations

import re

from packaging.utils import canonicalize_name

from dflashctl.core import contract
from dflashctl.envaudit.context import _Context, crash_signature
from dflashctl.envaudit.findings import Finding
from dflashctl.envaudit.fixes import listing
from dflashctl.envaudit.snapshot import Dist
from dflashctl.envaudit.stack import WHEEL_SONAMES, ReqCheck, component


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


def _rule_flash_attn(c: _Context) -> list[Finding]:
    """flash-attn-4 where it is installed: ``compile.flex_kernel: auto`` runs the drafter's
    attention on its kernels on Hopper and Blackwell GPUs (information: each start compiles
    them); a release before the one that fixed its backward is not used (a warning)."""
    findings = []
    for d in c.s.copies(contract.FLASH_ATTN_PACKAGE):
        why = contract.flash_attn_problem(d.version)
        if why is None:
            findings.append(c.finding(
                "info", "flash-attn",
                f"{d.label()} at {d.location}: with compile.flex_kernel: auto the drafter's attention runs on "
                "flash-attention 4's kernels on Hopper and Blackwell GPUs (each start compiles them; "
                "compile.flex_kernel: triton keeps flex_attention's own)", packages=[d.name]))
            continue
        spec = contract.FLASH_ATTN_SPEC
        findings.append(c.finding(
            "warning", "flash-attn",
            f"{d.label()} at {d.location}: {why}: the trainer does not use it (compile.flex_kernel: auto takes "
            "flex_attention's own kernels, flash is refused)",
            fix=f"install the fixed release ({spec}), or uninstall it", argv=[c.fixer.install([spec])],
            packages=[d.name]))
    return findings


def _rule_imports(c: _Context) -> list[Finding]:
    """--deep: each module the trainer imports (and each asked for) that is
    installed but fails to import in a fresh interpreter is an error, whatever
    the static checks say (torch's is torch-import's)."""
    findings = []
    for module, answer in c.s.imports().items():
        error = answer.get("error") if isinstance(answer, dict) else None
        if not error or module == "torch" or c.s.modules.get(module, False) is None:
            continue  # imports; torch-import says torch's; not installed: the requirement rules say it
        owner = c.s.owner(module) or c.declared.get(module)
        findings.append(c.finding(
            "error", "import-error",
            f"`import {module}` fails on the host in a fresh interpreter: {error}"
            + (f" ({owner.label()} at {owner.location})" if owner else "") + ": the trainer cannot start",
            fix="the error names the module or file that fails; the other findings name what is missing or "
                "mixed: fix those, then audit again with --deep",
            packages=[owner.name if owner else module], detail={"module": module, "error": error}))
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
