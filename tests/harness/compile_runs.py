"""Child processes of the compile tests (tests/trainer/test_compile_*.py): each starts
with Dynamo's caches empty and its own inductor cache directory under the test's
tmp_path. No torch here: the parent only reads what the child prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.harness import REPO


ROOT = REPO


def run_python(args: list[str], tmp_path, pythonpath: tuple = ()) -> tuple[dict, str]:
    """``python ARGS`` with ``tmp_path/inductor`` as its inductor cache: its last line of
    stdout as JSON, and its stderr."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), *map(str, pythonpath)])}
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=400, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def race(mode: str, tmp_path, iters: int = 1500) -> dict:
    return race_with_stderr(mode, tmp_path, iters)[0]


def race_with_stderr(mode: str, tmp_path, iters: int = 1500) -> tuple[dict, str]:
    return run_python(["-m", "tests.harness.compile_race", "--mode", mode, "--iters", str(iters)], tmp_path)
