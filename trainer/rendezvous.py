"""Joining a multi-host run: the store at ``MASTER_ADDR:MASTER_PORT``, and every rank's
proof of the run's secret before any data is accepted.

The controller writes a fresh secret for each start into every host's run directory
(``rendezvous.key``, mode 0600; never on a command line or in the environment). A
process that holds the port in rank 0's place (another user's listener after a rank
failure, a stale process of an earlier start) does not know it.

The proof runs on the store before the process group exists, so nothing has been
received from a peer yet: every rank writes a fresh nonce, then, once it has every
nonce, ``HMAC(key, "proof" | rank | every nonce)``; each checks every other rank's
proof. Both live under names derived from the key (``proof_prefix``): a stranger on
the port cannot write over them. A store that is not this run's (it answers with no proof, a wrong one, or
replays an old one: the nonces are new) is refused with a message naming the address
and what to do. Both derive a session key from the same transcript; every frame one
rank sends another is tagged with it (trainer/wire.py).

After the proof the store stays authenticated for the process's whole life
(``Signed``): every value a rank writes (its host and pid, heartbeat, step, failure)
lives under a name derived from the session key, tagged with an HMAC of that key
over the name, a counter that only grows and the value. A value that does not verify,
or an older one written again, is a stranger's: ignored, named once in the log,
never a reason to blame the rank it was written for. A write to the names torch's
env:// users would guess (``dflash/beat/1``: no rank of this run writes them) is
named the same way.

Without a key file and without ``DFLASHCTL_HOST`` (a run started by hand, torchrun on
a trusted machine) the rendezvous is unauthenticated and says so in the log; a run the
controller started (``DFLASHCTL_HOST`` set) refuses to start without its key.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import re
import secrets
import stat
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from dflashctl.core import contract

KEY_ENV = "DFLASHCTL_RENDEZVOUS_KEY_FILE"  # a key file elsewhere than the run directory (by hand)
MIN_KEY_BYTES = 16
_PREFIX = "dflash/auth"


class RendezvousError(RuntimeError):
    """This process cannot join the run: the port is taken, the peer is not this run's, the key is missing."""


@dataclass
class Joined:
    store: "object"  # torch.distributed.Store (the raw one: the process group prefixes its own keys)
    rank: int
    world: int
    session_key: bytes
    authenticated: bool
    where: str = ""  # MASTER_ADDR:MASTER_PORT, for messages


def key_path(run_dir: str) -> str:
    return os.environ.get(KEY_ENV) or os.path.join(run_dir, contract.RENDEZVOUS_KEY_FILE)


def read_key(run_dir: str) -> Optional[bytes]:
    """The run's secret for this start, or None where none is required (see the module docstring)."""
    path = key_path(run_dir)
    try:
        st = os.stat(path)
        with open(path) as f:
            text = f.read(4096).strip()
    except FileNotFoundError:
        if os.environ.get(contract.HOST_ENV):
            raise RendezvousError(f"{path}: missing; a multi-host run started by dflashctl proves its secret from "
                                  "this file before it joins. Start the run with `dflashctl launch` or "
                                  "`dflashctl restart`, which write it on every host") from None
        return None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise RendezvousError(f"{path}: readable or writable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
                              f"`chmod 600 {path}` and start again")
    if not re.fullmatch(r"[0-9a-f]+", text) or len(text) % 2 or len(text) // 2 < MIN_KEY_BYTES:
        raise RendezvousError(f"{path}: not a key (at least {MIN_KEY_BYTES} bytes as hex expected)")
    return bytes.fromhex(text)


def _port_message(addr: str, port: str, error: BaseException) -> Optional[str]:
    text = str(error)
    if "EADDRINUSE" in text or "ddress already in use" in text:
        return (f"rendezvous port {port} on this host is in use by another process (EADDRINUSE): "
                f"this run's rank 0 cannot listen on it. `ss -ltnp 'sport = :{port}'` shows who holds it; "
                "stop that process, or set rendezvous.port in the playbook to a free port, then restart the run")
    return None


def open_store(timeout_s: float):
    """The env:// store (rank 0 listens, the others connect), as init_process_group would make it."""
    import torch.distributed as dist
    from torch.distributed.rendezvous import rendezvous

    addr, port = os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?")
    try:
        store, rank, world = next(rendezvous("env://", timeout=datetime.timedelta(seconds=timeout_s)))
    except (RuntimeError, dist.DistError) as e:  # DistNetworkError, DistStoreError, ...
        said = _port_message(addr, port, e)
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise RendezvousError(said or f"could not join the rendezvous at {addr}:{port}: {first}") from e
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store, rank, world


def _wait(store, keys: list[str], deadline: float, what: str, addr: str) -> None:
    left = deadline - time.monotonic()
    try:
        store.wait(keys, datetime.timedelta(seconds=max(0.1, left)))
    except Exception as e:  # noqa: BLE001 - a store that never answers is a refusal, whatever torch calls it
        raise RendezvousError(f"the rendezvous at {addr} gave no {what} within {max(0.0, left):.0f}s: it is not "
                              "this run's, or its rank 0 is not there (another process may hold the port); "
                              f"refusing to join, nothing was accepted from it ({type(e).__name__})") from e


def proof_prefix(key: Optional[bytes]) -> str:
    """Where the proof's nonces and proofs live: under a name derived from the run's
    secret, which a stranger on the port cannot guess (so cannot write over); the
    plain prefix without a key."""
    return f"{_PREFIX}/{hmac.new(key, b'proof names', hashlib.sha256).hexdigest()[:24]}" if key else _PREFIX


def prove(store, rank: int, world: int, key: Optional[bytes], timeout_s: float) -> tuple[bytes, bool]:
    """Every rank proves ``key`` to every other (see the module docstring); returns
    (session key, authenticated). Raises RendezvousError naming the rank whose proof failed."""
    addr = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    deadline = time.monotonic() + timeout_s
    prefix = proof_prefix(key)
    store.set(f"{prefix}/nonce/{rank}", secrets.token_hex(16))
    nonce_keys = [f"{prefix}/nonce/{r}" for r in range(world)]
    _wait(store, nonce_keys, deadline, "nonce from every rank", addr)
    nonces = [store.get(k) for k in nonce_keys]
    if any(len(n) != 32 for n in nonces):
        raise RendezvousError(f"the rendezvous at {addr} holds a malformed nonce: not this run's; refusing to join")
    transcript = b"|".join([str(world).encode(), *nonces])
    if key is None:
        return hashlib.sha256(b"session|" + transcript).digest(), False

    def proof(r: int) -> bytes:
        return hmac.new(key, b"proof|%d|" % r + transcript, hashlib.sha256).hexdigest().encode()

    store.set(f"{prefix}/proof/{rank}", proof(rank))
    proof_keys = [f"{prefix}/proof/{r}" for r in range(world) if r != rank]
    _wait(store, proof_keys, deadline, "proof of the run's secret from every rank", addr)
    for r in range(world):
        if r != rank and not hmac.compare_digest(store.get(f"{prefix}/proof/{r}"), proof(r)):
            raise RendezvousError(
                f"rank {r} at the rendezvous {addr} did not prove this start's secret ({contract.RENDEZVOUS_KEY_FILE}): "
                f"it is not this run's process (another process may hold the port, or an older start); "
                "refusing to join, nothing was accepted from it")
    return hmac.new(key, b"session|" + transcript, hashlib.sha256).digest(), True


def join(run_dir: str, timeout_s: float) -> Joined:
    """Open the store and prove the secret; the process group is made on the returned store."""
    key = read_key(run_dir)
    store, rank, world = open_store(timeout_s)
    session, authenticated = prove(store, rank, world, key, timeout_s)
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    return Joined(store, rank, world, session, authenticated, where)


# --------------------------------------------------------------------------- after the proof

MAX_VALUE_BYTES = 4096  # a signed value (host and pid, a count, a failure message); larger is not one
KINDS = ("info", "beat", "step", "failed")  # what each rank writes: host and pid, heartbeat, step, its failure


class Signed:
    """This start's values on the store, bound to its session key (see the module
    docstring). ``set(kind, value)`` writes this rank's; ``get(kind, rank)`` reads
    another's: (counter, value), or None when it is absent or a stranger's. Thread-safe."""

    def __init__(self, store, session_key: bytes, rank: int, where: str = "",
                 say: Optional[Callable[[str], None]] = None, authenticated: bool = False):
        self.store, self.rank, self.where = store, rank, where
        self.authenticated = authenticated  # the proof ran under secret names: the plain ones are strangers' too
        self._mac_key = hmac.new(session_key, b"values", hashlib.sha256).digest()
        self._tag = hmac.new(session_key, b"names", hashlib.sha256).hexdigest()[:24]
        self._counter = 0
        self._lock = threading.Lock()
        self._seen: dict[str, int] = {}
        self.strangers: dict[str, str] = {}  # name -> why, each named once
        self.stranger_at: dict[str, float] = {}  # name -> when (monotonic) a stranger's value was last read there
        self.say = say or (lambda text: print(text, file=sys.stderr, flush=True))

    def name(self, kind: str, rank: int) -> str:
        return f"dflash/{self._tag}/{kind}/{rank}"

    def _mac(self, name: str, counter: int, value: bytes) -> bytes:
        return hmac.new(self._mac_key, b"%s|%d|" % (name.encode(), counter) + value, hashlib.sha256).hexdigest().encode()

    def set(self, kind: str, value: str, store=None) -> None:
        name, data = self.name(kind, self.rank), value.encode("utf-8")[:MAX_VALUE_BYTES - 100]
        with self._lock:
            self._counter += 1
            counter = self._counter
        (store or self.store).set(name, b"%d %s " % (counter, self._mac(name, counter, data)) + data)

    def get(self, kind: str, rank: int, store=None) -> Optional[tuple[int, str]]:
        store, name = store or self.store, self.name(kind, rank)
        if not store.check([name]):
            return None
        return self.verify(name, store.get(name))

    def verify(self, name: str, raw: bytes) -> Optional[tuple[int, str]]:
        """(counter, value) of ``raw`` read at ``name``, or None (and the stranger named)."""
        parts = bytes(raw[:MAX_VALUE_BYTES + 1]).split(b" ", 2)
        if len(raw) > MAX_VALUE_BYTES or len(parts) != 3 or not parts[0].isdigit() or len(parts[0]) > 18:
            return self.stranger(name, "a value not in this start's form")
        counter, mac, data = int(parts[0]), parts[1], parts[2]
        if not hmac.compare_digest(mac, self._mac(name, counter, data)):
            return self.stranger(name, "a value not signed with this start's key")
        with self._lock:
            if counter < self._seen.get(name, 0):
                return self.stranger(name, f"an older value written again (counter {counter}, "
                                           f"{self._seen[name]} read before)")
            self._seen[name] = counter
        return counter, data.decode("utf-8", "replace")

    def look_for_strangers(self, ranks, store=None) -> None:
        """Name a write to the names torch's users would guess (``dflash/beat/1``): no
        rank of this run writes them, so whoever did is a stranger on the port."""
        store = store or self.store
        for r in ranks:
            names = [f"dflash/{kind}/{r}" for kind in KINDS]
            if self.authenticated:
                names += [f"{_PREFIX}/nonce/{r}", f"{_PREFIX}/proof/{r}"]
            for name in names:
                if name not in self.strangers and store.check([name]):
                    self.stranger(name, "no rank of this run writes it")

    def stranger(self, name: str, why: str) -> None:
        self.stranger_at[name] = time.monotonic()
        if name not in self.strangers:
            self.strangers[name] = why
            self.say(f"warning: rendezvous store{' at ' + self.where if self.where else ''}: {name} holds {why}: "
                     "a stranger's write, ignored (no rank is blamed for it); someone who is not this run's "
                     "reaches the rendezvous port")
        return None

    def tampered(self, kind: str, rank: int, within: float) -> bool:
        """Whether a stranger's value was read at ``rank``'s ``kind`` within the last ``within`` seconds."""
        at = self.stranger_at.get(self.name(kind, rank))
        return at is not None and time.monotonic() - at < within
