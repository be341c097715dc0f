"""A trainer process started before it is needed: the next restart's, already imported.

A restart's trainer spends most of its start importing torch, its compiler and
transformers (7-8 s of 11 s on an H200 host with bytecode; bench/RESULTS.md). A
standby (``python -m trainer --standby TOKEN ...``, started by the controller once the
running process trains) does those imports, says so in ``standby.json`` and waits.
When the controller restarts the run it renames ``standby.<TOKEN>.go`` into place;
the standby takes it (an atomic rename to ``standby.<TOKEN>.went``), and from then on
it is the trainer exactly as a fresh process would be: it reads config.json as it is
then, resumes from the newest checkpoint, writes status.json and metrics. Until then
it has read nothing of the run but config.json's compile cache, touched no GPU and
written only ``standby.json``.

A standby leaves by itself, quietly (its script writes no exit code for it), when
the run ended with nothing to restart (exit code done or stopped, unless an
operator's restart holds it through the stop it makes: ``standby.<TOKEN>.hold``), or
when a newer standby replaced it in ``standby.json``. This module never starts, stops or signals
a process; it only waits, and imports what a start would.
"""

from __future__ import annotations

import importlib
import json
import os
import time

from dflashctl.core import contract

POLL_S = 0.1  # seconds between looks for the go file
ENDED = (contract.EXIT_DONE, contract.EXIT_STOPPED)

went_at: float | None = None  # unix time the standby became the trainer (train.Startup counts from it)


def _exit_code(run_dir: str) -> int | None:
    try:
        with open(os.path.join(run_dir, contract.EXIT_CODE_FILE)) as f:
            return int(f.read(32).strip())
    except (OSError, ValueError):
        return None


def _current(run_dir: str) -> str | None:
    try:
        with open(os.path.join(run_dir, contract.STANDBY_FILE)) as f:
            return json.loads(f.read(1 << 16)).get("token")
    except (OSError, ValueError, AttributeError, RecursionError):  # a file another process wrote: data, bounded
        return None


def _held(run_dir: str, token: str) -> bool:
    """Whether a restart holds this standby through the stop it makes (a fresh hold file)."""
    try:
        age = time.time() - os.stat(os.path.join(run_dir, contract.standby_hold(token))).st_mtime
    except OSError:
        return False
    return age < contract.STANDBY_HOLD_S


def wait(run_dir: str, token: str, cache_dir: str | None, log=print) -> bool:
    """Import, say ready, wait: True once the go file is taken (this process is the
    trainer now), False when there is nothing to wait for."""
    from trainer import bytecode, imports

    t0 = time.monotonic()
    bytecode.keep(cache_dir)
    hidden = imports.hide_unused()
    imports.remember_package_map(cache_dir)
    imports.prehash_triton()
    for name in imports.MODULES:
        importlib.import_module(name)
    imports.show_again(hidden)
    return wait_for_go(run_dir, token, round(time.monotonic() - t0, 2), log)


def wait_for_go(run_dir: str, token: str, import_s: float, log=print) -> bool:
    """Say ready in standby.json, then wait for the go file (``wait`` without the imports)."""
    global went_at
    ready = {"pid": os.getpid(), "token": token, "ready": time.time(), "import_s": import_s}
    contract.atomic_write_text(os.path.join(run_dir, contract.STANDBY_FILE), json.dumps(ready) + "\n")
    go, went = os.path.join(run_dir, contract.standby_go(token)), os.path.join(run_dir, contract.standby_went(token))
    while True:
        try:
            os.rename(go, went)
        except FileNotFoundError:
            pass
        else:
            went_at = time.time()
            log(f"standby {token}: taken over as the trainer ({import_s:.1f}s of imports done before)")
            return True
        if (_exit_code(run_dir) in ENDED and not _held(run_dir, token)) or _current(run_dir) != token:
            return False
        time.sleep(POLL_S)
