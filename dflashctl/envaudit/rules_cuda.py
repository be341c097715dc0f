"""CUDA rules: wheels for another CUDA major, and shared libraries installed twice.

``cuda-major``: a wheel built for another CUDA major than torch's.
``duplicate-library``: the same shared library from a wheel and from the system
(or twice in the system's cache), compared by version and by which copy torch loads.
"""

from __future__ import annotations

import re

from dflashctl.envaudit.context import _Context
from dflashctl.envaudit.findings import Finding
from dflashctl.envaudit.fixes import listing
from dflashctl.envaudit.snapshot import Dist, LibEntry, Snapshot
from dflashctl.envaudit.stack import cuda_major, release_of, required_by, same_soname, wheel_sonames

# A soname with its version (libcudnn.so.9): the name a library is loaded by, the
# unversioned link (libcudnn.so) being for builds.
_VERSIONED_SONAME = re.compile(r"\.so\.\d+(?:\.\d+)*$")
_FILE_VERSION = re.compile(r"\.so\.(\d+(?:\.\d+)*)$")


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
