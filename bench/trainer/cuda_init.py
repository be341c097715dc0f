"""Does creating the CUDA context in a thread, while the main thread imports the rest
of what a trainer start needs (dynamo, inductor, flex_attention, transformers, the
trainer's modules: ``trainer.imports.MODULES``), shorten the start?

    python -m bench.trainer.cuda_init --repeat 4

Each start is a fresh interpreter with one bytecode cache (``-X pycache_prefix``, its
first start writes it and is not counted). ``serial``: import torch, the rest, then the
CUDA context (``torch.cuda.init()`` and a first allocation); ``overlap``: the context
in a thread started right after ``import torch``, joined after the imports. Prints one
JSON line per start and a summary: seconds to import torch, the rest, the context,
and in all.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from bench.common import REPO

CHILD = r"""
import json, sys, threading, time
t0 = time.perf_counter()
from trainer import imports
imports.hide_unused()
import torch
t_torch = time.perf_counter()
mode = sys.argv[1]
ctx = {}
def context():
    start = time.perf_counter()
    torch.cuda.init()
    torch.empty(1, device="cuda")
    ctx["s"] = time.perf_counter() - start
thread = threading.Thread(target=context) if mode == "overlap" else None
if thread:
    thread.start()
import importlib
for name in imports.MODULES:
    importlib.import_module(name)
t_rest = time.perf_counter()
if thread:
    thread.join()
else:
    context()
t_end = time.perf_counter()
print(json.dumps({"mode": mode, "torch_s": round(t_torch - t0, 3), "rest_s": round(t_rest - t_torch, 3),
                  "context_s": round(ctx["s"], 3), "total_s": round(t_end - t0, 3)}))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=4, help="starts per mode (after one that writes the bytecode)")
    args = p.parse_args(argv)
    prefix = tempfile.mkdtemp(prefix="bench-cuda-init-")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # the first start must leave its bytecode for the others

    def start(mode: str) -> dict:
        out = subprocess.run([sys.executable, "-X", f"pycache_prefix={prefix}", "-c", CHILD, mode], env=env,
                             cwd=REPO, capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    start("serial")  # writes the bytecode cache
    rows = {"serial": [], "overlap": []}
    for _ in range(args.repeat):
        for mode in rows:  # alternated: the page cache treats both alike
            row = start(mode)
            rows[mode].append(row)
            print(json.dumps(row), flush=True)
    summary = {mode: {key: sorted(r[key] for r in rs)[len(rs) // 2] for key in ("torch_s", "rest_s", "context_s", "total_s")}
               for mode, rs in rows.items()}
    print(json.dumps({"summary": "median", **summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
