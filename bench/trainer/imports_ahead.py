"""A cold start's imports (no bytecode for torch and the rest yet), with and without
the bytecode compiled ahead in worker processes while they run
(``trainer.bytecode.compile_ahead``, what a trainer start does on a cold cache).

    python -m bench.trainer.imports_ahead --repeat 3

Each start is a fresh interpreter on a fresh, empty bytecode cache (``-X
pycache_prefix``, and no bytecode written beside the sources), importing what a
trainer start imports (``trainer.imports.MODULES``); the two kinds alternate. Prints
one JSON line per start and the medians: seconds to import, and how many modules the
start compiled itself from source.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

from bench.common import REPO

CHILD = r"""
import importlib, importlib._bootstrap_external as be, json, sys, time
t0 = time.perf_counter()
compiled = [0]
original = be.SourceLoader.source_to_code
def counted(self, *args, **kwargs):  # every module this start compiles from source
    compiled[0] += 1
    return original(self, *args, **kwargs)
be.SourceLoader.source_to_code = counted
from trainer import bytecode, imports
ahead = bytecode.compile_ahead(sys.pycache_prefix) if sys.argv[1] == "ahead" else None
hidden = imports.hide_unused()
for name in imports.MODULES:
    importlib.import_module(name)
imports.show_again(hidden)
state = bytecode.stop_ahead(ahead)
print(json.dumps({"mode": sys.argv[1], "import_s": round(time.perf_counter() - t0, 3), "compiled_here": compiled[0],
                  "ahead": state}))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=3, help="cold starts of each kind")
    args = p.parse_args(argv)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    rows: dict[str, list[dict]] = {"plain": [], "ahead": []}
    for _ in range(args.repeat):
        for mode in rows:  # alternated: the page cache treats both alike
            prefix = tempfile.mkdtemp(prefix="bench-imports-")
            try:
                out = subprocess.run([sys.executable, "-X", f"pycache_prefix={prefix}", "-c", CHILD, mode], env=env,
                                     cwd=REPO, capture_output=True, text=True, check=True, timeout=300)
            finally:
                shutil.rmtree(prefix, ignore_errors=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows[mode].append(row)
            print(json.dumps(row), flush=True)
    summary = {mode: {key: sorted(r[key] for r in rs)[len(rs) // 2] for key in ("import_s", "compiled_here")}
               for mode, rs in rows.items()}
    print(json.dumps({"summary": "median", "cpus": os.cpu_count(), **summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
