"""Compile artifacts that travel: what one start compiled, saved in its run directory,
loaded by a later start on any host with the same key before its warm-up.

A first start on a new host, in a new container or after a cache wipe otherwise
pays the whole compile again (minutes at the reference size). The artifacts are
``torch.compiler.save_cache_artifacts()`` bytes ("Mega-Cache": inductor graphs with
their triton kernels, AOTAutograd entries, autotuning results); loading them fills
this host's inductor and triton caches, so the warm-up finds its kernels there.

Layout, in the run directory::

    compile_cache/compile_cache.json   the manifest, written last (atomically)
    compile_cache/<key>.bin            the artifact bytes, then (version 2) the
                                       bytecode archive (``trainer.bytecode``) and
                                       the saved compiled variants (a tar)

Manifest (JSON object)::

    v          MANIFEST_VERSION
    key        16 hex digits: sha256 over ``fields``
    fields     {torch, triton, cuda, attention, gpu, python, bundle, config}: what
               the artifacts are valid for (``key_fields``); ``attention`` is the
               installed flash-attn-4 ('flash-attn-4 4.0.0b36', or 'none': it decides
               which kernels ``compile.flex_kernel: auto`` compiles); ``config`` is
               the digest of the shape-relevant configuration (``shape_config``)
    shape      the shape-relevant configuration itself (for people; not compared)
    file       the artifact's file name, ``<key>.bin``
    bytes      its size
    sha256     its sha256 (hex)
    created    unix time it was written
    artifacts  {kind: count}: what it holds (inductor, aot_autograd, autotune, ...)
    parts      (version 2) {"artifacts": {offset, bytes}, "bytecode": {offset, bytes,
               python, magic, files}}: where each part lies in the file; without
               ``parts`` (version 1) the whole file is the artifacts. The bytecode
               part is present when the start that wrote it kept bytecode of its own
               (an image without any): it is unpacked before torch is imported,
               when the key fields known then (``pre_import_fields``) and its
               Python's magic number are this one's (each file is checked against
               this host's source hash as it is unpacked; what it runs is trusted
               because the controller moves artifacts only inside a trust domain).
               The variants part ({offset, bytes, files}) is present when the start
               that wrote it saved variants of ``compile.share: shared``
               (``trainer.compile.SavedVariants``): they are written into this
               host's compile cache when the artifacts are loaded, where each is
               checked as it is loaded (its key, its bytes, its source).

Whoever puts an artifact into a run directory (the controller, when it starts a run
on a host whose cache lacks it) copies both files; the trainer decides. Outcomes
(trainer.log, status.json ``detail.compile_cache``, every metrics line):
``hit`` (key and sha256 match: loaded, or already in this host's cache), ``miss``
(none present), ``mismatch:<field>`` (the first key field that differs, or
``mismatch:sha256`` / ``mismatch:manifest`` for bytes or a manifest that do not
check out), ``off`` (``compile.artifacts: false`` or no compiled path).

This module must never import torch at import time (the controller imports it for
the key's config digest), never load an artifact whose key or sha256 differs (the
bytes are pickles and compiled code: a run directory must be as trusted as the
bundle it runs; the controller puts only artifacts of the host's trust domain there),
never load one with an entry whose key is not a path inside this host's caches
(``load_checked``), and never read or write through a symbolic link.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import platform
import re
import tarfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from dflashctl.core import contract
from trainer.torch_api import cache_artifact_manager, inductor_cache_dir

CACHE_DIR = "compile_cache"
MANIFEST_FILE = "compile_cache.json"
MANIFEST_VERSION = 2
# In the order they are compared: the first that differs names the mismatch.
FIELDS = ("torch", "triton", "cuda", "attention", "gpu", "python", "bundle", "config")
BUNDLE_ENV = "DFLASH_BUNDLE_HASH"
MAX_MANIFEST_BYTES = 1 << 16
# In this host's inductor cache: one empty file per artifact already loaded or
# saved here, so a restart on the same host does not load it again.
_LOCAL_MARKERS = "dflash-artifacts"

_HEX64 = re.compile(r"[0-9a-f]{64}")


# ---------------------------------------------------------------------------- the key (torch-free)


def shape_config(cfg) -> dict[str, Any]:
    """The configuration values that change what is compiled (shapes, graphs, devices);
    the rest (learning rate, steps, data paths, seeds) does not invalidate artifacts."""
    m, d, c = cfg.model, cfg.data, cfg.compile
    return {
        "model": {"preset": None if m.path else m.preset, "path_config": _model_config_digest(m.path),
                  "num_target_layers": m.num_target_layers, "drafter_layers": m.drafter_layers,
                  "block_size": m.block_size, "layer_types": m.layer_types, "sliding_window": m.sliding_window,
                  "dtype": m.dtype,
                  # the sliding mask is traced into the kernels; named only off the default, so
                  # the keys of existing artifacts stay what they were
                  **({"sliding_semantics": m.sliding_semantics} if m.sliding_semantics != "causal_in_block" else {}),
                  **({"residual": m.residual} if m.residual != "float32" else {})},
        "data": {"buckets": sorted(d.buckets), "max_anchors": d.max_anchors, "batch_size": d.batch_size},
        "train": {"loss_chunk": cfg.train.loss_chunk, "loss_kernel": cfg.train.loss_kernel},
        "placement": {"device": cfg.placement.device, "target": list(cfg.placement.target),
                      "drafter": list(cfg.placement.drafter)},
        "compile": {"enabled": c.enabled, "drafter_layers": c.drafter_layers, "target": c.target,
                    "mask_builder": c.mask_builder, "flex_kernel": c.flex_kernel},
    }


def _model_config_digest(path: Optional[str]) -> Optional[str]:
    """A local model is identified by its config.json (its shapes), not by where it lies."""
    if not path:
        return None
    try:
        with open(os.path.join(os.path.expanduser(path), "config.json"), "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:16]
    except OSError:
        return "path:" + hashlib.sha256(path.encode()).hexdigest()[:16]


def digest(value: Any) -> str:
    """16 hex digits of sha256 over canonical JSON."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def config_digest(cfg) -> str:
    """The key's ``config`` field for a TrainerConfig (what a controller computes too)."""
    return digest(shape_config(cfg))


def bundle_hash(environ: Optional[dict] = None, package_dir: Optional[str] = None) -> str:
    """The trainer code the artifacts were compiled by: ``$DFLASH_BUNDLE_HASH`` when the
    launcher sets it, else the name of the deployed bundle directory
    (``<workdir>/bundles/<sha256>/trainer``), else ``src-`` + a digest of the trainer's
    own source files (a checkout)."""
    environ = os.environ if environ is None else environ
    if environ.get(BUNDLE_ENV):
        return environ[BUNDLE_ENV]
    package_dir = package_dir or os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(package_dir)
    if _HEX64.fullmatch(os.path.basename(root)) and os.path.basename(os.path.dirname(root)) == "bundles":
        return os.path.basename(root)
    h = hashlib.sha256()
    for name in sorted(os.listdir(package_dir)):
        if name.endswith(".py"):
            h.update(name.encode() + b"\0")
            with open(os.path.join(package_dir, name), "rb") as f:
                h.update(f.read())
    return "src-" + h.hexdigest()[:16]


def key_of(fields: dict[str, str]) -> str:
    # Over the fields present only: a manifest written before a field was added keeps its
    # key (it is then refused as ``mismatch:<that field>``, not as a damaged manifest).
    return digest({k: fields[k] for k in FIELDS if k in fields})


def first_mismatch(theirs: dict, mine: dict) -> Optional[str]:
    """The first key field (in FIELDS order) whose value differs, or None."""
    for name in FIELDS:
        if theirs.get(name) != mine.get(name):
            return name
    return None


# ---------------------------------------------------------------------------- this process's key


def key_fields(cfg, devices: list) -> dict[str, str]:
    """What artifacts compiled by this process are valid for."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    from trainer.attention import installed_version

    gpus = sorted({torch.cuda.get_device_name(d) for d in devices if d.type == "cuda"}) or ["cpu"]
    flash = installed_version(contract.FLASH_ATTN_PACKAGE)
    return {
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": str(torch.version.cuda),
        "attention": f"{contract.FLASH_ATTN_PACKAGE} {flash}" if flash else "none",
        "gpu": ",".join(gpus),
        "python": platform.python_version(),
        "bundle": bundle_hash(),
        "config": config_digest(cfg),
    }


# ---------------------------------------------------------------------------- files


def _read_no_follow(path: str, limit: Optional[int] = None) -> bytes:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        data = f.read() if limit is None else f.read(limit + 1)
    if limit is not None and len(data) > limit:
        raise ValueError(f"{os.path.basename(path)} is larger than {limit} bytes")
    return data


# The last artifact file hashed by this process: (its identity, sha256). The trainer
# reads it twice at a start, for the bytecode before torch is imported and for the
# compiled artifacts after; the second read does not hash it again.
_hashed: Optional[tuple[tuple, str]] = None


def _read_artifact(run_dir: str, manifest: dict) -> tuple[bytes, str]:
    """The artifact file a manifest names, and its sha256 (OSError when unreadable)."""
    global _hashed
    fd = os.open(os.path.join(run_dir, CACHE_DIR, manifest["file"]), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        data = f.read()
    identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, len(data))
    if _hashed is None or _hashed[0] != identity:
        _hashed = (identity, hashlib.sha256(data).hexdigest())
    return data, _hashed[1]


def read_manifest(run_dir: str) -> Optional[dict]:
    """The manifest in ``run_dir``, None when there is none; ValueError when it is unusable."""
    path = os.path.join(run_dir, CACHE_DIR, MANIFEST_FILE)
    if not os.path.lexists(path):
        return None
    try:
        manifest = contract.load_json_object(_read_no_follow(path, MAX_MANIFEST_BYTES).decode("utf-8", "replace"),
                                             MANIFEST_FILE)
    except (OSError, ValueError) as e:
        raise ValueError(f"unreadable manifest: {e}") from None
    if not isinstance(manifest.get("fields"), dict):
        raise ValueError("manifest is not an object with 'fields'")
    name = manifest.get("file")
    if not isinstance(name, str) or os.path.basename(name) != name or name.startswith("."):
        raise ValueError(f"manifest 'file' {name!r} is not a plain file name")
    if not isinstance(manifest.get("sha256"), str) or not _HEX64.fullmatch(manifest["sha256"]):
        raise ValueError("manifest 'sha256' is not 64 hex digits")
    return manifest


def _local_marker(sha256: str) -> Optional[str]:
    """Path of this host's marker for an artifact, in the inductor cache in use (no
    marker: the artifact is simply loaded again)."""
    base = inductor_cache_dir()
    return os.path.join(base, _LOCAL_MARKERS, sha256) if base else None


def _mark_local(sha256: str) -> None:
    path = _local_marker(sha256)
    if path:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w"):
            pass


# ---------------------------------------------------------------------------- load and save


@dataclass
class Outcome:
    """What happened to the run directory's artifact at this start."""

    status: str = "off"  # hit | miss | mismatch:<field> | off
    loaded: bool = False  # False on a hit means: already in this host's cache
    load_s: float = 0.0
    bytes: int = 0
    key: str = ""
    sha256: str = ""
    saved: Optional[dict] = None  # the manifest this start wrote, if any
    bytecode: Optional[dict] = None  # what load_bytecode did at this start, if anything
    save_s: float = 0.0
    note: str = ""
    details: dict = field(default_factory=dict)

    def summary(self) -> dict:
        out = {"status": self.status, "key": self.key, "loaded": self.loaded, "load_s": round(self.load_s, 2),
               "bytes": self.bytes}
        if self.saved:
            out["saved"] = {"bytes": self.saved["bytes"], "sha256": self.saved["sha256"][:16],
                            "save_s": round(self.save_s, 2)}
        if self.note:
            out["note"] = self.note
        if self.bytecode:
            out["bytecode"] = self.bytecode
        return out


def load(run_dir: str, fields: dict[str, str]) -> Outcome:
    """Load ``run_dir``'s artifact when its key and bytes check out; else say why not."""
    out = Outcome(status="miss", key=key_of(fields))
    try:
        manifest = read_manifest(run_dir)
    except ValueError as e:
        out.status, out.note = "mismatch:manifest", str(e)
        return out
    if manifest is None:
        return out
    theirs = manifest["fields"]
    wrong = first_mismatch(theirs, fields)
    if wrong is not None:
        out.status = f"mismatch:{wrong}"
        out.note = f"artifact {wrong} {str(theirs.get(wrong))[:80]!r}, this process {str(fields.get(wrong))[:80]!r}"
        return out
    if manifest.get("key") != out.key:
        out.status, out.note = "mismatch:key", f"manifest key {str(manifest.get('key'))[:20]!r} is not {out.key}"
        return out
    t0 = time.monotonic()
    try:
        data, sha = _read_artifact(run_dir, manifest)
    except OSError as e:
        out.status, out.note = "mismatch:file", f"cannot read {manifest['file']}: {e}"
        return out
    if sha != manifest["sha256"]:
        out.status, out.note = "mismatch:sha256", f"{manifest['file']} has sha256 {sha[:16]}, manifest {manifest['sha256'][:16]}"
        return out
    out.status, out.bytes, out.sha256 = "hit", len(data), sha
    try:
        artifacts = part(manifest, data, "artifacts")
        variants = part(manifest, data, "variants") if part_info(manifest, "variants") else None
    except ValueError as e:
        out.status, out.note = "mismatch:manifest", str(e)
        return out
    marker = _local_marker(sha)
    if marker and os.path.exists(marker):
        out.note = "already in this host's compile cache"
        out.load_s = time.monotonic() - t0
        return out
    try:
        info = load_checked(artifacts)
    except ValueError as e:
        out.status, out.note = "mismatch:entry", str(e)[:300]
        return out
    out.loaded = True
    out.details = _artifact_counts(info)
    if variants is not None:
        try:
            out.details["variants"] = unpack_variants(variants)
        except (OSError, tarfile.TarError) as e:  # the variants are compiled again
            out.note = f"saved variants not unpacked: {e}"[:300]
    out.load_s = time.monotonic() - t0
    _mark_local(sha)
    return out


def entry_key_problem(key: Any) -> Optional[str]:
    """Why an artifact entry's key cannot be a path inside this host's caches (inductor
    and autotune entries are written at ``<cache dir>/<key>``), or None."""
    if not isinstance(key, str) or not key or len(key) > 4096:
        return "is not a non-empty string"
    if "\0" in key or "\\" in key or os.path.isabs(key) or key.startswith("~"):
        return "is an absolute path"
    if ".." in key.split("/"):
        return "leaves the cache directory"
    return None


def load_checked(data: bytes):
    """``torch.compiler.load_cache_artifacts(data)``, with every entry's key checked
    first: the format (torch.compiler._cache) is parsed without writing anything, and
    one entry whose key would write outside this host's caches refuses the whole
    artifact (ValueError). Inductor entries stay pickles: only an artifact from the
    operator's trust domain reaches this (the controller's copy-back and upload)."""
    CacheArtifactManager = cache_artifact_manager()  # another torch: ValueError, none is loaded
    artifacts = CacheArtifactManager.deserialize(data)
    if artifacts is None:
        raise ValueError("not a torch compile artifact (it does not parse)")
    for kind, entries in artifacts.items():
        for entry in entries:
            problem = entry_key_problem(getattr(entry, "key", None))
            if problem:
                raise ValueError(f"{str(kind)[:40]} entry key {str(getattr(entry, 'key', None))[:80]!r} {problem}: "
                                 "the artifact is refused")
    return CacheArtifactManager.populate_caches(artifacts)


def part_info(manifest: dict, name: str) -> Optional[dict]:
    """The manifest's entry for part ``name`` (offset, bytes, ...), None when it has
    none or it is not an object."""
    parts = manifest.get("parts")
    where = parts.get(name) if isinstance(parts, dict) else None
    return where if isinstance(where, dict) else None


def part(manifest: dict, data: bytes, name: str) -> bytes:
    """Part ``name`` of an artifact file (the whole file is the artifacts in version 1);
    ValueError when the manifest places it outside the file."""
    if manifest.get("parts") is None and name == "artifacts":
        return data
    where = part_info(manifest, name)
    if where is None:
        raise ValueError(f"manifest has no part {name!r}")
    offset, size = where.get("offset"), where.get("bytes")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, size)) \
            or offset + size > len(data):
        raise ValueError(f"manifest places part {name!r} outside the file ({offset!r}+{size!r} of {len(data)})")
    return data[offset:offset + size]


def torch_version_unimported() -> Optional[str]:
    """torch's version as ``torch.__version__`` will say it, read from the copy that
    ``import torch`` would load, without importing it (None: no torch found)."""
    try:
        spec = importlib.util.find_spec("torch")
        locations = list(spec.submodule_search_locations or []) if spec else []
        with open(os.path.join(locations[0], "version.py"), encoding="utf-8") as f:
            text = f.read(1 << 16)
    except (ImportError, ValueError, OSError, IndexError):
        return None
    found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    return found.group(1) if found else None


def pre_import_fields(cfg) -> dict[str, Optional[str]]:
    """The key fields this process knows before torch is imported (``key_fields`` less
    triton, CUDA and the GPU): what a travelled bytecode part must have been made for."""
    return {"torch": torch_version_unimported(), "python": platform.python_version(), "bundle": bundle_hash(),
            "config": config_digest(cfg)}


def load_bytecode(run_dir: str, prefix: Optional[str], expected: dict) -> Optional[dict]:
    """Before torch is imported: unpack the run directory's travelled bytecode into
    ``prefix`` (``trainer.bytecode.keep``'s directory; None: this host has bytecode of
    its own, nothing to do), only when the artifact's key fields are ``expected``'s
    (``pre_import_fields``) and its bytes check out. An archive refused for its bytes
    is marked as considered, so later starts do not pay for it again. Returns what
    happened, or None when there was nothing to consider."""
    from trainer import bytecode

    if not prefix:
        return None
    try:
        manifest = read_manifest(run_dir)
    except ValueError as e:
        return {"status": "refused", "note": str(e)}
    where = part_info(manifest, "bytecode") if manifest else None
    if where is None:
        return None
    for name, value in expected.items():
        if manifest["fields"].get(name) != value:
            return {"status": f"mismatch:{name}", "note": f"artifact {name} {str(manifest['fields'].get(name))[:80]!r}, "
                                                          f"this process {str(value)[:80]!r}: bytecode not unpacked"}
    if manifest.get("key") != key_of(manifest["fields"]):
        return {"status": "mismatch:key", "note": "the manifest's key is not the key of its fields"}
    magic = importlib.util.MAGIC_NUMBER.hex()
    if where.get("magic") != magic:
        return {"status": "mismatch:python", "note": f"bytecode of Python {str(where.get('python'))[:20]} "
                                                     f"(magic {str(where.get('magic'))[:12]}), this one {magic}"}
    if os.path.exists(bytecode.unpacked_marker(prefix, manifest["sha256"])):
        return {"status": "present"}
    t0 = time.monotonic()
    try:
        data, sha = _read_artifact(run_dir, manifest)
        if sha != manifest["sha256"]:
            return {"status": "mismatch:sha256"}
        counts = bytecode.unpack(part(manifest, data, "bytecode"), prefix, manifest["sha256"])
    except (OSError, ValueError, EOFError, tarfile.TarError) as e:
        try:
            bytecode.mark_unpacked(prefix, manifest["sha256"])
        except OSError:
            pass
        return {"status": "refused", "note": f"{type(e).__name__}: {e}"[:300]}
    return {"status": "unpacked", "seconds": round(time.monotonic() - t0, 2), **counts}


def pack_variants(paths: list[str]) -> Optional[tuple[bytes, int]]:
    """A tar of the saved compiled variants ``paths`` (``compile.saved_variant_files``)
    that can be read, and how many it holds; None when none can."""
    buf, count = io.BytesIO(), 0
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path in paths:
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:
                continue
            info = tarfile.TarInfo(os.path.basename(path))
            info.size, info.mode = len(data), 0o600
            tar.addfile(info, io.BytesIO(data))
            count += 1
    return (buf.getvalue(), count) if count else None


def unpack_variants(data: bytes) -> int:
    """Write each file of ``pack_variants``'s tar that is named as a saved variant into
    this process's directory of them (``compile.saved_dir``), in place of one of that
    name; other members are skipped. Returns how many were written."""
    from trainer import compile as compile_mod

    directory = compile_mod.saved_dir()
    written = 0
    if directory is None:
        return written
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        for member in tar:
            if member.isfile() and compile_mod.SAVED_NAME.fullmatch(member.name):
                contract.atomic_write_bytes(os.path.join(directory, member.name), tar.extractfile(member).read())
                written += 1
    return written


def _artifact_counts(info) -> dict:
    artifacts = getattr(info, "artifacts", None) or {}
    return {str(kind): len(keys) for kind, keys in artifacts.items()}


def serialize() -> Optional[tuple[bytes, dict]]:
    """Every artifact this process compiled or loaded from a cache so far (None: none).
    Call only while nothing compiles (after the warm-up locked recompiles)."""
    import torch

    result = torch.compiler.save_cache_artifacts()
    if result is None:
        return None
    data, info = result
    return data, _artifact_counts(info)


def write(run_dir: str, fields: dict[str, str], cfg, data: bytes, counts: dict,
          bytecode_part: Optional[tuple[bytes, dict]] = None,
          variants_part: Optional[tuple[bytes, int]] = None) -> dict:
    """Write ``data`` (then the bytecode archive and the variants' tar, when given) and
    the manifest into ``run_dir/compile_cache`` (bytes first, the manifest last, each
    atomically); older artifact files there are removed."""
    directory = os.path.join(run_dir, CACHE_DIR)
    os.makedirs(directory, exist_ok=True)
    key = key_of(fields)
    name = f"{key}.bin"
    parts = {"artifacts": {"offset": 0, "bytes": len(data)}}

    def append(part_name: str, blob: bytes, **about) -> None:
        nonlocal data
        parts[part_name] = {"offset": len(data), "bytes": len(blob), **about}
        data = data + blob

    if bytecode_part is not None:
        archive, stats = bytecode_part
        append("bytecode", archive, python=platform.python_version(), magic=importlib.util.MAGIC_NUMBER.hex(),
               files=stats["files"])
    if variants_part is not None:
        append("variants", variants_part[0], files=variants_part[1])
    manifest = {
        "v": MANIFEST_VERSION, "key": key, "fields": dict(fields), "shape": shape_config(cfg), "file": name,
        "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "created": time.time(),
        "artifacts": counts, "parts": parts,
    }
    contract.atomic_write_bytes(os.path.join(directory, name), data)
    contract.atomic_write_bytes(os.path.join(directory, MANIFEST_FILE), json.dumps(manifest, indent=1, sort_keys=True).encode())
    for other in os.listdir(directory):
        if other.endswith(".bin") and other != name:
            try:
                os.unlink(os.path.join(directory, other))
            except OSError:
                pass
    return manifest


def should_save(outcome: Outcome, compiled: int) -> bool:
    """After the warm-up: save unless the artifact that was there covered everything
    (``compiled``: inductor's graph cache misses plus the variants ``compile.Shared``
    compiled)."""
    if outcome.status == "off":
        return False
    return not (outcome.status == "hit" and compiled == 0)


def save_in_background(run_dir: str, fields: dict[str, str], cfg, outcome: Outcome,
                       log: Callable[[str], None], bytecode_prefix: Optional[str] = None) -> Optional[threading.Thread]:
    """Serialize now (nothing compiles any more), pack the bytecode (when this process
    keeps its own, ``bytecode_prefix``) and the saved compiled variants, hash and write
    in a daemon thread, off the way to the first step. Records the manifest in
    ``outcome.saved``."""
    from trainer import bytecode
    from trainer import compile as compile_mod

    t0 = time.monotonic()
    result = serialize()
    if result is None:
        log("compile_cache: nothing to save (no artifacts recorded)")
        return None
    data, counts = result
    sources = bytecode.imported_sources() if bytecode_prefix else []
    generated = [inductor_cache_dir()]
    variant_files = compile_mod.saved_variant_files()

    def work():
        try:
            packed = bytecode.pack(sources, exclude=generated) if sources else None
            variants = pack_variants(variant_files)
            if variants is not None:
                counts["variants"] = variants[1]
            manifest = write(run_dir, fields, cfg, data, counts, packed, variants)
            _mark_local(manifest["sha256"])  # this host's cache holds every entry of it
            if packed is not None:  # and its bytecode
                bytecode.mark_unpacked(bytecode_prefix, manifest["sha256"])
            outcome.save_s = time.monotonic() - t0
            outcome.saved = manifest
            log(f"compile_cache: saved {manifest['bytes'] / 2**20:.1f} MiB ({counts}"
                + (f", bytecode of {packed[1]['files']} modules in {len(packed[0]) / 2**20:.1f} MiB" if packed else "")
                + f") as {CACHE_DIR}/{manifest['file']} in {outcome.save_s:.1f}s")
        except OSError as e:  # a full disk must not stop training; the next start compiles
            log(f"compile_cache: could not save: {e}")

    thread = threading.Thread(target=work, name="compile-cache-save", daemon=True)
    thread.start()
    return thread
