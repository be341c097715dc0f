"""Requirement rules: torch's and the trainer's, at the versions they pin.

``missing-requirement`` and ``requirement-version``: torch's requirement tree.
``triton-version``: the Triton torch pins, and only one Triton. ``unmet-requirement``:
every other distribution's (what `pip check` says). ``trainer-requirement``: what
the trainer itself needs (Python, torch, transformers, safetensors, Triton).
"""

from __future__ import annotations

import re

from packaging.utils import canonicalize_name

from dflashctl.envaudit.context import _Context, crash_signature
from dflashctl.envaudit.findings import Finding
from dflashctl.envaudit.fixes import index_args, listing
from dflashctl.envaudit.snapshot import Dist
from dflashctl.envaudit.stack import WHEEL_SONAMES, ReqCheck, component, release_of, required_by, unmet_requirements

TRITON_NAMES = ("triton", "pytorch-triton")


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


def unrunnable(snapshot) -> str:
    """Why no fix is offered for this interpreter at all ('' when the trainer runs on it)."""
    py = release_of(snapshot.python_version or "")
    if py and py[:2] < TRAINER_PYTHON:
        return (f"the trainer cannot run on Python {snapshot.python_version} (it needs "
                f"{'.'.join(map(str, TRAINER_PYTHON))}+), so no change to this environment's packages makes it run: "
                "point the inventory's python: at a Python 3.10+ environment")
    return ""


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
