"""Environment audit: what the trainer's Python on a host will actually load.

One round trip per host: ``AUDIT_SOURCE``, a stdlib-only script, runs with the
host's python (the one that runs the trainer; without ``-I``, because a user
site-packages directory or a PYTHONPATH is exactly what is being audited) and
prints one JSON object: every installed distribution in ``sys.path`` order (name,
version, location, requirements, top-level modules, CUDA-family shared libraries
it ships), ``sys.prefix`` / ``sys.path`` / the user site, the ``ldconfig -p``
entries for libcudnn / libnccl / libcuda / libcublas, LD_LIBRARY_PATH and
PYTHONPATH (with what each entry holds), torch's ``version.py`` text and the
RUNPATH of its shared library, read from the file without importing torch.

Everything after that is pure: ``parse_snapshot`` turns the JSON into a
``Snapshot``, ``audit(snapshot)`` returns ``Finding``s (severity, message, a
suggested fix). The same rules run on the real captures in
tests/fixtures/env/ through ``snapshot_from_captures``.

Rules: torch present (and a CUDA build when the playbook wants GPUs); torch's
requirements installed at the versions it pins (triton above all); wheels built
for another CUDA major than torch's; the same shared library from a wheel and
from the system; user site-packages and PYTHONPATH entries shadowing the
environment; stray inference stacks beside the trainer. A suggested fix never
uninstalls a package torch (or the trainer) requires: every removal goes through
``_Context.removal``, which keeps those.
"""

from __future__ import annotations

import json
import re
import shlex
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from packaging.markers import InvalidMarker, UndefinedComparison, UndefinedEnvironmentName
from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

from dflashctl.contract import did_you_mean
from dflashctl.errors import ConfigError, TransportError, UnreachableError, first_line

if TYPE_CHECKING:
    from dflashctl.config import Host, Inventory, Playbook
    from dflashctl.store import Store
    from dflashctl.transport import Transport

SEVERITIES = ("info", "warning", "error", "critical")
# Finding codes, one per kind of problem (a playbook's env_audit.ignore names them).
CODES = (
    "torch-missing", "torch-cpu-build", "missing-requirement", "requirement-version", "triton-version",
    "cuda-major", "duplicate-library", "ld-preload", "user-site", "pythonpath", "stray-stack",
    "other-framework", "no-venv", "audit-incomplete", "audit-failed",
)
DEFAULT_TIMEOUT = 60.0
# The trainer imports these; they and everything they require are never suggested for removal.
TRAINER_ROOTS = ("torch", "transformers")
# Shared libraries the audit follows: ldconfig is filtered to these (libcuda also
# matches libcudart).
LIB_PREFIXES = ("libcudnn", "libnccl", "libcuda", "libcublas")

# --------------------------------------------------------------------------- the remote script

AUDIT_SOURCE = r'''
import csv, json, os, platform, re, shutil, site, socket, struct, subprocess, sys

LIB_PREFIXES = ("libcudnn", "libnccl", "libcuda", "libcublas")  # as in dflashctl/envaudit.py
LIB_NAME = re.compile(r"^lib(?:cudnn|nccl|cuda|cublas)[A-Za-z0-9_+-]*\.so(?:\.[0-9]+)*$")
SKIP_TOP = re.compile(r"(\.dist-info|\.egg-info|\.data|\.pth|__pycache__|\.\.)$")
errors = []


def canon(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def full_version(info):
    v = "%d.%d.%d" % (info.major, info.minor, info.micro)
    return v + info.releaselevel[0] + str(info.serial) if info.releaselevel != "final" else v


def markers():
    return {
        "implementation_name": sys.implementation.name,
        "implementation_version": full_version(sys.implementation.version),
        "os_name": os.name,
        "platform_machine": platform.machine(),
        "platform_release": platform.release(),
        "platform_system": platform.system(),
        "platform_version": platform.version(),
        "python_full_version": platform.python_version(),
        "platform_python_implementation": platform.python_implementation(),
        "python_version": ".".join(platform.python_version_tuple()[:2]),
        "sys_platform": sys.platform,
    }


def module_name(entry):
    """The importable top-level name a path's first component provides, or None."""
    if SKIP_TOP.search(entry) or entry.startswith("."):
        return None
    if entry.endswith(".py"):
        return entry[:-3]
    if ".so" in entry or entry.endswith(".pyd"):
        return entry.split(".", 1)[0]
    return None if "." in entry else entry


def record(dist):
    """(top-level module names, CUDA-family shared libraries) from RECORD."""
    modules, libs = set(), []
    try:
        text = dist.read_text("RECORD")
    except Exception:
        text = None
    if text is None:
        try:
            top = dist.read_text("top_level.txt") or ""
        except Exception:
            top = ""
        return sorted(t.strip() for t in top.split() if t.strip()), None
    for row in csv.reader(text.splitlines()):
        if not row:
            continue
        path = row[0]
        first, sep, _ = path.partition("/")
        name = module_name(first) if sep or first.endswith(".py") or ".so" in first else None
        if name:
            modules.add(name)
        base = path.rsplit("/", 1)[-1]
        if base.startswith(LIB_PREFIXES) and LIB_NAME.match(base):
            libs.append(path)
    return sorted(modules), sorted(libs)


def distributions():
    import importlib.metadata as md

    out = []
    for dist in md.distributions():
        try:
            name = dist.metadata["Name"]
            if not name:
                continue
            path = getattr(dist, "_path", None)
            modules, libs = record(dist)
            out.append({
                "name": name,
                "version": dist.version,
                "location": str(path.parent) if path is not None else None,
                "requires": list(dist.requires or []),
                "modules": modules,
                "libs": libs,
            })
        except Exception as e:
            errors.append("distribution %r: %s: %s" % (getattr(dist, "_path", "?"), type(e).__name__, e))
    return out


def elf_paths(path):
    """DT_RPATH / DT_RUNPATH of an ELF64 little-endian file, without running anything."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            return None
        shoff, = struct.unpack_from("<Q", head, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", head, 0x3A)
        f.seek(shoff)
        table = f.read(shentsize * shnum)
        sections = [struct.unpack_from("<IIQQQQIIQQ", table, i * shentsize) for i in range(shnum)]
        for s in sections:
            if s[1] != 6:  # SHT_DYNAMIC
                continue
            f.seek(s[4])
            dynamic = f.read(s[5])
            strtab = sections[s[6]]
            f.seek(strtab[4])
            strings = f.read(strtab[5])
            found = {}
            for i in range(0, len(dynamic) - 15, 16):
                tag, value = struct.unpack_from("<qQ", dynamic, i)
                if tag == 0:
                    break
                if tag in (15, 29):
                    end = strings.index(b"\0", value)
                    found["rpath" if tag == 15 else "runpath"] = strings[value:end].decode("utf-8", "replace")
            return found
    return None


def torch_files(dists):
    torch = next((d for d in dists if canon(d["name"]) == "torch"), None)
    if torch is None or not torch["location"]:
        return None
    root = os.path.join(torch["location"], "torch")
    info = {"dir": root, "version_py": None, "elf": None}
    try:
        with open(os.path.join(root, "version.py"), encoding="utf-8") as f:
            info["version_py"] = f.read(8192)
    except OSError as e:
        errors.append("torch/version.py: %s" % e)
    for lib in ("libtorch_cuda.so", "libtorch_global_deps.so"):
        path = os.path.join(root, "lib", lib)
        if os.path.exists(path):
            try:
                info["elf"] = {"file": "torch/lib/" + lib, **(elf_paths(path) or {})}
            except (OSError, ValueError, struct.error) as e:
                errors.append("%s: %s" % (path, e))
            break
    return info


def ldconfig():
    # Often not on a non-root PATH.
    found = [p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.path.exists(p)]
    exe = shutil.which("ldconfig") or (found[0] if found else None)
    if exe is None:
        return {"error": "ldconfig not found"}
    try:
        p = subprocess.run([exe, "-p"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=20,
                           universal_newlines=True)
    except (OSError, subprocess.SubprocessError) as e:
        return {"error": "%s -p: %s" % (exe, e)}
    lines = [l for l in p.stdout.splitlines() if l.strip().startswith(LIB_PREFIXES)]
    out = {"text": "\n".join(lines)}
    if p.returncode != 0:
        out["error"] = "%s -p exited %d: %s" % (exe, p.returncode, p.stderr.strip()[-300:])
    return out


def names_in(directory):
    """Importable top-level names in a directory (a file without a suffix is not one)."""
    try:
        entries = os.listdir(directory)
    except OSError:
        return set()
    names = set()
    for entry in entries:
        name = module_name(entry)
        if name and (entry != name or os.path.isdir(os.path.join(directory, entry))):
            names.add(name)
    return names


def path_entries(var):
    return [p for p in os.environ.get(var, "").split(os.pathsep) if p]


def pythonpath():
    entries = path_entries("PYTHONPATH")
    mine = {os.path.abspath(p) for p in entries}
    others = set()
    for p in sys.path:
        if p and os.path.abspath(p) not in mine:
            others |= names_in(p)
    others |= set(sys.builtin_module_names)
    out = []
    for p in entries:
        names = names_in(p)
        out.append({"path": p, "exists": os.path.isdir(p), "names": sorted(names)[:200],
                    "shadows": sorted(names & others)})
    return out


def ld_library_path():
    out = []
    for p in path_entries("LD_LIBRARY_PATH"):
        try:
            libs = sorted(e for e in os.listdir(p) if e.startswith(LIB_PREFIXES) and LIB_NAME.match(e))
        except OSError:
            libs = None
        out.append({"path": p, "libs": libs})
    return out


snapshot = {"v": 1, "errors": errors}
for key, fn in (
    ("hostname", socket.gethostname),
    ("python", lambda: {
        "executable": sys.executable, "version": platform.python_version(), "prefix": sys.prefix,
        "base_prefix": getattr(sys, "base_prefix", sys.prefix), "path": list(sys.path),
        "user_site": site.getusersitepackages(), "user_site_enabled": bool(site.ENABLE_USER_SITE)}),
    ("markers", markers),
    ("distributions", distributions),
    ("ldconfig", ldconfig),
    ("pythonpath", pythonpath),
    ("ld_library_path", ld_library_path),
    ("env", lambda: {k: os.environ[k] for k in ("PYTHONPATH", "LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONNOUSERSITE")
                     if k in os.environ}),
):
    try:
        snapshot[key] = fn()
    except Exception as e:
        errors.append("%s: %s: %s" % (key, type(e).__name__, e))
try:
    snapshot["torch"] = torch_files(snapshot.get("distributions") or [])
except Exception as e:
    errors.append("torch: %s: %s" % (type(e).__name__, e))
print(json.dumps(snapshot))
'''

# --------------------------------------------------------------------------- the snapshot


def canon(name: str) -> str:
    """A distribution name the way pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class Dist:
    """One installed distribution. ``requires`` / ``libs`` are None when unknown
    (a capture that has names and versions only)."""

    name: str
    version: str
    location: str | None = None
    requires: list[str] | None = None
    modules: list[str] = field(default_factory=list)
    libs: list[str] | None = None  # paths (relative to location) of CUDA-family .so files it ships

    @property
    def key(self) -> str:
        return canon(self.name)

    def label(self) -> str:
        return f"{self.name} {self.version}"


@dataclass
class LibEntry:
    """One ``ldconfig -p`` line: a soname and the file the dynamic loader's cache maps it to."""

    soname: str
    path: str

    @property
    def directory(self) -> str:
        return self.path.rsplit("/", 1)[0] if "/" in self.path else ""


@dataclass
class PathEntry:
    """One PYTHONPATH entry: what it holds and which of those names it shadows."""

    path: str
    exists: bool = True
    names: list[str] = field(default_factory=list)
    shadows: list[str] = field(default_factory=list)


@dataclass
class Snapshot:
    host: str
    hostname: str | None = None
    python: str | None = None  # the executable
    python_version: str | None = None
    prefix: str | None = None
    base_prefix: str | None = None
    sys_path: list[str] = field(default_factory=list)
    user_site: str | None = None
    user_site_enabled: bool = False
    markers: dict[str, str] = field(default_factory=dict)
    dists: list[Dist] = field(default_factory=list)  # in sys.path order: the first of a name is imported
    torch_version_py: str | None = None
    torch_elf: dict[str, str] | None = None  # {"file", "runpath" and/or "rpath"}
    ldconfig: list[LibEntry] = field(default_factory=list)
    ldconfig_error: str | None = None
    ld_library_path: list[str] = field(default_factory=list)
    # LD_LIBRARY_PATH directory -> the CUDA-family files in it (None: unreadable, or a capture)
    ld_library_libs: dict[str, list[str] | None] = field(default_factory=dict)
    ld_preload: list[str] = field(default_factory=list)
    pythonpath: list[PathEntry] = field(default_factory=list)
    env_sources: dict[str, str] = field(default_factory=dict)  # variable -> where it was set
    errors: list[str] = field(default_factory=list)

    def installed(self) -> dict[str, Dist]:
        """The distribution Python imports for each name: the first on sys.path."""
        found: dict[str, Dist] = {}
        for d in self.dists:
            found.setdefault(d.key, d)
        return found

    def packages(self) -> dict[str, str]:
        """name -> version of what is imported: the package set stored for drift checks."""
        return {d.name: d.version for d in self.installed().values()}


def parse_snapshot(stdout: str, host: str) -> Snapshot:
    """The audit script's JSON -> Snapshot. Raises ValueError when it is not the script's output."""
    text = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    raw = json.loads(text)
    if not isinstance(raw, dict) or raw.get("v") != 1:
        raise ValueError("not an env-audit answer")
    py = raw.get("python") or {}
    torch = raw.get("torch") or {}
    ldconfig = raw.get("ldconfig") or {}
    env = raw.get("env") or {}
    ld_dirs = raw.get("ld_library_path") or []
    return Snapshot(
        host=host,
        hostname=raw.get("hostname"),
        python=py.get("executable"),
        python_version=py.get("version"),
        prefix=py.get("prefix"),
        base_prefix=py.get("base_prefix"),
        sys_path=list(py.get("path") or []),
        user_site=py.get("user_site"),
        user_site_enabled=bool(py.get("user_site_enabled")),
        markers=dict(raw.get("markers") or {}),
        dists=[
            Dist(d["name"], d["version"], d.get("location"), d.get("requires"), d.get("modules") or [], d.get("libs"))
            for d in raw.get("distributions") or []
        ],
        torch_version_py=torch.get("version_py"),
        torch_elf=torch.get("elf"),
        ldconfig=parse_ldconfig(ldconfig.get("text") or ""),
        ldconfig_error=ldconfig.get("error"),
        ld_library_path=[e["path"] for e in ld_dirs],
        ld_library_libs={e["path"]: e.get("libs") for e in ld_dirs},
        ld_preload=[p for p in re.split(r"[:\s]+", env.get("LD_PRELOAD", "")) if p],
        pythonpath=[PathEntry(**e) for e in raw.get("pythonpath") or []],
        errors=list(raw.get("errors") or []),
    )


# --------------------------------------------------------------------------- captures (pure parsers)

_FREEZE_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(?:==\s*(\S+)|@\s*(\S+))")
_LDCONFIG_LINE = re.compile(r"^\s*(\S+)\s+\(([^)]*)\)\s+=>\s+(\S+)\s*$")


def parse_pip_freeze(text: str) -> list[tuple[str, str]]:
    """``pip freeze`` -> [(name, version)]; ``name @ url`` lines get version '' (unknown)."""
    found = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "-")):
            continue
        m = _FREEZE_LINE.match(line)
        if m:
            found.append((m.group(1), m.group(2) or ""))
    return found


def parse_pip_list_json(text: str) -> list[tuple[str, str]]:
    """``pip list --format=json`` -> [(name, version)]."""
    return [(d["name"], d["version"]) for d in json.loads(text)]


def parse_python_paths(text: str) -> tuple[str, list[str], str | None]:
    """Three lines: ``sys.prefix``, ``repr(sys.path)``, ``site.getusersitepackages()``."""
    import ast

    lines = [l for l in text.splitlines() if l.strip()]
    if len(lines) < 2:
        raise ValueError("expected sys.prefix, sys.path and the user site on three lines")
    path = ast.literal_eval(lines[1].strip())
    return lines[0].strip(), [str(p) for p in path], (lines[2].strip() if len(lines) > 2 else None)


def parse_ldconfig(text: str) -> list[LibEntry]:
    """``ldconfig -p`` lines -> entries, in cache order (the first of a soname is the one found)."""
    entries = []
    for line in text.splitlines():
        m = _LDCONFIG_LINE.match(line)
        if m:
            entries.append(LibEntry(m.group(1), m.group(3)))
    return entries


def parse_libs_capture(text: str) -> tuple[list[LibEntry], list[str]]:
    """The libs capture: filtered ``ldconfig -p`` lines, then ``LD_LIBRARY_PATH=...``."""
    ld_path: list[str] = []
    for line in text.splitlines():
        if line.startswith("LD_LIBRARY_PATH="):
            ld_path = [p for p in line.split("=", 1)[1].strip().split(":") if p]
    return parse_ldconfig(text), ld_path


def snapshot_from_captures(
    packages: list[tuple[str, str]],
    python_paths: str,
    libs: str,
    *,
    host: str = "capture",
    requires: dict[str, list[str]] | None = None,
    torch_version_py: str | None = None,
    markers: dict[str, str] | None = None,
) -> Snapshot:
    """A Snapshot from captured command output (``pip freeze``, the python paths,
    ``ldconfig -p`` + LD_LIBRARY_PATH). Captures do not say where each package lives
    (the environment's site-packages is assumed) nor what it requires (``requires``
    supplies that, by name)."""
    prefix, sys_path, user_site = parse_python_paths(python_paths)
    site_dir = next((p for p in reversed(sys_path) if p.startswith(prefix) and p.endswith("site-packages")), prefix)
    wanted = {canon(k): v for k, v in (requires or {}).items()}
    entries, ld_path = parse_libs_capture(libs)
    return Snapshot(
        host=host,
        prefix=prefix,
        sys_path=sys_path,
        user_site=user_site,
        user_site_enabled=bool(user_site and user_site in sys_path),
        markers=dict(markers or {}),
        dists=[Dist(n, v, site_dir, wanted.get(canon(n))) for n, v in packages],
        torch_version_py=torch_version_py,
        ldconfig=entries,
        ld_library_path=ld_path,
    )


# --------------------------------------------------------------------------- knowledge


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
_VERSIONED_SONAME = re.compile(r"\.so\.\d+(?:\.\d+)*$")


def _release(version: str) -> tuple[int, ...] | None:
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
    release = _release(dist.version)
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


def _same_soname(a: Dist, b: Dist) -> bool:
    """Two NVIDIA wheels shipping the same soname: one library, and its major version agrees."""
    if component(a) is None or component(a) != component(b):
        return False
    ra, rb = _release(a.version), _release(b.version)
    return bool(ra and rb and ra[0] == rb[0])


@dataclass
class TorchBuild:
    version: str
    cuda: str | None  # "13.0"; None: a CPU (or ROCm) build, or unknown
    source: str  # where ``cuda`` was read

    @property
    def cuda_major(self) -> int | None:
        return int(self.cuda.split(".")[0]) if self.cuda else None

    @property
    def label(self) -> str:
        return f"torch {self.version} ({f'CUDA {self.cuda}' if self.cuda else 'no CUDA'})"


_VERSION_PY_CUDA = re.compile(r"""^cuda\b[^=\n]*=\s*(?:'([^']*)'|"([^"]*)"|(None))""", re.M)


def torch_build(snapshot: Snapshot) -> TorchBuild | None:
    """torch's version and the CUDA it was built for: torch/version.py's ``cuda``,
    else the +cuNNN of its version, else the CUDA major of the wheels it requires
    (a PyPI torch has no local label)."""
    torch = snapshot.installed().get("torch")
    if torch is None:
        return None
    m = _VERSION_PY_CUDA.search(snapshot.torch_version_py or "")
    if m:
        return TorchBuild(torch.version, m.group(1) or m.group(2) or None, "torch/version.py")
    m = _LOCAL_CUDA.search(torch.version)
    if m:
        return TorchBuild(torch.version, f"{m.group(1)[:-1]}.{m.group(1)[-1]}", "its version")
    if torch.version.endswith("+cpu"):
        return TorchBuild(torch.version, None, "its version")
    majors = {cuda_major(Dist(r.name, _pinned(r) or "")) for r in _parsed(torch.requires or [])}
    majors.discard(None)
    if len(majors) == 1:
        return TorchBuild(torch.version, str(majors.pop()), "the CUDA wheels it requires")
    return TorchBuild(torch.version, None, "unknown (no torch/version.py, no +cu label)")


def _parsed(requirements: Iterable[str]) -> list[Requirement]:
    out = []
    for text in requirements:
        try:
            out.append(Requirement(text))
        except InvalidRequirement:
            continue
    return out


def _pinned(req: Requirement) -> str | None:
    """The version of an ``==X`` requirement (``==X.*`` -> X), else None."""
    for spec in req.specifier:
        if spec.operator in ("==", "==="):
            return spec.version.removesuffix(".*")
    return None


# --------------------------------------------------------------------------- requirements


@dataclass
class ReqCheck:
    """One requirement of the trainer's stack, checked against what is installed."""

    chain: str  # "torch -> cuda-toolkit[cublas]"
    requirement: Requirement
    installed: Dist | None

    @property
    def satisfied(self) -> bool:
        if self.installed is None:
            return False
        if not self.requirement.specifier:
            return True
        try:
            return self.requirement.specifier.contains(Version(self.installed.version), prereleases=True)
        except InvalidVersion:
            return False

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
    queue = [(installed[canon(r)], frozenset(), canon(r)) for r in roots if canon(r) in installed]
    seen: set[tuple[str, frozenset]] = set()
    while queue:
        dist, extras, chain = queue.pop(0)
        if (dist.key, extras) in seen:
            continue
        seen.add((dist.key, extras))
        for req in _parsed(dist.requires or []):
            if not _applies(req, snapshot.markers, extras):
                continue
            target = installed.get(canon(req.name))
            checks.append(ReqCheck(chain, req, target))
            if target is not None:
                wanted = frozenset(canon(e) for e in req.extras)
                label = req.name + (f"[{','.join(sorted(req.extras))}]" if req.extras else "")
                queue.append((target, wanted, f"{chain} -> {label}"))
    return checks


def protected(snapshot: Snapshot, checks: list[ReqCheck] | None = None) -> set[str]:
    """Names (canonical) of the trainer's roots and everything they require:
    never suggested for removal."""
    checks = requirement_checks(snapshot) if checks is None else checks
    return {canon(r) for r in TRAINER_ROOTS} | {canon(c.requirement.name) for c in checks}


def required_by(snapshot: Snapshot, name: str) -> list[str]:
    """Installed distributions that list ``name`` among their requirements (any marker)."""
    key = canon(name)
    return sorted(
        d.name for d in snapshot.installed().values() if any(canon(r.name) == key for r in _parsed(d.requires or []))
    )


# --------------------------------------------------------------------------- findings


@dataclass
class Finding:
    severity: str  # info | warning | error
    code: str  # the rule: stray-stack, cuda-major, duplicate-library, ...
    message: str
    fix: str | None = None
    packages: list[str] = field(default_factory=list)
    remove: list[str] = field(default_factory=list)  # what the fix uninstalls (never a protected package)
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def severity_rank(severity: str) -> int:
    return SEVERITIES.index(severity)


def exit_code(findings: Iterable[Finding]) -> int:
    """0 clean (info at most), 1 warnings, 2 errors."""
    worst = max((severity_rank(f.severity) for f in findings), default=0)
    return 2 if worst >= severity_rank("error") else 1 if worst >= severity_rank("warning") else 0


@dataclass
class Policy:
    """The playbook's ``env_audit:`` section."""

    allow: list[str] = field(default_factory=list)  # packages not reported as stray stacks or frameworks
    ignore: list[str] = field(default_factory=list)  # finding codes to leave out

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None, source: str | None = None) -> "Policy":
        raw = raw or {}
        problems = []
        for key, value in raw.items():
            if key not in ("allow", "ignore"):
                problems.append(f"env_audit.{key}: unknown key{did_you_mean(key, ['allow', 'ignore'])}")
            elif not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                problems.append(f"env_audit.{key}: expected a list of names")
        for i, code in enumerate(raw.get("ignore") or []):
            if isinstance(code, str) and code not in CODES:
                problems.append(f"env_audit.ignore[{i}]: unknown finding '{code}'{did_you_mean(code, CODES)}")
        if problems:
            raise ConfigError(problems, source=source)
        return cls(list(raw.get("allow") or []), list(raw.get("ignore") or []))


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
        self.allowed = {canon(a) for a in policy.allow}

    def removal(self, names: Iterable[str]) -> tuple[list[str], list[str]]:
        """(names a fix may uninstall, names it must keep: torch or the trainer requires them)."""
        ok, kept = [], []
        for n in names:
            (kept if canon(n) in self.protected else ok).append(n)
        return ok, kept

    def torch_requirement(self, name: str) -> ReqCheck | None:
        return next((c for c in self.checks if canon(c.requirement.name) == canon(name)), None)


def _uninstall(names: list[str]) -> str:
    return "pip uninstall -y " + " ".join(names)


def _install(specs: list[str]) -> str:
    return "pip install " + " ".join(shlex.quote(s) for s in specs)


def _listing(items: list[str], shown: int = 6) -> str:
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


# --------------------------------------------------------------------------- rules


def _rule_torch(c: _Context) -> list[Finding]:
    s = c.s
    if c.torch is None:
        where = f"{s.python or 'the host python'} ({s.prefix or '?'})"
        return [Finding("error", "torch-missing", f"torch is not installed for {where}: the trainer cannot start",
                        fix="install torch into that environment, or point the inventory's python: at the "
                            "interpreter of the environment that has it")]
    fix = ("install a CUDA build of torch (pip install torch from the CUDA index matching the driver), "
           "or set trainer.placement.device: cpu")
    if c.torch.cuda is None and c.device == "cuda":
        # A warning, not an error: the trainer refuses this itself at start, with a
        # configuration error (exit 2) that the supervisor does not retry.
        return [Finding("warning", "torch-cpu-build",
                        f"{c.torch.label} is not a CUDA build (read from {c.torch.source}), but the playbook "
                        "says trainer.placement.device: cuda: the trainer will refuse to start",
                        fix=fix, packages=["torch"])]
    if c.torch.cuda is None and c.device == "auto" and c.host_gpus:
        return [Finding("warning", "torch-cpu-build",
                        f"{c.torch.label} is not a CUDA build (read from {c.torch.source}): with "
                        f"trainer.placement.device: auto the trainer runs on the CPU of a host with {c.host_gpus} GPUs",
                        fix=fix, packages=["torch"])]
    if c.torch.cuda is None:
        return [Finding("info", "torch-cpu-build", f"{c.torch.label}: a CPU build (read from {c.torch.source})",
                        packages=["torch"])]
    return []


def _rule_requirements(c: _Context) -> list[Finding]:
    """Missing requirements of torch / the trainer, and versions they do not accept:
    one finding per package and version range, naming every requirer."""
    failing: dict[tuple[str, str], list[ReqCheck]] = {}
    for check in c.checks:
        name = canon(check.requirement.name)
        if not check.satisfied and name not in TRITON_NAMES:  # triton has a rule of its own
            failing.setdefault((name, str(check.requirement.specifier)), []).append(check)
    findings = []
    for group in failing.values():
        check, name = group[0], group[0].requirement.name
        also = f" (also required by {', '.join(g.chain for g in group[1:])})" if group[1:] else ""
        detail = {"chains": [g.chain for g in group], "requirement": check.spec}
        if check.installed is None:
            findings.append(Finding(
                "error", "missing-requirement", f"{check.chain} requires {check.spec}, which is not installed{also}",
                fix=_install([check.spec]), packages=[name], detail=detail))
            continue
        # A binary wheel pinned by torch (CUDA libraries) at another version breaks
        # at load time; a pure-Python one usually just works, so it is a warning.
        binary = canon(name).startswith(("nvidia-", "cuda-"))
        findings.append(Finding(
            "error" if binary else "warning", "requirement-version",
            f"{check.chain} requires {check.spec}; {check.installed.label()} is installed{also}",
            fix=_install([check.spec]), packages=[name], detail={**detail, "installed": check.installed.version}))
    return findings


TRITON_NAMES = ("triton", "pytorch-triton")


def _rule_triton(c: _Context) -> list[Finding]:
    """torch.compile generates Triton kernels with the Triton torch was released with;
    another version fails to compile or falls back to slow paths."""
    check = next((ch for ch in c.checks if ch.chain == "torch" and canon(ch.requirement.name) in TRITON_NAMES), None)
    findings = []
    if check is not None and not check.satisfied:
        found = f"{check.installed.label()} is installed" if check.installed else "none is installed"
        others = [d.label() for k, d in c.installed.items() if k in TRITON_NAMES and d is not check.installed]
        if others and check.installed is None:
            found = f"{_listing(others)} is installed instead"
        pinners = [n for n in required_by(c.s, check.installed.name) if canon(n) != "torch"] if check.installed else []
        why = f" (also required by {', '.join(pinners)})" if pinners else ""
        findings.append(Finding(
            "error", "triton-version",
            f"torch {c.torch.version} requires {check.spec}; {found}{why}: torch.compile kernels "
            "will fail to build or fall back to slow paths",
            fix=_install([check.spec]), packages=[check.requirement.name],
            detail={"requirement": check.spec, "installed": check.installed.version if check.installed else None}))
    both = [c.installed[k] for k in TRITON_NAMES if k in c.installed]
    if len(both) > 1:
        wanted = canon(check.requirement.name) if check else "triton"
        extra = [d.name for d in both if d.key != wanted]
        ok, _ = c.removal(extra)
        findings.append(Finding(
            "error", "triton-version",
            f"{' and '.join(d.label() for d in both)} are both installed: both provide the `triton` module "
            "and the one found first on sys.path wins",
            fix=(_uninstall(ok) + f" (torch requires {wanted}; reinstall it afterwards: files are shared)")
            if ok else None,
            packages=[d.name for d in both], remove=ok))
    return findings


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
        twin = next((t for t in twins if t is not d and _same_soname(d, t) and cuda_major(t) == torch_major), None)
        (conflicts if twin else strays).append((d, major, twin))
    findings = []
    for d, major, twin in conflicts:
        ok, kept = c.removal([d.name])
        users = required_by(c.s, d.name)
        findings.append(Finding(
            "error", "cuda-major",
            f"{d.label()} is built for CUDA {major} but torch for CUDA {c.torch.cuda}; it ships the same "
            f"library as {twin.label()} that torch requires (same soname): whichever a process loads first "
            f"is used everywhere in it" + (f"; required by {', '.join(users)}" if users else ""),
            fix=_cuda_fix(c, [d.name], ok, kept), packages=[d.name], remove=ok,
            detail={"cuda_major": major, "torch_cuda": c.torch.cuda, "same_library_as": twin.name}))
    if strays:
        names = [d.name for d, _, _ in strays]
        ok, kept = c.removal(names)
        listed = []
        for d, m, _ in strays:
            users = required_by(c.s, d.name)
            listed.append(f"{d.label()} (CUDA {m}" + (f", for {', '.join(users)})" if users else ")"))
        findings.append(Finding(
            "warning", "cuda-major",
            f"{len(strays)} wheel(s) built for another CUDA major than torch's CUDA {c.torch.cuda}: {_listing(listed)}",
            fix=_cuda_fix(c, names, ok, kept), packages=names, remove=ok,
            detail={"torch_cuda": c.torch.cuda, "wheels": {d.name: m for d, m, _ in strays}}))
    return findings


def _cuda_fix(c: _Context, names: list[str], ok: list[str], kept: list[str]) -> str:
    parts = []
    if ok:
        parts.append(_uninstall(ok) + " (check first that nothing else you run from this environment needs them)")
    for name in kept:
        check = c.torch_requirement(name)
        spec = check.spec if check else name
        parts.append(f"keep {name} (torch requires it): {_install([spec])}")
    return "; ".join(parts)


def _wheel_sonames(d: Dist, sonames: Iterable[str]) -> dict[str, str]:
    """soname -> where the wheel has it ('' when inferred), for the given sonames."""
    if d.libs is not None:
        have = {p.rsplit("/", 1)[-1]: (f"{d.location}/{p}" if d.location else p) for p in d.libs}
        return {n: have[n] for n in sonames if n in have}
    comp = component(d)
    release = _release(d.version)
    if comp not in WHEEL_SONAMES or not release:
        return {}
    pattern = re.compile(WHEEL_SONAMES[comp].format(major=release[0]) + "$")
    return {n: "" for n in sonames if pattern.match(n)}


def _rule_duplicate_libraries(c: _Context) -> list[Finding]:
    """The same soname from a wheel and from the system's ldconfig cache."""
    system: dict[str, list[LibEntry]] = {}
    for e in c.s.ldconfig:
        if _VERSIONED_SONAME.search(e.soname):
            system.setdefault(e.soname, []).append(e)
    torch_major = c.torch.cuda_major if c.torch else None
    findings = []
    for d in c.installed.values():
        if torch_major is not None and cuda_major(d) not in (None, torch_major):
            continue  # a wheel for another CUDA: the cuda-major rule reports it
        shared = _wheel_sonames(d, system)
        if not shared:
            continue
        names = sorted(shared)
        first = names[0]
        sys_paths = [system[n][0].path for n in names]
        ld_hits = _on_ld_library_path(c.s, names)
        torch_needs = d.key in c.protected
        how = _which_copy(c, d, shared[first], ld_hits)
        severity = "error" if ld_hits and torch_needs else "warning"
        message = (f"{_listing(names, 3)} installed twice: by the wheel {d.label()} and in the system "
                   f"library cache ({_listing(sys_paths, 2)}). {how}")
        if len(names) > 1:
            message += ("; if the two copies' versions differ, a process that ends up with libraries from both "
                        "fails with a version mismatch")
        if torch_needs:
            fix = (f"keep {d.name} (torch requires it). If nothing else on the host needs the system copy, remove "
                   f"the package that owns it (`dpkg -S {sys_paths[0]}` names it); otherwise keep both at the "
                   "same version" + (" and take its directory off LD_LIBRARY_PATH" if ld_hits else ""))
            remove = []
        else:
            remove, _ = c.removal([d.name])
            fix = (_uninstall(remove) + " if nothing you run needs the wheel's copy") if remove else None
        findings.append(Finding(severity, "duplicate-library", message, fix=fix, packages=[d.name], remove=remove,
                                detail={"sonames": names, "system": sys_paths, "wheel": d.name,
                                        "ld_library_path": ld_hits}))
    for soname, entries in system.items():
        paths = list(dict.fromkeys(e.path for e in entries))
        if len(paths) > 1:
            on_ld = [p for p in paths if _dir(p) in c.s.ld_library_path]
            loaded = on_ld[0] if on_ld else paths[0]
            why = "it is on LD_LIBRARY_PATH" if on_ld else "it comes first in the cache"
            findings.append(Finding(
                "info", "duplicate-library",
                f"{soname} is in the system library cache {len(paths)} times ({', '.join(paths)}); {loaded} "
                f"is the one loaded ({why}). Copies of different versions mean one of them does not match "
                "the installed driver or toolkit",
                detail={"sonames": [soname], "system": paths}))
    return findings


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


def _which_copy(c: _Context, d: Dist, wheel_path: str, ld_hits: list[str]) -> str:
    """Which copy torch loads, in the dynamic loader's order: LD_LIBRARY_PATH, then
    the RUNPATH of the library asking, then the ldconfig cache."""
    elf = c.s.torch_elf or {}
    where = f" ({wheel_path})" if wheel_path else ""
    if ld_hits:
        if elf.get("rpath") and not elf.get("runpath"):
            return (f"torch's libraries use RPATH, which wins over LD_LIBRARY_PATH: torch loads the wheel's "
                    f"copy{where}; other programs get {ld_hits[0]}")
        return (f"LD_LIBRARY_PATH holds {ld_hits[0]}, and LD_LIBRARY_PATH is searched before torch's RUNPATH: "
                f"torch loads that copy, not the wheel's{where}")
    if d.key in c.protected:
        via = f"{elf['file']} has RUNPATH {elf['runpath']}" if elf.get("runpath") else \
            "torch's libraries find their NVIDIA wheels through their RUNPATH"
        return (f"torch loads the wheel's copy{where} ({via}, searched before the cache); anything that loads "
                "the library by name without that RUNPATH gets the system copy, and whichever a process loads "
                "first is used everywhere in it")
    return "torch does not require this wheel; a process gets whichever copy it loads first"


def _rule_ld_preload(c: _Context) -> list[Finding]:
    libs = [p for p in c.s.ld_preload if p.rsplit("/", 1)[-1].startswith(LIB_PREFIXES)]
    if not libs:
        return []
    return [Finding("warning", "ld-preload",
                    f"LD_PRELOAD forces {', '.join(libs)} into every process, ahead of the copies torch requires"
                    + _source(c, "LD_PRELOAD"),
                    fix="unset LD_PRELOAD for the trainer", detail={"ld_preload": libs})]


def _source(c: _Context, variable: str) -> str:
    where = c.s.env_sources.get(variable)
    return f" (set by {where})" if where else ""


def _rule_user_site(c: _Context) -> list[Finding]:
    """User site-packages (~/.local) come before the environment's site-packages."""
    s = c.s
    if not (s.user_site and s.user_site_enabled and s.user_site in s.sys_path):
        return []
    at_user = [d for d in s.dists if d.location == s.user_site]
    if not at_user:
        return []
    elsewhere = {d.key for d in s.dists if d.location != s.user_site}
    shadowing = [d for d in at_user if d.key in elsewhere]
    fix = (f"set PYTHONNOUSERSITE=1 for the trainer (the inventory's env: for host {s.host}), or move "
           f"{s.user_site} aside; do not pip uninstall them (that removes whichever copy is found first)")
    findings = []
    if shadowing:
        bad = [d for d in shadowing if d.key in c.protected]
        findings.append(Finding(
            "error" if bad else "warning", "user-site",
            f"user site-packages {s.user_site} shadows the environment's "
            f"{_listing([d.label() for d in shadowing])}: Python imports the user copy first",
            fix=fix, packages=[d.name for d in shadowing]))
    rest = [d for d in at_user if d.key not in elsewhere]
    if rest:
        findings.append(Finding(
            "info", "user-site",
            f"{len(rest)} package(s) from user site-packages {s.user_site} are importable by the trainer: "
            f"{_listing([d.label() for d in rest])}",
            fix=fix, packages=[d.name for d in rest]))
    return findings


def _rule_pythonpath(c: _Context) -> list[Finding]:
    findings = []
    by_module: dict[str, str] = {}
    for d in c.installed.values():
        for m in d.modules:
            by_module.setdefault(m, d.key)
    for entry in c.s.pythonpath:
        where = _source(c, "PYTHONPATH")
        if not entry.exists:
            findings.append(Finding("info", "pythonpath", f"PYTHONPATH entry {entry.path} does not exist{where}"))
            continue
        if entry.shadows:
            vital = [m for m in entry.shadows if by_module.get(m) in c.protected]
            findings.append(Finding(
                "error" if vital else "warning", "pythonpath",
                f"PYTHONPATH entry {entry.path}{where} shadows {_listing(entry.shadows)}: the trainer imports "
                "those from there instead of from its environment",
                fix="remove it from PYTHONPATH for the trainer", packages=entry.shadows,
                detail={"path": entry.path, "shadows": entry.shadows}))
        elif entry.names:
            findings.append(Finding(
                "warning", "pythonpath",
                f"PYTHONPATH adds {entry.path}{where} to the trainer's imports ({_listing(entry.names)}), "
                "outside what pip manages",
                fix="remove it from PYTHONPATH for the trainer unless the trainer needs it",
                detail={"path": entry.path, "names": entry.names}))
    return findings


def _rule_stray_stacks(c: _Context) -> list[Finding]:
    strays = [d for k, d in c.installed.items() if k in STRAY_STACKS and k not in c.allowed]
    findings = []
    if strays:
        ok, kept = c.removal([d.name for d in strays])
        stacks = sorted({STRAY_STACKS[d.key] for d in strays})
        fix = (_uninstall(ok) + ", or give the trainer an environment of its own (the inventory's python:)") if ok \
            else "give the trainer an environment of its own (the inventory's python:)"
        if kept:
            fix += f"; keep {', '.join(kept)} (torch or the trainer requires them)"
        findings.append(Finding(
            "warning", "stray-stack",
            f"{', '.join(stacks)} installed beside the trainer ({_listing([d.label() for d in strays])}): "
            "these stacks pin their own torch, triton and CUDA wheels",
            fix=fix, packages=[d.name for d in strays], remove=ok))
    others = [d for k, d in c.installed.items() if OTHER_FRAMEWORKS.match(k) and k not in c.allowed]
    if others:
        findings.append(Finding(
            "info", "other-framework",
            f"other GPU frameworks in the trainer's environment: {_listing([d.label() for d in others])}; "
            "harmless unless imported with the trainer (they load their own CUDA libraries)",
            packages=[d.name for d in others]))
    return findings


def _rule_environment(c: _Context) -> list[Finding]:
    s = c.s
    findings = []
    if s.prefix and s.base_prefix and s.prefix == s.base_prefix:
        findings.append(Finding(
            "info", "no-venv",
            f"the trainer's python ({s.python}) is not in a virtual environment: packages installed for "
            "anything else on the host land beside the trainer's",
            fix="create a venv for the trainer and point the inventory's python: at it"))
    for line in ([f"ldconfig: {s.ldconfig_error}"] if s.ldconfig_error else []) + s.errors:
        findings.append(Finding("info", "audit-incomplete", f"could not read everything: {line}"))
    return findings


RULES = (
    _rule_torch,
    _rule_requirements,
    _rule_triton,
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
    trainer.placement.device (a CPU-only torch is an error for 'cuda'); ``host_gpus``:
    the inventory's GPU count."""
    policy = policy or Policy()
    context = _Context(snapshot, device, host_gpus, policy)
    findings: list[Finding] = []
    for rule in RULES:
        findings += rule(context)
    findings = [f for f in findings if f.code not in policy.ignore]
    return sorted(findings, key=lambda f: -severity_rank(f.severity))


# --------------------------------------------------------------------------- on a host


@dataclass
class AuditReport:
    target: str  # what was asked for: a playbook or a host name
    host: str
    playbook: str | None
    snapshot: Snapshot
    findings: list[Finding]
    torch: TorchBuild | None
    seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        return exit_code(self.findings)

    def counts(self) -> dict[str, int]:
        return {s: sum(f.severity == s for f in self.findings) for s in ("error", "warning", "info")}

    def to_dict(self) -> dict[str, Any]:
        s = self.snapshot
        return {
            "target": self.target,
            "host": self.host,
            "playbook": self.playbook,
            "hostname": s.hostname,
            "python": {"executable": s.python, "version": s.python_version, "prefix": s.prefix,
                       "user_site": s.user_site, "user_site_enabled": s.user_site_enabled},
            "torch": asdict(self.torch) if self.torch else None,
            "exit_code": self.exit_code,
            "counts": self.counts(),
            "findings": [f.to_dict() for f in self.findings],
            "packages": s.packages(),
            "libraries": [asdict(e) for e in s.ldconfig],
            "seconds": round(self.seconds, 3),
        }


def audit_command(host: "Host") -> list[str]:
    """argv running the audit with the python that runs the trainer (split as launch splits it)."""
    return [*shlex.split(host.python), "-c", AUDIT_SOURCE]


def collect(transport: "Transport", env: dict[str, str] | None = None, timeout: float = DEFAULT_TIMEOUT) -> Snapshot:
    """The one round trip: run the audit script on the host, parse its answer."""
    argv = audit_command(transport.host)
    result = transport.run(argv, env=env, timeout=timeout, check=False)
    try:
        return parse_snapshot(result.stdout, transport.host.name)
    except (ValueError, KeyError, TypeError):
        raise TransportError(
            transport.host.name, f"{argv[0]} -c <env-audit script>",
            "the env-audit script gave no answer"
            + (" (is python: right in the inventory?)" if result.exit_code else ""),
            exit_code=result.exit_code, stderr_tail=result.stderr[-2000:],
            hint=f"check that {transport.host.python} runs on {transport.host.name}",
        ) from None


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
) -> AuditReport:
    """Collect a host's snapshot (with the playbook's environment, when given) and audit it."""
    from dflashctl.transport import connect

    host = inventory.get(host_name)
    started = time.monotonic()
    snapshot = collect(connect(host.name, inventory), env=dict(playbook.env) if playbook else None, timeout=timeout)
    snapshot.env_sources = _env_sources(host, playbook)
    policy = Policy.from_dict(playbook.env_audit, playbook.source) if playbook else Policy()
    device = playbook.trainer.placement.device if playbook else None
    findings = audit(snapshot, device=device, host_gpus=host.gpus, policy=policy)
    return AuditReport(target or host_name, host.name, playbook.name if playbook else None, snapshot, findings,
                       torch_build(snapshot), time.monotonic() - started)


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
                 timeout: float = DEFAULT_TIMEOUT) -> AuditReport:
    host, playbook = resolve_target(name, inventory, playbooks_dir)
    return audit_host(host, inventory, playbook, target=name, timeout=timeout)


def record_snapshot(store: "Store", report: AuditReport, now: float, run_id: str | None = None) -> int:
    """Store the package set (name -> version) for drift checks (``detectors.env_drift``)."""
    return store.add_env_snapshot(report.host, now, report.snapshot.packages(), kind="packages", run_id=run_id)


def preflight(playbook: "Playbook", inventory: "Inventory", store: "Store | None" = None,
              now: float | None = None) -> list[Finding]:
    """The launcher's preflight: the audit of the playbook's host, as findings
    (errors block a launch unless forced). An unreachable host raises (the launch
    cannot go on anyway); a host where the audit script fails is an error finding.
    With a store, the package set is recorded for drift checks."""
    try:
        report = audit_host(playbook.host, inventory, playbook)
    except UnreachableError:
        raise
    except TransportError as e:
        first = first_line(e)
        return [Finding("error", "audit-failed", f"cannot audit {playbook.host}: {first}",
                        fix=e.hint or "run `dflashctl env-audit` for details", detail={"stderr": e.stderr_tail})]
    if store is not None:
        record_snapshot(store, report, time.time() if now is None else now)
    return report.findings
