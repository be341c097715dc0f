"""Env-audit collector: what the trainer's python on a host will actually load,
asked of that python's own import system.

Runs on the host, with the python that runs the trainer and the run's environment,
and prints one JSON snapshot, on a line of its own between the two FRAME markers
(code a .pth file runs, at start or at exit, may print around it):

- every installed distribution, in ``importlib.metadata`` order (sys.path order):
  name, version, location, requirements, top-level modules, the shared libraries
  it ships, and its RECORD checked against the disk (files missing, files whose
  size is not the recorded one);
- files listed by more than one distribution (an uninstall of one deletes them
  for the others), grouped by their owners;
- ``importlib.util.find_spec`` for torch, triton, transformers, the modules named
  in the argument and every top-level module of every distribution: where each
  is imported from, which distribution owns that file, and the sys.path entry it
  was found under (never guessed from dist-info order);
- the imported torch's ``version.py`` text, its CUDA library's RPATH / RUNPATH /
  NEEDED and, for each followed library it needs, the file the dynamic loader
  would pick and why; with ``"deep": true`` also ``import torch``, triton,
  transformers, safetensors and the ``imports`` asked for, one after the other
  in a subprocess (with a timeout): torch's version and CUDA, each import's
  error if it fails and the shared objects it mapped, and whether pip's own code
  imports;
- the files the loader resolves for the shared objects of the trainer's
  distributions and everything they require (``loader_files``), owned by a
  RECORD or not, with every RECORD that lists each;
- a module found by a meta-path finder that is not Python's own (one a .pth
  installs) names it; a RECORD file that is a dangling symlink says where it
  pointed; a changed console script gives its ``#!`` line; pip's ``~`` stash
  directories left in a site directory are listed;
- ``sys.prefix`` / ``sys.path`` / the user site, the ``.pth`` files of the site
  directories, the environment markers, the ``ldconfig -p`` entries of the
  followed libraries (with the files they resolve to), LD_LIBRARY_PATH and
  PYTHONPATH with what each entry holds.

``sys.path[0]`` is this script's own entry ('' under ``-c``: the current
directory of whoever started it, never the trainer's): it is left out before
anything is asked, so a dist-info lying in that directory is not taken for an
installed distribution.

Stdlib only, Python 3.8+, nothing from dflashctl (the host has none of it): the
controller ships this file's text (``python -c <text> <json>``) and reads the
answer with ``dflashctl.envaudit.parse_snapshot``. Run without ``-I``: a user
site-packages directory or a PYTHONPATH is exactly what is being audited.

It never imports torch or any package it reports on in its own process (only the
``deep`` subprocess does), never changes anything on the host, and once its
argument is understood it always prints exactly one JSON object: what cannot be
read is a line in ``errors``.

Argument, one JSON object::

    {"lib_prefixes": ["libcudnn", ...],   the shared libraries to follow (required;
                                          ``libcuda`` also matches ``libcudart``)
     "modules": ["torch", ...],           modules to look up besides every
                                          distribution's top-level modules
     "deep": false, "deep_timeout": 60,   import torch in a subprocess
     "imports": ["sympy", ...]}           with --deep: imported too, after DEEP_IMPORTS
"""

import base64
import csv
import hashlib
import json
import os
import platform
import re
import shutil
import site
import socket
import struct
import subprocess
import sys
import time

SNAPSHOT_VERSION = 2
USAGE = 'usage: audit.py \'{"lib_prefixes": ["libcudnn", "libnccl", ...], "modules": [...], "deep": false}\'\n'
DEFAULT_MODULES = ("torch", "triton", "transformers")
DEEP_IMPORTS = ("torch", "triton", "transformers", "safetensors")  # what the trainer imports
# First path components that are never an importable top-level name.
SKIP_TOP = re.compile(r"(\.dist-info|\.egg-info|\.data|\.pth|__pycache__|\.\.)$")
ENV_VARIABLES = ("PYTHONPATH", "LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONNOUSERSITE", "PYTHONUSERBASE")
TORCH_LIBRARIES = ("libtorch_cuda.so", "libtorch_global_deps.so")  # the first present is read
# A shared file's holder that is none of its owners (or cannot be told: same size, no hash).
HOLDER_MISSING, HOLDER_FOREIGN, HOLDER_DENIED, HOLDER_UNKNOWN = -1, -2, -3, -4
LISTED = 20  # paths listed per problem; counts are always whole
MAX_SOS = 2000  # shared objects listed per distribution (torch ships a few dozen)
MAX_LOADER_FILES = 4000  # files followed through the loader, in all
SHARED_OBJECT = re.compile(r"\.so(?:\.[0-9]+)*$")
# What the trainer imports: the loader's files of these and of everything they
# require (by name, every marker taken as true: a superset is the safe side).
LOADER_ROOTS = ("torch", "triton", "pytorch-triton", "transformers", "safetensors")
DEFAULT_LIBRARY_DIRS = ("/lib", "/usr/lib", "/lib64", "/usr/lib64")
# The answer between these, on one line: code a .pth runs at start or at exit (or
# torch's import) may print to stdout before and after it.
FRAME = ("<<dflashctl-env-audit>>", "<</dflashctl-env-audit>>")
# The imports in a child: the answer is the framed one on its stdout. Its own
# sys.path[0] ('' under -c) is dropped first, as this script drops its own. Each
# module is imported in turn; what each maps (/proc/self/maps) is what it loaded.
DEEP_CODE = r"""
import json, sys
del sys.path[0]
args = json.loads(sys.argv[1])
prefixes = tuple(args["prefixes"])
FRAME = tuple(args["frame"])


def mapped():
    found = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6:
                    path = parts[5].strip()
                    if ".so" in path.rsplit("/", 1)[-1]:
                        found.add(path)
    except OSError:
        pass
    return found


answer, imports = {}, {}
seen = mapped()
for name in args["imports"]:
    entry = {}
    try:
        module = __import__(name)
        version = getattr(module, "__version__", None)
        entry["version"] = version if isinstance(version, str) else None
        if name == "torch":
            answer["version"] = str(module.__version__)
            answer["cuda"] = module.version.cuda
            answer["file"] = module.__file__
    except BaseException as e:
        entry["error"] = "%s: %s" % (type(e).__name__, e)
        if name == "torch":
            answer["error"] = entry["error"]
    now = mapped()
    entry["loaded"] = sorted(now - seen)
    seen = now
    imports[name] = entry
if args.get("pip"):
    try:
        import pip._internal.cli.main
        answer["pip"] = None
    except BaseException as e:
        answer["pip"] = "%s: %s" % (type(e).__name__, e)
answer["loaded"] = sorted(p for p in seen if p.rsplit("/", 1)[-1].startswith(prefixes))
answer["imports"] = imports
sys.stdout.write("\n" + FRAME[0] + json.dumps(answer) + FRAME[1] + "\n")
"""


def canon(name):
    """A distribution name the way pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def library_matcher(prefixes):
    """A test on file names: a shared library (``.so`` with or without a version)
    whose name starts with one of ``prefixes``."""
    pattern = re.compile(
        "^(?:" + "|".join(re.escape(p) for p in prefixes) + r")[A-Za-z0-9_+-]*\.so(?:\.[0-9]+)*$")
    return lambda base: pattern.match(base) is not None


def full_version(info):
    """``sys.implementation.version`` as PEP 508's implementation_version writes it."""
    version = "%d.%d.%d" % (info.major, info.minor, info.micro)
    return version + info.releaselevel[0] + str(info.serial) if info.releaselevel != "final" else version


def markers():
    """The PEP 508 environment markers of this python, to evaluate requirements with."""
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


def own_path_entry():
    """Take this script's own first sys.path entry out (see the module docstring);
    what was taken, or None when Python did not add one (-P)."""
    if getattr(sys.flags, "safe_path", False) or not sys.path:
        return None
    return sys.path.pop(0)


def python_info(dropped):
    try:
        site_dirs = list(site.getsitepackages())
    except AttributeError:  # an old virtualenv's site.py
        site_dirs = []
    return {
        "executable": sys.executable,
        "version": platform.python_version(),
        "prefix": sys.prefix,
        "base_prefix": getattr(sys, "base_prefix", sys.prefix),
        "path": list(sys.path),
        "dropped_path": dropped,
        "site_packages": site_dirs,
        "user_site": site.getusersitepackages(),
        "user_site_enabled": bool(site.ENABLE_USER_SITE),
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


def read_text(dist, name):
    try:
        return dist.read_text(name)
    except Exception:
        return None


class Owners:
    """Which distribution lists each file: an index per normalized absolute path
    (with the size and sha256 its RECORD gives), and every owner of the paths
    listed by more than one."""

    def __init__(self):
        self.first = {}
        self.more = {}

    def add(self, path, index, size=None, digest=None):
        row = (index, size, digest)
        first = self.first.setdefault(path, row)
        if first[0] != index:
            owners = self.more.get(path)
            if owners is None:
                self.more[path] = [first, row]
            elif all(r[0] != index for r in owners):
                owners.append(row)

    def of(self, path):
        """The owners of a file, the one whose bytes it holds first (when one does)."""
        if path in self.more:
            rows = self.more[path]
            holder = file_holder(path, rows)
            return sorted((r[0] for r in rows), key=lambda i: i != holder)
        return [self.first[path][0]] if path in self.first else []

    def listing(self, path):
        """Every distribution whose RECORD lists ``path`` (indexes), without reading the file."""
        if path in self.more:
            return [r[0] for r in self.more[path]]
        return [self.first[path][0]] if path in self.first else []

    def shared(self):
        """Files listed by several distributions, grouped by their owners and by
        whose bytes are on disk (``holder``: the owner whose RECORD size and hash
        the file matches, HOLDER_MISSING or HOLDER_FOREIGN); and, per owner, the
        shared files whose hash is not the one it recorded though their size is
        (changed, which a size check alone cannot see)."""
        groups, mismatched = {}, {}
        for path, rows in self.more.items():
            holder = file_holder(path, rows)
            for index, size, digest in rows:
                if holder >= 0 and index != holder and digest and digest != _row_of(rows, holder)[2] \
                        and size is not None and size == _row_of(rows, holder)[1]:
                    mismatched.setdefault(index, []).append(path)
            groups.setdefault((tuple(sorted(r[0] for r in rows)), holder), []).append(path)
        return [{"owners": list(owners), "holder": holder, "count": len(paths), "paths": sorted(paths)[:LISTED]}
                for (owners, holder), paths in sorted(groups.items())], mismatched


def _row_of(rows, index):
    return next(r for r in rows if r[0] == index)


def sha256_of(path):
    """A file's sha256 as a RECORD writes it (urlsafe base64, no padding)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode("ascii")


def file_holder(path, rows):
    """Whose bytes a file listed by several distributions holds: the index of the
    owner whose recorded size and sha256 it matches (the hash read only where a
    RECORD gives one), HOLDER_MISSING when it is gone, HOLDER_FOREIGN when it
    matches none of them, HOLDER_DENIED when it cannot be read."""
    try:
        size = os.stat(path).st_size
    except PermissionError:
        return HOLDER_DENIED
    except OSError:
        return HOLDER_MISSING
    fits = [r for r in rows if r[1] is None or r[1] == size]
    if not fits:
        return HOLDER_FOREIGN
    if not any(r[2] for r in fits):
        return fits[0][0] if len(fits) == 1 else HOLDER_UNKNOWN
    try:
        digest = sha256_of(path)
    except PermissionError:
        return HOLDER_DENIED
    except OSError:
        return HOLDER_MISSING
    return next((r[0] for r in fits if r[2] == digest), HOLDER_FOREIGN)


def read_distribution(dist, index, is_library, owners):
    """One distribution: its metadata, and its RECORD checked file by file."""
    path = getattr(dist, "_path", None)  # its .dist-info / .egg-info directory (no public name for it)
    entry = {"name": None, "version": None, "location": None, "metadata": str(path) if path is not None else None,
             "requires": [], "modules": [], "libs": None, "files": None, "missing": [], "missing_count": 0,
             "changed": [], "changed_count": 0, "installer": None, "editable": False}
    requires = None
    try:
        meta = dist.metadata  # parsed on every access: read once
        if meta is not None:
            entry["name"] = meta["Name"] or None
            entry["version"] = meta["Version"] or None
            requires = meta.get_all("Requires-Dist")
    except Exception as e:
        entry["error"] = "metadata: %s: %s" % (type(e).__name__, e)
    if not entry["name"] and path is not None and "error" not in entry:
        for file in ("METADATA", "PKG-INFO"):  # importlib.metadata reads an unreadable one as empty
            full = os.path.join(str(path), file)
            if os.path.exists(full) and not os.access(full, os.R_OK):
                entry["error"] = "metadata: PermissionError: [Errno 13] Permission denied: %r" % full
    try:
        # An egg-info keeps its requirements in requires.txt, which only dist.requires reads.
        if requires is None and str(path).endswith(".egg-info"):
            requires = dist.requires
        entry["requires"] = list(requires or [])
    except Exception as e:
        entry["error"] = "requires: %s: %s" % (type(e).__name__, e)
    location = str(dist.locate_file(""))
    entry["location"] = location
    entry["installer"] = (read_text(dist, "INSTALLER") or "").strip() or None
    try:
        direct = json.loads(read_text(dist, "direct_url.json") or "{}")
        entry["editable"] = bool((direct.get("dir_info") or {}).get("editable"))
    except (ValueError, AttributeError):
        pass
    try:
        files = record_rows(dist)
    except Exception as e:
        entry["error"] = "RECORD: %s: %s" % (type(e).__name__, e)
        files = None
    if files is None:
        top = read_text(dist, "top_level.txt") or ""
        entry["modules"] = sorted(t.strip() for t in top.split() if t.strip())
        return entry
    modules, libs, missing, changed, denied, sos, dangling = set(), [], [], [], [], [], []
    firsts = {}
    base = location.rstrip("/") + "/"
    for rel, size, digest in files:
        first, sep, _ = rel.partition("/")
        if first not in firsts:
            firsts[first] = module_name(first) if sep or first.endswith(".py") or ".so" in first else None
        name = firsts[first]
        if name:
            modules.add(name)
        base_name = rel.rsplit("/", 1)[-1]
        if is_library(base_name):
            libs.append(rel)
        if SHARED_OBJECT.search(base_name):
            sos.append(rel)
        if "./" in rel or rel.startswith("/"):  # ../../bin/x: outside the site directory
            full = os.path.normpath(os.path.join(location, rel))
        else:
            full = base + rel
        owners.add(full, index, size, digest)
        try:
            st = os.stat(full)
        except PermissionError:  # a directory on the way that this user may not search
            denied.append(rel)
            continue
        except OSError:
            if not rel.endswith(".pyc"):  # compiled again on the next import
                missing.append(rel)
                if os.path.islink(full):  # a symlink whose target is gone (uv's symlink mode, its cache removed)
                    dangling.append((rel, os.readlink(full)))
            continue
        if size is not None and st.st_size != size:
            changed.append(rel)
        elif not readable(st):
            denied.append(rel)
    entry.update(modules=sorted(modules), libs=sorted(libs), files=len(files), missing=missing[:LISTED],
                 missing_count=len(missing), changed=changed[:LISTED], changed_count=len(changed),
                 denied=denied[:LISTED], denied_count=len(denied), sos=sos[:MAX_SOS],
                 dangling=[{"path": r, "target": t} for r, t in dangling[:LISTED]], dangling_count=len(dangling),
                 shebangs=shebangs(location, changed[:LISTED]))
    return entry


def shebangs(location, changed):
    """The first line of each changed file outside the package directory that starts
    with ``#!`` (a console script: a relocated venv's tools rewrite those lines)."""
    found = {}
    for rel in changed:
        if not rel.startswith("../"):
            continue
        try:
            with open(os.path.normpath(os.path.join(location, rel)), "rb") as f:
                head = f.read(512)
        except OSError:
            continue
        if head.startswith(b"#!"):
            found[rel] = head.split(b"\n", 1)[0].decode("utf-8", "replace")
    return found


EUID = os.geteuid() if hasattr(os, "geteuid") else 0
GROUPS = set(os.getgroups()) | {os.getegid()} if hasattr(os, "getgroups") else set()


def readable(st):
    """Whether this user may read a file, from its stat (no second system call per file)."""
    if EUID == 0:
        return True
    if st.st_uid == EUID:
        return bool(st.st_mode & 0o400)
    if st.st_gid in GROUPS:
        return bool(st.st_mode & 0o040)
    return bool(st.st_mode & 0o004)


def record_rows(dist):
    """(path, size or None, sha256 or None) for each file a distribution lists;
    None when it lists none.
    A RECORD is the three-column CSV the wheel spec defines, read with csv as
    importlib.metadata reads it, but without a path object per row (torch's RECORD
    has some 20,000); anything else (an egg-info's installed-files.txt or
    SOURCES.txt) is left to importlib.metadata's ``files``."""
    text = read_text(dist, "RECORD")
    if text is None:
        files = dist.files
        return None if files is None else [(str(f), f.size, None) for f in files]
    rows = []
    for row in csv.reader(text.splitlines()):
        if row and row[0]:
            size = row[2] if len(row) > 2 else ""
            digest = row[1][7:] if len(row) > 1 and row[1].startswith("sha256=") else None
            rows.append((row[0], int(size) if size.isdigit() else None, digest))
    return rows


def mark_changed(entry, paths):
    """Shared files whose size is the one ``entry``'s RECORD gives but whose bytes
    are another owner's: changed, as the hash says."""
    base = (entry.get("location") or "").rstrip("/") + "/"
    for path in sorted(paths):
        rel = path[len(base):] if path.startswith(base) else path
        changed = entry.setdefault("changed", [])
        if len(changed) < LISTED:
            changed.append(rel)
        entry["changed_count"] = entry.get("changed_count", 0) + 1


def distributions(is_library, owners, errors):
    """Every installed distribution, in the order importlib.metadata finds them
    (sys.path order). A sys.path directory this user may not list is an error
    (importlib.metadata skips it without a word)."""
    import importlib.metadata as md

    for entry in sys.path:
        try:
            os.listdir(entry or ".")
        except PermissionError as e:
            errors.append("permission denied: %s cannot be listed, the packages in it are not seen (%s)" % (entry, e))
        except OSError:
            pass
    found = []
    for dist in md.distributions():
        try:
            found.append(read_distribution(dist, len(found), is_library, owners))
        except Exception as e:
            errors.append("distribution %r: %s: %s" % (str(getattr(dist, "_path", "?")), type(e).__name__, e))
            found.append({"name": None, "version": None, "error": "%s: %s" % (type(e).__name__, e)})
    return found


def path_entries_longest_first():
    return sorted({os.path.normpath(os.path.abspath(p)) for p in sys.path if p}, key=len, reverse=True)


def find_specs(names, owners, errors):
    """name -> where the import system finds it: its origin file, the owners of
    that file, the sys.path entry it is under; None when it is not importable."""
    import importlib.util

    entries = path_entries_longest_first()
    answers = {}
    for name in names:
        try:
            spec, finder = find_spec(name, importlib.util)
        except Exception as e:
            answers[name] = {"error": "%s: %s" % (type(e).__name__, e)}
            continue
        if spec is None:
            answers[name] = None
            continue
        origin = spec.origin if getattr(spec, "has_location", False) else None
        search = [str(p) for p in (spec.submodule_search_locations or [])]
        answer = {"origin": origin, "namespace": origin is None and bool(search), "owners": [], "entry": None}
        if finder:
            answer["finder"] = finder
        if origin is None and search:
            origin_dir = os.path.normpath(os.path.abspath(search[0]))
            answer["entry"] = next((e for e in entries if origin_dir.startswith(e + os.sep)), None)
        if origin:
            full = os.path.normpath(os.path.abspath(origin))
            answer["owners"] = owners.of(full)
            answer["entry"] = next((e for e in entries if full.startswith(e + os.sep)), None)
        answers[name] = answer
    return answers


STANDARD_FINDERS = ("BuiltinImporter", "FrozenImporter", "PathFinder")


def find_spec(name, util):
    """``importlib.util.find_spec`` for a top-level name, asked of each finder on
    sys.meta_path in turn as the import system does, and which finder answered
    when it is not one of Python's own (a finder a .pth installs): (spec, finder
    as module.name, or None)."""
    if name in sys.modules:
        return util.find_spec(name), None
    for finder in sys.meta_path:
        ask = getattr(finder, "find_spec", None)
        if ask is None:
            continue
        spec = ask(name, None)
        if spec is not None:
            kind = finder if isinstance(finder, type) else type(finder)
            if kind.__name__ in STANDARD_FINDERS and kind.__module__.startswith(("importlib", "_frozen_importlib")):
                return spec, None
            return spec, "%s.%s" % (kind.__module__, kind.__name__)
    return None, None


def elf_info(path):
    """DT_RPATH, DT_RUNPATH and DT_NEEDED of an ELF64 little-endian file, read
    without running or loading anything."""
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

            def string(at):
                return strings[at:strings.index(b"\0", at)].decode("utf-8", "replace")

            found = {"needed": []}
            for i in range(0, len(dynamic) - 15, 16):
                tag, value = struct.unpack_from("<qQ", dynamic, i)
                if tag == 0:
                    break
                if tag == 1:  # DT_NEEDED
                    found["needed"].append(string(value))
                elif tag in (15, 29):  # DT_RPATH, DT_RUNPATH
                    found["rpath" if tag == 15 else "runpath"] = string(value)
            return found
    return None


def loader_pick(soname, origin_dir, elf, ld_dirs, cache):
    """The file the dynamic loader maps for ``soname`` asked for by a library in
    ``origin_dir`` with these RPATH / RUNPATH, and why: (path, via), or (None,
    None). glibc's order: RPATH (only without RUNPATH), LD_LIBRARY_PATH, RUNPATH,
    the ldconfig cache, the default directories; then where torch's own
    ``_preload_cuda_deps`` looks when that fails (nvidia/*/lib on sys.path)."""

    def expand(directories):
        return [d.replace("${ORIGIN}", origin_dir).replace("$ORIGIN", origin_dir)
                for d in (directories or "").split(":") if d]

    order = []
    if elf.get("rpath") and not elf.get("runpath"):
        order += [(d, "RPATH") for d in expand(elf["rpath"])]
    order += [(d, "LD_LIBRARY_PATH") for d in ld_dirs]
    order += [(d, "RUNPATH") for d in expand(elf.get("runpath"))]
    for directory, via in order:
        candidate = os.path.join(directory, soname)
        if os.path.exists(candidate):
            return os.path.normpath(candidate), via
    if cache.get(soname):
        return cache[soname][0], "ldconfig cache"
    for directory in DEFAULT_LIBRARY_DIRS:
        candidate = os.path.join(directory, soname)
        if os.path.exists(candidate):
            return candidate, "default directories"
    for entry in sys.path:
        nvidia = os.path.join(entry or ".", "nvidia")
        try:
            subdirs = sorted(os.listdir(nvidia))
        except OSError:
            continue
        for sub in subdirs:
            candidate = os.path.join(nvidia, sub, "lib", soname)
            if os.path.exists(candidate):
                return os.path.normpath(candidate), "torch's preload from sys.path"
    return None, None


def torch_files(spec, is_library, cache, errors):
    """The imported torch's version.py text, its CUDA library's ELF paths and, for
    each followed library it needs, the file the loader would pick. None when
    torch is not importable as a package with files."""
    if not spec or not spec.get("origin"):
        return None
    root = os.path.dirname(spec["origin"])
    info = {"dir": root, "version_py": None, "elf": None, "libs": {}}
    try:
        with open(os.path.join(root, "version.py"), encoding="utf-8") as f:
            info["version_py"] = f.read(8192)
    except OSError as e:
        errors.append("torch/version.py: %s" % e)
    ld_dirs = path_entries("LD_LIBRARY_PATH")
    for lib in TORCH_LIBRARIES:
        path = os.path.join(root, "lib", lib)
        if not os.path.exists(path):
            continue
        try:
            elf = elf_info(path) or {}
        except (OSError, ValueError, struct.error) as e:
            errors.append("%s: %s" % (path, e))
            break
        info["elf"] = dict(elf, file="torch/lib/" + lib)
        for soname in elf.get("needed", []):
            if is_library(soname):
                picked, via = loader_pick(soname, os.path.dirname(path), elf, ld_dirs, cache)
                info["libs"][soname] = {"path": picked, "via": via}
        break
    return info


def loader_closure(dists):
    """Indexes of the distributions of LOADER_ROOTS and of everything they require,
    by name (the first copy of each name on sys.path, every marker taken as true)."""
    first = {}
    for i, d in enumerate(dists):
        if d.get("name"):
            first.setdefault(canon(d["name"]), i)
    wanted, queue = set(), [canon(n) for n in LOADER_ROOTS]
    while queue:
        name = queue.pop()
        if name in wanted or name not in first:
            continue
        wanted.add(name)
        for req in dists[first[name]].get("requires") or []:
            m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
            if m:
                queue.append(canon(m.group(1)))
    return sorted(first[n] for n in wanted)


def under(path, roots):
    return any(path == r or path.startswith(r + os.sep) for r in roots)


def loader_files(dists, owners, cache):
    """The files the dynamic loader resolves for the shared objects of the
    trainer's distributions (``loader_closure``): each DT_NEEDED followed as the
    loader does (``loader_pick``), and what those need in turn, and beside each
    library found, the libraries of its directory (cuDNN, cuBLAS and NCCL dlopen
    their siblings by name). Only files inside the environment's sys.path
    directories or prefix are listed: those are what pip can remove or overwrite.
    Each with how it was found, who needs it, and every RECORD that lists it."""
    roots = sorted({os.path.normpath(os.path.abspath(p)) for p in sys.path if p} | {os.path.normpath(sys.prefix)})
    ld_dirs = path_entries("LD_LIBRARY_PATH")
    queue, found = [], []
    for i in loader_closure(dists):
        location = (dists[i].get("location") or "").rstrip("/")
        for rel in dists[i].get("sos") or []:
            queue.append(os.path.normpath(os.path.join(location, rel)))
    scanned, listed, dirs_done = set(queue), set(), set()

    def add(path, via, needed_by):
        if path in listed or len(found) >= MAX_LOADER_FILES:
            return
        listed.add(path)
        found.append({"path": path, "via": via, "needed_by": needed_by, "owners": owners.listing(path)})
        if path not in scanned:
            scanned.add(path)
            queue.append(path)

    while queue:
        path = queue.pop(0)
        try:
            elf = elf_info(path) or {}
        except (OSError, ValueError, struct.error, IndexError):
            continue
        for soname in elf.get("needed", []):
            picked, via = loader_pick(soname, os.path.dirname(path), elf, ld_dirs, cache)
            if picked is None or not under(picked, roots):
                continue
            add(picked, via, path)
            directory = os.path.dirname(picked)
            if directory in dirs_done:
                continue
            dirs_done.add(directory)
            try:
                siblings = sorted(os.listdir(directory))
            except OSError:
                siblings = []
            for name in siblings:
                sibling = os.path.join(directory, name)
                if SHARED_OBJECT.search(name) and os.path.isfile(sibling):
                    add(sibling, "beside " + soname + " (dlopened by name)", picked)
    return found


def stashes(site_dirs):
    """What pip leaves in a site directory when it is killed mid-step: its
    ``~name`` stash directories (what it had moved aside to put back on failure)."""
    found = []
    for directory in site_dirs:
        try:
            found += [os.path.join(directory, n) for n in sorted(os.listdir(directory)) if n.startswith("~")]
        except OSError:
            continue
    return found[:200]


def transformers_models(spec):
    """The model families the imported transformers ships (its ``models/``
    subdirectories, read, not imported); None when it is not importable."""
    if not spec or not spec.get("origin"):
        return None
    models = os.path.join(os.path.dirname(spec["origin"]), "models")
    try:
        names = sorted(n for n in os.listdir(models) if os.path.isdir(os.path.join(models, n)))
    except OSError as e:
        return {"dir": models, "models": None, "error": str(e)}
    return {"dir": models, "models": names}


def deep_import(prefixes, timeout, imports=DEEP_IMPORTS, pip=True):
    """``import torch`` (and each of ``imports``, pip's own code when ``pip``) in a
    child python with this environment."""
    argument = {"prefixes": list(prefixes), "frame": list(FRAME), "imports": list(imports), "pip": pip}
    try:
        p = subprocess.run([sys.executable, "-c", DEEP_CODE, json.dumps(argument)],
                           stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": "import torch did not finish within %gs" % timeout, "timeout": True}
    except OSError as e:
        return {"error": "cannot start %s: %s" % (sys.executable, e)}
    try:
        answer = json.loads(framed(p.stdout.decode("utf-8", "replace")))
    except ValueError:
        tail = p.stderr.decode("utf-8", "replace").strip().splitlines()[-3:]
        return {"error": "import torch: exit %s: %s" % (p.returncode, " | ".join(tail))}
    answer["exit_code"] = p.returncode
    return answer


def framed(text):
    """The text between the last FRAME start and the end after it (ValueError without one)."""
    start = text.rindex(FRAME[0]) + len(FRAME[0])
    return text[start:text.index(FRAME[1], start)]


def ldconfig(prefixes):
    """The dynamic loader's cache: the lines of the followed libraries, the files
    they resolve to, and (for this script only) soname -> paths of every library."""
    found = [p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.path.exists(p)]  # often off a user's PATH
    exe = shutil.which("ldconfig") or (found[0] if found else None)
    if exe is None:
        return {"error": "ldconfig not found"}, {}
    try:
        p = subprocess.run([exe, "-p"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=20,
                           universal_newlines=True)
    except (OSError, subprocess.SubprocessError) as e:
        return {"error": "%s -p: %s" % (exe, e)}, {}
    wide = sys.maxsize > 2 ** 32
    cache, lines, real = {}, [], {}
    for line in p.stdout.splitlines():
        m = re.match(r"^\s*(\S+)\s+\(([^)]*)\)\s+=>\s+(\S+)\s*$", line)
        if not m:
            continue
        if not wide or "64" in m.group(2):
            cache.setdefault(m.group(1), []).append(m.group(3))
        if m.group(1).startswith(prefixes):
            lines.append(line)
            real[m.group(3)] = os.path.realpath(m.group(3))
    answer = {"text": "\n".join(lines), "real": real}
    if p.returncode != 0:
        answer["error"] = "%s -p exited %s: %s" % (exe, p.returncode, p.stderr.strip()[-300:])
    return answer, cache


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


def path_entries(variable):
    return [p for p in os.environ.get(variable, "").split(os.pathsep) if p]


def pythonpath():
    """Each PYTHONPATH entry: whether it exists, what it holds, and which of those
    names it shadows (found elsewhere on sys.path, or built in)."""
    entries = path_entries("PYTHONPATH")
    mine = {os.path.abspath(p) for p in entries}
    others = set()
    for p in sys.path:
        if p and os.path.abspath(p) not in mine:
            others |= names_in(p)
    others |= set(sys.builtin_module_names)
    answer = []
    for p in entries:
        names = names_in(p)
        answer.append({"path": p, "exists": os.path.isdir(p), "names": sorted(names)[:200],
                       "shadows": sorted(names & others)})
    return answer


def pth_files(site_dirs):
    """The .pth files of the site directories: the directories each adds to
    sys.path, and whether it runs code (an ``import`` line)."""
    answer = []
    for directory in site_dirs:
        try:
            names = sorted(n for n in os.listdir(directory) if n.endswith(".pth"))
        except OSError:
            continue
        for name in names[:200]:
            path = os.path.join(directory, name)
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    lines = f.read(65536).splitlines()
            except OSError:
                continue
            adds, code = [], False
            for line in lines:
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                if line.startswith(("import ", "import\t")):
                    code = True
                    continue
                added = os.path.normpath(os.path.join(directory, line))
                if os.path.exists(added):
                    adds.append(added)
            answer.append({"file": path, "adds": adds, "code": code, "text": "\n".join(lines)[:2000]})
    return answer


def ld_library_path(is_library):
    """Each LD_LIBRARY_PATH entry and the followed libraries in it (None: unreadable)."""
    answer = []
    for p in path_entries("LD_LIBRARY_PATH"):
        try:
            libs = sorted(e for e in os.listdir(p) if is_library(e))
        except OSError:
            libs = None
        answer.append({"path": p, "libs": libs})
    return answer


def snapshot(args):
    """The whole answer. Each part is read on its own: one that fails is a line in
    ``errors`` and the others are still there."""
    started = time.monotonic()
    prefixes = tuple(args["lib_prefixes"])
    dropped = own_path_entry()
    errors = []
    is_library = library_matcher(prefixes)
    owners = Owners()
    answer = {"v": SNAPSHOT_VERSION, "errors": errors}
    cache = {}

    def read_ldconfig():
        text, found = ldconfig(prefixes)
        cache.update(found)
        return text

    for key, read in (
        ("hostname", socket.gethostname),
        ("python", lambda: python_info(dropped)),
        ("markers", markers),
        ("distributions", lambda: distributions(is_library, owners, errors)),
        ("ldconfig", read_ldconfig),
        ("pythonpath", pythonpath),
        ("ld_library_path", lambda: ld_library_path(is_library)),
        ("env", lambda: {k: os.environ[k] for k in ENV_VARIABLES if k in os.environ}),
    ):
        try:
            answer[key] = read()
        except Exception as e:
            errors.append("%s: %s: %s" % (key, type(e).__name__, e))
    dists = answer.get("distributions") or []
    answer["shared_files"], mismatched = owners.shared()
    for index, paths in mismatched.items():
        mark_changed(dists[index] if index < len(dists) else {}, paths)
    names = list(DEFAULT_MODULES) + [m for m in args.get("modules") or [] if m not in DEFAULT_MODULES]
    for d in dists:
        names += [m for m in d.get("modules") or [] if m.isidentifier()]
    try:
        answer["modules"] = find_specs(list(dict.fromkeys(names)), owners, errors)
    except Exception as e:
        errors.append("modules: %s: %s" % (type(e).__name__, e))
    try:
        site_dirs = list((answer.get("python") or {}).get("site_packages") or [])
        user = (answer.get("python") or {}).get("user_site")
        answer["pth"] = pth_files(site_dirs + ([user] if user and site.ENABLE_USER_SITE else []))
    except Exception as e:
        errors.append("pth: %s: %s" % (type(e).__name__, e))
    try:
        answer["torch"] = torch_files((answer.get("modules") or {}).get("torch"), is_library, cache, errors)
    except Exception as e:
        errors.append("torch: %s: %s" % (type(e).__name__, e))
    try:
        answer["transformers"] = transformers_models((answer.get("modules") or {}).get("transformers"))
    except Exception as e:
        errors.append("transformers: %s: %s" % (type(e).__name__, e))
    try:
        answer["loader"] = loader_files(dists, owners, cache)
    except Exception as e:
        errors.append("loader: %s: %s" % (type(e).__name__, e))
    try:
        answer["stashes"] = stashes(list((answer.get("python") or {}).get("site_packages") or []))
    except Exception as e:
        errors.append("stashes: %s: %s" % (type(e).__name__, e))
    if args.get("deep"):
        imports = list(DEEP_IMPORTS) + [m for m in args.get("imports") or [] if m not in DEEP_IMPORTS]
        answer["deep"] = deep_import(prefixes, float(args.get("deep_timeout") or 60), imports)
    answer["seconds"] = round(time.monotonic() - started, 4)
    return answer


def parse_argument(argv):
    """The argument, checked; None when it is not one this script understands."""
    try:
        args = json.loads(argv[1])
        prefixes = args["lib_prefixes"]
        modules = args.get("modules", [])
        timeout = args.get("deep_timeout", 60)
    except (IndexError, KeyError, TypeError, ValueError, AttributeError):
        return None
    if not isinstance(prefixes, list) or not prefixes or not all(isinstance(p, str) and p for p in prefixes):
        return None
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        return None
    imports = args.get("imports", [])
    if not isinstance(imports, list) or not all(isinstance(m, str) and m.isidentifier() for m in imports):
        return None
    if not isinstance(args.get("deep", False), bool) or isinstance(timeout, bool) \
            or not isinstance(timeout, (int, float)) or not timeout > 0:
        return None
    return args


def main(argv):
    args = parse_argument(argv)
    if args is None:
        sys.stderr.write(USAGE)
        return 2
    answer = json.dumps(snapshot(args))
    sys.stdout.write("\n" + FRAME[0] + answer + FRAME[1] + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
