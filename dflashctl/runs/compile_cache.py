"""The controller's compile-cache store: compiled artifacts copied back from runs,
put into the run directory of a later start whose key matches.

A trainer that compiled cold saves what it compiled in its run directory
(``trainer.compile_cache``: ``compile_cache/compile_cache.json``, the manifest, and
``compile_cache/<key>.bin``). After the run's first healthy minutes the supervisor
copies both back here (``copy_back``); ``launch`` and ``restart`` put
a held artifact into the run directory before the trainer starts (``provide``), so
a host whose own cache was wiped, a new container or a new host skips the compile.

Layout, under the controller's data directory (``dflashctl.core.paths.data_dir``)::

    compile-cache/domains.json                   the trust domains this controller issued:
                                                 (inventory file, group:NAME | host:NAME) -> d-<random id>
    compile-cache/<domain>/<key>/compile_cache.json   the manifest, as the trainer wrote it
    compile-cache/<domain>/<key>/<key>.bin        the artifact bytes
    compile-cache/<domain>/<key>/.used            touched each time it is put into a run
    compile-cache/<domain>/<key>/origin.json      the controller's record: trust domain, host, run,
                                                 when it was received (its clock), what it expected
    compile-cache/<key>/                         an entry of the layout before domains: never provided
    compile-cache/.tmp-*                         an entry being written (or a stale one)

An entry is held per (trust domain, key): a copy-back of one domain never replaces
another's entry of the same key. A domain is an identity this controller issues (a
random id, recorded per inventory file and group), not a name: another inventory's
host in a group of the same name is another domain.

An entry is written into a temporary directory and renamed into place whole; its
size and sha256 are checked against the manifest on the way in and again on the
way out (a corrupted entry is never uploaded): ``provide`` reads an entry once,
through one open directory, checks those bytes and sends exactly them. On a host the upload travels like
the bundle (``dflashctl.hosts.deploy``): stdin of ``sh -c``, received into a temporary
directory in the run directory, its sha256 checked there, renamed into place, the
manifest last.

Which held artifact fits a run (``choose``, pure): its ``fields.config`` equals the
digest of the run's trainer configuration as the trainer will read it
(``trainer.compile_cache.config_digest``), its ``fields.bundle`` the bundle being
deployed, and its ``fields.gpu`` the host's GPU name when nvidia-smi told it. The
torch, triton, CUDA, attention (flash-attn-4) and Python fields are not known before the trainer starts: the
trainer refuses an artifact whose key differs (it reports ``mismatch:<field>``).

Trust: an artifact holds pickles and bytecode, so it is put only into runs on hosts
of the trust domain it was copied back from (``Host.trust_domain``: the inventory's
``trust_group``, else the host itself); a copy-back is taken only when its config,
bundle and GPU fields are the ones the controller computes for the run, streamed
into the store with its size and sha256 checked as it arrives, within a quota.

This module never imports torch, never uploads an artifact whose key, size or
sha256 does not check out or that came from another trust domain, and never decides
when to copy back (the supervisor's core does).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

from dflashctl.core import contract
from dflashctl.core.errors import DflashError, first_line
from dflashctl.hosts.deploy import RECEIVE_CHECKED
from dflashctl.hosts.transport.limits import CACHE_LOOK, COPY_BACK
from trainer import compile_cache as trainer_cache

if TYPE_CHECKING:
    from dflashctl.config import Host, Inventory
    from dflashctl.hosts.transport import Transport
    from dflashctl.store import Store

STORE_DIR = "compile-cache"
USED_FILE = ".used"
GENERATION_FILE = ".generation"  # bumped by `cache rm` (LocalCache.generation)
ORIGIN_FILE = "origin.json"  # the controller's own record of an entry: where, when, what it expected
DOMAINS_FILE = "domains.json"  # the trust domains this controller issued: (inventory, name) -> a random id
MAX_ARTIFACT_BYTES = 8 << 30  # larger than any real artifact; a manifest claiming more is not believed
QUOTA_ENV = "DFLASHCTL_COMPILE_CACHE_QUOTA"  # bytes the store may hold in all (default DEFAULT_QUOTA)
DEFAULT_QUOTA = 64 << 30
MIN_FREE_BYTES = 2 << 30  # what a copy-back leaves free on the controller's disk (it holds runs.db)
TRANSFER_TIMEOUT = 1800.0  # seconds for one artifact to travel either way
EVENT_KIND = "compile_cache"
# The key fields the controller can know before a start, in the order they are compared.
MATCHED_FIELDS = ("config", "bundle", "gpu")

_KEY = re.compile(r"[0-9a-f]{16}")
_DOMAIN = re.compile(r"d-[0-9a-f]{24}")  # an issued domain's id (LocalCache.domain)
_HEX64 = re.compile(r"[0-9a-f]{64}")


class CacheError(DflashError):
    """A compile artifact that does not check out, or a store entry that cannot be used."""


# --------------------------------------------------------------------------- manifests


def check_manifest(manifest: Any, where: str = "manifest") -> dict:
    """``manifest`` when it is one the trainer could have written and its key is the
    key of its fields; CacheError naming what is wrong otherwise."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("fields"), dict):
        raise CacheError(f"{where}: not an object with 'fields'")
    key = manifest.get("key")
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise CacheError(f"{where}: key {str(key)[:40]!r} is not 16 hex digits")
    if trainer_cache.key_of(manifest["fields"]) != key:
        raise CacheError(f"{where}: key {key} is not the key of its fields")
    if manifest.get("file") != f"{key}.bin":
        raise CacheError(f"{where}: file {str(manifest.get('file'))[:60]!r} is not {key}.bin")
    size = manifest.get("bytes")
    if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= MAX_ARTIFACT_BYTES:
        raise CacheError(f"{where}: bytes {str(size)[:30]!r} is not a size up to {MAX_ARTIFACT_BYTES}")
    if not isinstance(manifest.get("sha256"), str) or not _HEX64.fullmatch(manifest["sha256"]):
        raise CacheError(f"{where}: sha256 is not 64 hex digits")
    return manifest


def parse_manifest(text: str, where: str) -> dict:
    """A manifest's text (a host's, or a held entry's) -> the checked manifest, with
    the contract's size and depth bounds (CacheError only)."""
    from dflashctl.core import contract

    try:
        return check_manifest(contract.load_json_object(text, where), where)
    except contract.ContractError as e:
        raise CacheError(str(e)) from None


def verify(manifest: dict, data: bytes, where: str = "artifact") -> None:
    """CacheError unless ``data`` has the manifest's size and sha256."""
    if len(data) != manifest["bytes"]:
        raise CacheError(f"{where}: {len(data)} bytes, the manifest says {manifest['bytes']}")
    sha = hashlib.sha256(data).hexdigest()
    if sha != manifest["sha256"]:
        raise CacheError(f"{where}: sha256 {sha[:16]}..., the manifest says {manifest['sha256'][:16]}...")


# --------------------------------------------------------------------------- the local store


@dataclass
class Entry:
    """One held artifact, in one trust domain (``domain``: the id this controller
    issued, the directory it is held in; None: an entry of the layout before domains,
    never provided)."""

    key: str
    manifest: dict
    path: str  # its directory
    last_used: Optional[float] = None  # when it was last put into a run
    origin: dict = field(default_factory=dict)  # the controller's record (ORIGIN_FILE); {} for an entry without
    received: Optional[float] = None  # when this controller took it in (its clock, never the host's 'created')
    domain: Optional[str] = None
    domain_name: Optional[str] = None  # the inventory's words for the domain: group:NAME, host:NAME
    inventory: Optional[str] = None  # the inventory the domain is read from

    @property
    def fields(self) -> dict:
        return self.manifest["fields"]

    @property
    def bytes(self) -> int:
        return self.manifest["bytes"]

    @property
    def created(self) -> Optional[float]:
        return self.received

    @property
    def age_reference(self) -> float:
        """What ``--older-than`` measures from: the last use, else the creation."""
        return self.last_used or self.created or 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "fields": dict(self.fields), "bytes": self.bytes, "created": self.created,
                "last_used": self.last_used, "sha256": self.manifest["sha256"], "domain": self.domain_name,
                "domain_id": self.domain, "inventory": self.inventory, "host": self.origin.get("host"),
                "run": self.origin.get("run"), "artifacts": self.manifest.get("artifacts"),
                "parts": self.manifest.get("parts"), "path": self.path}

    @property
    def bytecode_bytes(self) -> Optional[int]:
        """Size of the Python bytecode that travels inside it (None: none does)."""
        size = (trainer_cache.part_info(self.manifest, "bytecode") or {}).get("bytes")
        return size if isinstance(size, int) and not isinstance(size, bool) else None


@dataclass(frozen=True)
class Domain:
    """A trust domain as this controller issued it: ``id`` is random and stored in the
    controller's state (DOMAINS_FILE), one per (inventory file, ``name``); no host and
    no other inventory can take it by naming a group."""

    id: str
    name: str  # Host.trust_domain: group:NAME, else host:NAME
    inventory: str  # the inventory file's real path (or what the inventory says it came from)

    @property
    def label(self) -> str:
        return f"{self.name} of {self.inventory}"


def store_dir() -> str:
    from dflashctl.core.paths import data_dir

    return os.path.join(data_dir(), STORE_DIR)


def inventory_identity(inventory: Any) -> str:
    """Which inventory a domain belongs to: its file's real path, else its ``source``
    ('<embedded default>'); '<no inventory>' for a transport made without one."""
    source = getattr(inventory, "source", None)
    if not isinstance(source, str) or not source:
        return "<no inventory>"
    return os.path.realpath(source) if os.path.isfile(source) else source


class LocalCache:
    """The compile artifacts this controller holds (see the module docstring)."""

    def __init__(self, root: Optional[str] = None):
        self.root = root or store_dir()

    def _own_root(self) -> None:
        """Create the store's directory mode 0700, or refuse one another user owns or
        may write: what they put there would be uploaded into this operator's runs."""
        try:
            contract.private_dir(self.root, "compile-cache store")
        except contract.UnsafeDirectory as e:
            raise CacheError(str(e), hint="or point $DFLASHCTL_HOME at a directory of your own") from None

    # -- trust domains -----------------------------------------------------------

    def domain(self, name: str, inventory: str) -> Domain:
        """The domain this controller issued for ``name`` of ``inventory``, issued now
        (a random id, recorded) when it has none yet. One writer at a time (flock)."""
        self._own_root()
        with open(os.path.join(self.root, DOMAINS_FILE + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            issued = self._domains_file()
            found = issued.get(f"{inventory}\n{name}")
            if found is None:
                found = {"id": "d-" + secrets.token_hex(12), "name": name, "inventory": inventory,
                         "issued": time.time()}
                issued[f"{inventory}\n{name}"] = found
                tmp = os.path.join(self.root, DOMAINS_FILE + ".tmp")
                with open(tmp, "w") as f:
                    json.dump(issued, f, indent=1, sort_keys=True)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, os.path.join(self.root, DOMAINS_FILE))
        return Domain(found["id"], name, inventory)

    def domain_for(self, host: "Host", inventory: Optional["Inventory"]) -> Domain:
        """The trust domain of ``host`` in ``inventory``."""
        return self.domain(host.trust_domain, inventory_identity(inventory))

    def domain_of(self, transport: "Transport") -> Domain:
        """The trust domain of the host ``transport`` reaches, in its inventory."""
        return self.domain_for(transport.host, getattr(transport, "inventory", None))

    def domains(self) -> dict[str, Domain]:
        """Every domain issued: id -> Domain."""
        return {d["id"]: Domain(d["id"], d["name"], d["inventory"]) for d in self._domains_file().values()}

    def _domains_file(self) -> dict:
        try:
            with open(os.path.join(self.root, DOMAINS_FILE)) as f:
                issued = json.load(f)
        except (OSError, ValueError):
            return {}
        return {k: v for k, v in issued.items() if isinstance(v, dict) and _DOMAIN.fullmatch(str(v.get("id")))
                and isinstance(v.get("name"), str) and isinstance(v.get("inventory"), str)} \
            if isinstance(issued, dict) else {}

    # -- entries -------------------------------------------------------------------

    def _dir(self, key: str, domain: Optional[str] = None) -> str:
        if not _KEY.fullmatch(key or ""):
            raise CacheError(f"{key!r} is not a compile cache key (16 hex digits)",
                             hint="`dflashctl cache ls` lists the keys held")
        if domain is None:  # the layout before domains
            return os.path.join(self.root, key)
        if not _DOMAIN.fullmatch(domain):
            raise CacheError(f"{domain!r} is not a trust domain this controller issued")
        return os.path.join(self.root, domain, key)

    def get(self, key: str, domain: Optional[str] = None) -> Optional[Entry]:
        """The entry for ``key`` in ``domain`` when its manifest reads and checks out
        (its bytes are checked by ``read``)."""
        directory = self._dir(key, domain)
        path = os.path.join(directory, trainer_cache.MANIFEST_FILE)
        try:
            with open(path, "rb") as f:
                manifest = parse_manifest(f.read(trainer_cache.MAX_MANIFEST_BYTES + 1).decode("utf-8", "replace"), key)
            received: Optional[float] = os.stat(path).st_mtime  # written by this controller
        except (OSError, CacheError):
            return None
        if manifest["key"] != key:
            return None
        origin = _read_origin(directory)
        if isinstance(origin.get("received"), (int, float)) and math.isfinite(origin["received"]):
            received = float(origin["received"])
        issued = self.domains().get(domain) if domain else None
        return Entry(key, manifest, directory, _mtime(os.path.join(directory, USED_FILE)), origin, received, domain,
                     issued.name if issued else None, issued.inventory if issued else None)

    def _places(self) -> list[tuple[str, Optional[str]]]:
        """(key, domain) of every entry directory: each domain's, then the old layout's."""
        places = []
        for name in _listdir(self.root):
            if _DOMAIN.fullmatch(name):
                places += [(key, name) for key in _listdir(os.path.join(self.root, name)) if _KEY.fullmatch(key)]
            elif _KEY.fullmatch(name):
                places.append((name, None))
        return places

    def entries(self, domain: Optional[str] = None) -> list[Entry]:
        """Every usable entry (of ``domain`` only, when given), the most recently used
        (else created) first."""
        found = [self.get(key, d) for key, d in self._places() if domain is None or d == domain]
        return sorted((e for e in found if e is not None), key=lambda e: e.age_reference, reverse=True)

    def held(self, key: str) -> list[Entry]:
        """``key``'s entries, one per domain that holds it (the old layout's too)."""
        return [e for e in (self.get(k, d) for k, d in self._places() if k == key) if e is not None]

    def put(self, manifest: dict, data: bytes, origin: Optional[dict] = None, now: Optional[float] = None) -> Entry:
        """Hold ``data`` under its manifest's key (checked first) in ``origin['domain']``
        (an issued domain's id; without one: never provided), replacing an entry held
        for the key there (a newer verified copy wins). ``origin``: the controller's
        record of where it came from (``domain``, ``host``, ``run``); ``now``: when it
        was received (default: now)."""
        receiver = self.receiver(manifest, origin, time.time if now is None else (lambda: now))
        receiver.write(data)
        return receiver.commit()

    def receiver(self, manifest: dict, origin: Optional[dict] = None,
                 clock: Callable[[], float] = time.time) -> "Receiver":
        """Where an artifact is written as it arrives (``Receiver``): the manifest is
        checked, and its size against the quota and the free disk, before the first
        byte; room is made in the quota only once it verified (a host that claims a
        large size and sends garbage evicts nothing)."""
        manifest = check_manifest(manifest)
        origin = dict(origin or {})
        self._dir(manifest["key"], origin.get("domain"))  # an id this controller issued, or none
        self.check_room(manifest["bytes"])
        return Receiver(self, manifest, origin, clock)

    def quota(self) -> int:
        try:
            return max(0, int(os.environ.get(QUOTA_ENV, DEFAULT_QUOTA)))
        except ValueError:
            raise CacheError(f"${QUOTA_ENV} is not a number of bytes: {os.environ[QUOTA_ENV][:40]!r}",
                             hint=f"unset it, or give bytes (e.g. {DEFAULT_QUOTA})") from None

    def check_room(self, size: int) -> None:
        """CacheError unless ``size`` bytes fit the quota and leave MIN_FREE_BYTES free
        on the controller's disk."""
        quota = self.quota()
        if size > quota:
            raise CacheError(f"an artifact of {_mib(size)} is over the compile cache's quota of {_mib(quota)}",
                             hint=f"raise ${QUOTA_ENV}, or `dflashctl cache rm --older-than 30d`")
        self._own_root()
        free = shutil.disk_usage(self.root).free
        if free - size < MIN_FREE_BYTES:
            raise CacheError(f"an artifact of {_mib(size)} would leave {_mib(max(0, free - size))} free on the disk "
                             f"of {self.root} (at least {_mib(MIN_FREE_BYTES)} is kept free)",
                             hint="free disk space, or `dflashctl cache rm --older-than 30d`")

    def make_room(self, size: int, keep: tuple[str, Optional[str]]) -> None:
        """Remove the least recently used entries (never ``keep``'s: (key, domain))
        until ``size`` more bytes fit the quota."""
        quota = self.quota()
        entries = [e for e in self.entries() if (e.key, e.domain) != keep]
        held = sum(e.bytes for e in entries)
        while entries and held + size > quota:
            oldest = entries.pop()
            self.remove(oldest.key, oldest.domain)
            held -= oldest.bytes

    def _install(self, key: str, domain: Optional[str], tmp: str) -> None:
        """Rename the written directory ``tmp`` into place as ``key``'s entry of
        ``domain``; an entry held there goes only once the new one is there."""
        final = self._dir(key, domain)
        os.makedirs(os.path.dirname(final), mode=0o700, exist_ok=True)
        old = None
        if os.path.lexists(final):
            old = tempfile.mkdtemp(prefix=f".tmp-{key}-old-", dir=self.root)
            os.rename(final, os.path.join(old, "entry"))
        os.rename(tmp, final)
        if old:
            shutil.rmtree(old, ignore_errors=True)

    def read(self, key: str, domain: Optional[str] = None) -> tuple[dict, bytes]:
        """The entry's manifest and bytes, checked against each other (CacheError when
        they do not agree: the entry is damaged). Both are read through one open
        directory: an entry replaced meanwhile is read whole, old or new, never mixed."""
        directory = self._dir(key, domain)
        try:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            raise CacheError(f"compile artifact {key} is not held",
                             hint="`dflashctl cache ls` lists what is held") from None
        try:
            manifest = parse_manifest(_read_at(fd, trainer_cache.MANIFEST_FILE, trainer_cache.MAX_MANIFEST_BYTES)
                                      .decode("utf-8", "replace"), key)
            if manifest["key"] != key:
                raise CacheError(f"held compile artifact {key}: its manifest is {manifest['key']}'s")
            data = _read_at(fd, manifest["file"], manifest["bytes"])
        except OSError as e:
            raise CacheError(f"compile artifact {key}: cannot read it: {e}") from None
        finally:
            os.close(fd)
        verify(manifest, data, f"held compile artifact {key}")
        return manifest, data

    def touch(self, key: str, domain: Optional[str] = None, now: Optional[float] = None) -> None:
        path = os.path.join(self._dir(key, domain), USED_FILE)
        with open(path, "a"):
            pass
        when = time.time() if now is None else now
        os.utime(path, (when, when))

    def generation(self) -> int:
        """How many times entries were removed by the operator (``cache rm``): a run's
        trainer that sees it grow drops the bytecode it unpacked (``contract.ARTIFACT_GENERATION_ENV``)."""
        try:
            with open(os.path.join(self.root, GENERATION_FILE)) as f:
                return max(0, int(f.read(32).strip() or 0))
        except (OSError, ValueError):
            return 0

    def bump_generation(self) -> None:
        self._own_root()
        path = os.path.join(self.root, GENERATION_FILE)
        with open(path + ".tmp", "w") as f:
            f.write(f"{self.generation() + 1}\n")
        os.replace(path + ".tmp", path)

    def remove(self, key: str, domain: Optional[str] = None, *, every_domain: bool = False) -> bool:
        """Remove ``key``'s entry of ``domain`` (``every_domain``: of every domain and
        the old layout). True when something was removed."""
        places = [(k, d) for k, d in self._places() if k == key] if every_domain else [(key, domain)]
        removed = False
        for k, d in places:
            directory = self._dir(k, d)
            if os.path.lexists(directory):
                shutil.rmtree(directory)
                removed = True
        return removed

    def prune(self, older_than: float, now: Optional[float] = None) -> list[str]:
        """Remove the entries neither used nor created within ``older_than`` seconds,
        and temporary directories of writes that stopped that long ago."""
        now = time.time() if now is None else now
        removed = [e for e in self.entries() if now - e.age_reference > older_than]
        for e in removed:
            self.remove(e.key, e.domain)
        for name in _listdir(self.root):
            path = os.path.join(self.root, name)
            if name.startswith(".tmp-") and now - (_mtime(path) or now) > older_than:
                shutil.rmtree(path, ignore_errors=True)
        return [e.key for e in removed]

    def clear(self) -> list[str]:
        """Remove every entry of every domain, whatever its manifest holds (unreadable
        ones too), and every write in progress or left over; the issued domains stay."""
        removed = sorted(key for key, _ in self._places())
        for name in sorted(_listdir(self.root)):
            if _KEY.fullmatch(name) or _DOMAIN.fullmatch(name) or name.startswith(".tmp-"):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        return removed


class Receiver:
    """One artifact written into the store as it arrives: hashed and counted while it
    is written, refused the moment it is more than its manifest says, installed by
    ``commit`` only when its size and sha256 are the manifest's."""

    def __init__(self, cache: LocalCache, manifest: dict, origin: dict, clock: Callable[[], float]):
        self.cache, self.manifest, self.origin, self.clock = cache, manifest, origin, clock
        self.size, self.over = 0, False
        self._sha = hashlib.sha256()
        self.tmp = tempfile.mkdtemp(prefix=f".tmp-{manifest['key']}-", dir=cache.root)
        self._file = open(os.path.join(self.tmp, manifest["file"]), "wb")

    def write(self, chunk: bytes) -> bool:
        """Take ``chunk``; False (and nothing more is kept) once the bytes are more than
        the manifest's ``bytes``."""
        if self.over:
            return False
        if self.size + len(chunk) > self.manifest["bytes"]:
            self.over = True
            self.abort()
            return False
        self._sha.update(chunk)
        self._file.write(chunk)
        self.size += len(chunk)
        return True

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def commit(self) -> Entry:
        key, where = self.manifest["key"], f"artifact {self.manifest['key']}"
        domain = self.origin.get("domain")
        try:
            if self.over:
                raise CacheError(f"{where}: more than the {self.manifest['bytes']} bytes its manifest says: refused "
                                 "at that size")
            if self.size != self.manifest["bytes"]:
                raise CacheError(f"{where}: {self.size} bytes, the manifest says {self.manifest['bytes']}")
            sha = self._sha.hexdigest()
            if sha != self.manifest["sha256"]:
                raise CacheError(f"{where}: sha256 {sha[:16]}..., the manifest says {self.manifest['sha256'][:16]}...")
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self.cache.make_room(self.size, keep=(key, domain))
            origin = {**self.origin, "received": self.clock(), "sha256": sha}
            for name, content in ((trainer_cache.MANIFEST_FILE, json.dumps(self.manifest, indent=1, sort_keys=True)),
                                  (ORIGIN_FILE, json.dumps(origin, indent=1, sort_keys=True))):
                with open(os.path.join(self.tmp, name), "w") as f:
                    f.write(content)
                    f.flush()
                    os.fsync(f.fileno())
            self.cache._install(key, domain, self.tmp)
        except BaseException:
            self.abort()
            raise
        return self.cache.get(key, domain) or Entry(key, self.manifest, self.cache._dir(key, domain), origin=origin,
                                                    received=origin["received"], domain=domain)


def _read_at(directory_fd: int, name: str, limit: int) -> bytes:
    """Up to ``limit`` + 1 bytes of the plain file ``name`` in the open directory."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=directory_fd)
    with os.fdopen(fd, "rb") as f:
        return f.read(limit + 1)


def _read_origin(directory: str) -> dict:
    try:
        with open(os.path.join(directory, ORIGIN_FILE), "rb") as f:
            return contract.load_json_object(f.read(1 << 16).decode("utf-8", "replace"), ORIGIN_FILE)
    except (OSError, ValueError):
        return {}


def _mtime(path: str) -> Optional[float]:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


# --------------------------------------------------------------------------- matching (pure)


@dataclass(frozen=True)
class Wanted:
    """What an artifact must have been compiled for to fit a start."""

    config: str
    bundle: str
    gpu: Optional[str] = None  # None: not known (no nvidia-smi answer): not compared

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, "bundle": self.bundle, "gpu": self.gpu}


def differs(fields: dict, wanted: Wanted) -> Optional[str]:
    """The first of MATCHED_FIELDS whose value is not the wanted one, or None."""
    for name in MATCHED_FIELDS:
        value = getattr(wanted, name)
        if value is not None and fields.get(name) != value:
            return name
    return None


def choose(entries: Iterable[Entry], wanted: Wanted) -> tuple[list[Entry], list[tuple[str, str]]]:
    """(the entries that fit, best first; (key, first differing field) of the others).
    ``entries`` come most recently used first, and keep that order."""
    fit, other = [], []
    for e in entries:
        name = differs(e.fields, wanted)
        if name is None:
            fit.append(e)
        else:
            other.append((e.key, name))
    return fit, other


def gpu_name(readings: Iterable[Any], gpus: Iterable[int]) -> Optional[str]:
    """The key's ``gpu`` field for a start on these GPUs (nvidia-smi readings, objects
    or dicts with ``index`` and ``name``), as the trainer writes it: the sorted
    distinct names joined by commas; None when a name is not known."""
    wanted = set(gpus)
    if not wanted:
        return None
    names = {}
    for r in readings or ():
        index = r.get("index") if isinstance(r, dict) else getattr(r, "index", None)
        name = r.get("name") if isinstance(r, dict) else getattr(r, "name", None)
        if index in wanted and isinstance(name, str) and name:
            names[index] = name
    if set(names) != wanted:
        return None
    return ",".join(sorted(set(names.values())))


def config_digest(trainer: dict, model_config_sha256: Optional[str] = None) -> str:
    """The key's ``config`` field the run's trainer will compute from ``trainer``, the
    configuration as its config.json holds it (``files.run_files``: GPU indices
    renumbered under CUDA_VISIBLE_DEVICES). A model given by path is identified by its
    config.json on the run host: ``model_config_sha256`` is that file's sha256 there
    ('' or None: not readable there)."""
    from trainer.config import from_dict

    cfg = from_dict(trainer)
    shape = trainer_cache.shape_config(cfg)
    path = cfg.model.path
    if path:
        shape["model"]["path_config"] = (model_config_sha256[:16] if model_config_sha256
                                         else "path:" + hashlib.sha256(path.encode()).hexdigest()[:16])
    return trainer_cache.digest(shape)


def bundle_of(env: Optional[dict], bundle_hash: Optional[str]) -> str:
    """The key's ``bundle`` field: $DFLASH_BUNDLE_HASH when the run's environment sets
    it, else the deployed bundle's hash (its directory name)."""
    return (env or {}).get(trainer_cache.BUNDLE_ENV) or bundle_hash or ""


# --------------------------------------------------------------------------- on the run host

# The run directory's manifest (when a plain file) and, given a model path, the sha256
# of that model's config.json there. Arguments: run dir, model path ('' for none).
_LOOK = r"""
d=$1; mp=$2
if [ -n "$mp" ]; then
  case "$mp" in "~") mp=$HOME ;; "~/"*) mp=$HOME/${mp#"~/"} ;; esac
  s=
  if [ -f "$mp/config.json" ] && [ -r "$mp/config.json" ] && command -v sha256sum >/dev/null 2>&1; then
    s=$(sha256sum < "$mp/config.json" | cut -d' ' -f1)
  fi
  printf 'model_config=%s\n' "$s"
fi
m=$d/compile_cache/compile_cache.json
if [ -f "$m" ] && [ ! -L "$m" ]; then
  echo "manifest:"
  head -c 65537 "$m"
fi
exit 0
"""

# Receive an artifact on stdin into the run directory. Arguments: run dir, file name,
# size, sha256, manifest JSON. The bytes go to a temporary directory beside the final
# place, are checked, renamed into place, and the manifest is written last.
_RECEIVE = RECEIVE_CHECKED + r"""
set -u
d=$1; name=$2; size=$3; sha=$4; manifest=$5
c=$d/compile_cache
mkdir -p "$c" || exit 70
tmp=$(mktemp -d "$c/.tmp-XXXXXX") || exit 70
trap 'rm -rf "$tmp"' EXIT
trap 'exit 71' HUP INT TERM PIPE
receive_checked "$tmp/$name" "$size" "$sha" dflashctl-cache
printf '%s' "$manifest" > "$tmp/compile_cache.json" || {
  echo "dflashctl-cache: could not write the manifest" >&2; exit 72; }
mv -f "$tmp/$name" "$c/$name" || exit 75
mv -f "$tmp/compile_cache.json" "$c/compile_cache.json" || exit 75
for f in "$c"/*.bin; do
  [ "$f" = "$c/$name" ] || rm -f "$f"
done
echo uploaded
"""


def look_argv(run_dir: str, model_path: str = "") -> list[str]:
    return ["sh", "-c", _LOOK, "dflashctl-cache-look", run_dir, model_path or ""]


def receive_argv(run_dir: str, manifest: dict) -> list[str]:
    return ["sh", "-c", _RECEIVE, "dflashctl-cache-receive", run_dir, manifest["file"], str(manifest["bytes"]),
            manifest["sha256"], json.dumps(manifest, indent=1, sort_keys=True)]


def fetch_argv(run_dir: str, name: str) -> list[str]:
    return ["sh", "-c", 'exec cat -- "$1/compile_cache/$2"', "dflashctl-cache-fetch", run_dir, name]


@dataclass
class HostView:
    """What the run directory holds, and the model's config.json digest there."""

    manifest: Optional[dict] = None
    problem: Optional[str] = None  # a manifest that does not check out
    model_config_sha256: Optional[str] = None


def look(transport: "Transport", run_dir: str, model_path: Optional[str] = None,
         timeout: Optional[float] = 60.0) -> HostView:
    """One round trip: the run directory's manifest (checked) and the model's digest."""
    answer = transport.run(look_argv(run_dir, model_path or ""), timeout=timeout, limit=CACHE_LOOK).stdout
    head, marker, text = answer.partition("manifest:\n")
    view = HostView()
    for line in head.splitlines():
        if line.startswith("model_config="):
            view.model_config_sha256 = line.split("=", 1)[1].strip() or None
    if marker:
        try:
            view.manifest = parse_manifest(text, f"{run_dir}/compile_cache/{trainer_cache.MANIFEST_FILE}")
        except CacheError as e:
            view.problem = str(e)
    return view


@dataclass
class Outcome:
    """What ``provide`` or ``fetch`` did. status: provide: uploaded | present | none |
    failed; fetch: fetched | held | absent | failed."""

    status: str
    message: str
    key: Optional[str] = None
    bytes: int = 0
    seconds: float = 0.0
    severity: str = "info"
    detail: dict = field(default_factory=dict)

    def event_detail(self) -> dict[str, Any]:
        return {"status": self.status, "key": self.key, "bytes": self.bytes, "seconds": round(self.seconds, 2),
                **self.detail}


def provide(transport: "Transport", run_dir: str, trainer: dict, bundle: str, gpu: Optional[str] = None,
            cache: Optional[LocalCache] = None) -> Outcome:
    """Before a start: put the best held artifact that fits the run into its run
    directory, unless the run directory already holds one that fits. ``trainer``: its
    config.json; ``bundle``: ``bundle_of`` the run. Never raises for the artifact's
    sake: a start without it compiles cold."""
    cache = cache or LocalCache()
    try:
        domain = cache.domain_of(transport)
    except (CacheError, OSError) as e:
        return Outcome("failed", f"the compile-cache store cannot be used: {first_line(e)}", severity="warning")
    held = cache.entries()
    entries = [e for e in held if e.domain == domain.id]  # never an artifact from outside the host's trust domain
    if not entries:
        return Outcome("none", f"no compile artifacts held from {domain.name}" if held else "no compile artifacts held",
                       detail={"domain": domain.name, "outside_domain": len(held)})
    model_path = (trainer.get("model") or {}).get("path")
    try:
        view = look(transport, run_dir, model_path)
        wanted = Wanted(config_digest(trainer, view.model_config_sha256), bundle, gpu)
    except (DflashError, ValueError) as e:
        return Outcome("failed", f"could not look into the run directory: {first_line(e)}", severity="warning")
    detail = {"wanted": wanted.to_dict()}
    if view.manifest is not None and differs(view.manifest["fields"], wanted) is None:
        return Outcome("present", f"the run directory holds compile artifact {view.manifest['key']} already",
                       view.manifest["key"], detail=detail)
    fit, other = choose(entries, wanted)
    detail["mismatched"] = [{"key": k, "field": f} for k, f in other[:20]]
    if not fit:
        shown = ", ".join(f"{k} ({f} differs)" for k, f in other[:3]) + (f" and {len(other) - 3} more" if len(other) > 3
                                                                         else "")
        return Outcome("none", f"no held compile artifact fits this run: {shown}", detail=detail)
    damaged = []
    for entry in fit:
        try:  # the bytes checked here are the bytes sent: read once, from the domain's own entry
            manifest, data = cache.read(entry.key, domain.id)
        except CacheError as e:
            damaged.append(str(e))
            continue
        t0 = time.monotonic()
        try:
            transport.run(receive_argv(run_dir, manifest), input=data, timeout=TRANSFER_TIMEOUT)
        except DflashError as e:
            return Outcome("failed", f"upload of compile artifact {entry.key} failed: {first_line(e)}", entry.key,
                           severity="warning", detail={**detail, "damaged": damaged})
        cache.touch(entry.key, domain.id)
        seconds = time.monotonic() - t0
        note = f" (skipped {len(damaged)} damaged: {damaged[0]})" if damaged else ""
        message = f"compile artifact {entry.key} uploaded ({_mib(len(data))} in {seconds:.1f} s){note}"
        return Outcome("uploaded", message,
                       entry.key, len(data), seconds, "warning" if damaged else "info",
                       {**detail, "fields": manifest["fields"], "damaged": damaged})
    return Outcome("none", f"every held compile artifact that fits is damaged, none uploaded: {damaged[0]}",
                   severity="warning", detail={**detail, "damaged": damaged})


def expected_fields(trainer: dict, bundle: str, gpu: Optional[str], model_config_sha256: Optional[str]) -> Wanted:
    """The key fields a run's artifact must carry, from the run's own configuration
    (``trainer``: its config.json), the bundle the controller deployed and the GPU
    name its probes saw; never from what the host's manifest claims."""
    return Wanted(config_digest(trainer, model_config_sha256), bundle, gpu)


def fetch(transport: "Transport", run_dir: str, trainer: dict, bundle: str, gpu: Optional[str] = None,
          claim: str = "", run_id: str = "", cache: Optional[LocalCache] = None,
          clock: Callable[[], float] = time.time) -> Outcome:
    """Copy the run directory's artifact into the local store when it is what the
    controller expects: its config, bundle and GPU fields are the run's own
    (``expected_fields``), and a start that says ``miss`` (``claim``) found no held
    artifact of its trust domain that fits. The bytes are streamed into the store,
    hashed as they arrive and cut off past the manifest's size (itself within the
    store's quota); the entry records the host's trust domain and the controller's
    time. A held entry of the key is replaced by the newer verified copy, unless it
    is that copy already."""
    cache = cache or LocalCache()
    model_path = (trainer.get("model") or {}).get("path")
    try:
        domain = cache.domain_of(transport)
        view = look(transport, run_dir, model_path)
        wanted = expected_fields(trainer, bundle, gpu, view.model_config_sha256)
    except (DflashError, ValueError, OSError) as e:
        return Outcome("failed", f"could not look into the run directory: {first_line(e)}", severity="warning")
    if view.problem:
        return Outcome("failed", f"not copied back: {view.problem}", severity="warning")
    manifest = view.manifest
    if manifest is None:
        return Outcome("absent", "no compile artifacts in the run directory (none saved yet?)", severity="warning")
    key, detail = manifest["key"], {"expected": wanted.to_dict(), "domain": domain.name}
    wrong = differs(manifest["fields"], wanted)
    if wrong is not None:
        return Outcome("refused", f"compile artifact {key} not copied back: its {wrong} "
                       f"{str(manifest['fields'].get(wrong))[:40]!r} is not this run's {getattr(wanted, wrong)!r}",
                       key, severity="warning", detail=detail)
    if claim == "miss" and choose(cache.entries(domain.id), wanted)[0]:
        return Outcome("refused", f"compile artifact {key} not copied back: the run says it found none, but a held "
                       f"artifact of {domain.name} fits it (the controller did not expect a cold start)", key,
                       severity="warning", detail=detail)
    held = cache.get(key, domain.id)  # only this domain's entry: another domain's copy of the key is its own
    if held is not None and held.manifest["sha256"] == manifest["sha256"]:
        return Outcome("held", f"compile artifact {key} is held already", key, manifest["bytes"], detail=detail)
    t0 = time.monotonic()
    try:
        receiver = cache.receiver(manifest, {"domain": domain.id, "domain_name": domain.name,
                                             "inventory": domain.inventory, "host": transport.host.name,
                                             "run": run_id, "expected": wanted.to_dict()}, clock)
    except (CacheError, OSError) as e:
        return Outcome("failed", f"compile artifact {key} not copied back: {first_line(e)}", key, severity="warning",
                       detail=detail)
    try:
        transport.run(fetch_argv(run_dir, manifest["file"]), timeout=TRANSFER_TIMEOUT, stdout_sink=receiver.write,
                      limit=COPY_BACK)
        entry = receiver.commit()
    except (DflashError, OSError) as e:
        receiver.abort()
        if receiver.over:
            e = CacheError(f"more than the {manifest['bytes']} bytes its manifest says: refused at that size")
        return Outcome("failed", f"compile artifact {key} not copied back: {first_line(e)}", key, severity="warning",
                       detail=detail)
    seconds = time.monotonic() - t0
    replaced = " (replacing the older copy)" if held is not None else ""
    return Outcome("fetched", f"compile artifact {key} copied back{replaced} ({_mib(entry.bytes)} in {seconds:.1f} s)",
                   key, entry.bytes, seconds, detail={**detail, "fields": manifest["fields"]})


def copy_back(run_id: str, store: "Store", inventory: "Inventory", trainer: dict, bundle: str,
              gpu: Optional[str] = None, claim: str = "", *, clock: Callable[[], float] = time.time,
              cache: Optional[LocalCache] = None) -> Outcome:
    """``fetch`` for a run (``trainer``, ``bundle``, ``gpu``: what its own records
    say, ``runhost.artifact_inputs``), its outcome stored as an event on the run."""
    from dflashctl.hosts.transport import connect

    run = store.get_run(run_id)
    try:
        outcome = fetch(connect(run.host, inventory), run.run_dir, trainer, bundle, gpu, claim, run.id, cache, clock)
    except DflashError as e:
        outcome = Outcome("failed", f"not copied back: {first_line(e)}", severity="warning")
    store.add_event(run.id, EVENT_KIND, outcome.message, clock(), outcome.severity, outcome.event_detail())
    return outcome


def provide_for_run(transport: "Transport", run_dir: str, trainer: dict, bundle: str, gpu: Optional[str],
                    say: Callable[[str], None], record: Callable[[Outcome], None],
                    cache: Optional[LocalCache] = None) -> Outcome:
    """``provide`` as a launch or restart uses it: said (when there is something to
    say) and recorded as an event on the run."""
    outcome = provide(transport, run_dir, trainer, bundle, gpu, cache)
    if outcome.status != "none" or outcome.detail.get("mismatched") or outcome.detail.get("damaged"):
        say(outcome.message)
        record(outcome)
    return outcome


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"
