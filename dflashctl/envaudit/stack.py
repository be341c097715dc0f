"""The trainer's stack in a snapshot: which torch Python imports and what it was
built for, which CUDA major each wheel was built for and which shared libraries it
ships, every requirement reachable from torch and transformers checked against
what is imported, and every installed distribution's requirements (what ``pip
check`` reports).

Pure functions of a ``Snapshot`` (requirements and markers read with
``packaging``); no I/O, no findings (``rules`` turns these into findings).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Iterable

from packaging.markers import InvalidMarker, UndefinedComparison, UndefinedEnvironmentName
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from dflashctl.envaudit.snapshot import Dist, Snapshot

# The trainer imports these; they and everything they require are never suggested for removal.
TRAINER_ROOTS = ("torch", "transformers")

# A CUDA major in a name: nvidia-cudnn-cu12, cupy-cuda13x, jax-cuda13-plugin, nvidia-dali-cuda120.
_NAME_CUDA = re.compile(r"(?:^|-)cu(?:da)?(\d{2,3})x?(?:-|$)")
# ... or in a local version label: torchvision 0.21.0+cu124.
_LOCAL_CUDA = re.compile(r"\+cu(\d{2,3})\b")

# CUDA 13 wheels dropped the -cuXX suffix (nvidia-cublas, nvidia-cuda-runtime), so
# the CUDA major of an un-suffixed wheel comes from its version, and several
# libraries number their own versions: cuFFT 11.x shipped with CUDA 12, 12.x with
# CUDA 13; cuSPARSE is 12.x in both (12.0-12.5 with CUDA 12, 12.6 with 13.0). Here:
# versions that follow the CUDA version, and [low, high) release ranges for the
# others. Outside every range the major is unknown and nothing is claimed.
FOLLOWS_CUDA = frozenset({
    "nvidia-cublas", "nvidia-cuda-runtime", "nvidia-cuda-nvrtc", "nvidia-cuda-cupti", "nvidia-nvjitlink",
    "nvidia-nvtx", "nvidia-cuda-nvcc", "nvidia-cuda-cccl", "nvidia-nvvm", "nvidia-cuda-crt", "nvidia-npp",
    "nvidia-nvjpeg", "nvidia-nvfatbin", "nvidia-cuda-sanitizer-api", "nvidia-cuda-cuobjdump",
    "nvidia-cuda-opencl", "nvidia-cuda-profiler-api", "cuda-toolkit", "cuda-bindings", "cuda-python",
})
OWN_VERSION_SCHEME: dict[str, tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...]] = {
    "nvidia-cufft": (((11, 0), (12, 0), 12), ((12, 0), (13, 0), 13)),
    "nvidia-curand": (((10, 3), (10, 4), 12), ((10, 4), (10, 5), 13)),
    "nvidia-cusolver": (((11, 4), (12, 0), 12), ((12, 0), (13, 0), 13)),
    "nvidia-cusparse": (((12, 0), (12, 6), 12), ((12, 6), (13, 0), 13)),
    "nvidia-cufile": (((1, 5), (1, 15), 12), ((1, 15), (2, 0), 13)),
}
# Shared libraries an NVIDIA wheel ships, by component, for snapshots without file
# lists (captures). The soname's number is the library's own major version, which is
# why cuDNN 9 built for CUDA 12 and for CUDA 13 are both libcudnn.so.9.
WHEEL_SONAMES = {
    "cudnn": r"libcudnn(?:_[a-z_]+)?\.so\.{major}",
    "nccl": r"libnccl\.so\.{major}",
    "cublas": r"libcublas(?:Lt)?\.so\.{major}",
    "cuda-runtime": r"libcudart\.so\.{major}",
}

# --------------------------------------------------------------------------- wheels


def release_of(version: str) -> tuple[int, ...] | None:
    """The release numbers of a version ('13.1.0.3' -> (13, 1, 0, 3)); None when it is not PEP 440."""
    try:
        return Version(version).release
    except InvalidVersion:
        return None


def cuda_major(dist: Dist) -> int | None:
    """The CUDA major a wheel was built for, or None when it is not CUDA-specific
    (or not known: nvidia-ml-py 13.x follows the driver, not CUDA)."""
    for pattern, text in ((_LOCAL_CUDA, dist.version), (_NAME_CUDA, dist.key)):
        m = pattern.search(text)
        if m:
            digits = m.group(1)
            return int(digits[:2]) if len(digits) == 3 else int(digits)
    release = release_of(dist.version)
    if release is None:
        return None
    if dist.key in FOLLOWS_CUDA:
        return release[0]
    for low, high, major in OWN_VERSION_SCHEME.get(dist.key, ()):
        if low <= release[: len(low)] < high:
            return major
    return None


def component(dist: Dist) -> str | None:
    """nvidia-cudnn-cu13 -> 'cudnn', nvidia-cuda-runtime -> 'cuda-runtime'; None for non-NVIDIA wheels."""
    if not dist.key.startswith("nvidia-"):
        return None
    return re.sub(r"-cu\d+$", "", dist.key[len("nvidia-"):])


def same_soname(a: Dist, b: Dist) -> bool:
    """Two NVIDIA wheels shipping the same soname: one library, and its major version agrees."""
    if component(a) is None or component(a) != component(b):
        return False
    ra, rb = release_of(a.version), release_of(b.version)
    return bool(ra and rb and ra[0] == rb[0])


def wheel_sonames(d: Dist, sonames: Iterable[str]) -> dict[str, str]:
    """soname -> where the wheel has it ('' when inferred), for the given sonames."""
    if d.libs is not None:
        have = {p.rsplit("/", 1)[-1]: (f"{d.location}/{p}" if d.location else p) for p in d.libs}
        return {n: have[n] for n in sonames if n in have}
    comp = component(d)
    release = release_of(d.version)
    if comp not in WHEEL_SONAMES or not release:
        return {}
    pattern = re.compile(WHEEL_SONAMES[comp].format(major=release[0]) + "$")
    return {n: "" for n in sonames if pattern.match(n)}


# --------------------------------------------------------------------------- torch


@dataclass
class TorchBuild:
    version: str
    cuda: str | None  # "13.0"; None: a CPU (or ROCm) build, or unknown
    source: str  # where ``cuda`` was read
    location: str | None = None  # the directory of the torch package Python imports

    @property
    def cuda_major(self) -> int | None:
        return int(self.cuda.split(".")[0]) if self.cuda else None

    @property
    def label(self) -> str:
        return f"torch {self.version} ({f'CUDA {self.cuda}' if self.cuda else 'no CUDA'})"


_VERSION_PY_CUDA = re.compile(r"""^cuda\b[^=\n]*=\s*(?:'([^']*)'|"([^"]*)"|(None))""", re.M)
_VERSION_PY_VERSION = re.compile(r"""^__version__\b[^=\n]*=\s*(?:'([^']*)'|"([^"]*)")""", re.M)


def torch_build(snapshot: Snapshot) -> TorchBuild | None:
    """The torch Python imports, and the CUDA it was built for. With the host's
    import system asked: ``import torch`` in a subprocess when it ran (--deep),
    else the imported copy's own torch/version.py (its ``__version__`` and
    ``cuda``); None when torch cannot be imported. From a capture (names and
    versions only): the first torch listed, its +cuNNN label, else the CUDA major
    of the wheels it requires (a PyPI torch has no local label)."""
    deep = snapshot.deep or {}
    if deep.get("version"):
        return TorchBuild(deep["version"], deep.get("cuda"), "import torch (--deep)", snapshot.torch_dir)
    torch = snapshot.installed().get("torch")
    if snapshot.asked:
        spec = snapshot.modules.get("torch")
        if spec is None or spec.origin is None:
            return None  # not importable, or a directory without __init__.py (an uninstall's leftovers)
        torch = snapshot.owner("torch") or torch
    text = snapshot.torch_version_py or ""
    found = _VERSION_PY_VERSION.search(text)
    version = (found.group(1) or found.group(2)) if found else (torch.version if torch and torch.version else None)
    if version is None:
        return TorchBuild("?", None, "unknown (no torch/version.py, no metadata)", snapshot.torch_dir) \
            if snapshot.asked else None
    m = _VERSION_PY_CUDA.search(text)
    if m:
        return TorchBuild(version, m.group(1) or m.group(2) or None, "torch/version.py", snapshot.torch_dir)
    m = _LOCAL_CUDA.search(version)
    if m:
        return TorchBuild(version, f"{m.group(1)[:-1]}.{m.group(1)[-1]}", "its version", snapshot.torch_dir)
    if version.endswith("+cpu"):
        return TorchBuild(version, None, "its version", snapshot.torch_dir)
    majors = {cuda_major(Dist(r.name, _pinned(r) or "")) for r in parse_requirements((torch and torch.requires) or [])}
    majors.discard(None)
    if len(majors) == 1:
        return TorchBuild(version, str(majors.pop()), "the CUDA wheels it requires", snapshot.torch_dir)
    return TorchBuild(version, None, "unknown (no torch/version.py, no +cu label)", snapshot.torch_dir)


# --------------------------------------------------------------------------- requirements


def parse_requirements(requirements: Iterable[str]) -> list[Requirement]:
    """Requirement strings -> Requirements; one that does not parse is left out."""
    return [r for r in map(_requirement, requirements) if r is not None]


@functools.lru_cache(maxsize=8192)
def _requirement(text: str) -> Requirement | None:
    # Every rule reads the same few thousand strings: parsed once per process.
    try:
        return Requirement(text)
    except InvalidRequirement:
        return None


def _pinned(req: Requirement) -> str | None:
    """The version of an ``==X`` requirement (``==X.*`` -> X), else None."""
    for spec in req.specifier:
        if spec.operator in ("==", "==="):
            return spec.version.removesuffix(".*")
    return None


def satisfies(requirement: Requirement, dist: Dist | None) -> bool:
    """Whether an installed distribution meets a requirement (as pip checks it:
    pre-releases accepted)."""
    if dist is None:
        return False
    if not requirement.specifier:
        return True
    try:
        return requirement.specifier.contains(Version(dist.version), prereleases=True)
    except InvalidVersion:
        return False


@dataclass
class ReqCheck:
    """One requirement of the trainer's stack, checked against what is installed."""

    chain: str  # "torch -> cuda-toolkit[cublas]"
    requirement: Requirement
    installed: Dist | None
    requirer: Dist | None = None  # the distribution whose METADATA lists it

    @property
    def satisfied(self) -> bool:
        return satisfies(self.requirement, self.installed)

    @property
    def spec(self) -> str:
        r = self.requirement
        extras = f"[{','.join(sorted(r.extras))}]" if r.extras else ""
        return f"{r.name}{extras}{r.specifier}"


def _applies(req: Requirement, markers: dict[str, str], extras: frozenset[str]) -> bool:
    if req.marker is None:
        return True
    for extra in ("", *sorted(extras)):
        try:
            if req.marker.evaluate({**markers, "extra": extra}):
                return True
        except (UndefinedEnvironmentName, UndefinedComparison, InvalidMarker):
            return True  # cannot tell: checking a requirement too many beats missing one
    return False


def requirement_checks(snapshot: Snapshot, roots: Iterable[str] = TRAINER_ROOTS) -> list[ReqCheck]:
    """Every requirement reachable from ``roots`` (with extras and markers evaluated
    for the host), each checked against the installed distribution."""
    installed = snapshot.installed()
    checks: list[ReqCheck] = []
    queue = [(installed[canonicalize_name(r)], frozenset(), canonicalize_name(r))
             for r in roots if canonicalize_name(r) in installed]
    seen: set[tuple[str, frozenset]] = set()
    while queue:
        dist, extras, chain = queue.pop(0)
        if (dist.key, extras) in seen:
            continue
        seen.add((dist.key, extras))
        for req in parse_requirements(dist.requires or []):
            if not _applies(req, snapshot.markers, extras):
                continue
            target = installed.get(canonicalize_name(req.name))
            checks.append(ReqCheck(chain, req, target, dist))
            if target is not None:
                wanted = frozenset(canonicalize_name(e) for e in req.extras)
                label = req.name + (f"[{','.join(sorted(req.extras))}]" if req.extras else "")
                queue.append((target, wanted, f"{chain} -> {label}"))
    return checks


def protected(snapshot: Snapshot, checks: list[ReqCheck] | None = None) -> set[str]:
    """Names (canonical) of the trainer's roots and everything they require:
    never suggested for removal, and their files never deleted by a fix."""
    checks = requirement_checks(snapshot) if checks is None else checks
    return {canonicalize_name(r) for r in TRAINER_ROOTS} | {canonicalize_name(c.requirement.name) for c in checks}


def required_by(snapshot: Snapshot, name: str) -> list[str]:
    """Installed distributions that list ``name`` among their requirements (any marker)."""
    key = canonicalize_name(name)
    return sorted(
        d.name for d in snapshot.installed().values()
        if any(canonicalize_name(r.name) == key for r in parse_requirements(d.requires or []))
    )


@dataclass
class Unmet:
    """A requirement of an installed distribution that what is installed does not meet."""

    requirer: Dist
    requirement: Requirement
    installed: Dist | None

    def describe(self) -> str:
        r = self.requirement
        have = f"{self.installed.label()} is installed" if self.installed else "it is not installed"
        return f"{r.name}{r.specifier} ({have})"


def unmet_requirements(snapshot: Snapshot) -> list[Unmet]:
    """What ``pip check`` reports: for every installed distribution (the copy of
    each name that is imported), the requirements that apply on the host (markers
    evaluated, no extras) and are missing or at a version they do not accept."""
    installed = snapshot.installed()
    unmet = []
    for dist in installed.values():
        for req in parse_requirements(dist.requires or []):
            if not _applies(req, snapshot.markers, frozenset()):
                continue
            target = installed.get(canonicalize_name(req.name))
            if not satisfies(req, target):
                unmet.append(Unmet(dist, req, target))
    return unmet
