"""What one rank sends another: data in one framed, authenticated byte string, never a pickle.

A frame is ``MAGIC | tag | header length | header JSON | body``. The tag is an
HMAC-SHA256 of everything after it, under the session key both ranks derived
when they proved the run's secret (trainer/rendezvous.py), so a frame from a
process that does not hold this start's secret is refused before any of it is
read. The header is JSON (bounded: size, depth by shape, keys checked) and says
how the body splits; the body is raw bytes. Received file names are plain names
(no separator, no ``..``, no leading dot): the receiver writes them into its
scratch directory and nowhere else.

Torch-free: the tensors that carry a frame are distributed.py's business.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import shutil
import struct
from typing import Any, Optional

MAGIC = b"DFLWIRE1"
TAG_BYTES = 32
MAX_HEADER_BYTES = 1 << 20
MAX_FILES = 64
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}\Z")
_LEN = struct.Struct(">Q")
_PREFIX = len(MAGIC) + TAG_BYTES + _LEN.size


class WireError(ValueError):
    """What another rank sent is refused: not this format, not authentic, or out of bounds."""


def _tag(key: bytes, signed: bytes) -> bytes:
    return hmac.new(key, signed, hashlib.sha256).digest()


def pack(header: dict[str, Any], body: bytes, key: bytes) -> bytes:
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    signed = _LEN.pack(len(raw)) + raw + body
    return MAGIC + _tag(key, signed) + signed


def unpack(frame: bytes, key: bytes) -> tuple[dict[str, Any], memoryview]:
    """(header, body) of an authentic frame, else WireError saying why."""
    view = memoryview(frame)
    if len(view) < _PREFIX or bytes(view[:len(MAGIC)]) != MAGIC:
        start = bytes(view[:2])
        what = " (a pickle: a peer running code that sends objects, refused)" if start[:1] == b"\x80" else ""
        raise WireError(f"not a dflash frame{what}: {len(view)} bytes starting {bytes(view[:8])!r}")
    tag, signed = bytes(view[len(MAGIC):len(MAGIC) + TAG_BYTES]), view[len(MAGIC) + TAG_BYTES:]
    if not hmac.compare_digest(tag, _tag(key, signed)):
        raise WireError("the frame's tag does not match this start's rendezvous key (sent by a process that "
                        "does not hold the run's secret, or altered on the way)")
    (n,) = _LEN.unpack(signed[:_LEN.size])
    if n > MAX_HEADER_BYTES or _LEN.size + n > len(signed):
        raise WireError(f"frame header of {n} bytes is out of bounds (at most {MAX_HEADER_BYTES}, "
                        f"{len(signed) - _LEN.size} sent)")
    try:
        header = json.loads(bytes(signed[_LEN.size:_LEN.size + n]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise WireError(f"frame header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise WireError(f"frame header is a {type(header).__name__}, not an object")
    return header, signed[_LEN.size + n:]


# --------------------------------------------------------------------------- checkpoint files


def pack_files(files: Optional[dict[str, bytes]], key: bytes) -> bytes:
    """A checkpoint directory's files (or None: nothing to resume from) as one frame."""
    if files is None:
        return pack({"kind": "none"}, b"", key)
    names = sorted(files)
    return pack({"kind": "files", "files": [[n, len(files[n])] for n in names]}, b"".join(files[n] for n in names), key)


def unpack_files(frame: bytes, key: bytes) -> Optional[dict[str, bytes]]:
    header, body = unpack(frame, key)
    if header.get("kind") == "none" and set(header) == {"kind"}:
        return None
    listing = header.get("files")
    if header.get("kind") != "files" or set(header) != {"kind", "files"} or not isinstance(listing, list):
        raise WireError(f"frame header is not a file listing: keys {sorted(header)[:8]}")
    if len(listing) > MAX_FILES:
        raise WireError(f"{len(listing)} files sent, at most {MAX_FILES}")
    out, offset = {}, 0
    for entry in listing:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
                and isinstance(entry[1], int) and not isinstance(entry[1], bool) and entry[1] >= 0):
            raise WireError(f"file entry {str(entry)[:80]!r} is not [name, size]")
        name, size = entry
        if not NAME.match(name) or ".." in name:
            raise WireError(f"file name {name[:80]!r} is not a plain name (letters, digits, '._-'; no path)")
        if name in out:
            raise WireError(f"file {name!r} sent twice")
        if offset + size > len(body):
            raise WireError(f"file {name!r} claims {size} bytes; only {len(body) - offset} left in the frame")
        out[name] = bytes(body[offset:offset + size])
        offset += size
    if offset != len(body):
        raise WireError(f"{len(body) - offset} bytes after the listed files")
    return out


def write_files(files: dict[str, bytes], scratch_dir: str) -> str:
    """Write received ``files`` into ``scratch_dir`` (emptied first: no file of an earlier
    resume is mixed in); each path is checked to stay inside it. Returns the directory."""
    if os.path.islink(scratch_dir):
        raise WireError(f"{scratch_dir} is a symbolic link; the received checkpoint goes only into a plain directory")
    shutil.rmtree(scratch_dir, ignore_errors=True)
    os.makedirs(scratch_dir, mode=0o700)
    root = os.path.realpath(scratch_dir)
    for name, data in files.items():
        path = os.path.join(root, name)
        if not NAME.match(name) or ".." in name or os.path.dirname(os.path.realpath(path)) != root:
            raise WireError(f"file name {name[:80]!r} escapes {scratch_dir}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    return scratch_dir
