"""A shard's scan (``scan_shard``), and the scan kept: what ``ShardDataset`` learns by
parsing every line of a shard (each usable line's offset, line number and length; the
bad lines; how many were too short), saved in the run directory so that a restart
reads it in milliseconds where the scan parses the whole corpus again (about 0.6 ms a
2,048-token line on a 2-core machine: minutes for a real corpus, at every restart).

One file a shard, ``<run>/data-index/<digest of the shard's path>.idx``: a JSON
header line, then the three arrays, little-endian. No pickle: the header is checked
field by field and the arrays by their sizes, order and bounds. A file that does not
match the shard as it is now (its path, size, modification time, inode) or the scan
it would stand for (largest bucket, loss tokens, vocabulary) is not used: the shard
is scanned again and the file replaced. A shard edited in a way that keeps its size
and modification time is still caught where a batch reads a line (``ShardDataset.get``
parses it again).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from array import array
from dataclasses import dataclass, field
from typing import Optional

from dflashctl.core import contract
from trainer.data.records import ErrorBudget, parse_line

INDEX_DIR = "data-index"
VERSION = 1
# The arrays in the file, in order: (field, typecode). Sizes fixed by the typecodes.
ARRAYS = (("offsets", "q"), ("line_no", "q"), ("lengths", "i"))
MAX_HEADER = 1 << 20  # bytes: the bad lines' reasons are capped (ShardScan.bad)


@dataclass
class ShardScan:
    """One shard's scan: its usable lines and what was skipped."""

    offsets: array = field(default_factory=lambda: array("q"))
    line_no: array = field(default_factory=lambda: array("q"))
    lengths: array = field(default_factory=lambda: array("i"))
    bad: list[list] = field(default_factory=list)  # [line number, reason], in order
    short: int = 0


def scan_shard(path: str, max_len: int, min_loss_tokens: int, vocab_size: Optional[int],
               errors: ErrorBudget) -> ShardScan:
    """Parse and check every line of ``path``. A bad line is reported to ``errors`` at
    once (past its budget the scan stops, and nothing is kept) and recorded."""
    scan = ShardScan()
    with open(path, "rb") as f:
        offset, line_no = 0, 0
        for raw in f:
            line_no += 1
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            try:
                ids, mask = parse_line(raw, vocab_size)
            except ValueError as e:
                errors.bad(f"{path}:{line_no}", str(e))
                scan.bad.append([line_no, str(e)])
                continue
            if sum(mask[:max_len]) < min_loss_tokens:
                scan.short += 1
                continue
            scan.offsets.append(start)
            scan.line_no.append(line_no)
            scan.lengths.append(min(len(ids), max_len))
    return scan


def identity(path: str, max_len: int, min_loss_tokens: int, vocab_size: Optional[int]) -> dict:
    """What a kept scan must match to stand for a scan of ``path`` now."""
    st = os.stat(path)
    return {"version": VERSION, "path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "inode": st.st_ino, "max_len": max_len, "min_loss_tokens": min_loss_tokens, "vocab_size": vocab_size}


def index_file(index_dir: str, path: str) -> str:
    return os.path.join(index_dir, hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:32] + ".idx")


def save(index_dir: str, ident: dict, scan: ShardScan) -> None:
    """Write the scan beside the others, whole or not at all (a temporary file
    renamed over the old one)."""
    header = {**ident, "count": len(scan.lengths), "short": scan.short, "bad": scan.bad}
    final = index_file(index_dir, ident["path"])
    tmp = f"{final}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(header, separators=(",", ":")).encode() + b"\n")
            for name, _ in ARRAYS:
                values = getattr(scan, name)
                if sys.byteorder != "little":
                    values = array(values.typecode, values)
                    values.byteswap()
                values.tofile(f)
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def load(index_dir: str, ident: dict) -> tuple[Optional[ShardScan], str]:
    """The scan kept for ``ident`` and "" where it matches and reads whole; else
    None and why not (said in trainer.log: the shard is scanned again)."""
    path = index_file(index_dir, ident["path"])
    try:
        with open(path, "rb") as f:
            head = f.readline(MAX_HEADER)
            body = f.read()
    except FileNotFoundError:
        return None, "none kept"
    except OSError as e:
        return None, f"unreadable ({e.strerror})"
    try:
        header = json.loads(head)
    except ValueError:
        return None, "its header is not JSON"
    if not isinstance(header, dict):
        return None, "its header is not an object"
    changed = [k for k, v in ident.items() if header.get(k) != v]
    if changed:
        return None, f"made for another {'/'.join(changed)}"
    count, short, bad = header.get("count"), header.get("short"), header.get("bad")
    if not (type(count) is int and count >= 0 and type(short) is int and short >= 0 and isinstance(bad, list)
            and all(isinstance(b, list) and len(b) == 2 and type(b[0]) is int and isinstance(b[1], str) for b in bad)):
        return None, "its header's counts are not what a scan writes"
    widths = [array(code).itemsize for _, code in ARRAYS]
    if len(body) != count * sum(widths):
        return None, f"{len(body)} bytes of arrays where {count} lines need {count * sum(widths)} (cut short?)"
    scan, at = ShardScan(bad=bad, short=short), 0
    for (name, code), width in zip(ARRAYS, widths):
        values = array(code)
        values.frombytes(body[at:at + count * width])
        if sys.byteorder != "little":
            values.byteswap()
        setattr(scan, name, values)
        at += count * width
    if not _plausible(scan, ident):
        return None, "its offsets, line numbers or lengths are out of order or out of bounds"
    return scan, ""


def _plausible(scan: ShardScan, ident: dict) -> bool:
    """Offsets inside the shard and rising, line numbers rising from 1, lengths within
    the scan's bounds: what a scan of this shard could have written."""
    n, off, line, lengths = len(scan.lengths), scan.offsets, scan.line_no, scan.lengths
    if n == 0:
        return True
    if off[0] < 0 or off[-1] >= ident["size"] or line[0] < 1:
        return False
    if any(off[i] >= off[i + 1] or line[i] >= line[i + 1] for i in range(n - 1)):
        return False
    return 2 <= min(lengths) and max(lengths) <= ident["max_len"]


def directory(run_dir: str) -> str:
    """``<run>/data-index``, made private (contract.private_dir): the trainer trusts
    what it reads there only as far as the checks above."""
    return contract.private_dir(os.path.join(run_dir, INDEX_DIR), "data index")
