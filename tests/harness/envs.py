"""Python environments built here for env-audit: real venvs whose site-packages hold
distributions written as an installer writes them (files, and a dist-info with
METADATA, INSTALLER and a RECORD of hashes and sizes; ``write_dist``), wheels of
tiny projects for a real pip to install offline (``write_wheel``, ``pip``,
``OFFLINE``), a fake torch whose loader really fails on a missing or foreign cuDNN
(``torch_files``, ``cudnn_files``), a healthy trainer environment (``healthy``)
and a venv with pip made once per module (the ``fresh_venv`` fixture)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from dflashctl import envaudit as ea
from dflashctl.config import load_inventory

PY = f"python{sys.version_info.major}.{sys.version_info.minor}"
TORCH_VERSION = "2.7.0+cu126"
CUDNN12 = ("nvidia-cudnn-cu12", "9.1.0.70")
CUDNN13 = ("nvidia-cudnn-cu13", "9.13.0.50")
TORCH_REQUIRES = [f"{CUDNN12[0]}=={CUDNN12[1]}; platform_system == \"Linux\"", "sympy>=1.13.3"]

# The fake torch loads "its" cuDNN the way torch's libraries do (found next to it
# through nvidia/cudnn/lib), and refuses a cuDNN built for another CUDA, as the real
# one fails on a mismatched libcudnn.
TORCH_INIT = '''import os
from torch import version
__version__ = version.__version__
_lib = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nvidia", "cudnn", "lib", "libcudnn.so.9")
if not os.path.exists(_lib):
    raise OSError("libcudnn.so.9: cannot open shared object file: No such file or directory")
with open(_lib, "rb") as _f:
    _build = _f.read(64)
if not _build.startswith(b"cudnn-cu12"):
    raise RuntimeError("cuDNN version incompatibility: libcudnn.so.9 is %r, torch was built with cudnn-cu12" % _build)
'''


# --------------------------------------------------------------------------- building distributions


def elf_library(runpath: str, needed: list[str]) -> bytes:
    """The smallest ELF64 little-endian shared object with DT_NEEDED entries and a
    DT_RUNPATH: a header and three section headers (null, .dynstr, .dynamic),
    which is all the collector reads."""
    strings = b"\0"
    offsets = []
    for text in [runpath, *needed]:
        offsets.append(len(strings))
        strings += text.encode() + b"\0"
    dynamic = b"".join(struct.pack("<qQ", 1, at) for at in offsets[1:])  # DT_NEEDED
    dynamic += struct.pack("<qQ", 29, offsets[0]) + struct.pack("<qQ", 0, 0)  # DT_RUNPATH, DT_NULL
    strings_at, dynamic_at = 64, 64 + len(strings)
    sections_at = dynamic_at + len(dynamic)
    header = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9) + struct.pack(
        "<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, sections_at, 0, 64, 0, 0, 64, 3, 0)

    def section(kind: int, offset: int, size: int, link: int) -> bytes:
        return struct.pack("<IIQQQQIIQQ", 0, kind, 0, 0, offset, size, link, 0, 0, 0)

    return header + strings + dynamic + section(0, 0, 0, 0) + section(3, strings_at, len(strings), 0) + \
        section(6, dynamic_at, len(dynamic), 1)


# --------------------------------------------------------------------------- real shared objects

# A cuDNN that says which CUDA it was built for, and a libtorch_cuda.so that needs
# it (DT_NEEDED libcudnn.so.9, found through its RUNPATH as torch's wheels find
# theirs): the fake torch below dlopens that library for real, so the dynamic
# loader, not a Python check, decides whether `import torch` works.
_CUDNN_C = "int cudnn_cuda_major(void) { return CUDA_MAJOR; }\n"
_TORCH_CUDA_C = "extern int cudnn_cuda_major(void);\nint torch_cudnn_major(void) { return cudnn_cuda_major(); }\n"
REAL_TORCH_INIT = '''import ctypes, os
from torch import version
__version__ = version.__version__
_lib = ctypes.CDLL(os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib", "libtorch_cuda.so"))
if _lib.torch_cudnn_major() != 12:
    raise RuntimeError("cuDNN version incompatibility: libcudnn.so.9 was built for CUDA %d, torch for 12"
                       % _lib.torch_cudnn_major())
'''
_BUILT: dict[tuple, bytes] = {}


def _gcc(out: Path, source: str, *args: str) -> None:
    import shutil

    if shutil.which("gcc") is None:
        pytest.skip("no C compiler here to build real shared objects")
    src = out.with_suffix(".c")
    src.write_text(source)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O0", "-o", str(out), str(src), *args], check=True,
                   capture_output=True, timeout=120)


def real_cudnn(cuda: int) -> bytes:
    """libcudnn.so.9 built for real (soname libcudnn.so.9), saying it was built for ``cuda``."""
    key = ("cudnn", cuda)
    if key not in _BUILT:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="so-") as tmp:
            out = Path(tmp) / "libcudnn.so.9"
            _gcc(out, _CUDNN_C, f"-DCUDA_MAJOR={cuda}", "-Wl,-soname,libcudnn.so.9")
            _BUILT[key] = out.read_bytes()
    return _BUILT[key]


def real_torch_cuda() -> bytes:
    """libtorch_cuda.so built for real: DT_NEEDED libcudnn.so.9, RUNPATH $ORIGIN/../../nvidia/cudnn/lib."""
    key = ("torch_cuda",)
    if key not in _BUILT:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="so-") as tmp:
            (Path(tmp) / "libcudnn.so.9").write_bytes(real_cudnn(12))
            out = Path(tmp) / "libtorch_cuda.so"
            _gcc(out, _TORCH_CUDA_C, f"-L{tmp}", "-l:libcudnn.so.9",
                 "-Wl,--enable-new-dtags,-rpath,$ORIGIN/../../nvidia/cudnn/lib")
            _BUILT[key] = out.read_bytes()
    return _BUILT[key]


def real_torch_files(version: str = TORCH_VERSION) -> dict:
    """A torch whose import dlopens its libtorch_cuda.so, which the loader links to libcudnn.so.9."""
    return {"torch/__init__.py": REAL_TORCH_INIT,
            "torch/version.py": f"__version__ = {version!r}\ncuda = '12.6'\n",
            "torch/lib/libtorch_cuda.so": real_torch_cuda()}


def real_cudnn_files(cuda: int, with_library: bool = True) -> dict:
    """A cuDNN wheel's files with a real libcudnn.so.9 (``with_library=False``: a
    wheel whose RECORD does not list the library)."""
    files = {"nvidia/__init__.py": "", "nvidia/cudnn/__init__.py": ""}
    if with_library:
        files["nvidia/cudnn/lib/libcudnn.so.9"] = real_cudnn(cuda)
    return files


def torch_files(version: str = TORCH_VERSION, cuda: str | None = "12.6", needed=("libcudnn.so.9",)) -> dict:
    files = {
        "torch/__init__.py": TORCH_INIT,
        "torch/version.py": f"from typing import Optional\n__version__ = {version!r}\ncuda: Optional[str] = {cuda!r}\n",
    }
    if needed:
        files["torch/lib/libtorch_cuda.so"] = elf_library("$ORIGIN/../../nvidia/cudnn/lib", list(needed))
    return files


def cudnn_files(build: str) -> dict:
    """A cuDNN wheel's files; the cu12 and cu13 builds own the same paths, with other bytes."""
    return {"nvidia/__init__.py": "", "nvidia/cudnn/__init__.py": "",
            "nvidia/cudnn/lib/libcudnn.so.9": f"{build} library bytes".encode() + bytes(64 if "13" in build else 16)}


def _data(content) -> bytes:
    return content if isinstance(content, bytes) else content.encode()


def _record_row(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}\n"


def metadata_text(name: str, version: str, requires) -> str:
    return f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + \
        "".join(f"Requires-Dist: {r}\n" for r in requires)


def dist_info_name(name: str, version: str) -> str:
    return f"{name.replace('-', '_')}-{version}.dist-info"


def write_dist(site: Path, name: str, version: str, files: dict, requires=(), *, metadata: str | None = None) -> Path:
    """A distribution as pip leaves it in ``site``: its files (overwriting what is
    there, as an install does) and its dist-info; the dist-info directory."""
    info = site / dist_info_name(name, version)
    info.mkdir(parents=True, exist_ok=True)
    rows = []
    for rel, content in files.items():
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_data(content))
        rows.append(_record_row(rel, _data(content)))
    meta = metadata_text(name, version, requires) if metadata is None else metadata
    for file, text in (("METADATA", meta), ("INSTALLER", "pip\n"), ("WHEEL", "Wheel-Version: 1.0\n")):
        (info / file).write_text(text)
        rows.append(_record_row(f"{info.name}/{file}", text.encode()))
    (info / "RECORD").write_text("".join(rows) + f"{info.name}/RECORD,,\n")
    return info


def write_wheel(directory: Path, name: str, version: str, files: dict, requires=()) -> Path:
    """A wheel (zip) of a tiny project, as `pip wheel` would build it."""
    info = dist_info_name(name, version)
    path = directory / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    entries = {rel: _data(c) for rel, c in files.items()}
    entries[f"{info}/METADATA"] = metadata_text(name, version, requires).encode()
    entries[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = "".join(_record_row(rel, data) for rel, data in entries.items()) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for rel, data in entries.items():
            z.writestr(rel, data)
        z.writestr(f"{info}/RECORD", record)
    return path


class Venv:
    """A real virtual environment (no pip in it) to fill with distributions."""

    def __init__(self, root: Path, system_site: bool = False, with_pip: bool = False, create: bool = True):
        flags = ([] if with_pip else ["--without-pip"]) + (["--system-site-packages"] if system_site else [])
        if create:
            subprocess.run([sys.executable, "-m", "venv", *flags, str(root)], check=True, capture_output=True,
                           timeout=120)
        self.root = root
        self.python = str(root / "bin" / "python")
        self.site = root / "lib" / PY / "site-packages"

    @classmethod
    def existing(cls, root: Path) -> "Venv":
        """A venv made before (or a copy of one: ``python -m`` runs from wherever it lies)."""
        return cls(root, create=False)

    def inventory(self, tmp: Path, env: dict | None = None, name: str = "box", extra: str = ""):
        path = tmp / f"inventory-{name}.yaml"
        lines = [f"hosts:\n  {name}:\n    transport: local\n    python: {self.python}\n"]
        if env:
            lines.append("    env:\n" + "".join(f"      {k}: {json.dumps(v)}\n" for k, v in env.items()))
        path.write_text("".join(lines) + extra)
        return load_inventory(str(path))

    def audit(self, tmp: Path, env: dict | None = None, **kwargs) -> ea.AuditReport:
        return ea.audit_host("box", self.inventory(tmp, env), **kwargs)

    def imports(self, module: str = "torch") -> subprocess.CompletedProcess:
        return subprocess.run([self.python, "-c", f"import {module}"], capture_output=True, text=True, timeout=60,
                              cwd=self.root)


# What the trainer needs besides torch: transformers (with the Qwen3 classes), safetensors
# and, torch being a CUDA build, Triton. (name, version, files, requires)
TRAINER_STACK = (
    ("transformers", "4.56.2", {"transformers/__init__.py": "__version__ = '4.56.2'\nimport safetensors\n",
                                "transformers/models/__init__.py": "",
                                "transformers/models/qwen3/__init__.py": ""}, ["safetensors>=0.4.3"]),
    ("safetensors", "0.5.3", {"safetensors/__init__.py": ""}, []),
    ("triton", "3.3.1", {"triton/__init__.py": ""}, []),
)


def trainer_stack_wheels(directory: Path) -> None:
    """Wheels of the trainer's other needs (TRAINER_STACK), for a real pip to install."""
    for name, version, files, requires in TRAINER_STACK:
        write_wheel(directory, name, version, files, requires)


def healthy(root: Path, **kwargs) -> Venv:
    """torch (CUDA 12.6) with the cuDNN wheel it pins and the sympy it requires, what
    else the trainer needs (TRAINER_STACK), and a pip (a stand-in: fixes name it,
    these tests never run it)."""
    env = Venv(root, **kwargs)
    write_dist(env.site, "pip", "24.0", {"pip/__init__.py": "", "pip/__main__.py": "", "pip/_internal/__init__.py": "",
                                         "pip/_internal/cli/__init__.py": "", "pip/_internal/cli/main.py": ""})
    write_dist(env.site, "torch", TORCH_VERSION, torch_files(), TORCH_REQUIRES)
    write_dist(env.site, *CUDNN12, cudnn_files("cudnn-cu12"))
    write_dist(env.site, "sympy", "1.14.0", {"sympy/__init__.py": "__version__ = '1.14.0'\n"})
    for name, version, files, requires in TRAINER_STACK:
        write_dist(env.site, name, version, files, requires)
    return env


def pyenv_python(version: str) -> str | None:
    """A pyenv-installed python of that version (``"3.8"``) on this machine, or None."""
    found = sorted(Path(os.path.expanduser("~/.pyenv/versions")).glob(f"{version}.*/bin/python{version}"))
    return str(found[0]) if found else None


def pyenv_venv(root: Path, version: str) -> Venv:
    """A venv (no pip) of the pyenv python of that version (``pyenv_python`` must have found one)."""
    subprocess.run([pyenv_python(version), "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    env = Venv.existing(root)
    env.site = root / "lib" / f"python{version}" / "site-packages"
    return env


def by_code(report: ea.AuditReport) -> dict[str, list[ea.Finding]]:
    found: dict[str, list[ea.Finding]] = {}
    for f in report.findings:
        found.setdefault(f.code, []).append(f)
    return found


def assert_removals_are_safe(report: ea.AuditReport) -> int:
    """Every uninstall among a finding's commands, simulated on the host's RECORDs:
    each protected distribution it deletes files of is reinstalled later in the
    same finding's commands. Returns the number of uninstalls checked."""
    s = report.snapshot
    keep = ea.protected(s)
    checked = 0
    for f in report.findings:
        for i, argv in enumerate(f.argv):
            if "uninstall" not in argv:
                continue
            checked += 1
            names = argv[argv.index("-y") + 1:]
            assert not {n for n in names if n in keep}, f
            gone = {d.index for n in names for d in s.copies(n)[:1]}
            later = [" ".join(a) for a in f.argv[i + 1:]]
            for group in s.shared:
                if not gone & set(group.owners):
                    continue
                for owner in group.owners:
                    d = s.dist(owner)
                    if owner not in gone and d.key in keep:
                        assert any("--force-reinstall" in a and d.spec() in a for a in later), (f, d.spec())
    return checked


# pip reads its options from the environment too: local wheels only, no network at all.
OFFLINE = {"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1", "PIP_NO_CACHE_DIR": "1"}


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory) -> Path:
    """A venv with pip, made once (ensurepip takes seconds); each test works on a copy."""
    root = tmp_path_factory.mktemp("fresh") / "venv"
    Venv(root, with_pip=True)
    return root


def pip(env: Venv, environment: dict, *args: str) -> None:
    done = subprocess.run([env.python, "-m", "pip", *args], env={**os.environ, **environment}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr


# --------------------------------------------------------------------------- editable checkouts

# A PEP 517 backend in the checkout itself (no setuptools, no wheel needed): its
# editable wheel is one .pth that puts the checkout on sys.path, what setuptools'
# "lenient" editable mode writes. pip installs it for real (`pip install -e`) and
# records it as editable (direct_url.json).
_EDITABLE_BACKEND = '''import base64, hashlib, os, zipfile
NAME, VERSION = {name!r}, {version!r}
HERE = os.path.dirname(os.path.abspath(__file__))


def _row(path, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return "%s,sha256=%s,%d\\n" % (path, digest, len(data))


def get_requires_for_build_editable(config_settings=None):
    return []


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    dist = NAME.replace("-", "_")
    info = "%s-%s.dist-info" % (dist, VERSION)
    entries = {{"__editable__.%s-%s.pth" % (dist, VERSION): (HERE + "\\n").encode(),
               info + "/METADATA": ("Metadata-Version: 2.1\\nName: %s\\nVersion: %s\\n" % (NAME, VERSION)).encode(),
               info + "/WHEEL": b"Wheel-Version: 1.0\\nGenerator: tests\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n"}}
    name = "%s-%s-py3-none-any.whl" % (dist, VERSION)
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as z:
        for path, data in entries.items():
            z.writestr(path, data)
        z.writestr(info + "/RECORD", "".join(_row(p, d) for p, d in entries.items()) + info + "/RECORD,,\\n")
    return name
'''


def editable_checkout(root: Path, name: str, version: str, files: dict) -> Path:
    """A source checkout of ``name`` that `pip install -e` installs (``pip(env, OFFLINE,
    "install", "--no-build-isolation", "-e", str(root))``)."""
    root.mkdir(parents=True, exist_ok=True)
    for rel, content in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(_data(content))
    (root / "pyproject.toml").write_text('[build-system]\nrequires = []\nbuild-backend = "editable_backend"\n'
                                         'backend-path = ["."]\n')
    (root / "editable_backend.py").write_text(_EDITABLE_BACKEND.format(name=name, version=version))
    return root
