"""Threads calling compiled layers, the way the trainer's drafter threads do, on the CPU.

Each of ``--threads`` replicas is a stack of small layers; the first layer's input needs
no gradient and the others' do (two cache entries per shape), and two shapes alternate.
Every shape is compiled first, then ``fail_on_recompile`` is set and the threads run
free: any recompile raises. ``--mode``:

- ``module``: every layer compiled with its own ``layer.compile()`` (the old trainer);
- ``shared``: one compiled callable for every layer of every replica;
- ``lane``: ``trainer.compile.PerLane``, a compiled copy of the layer's forward per thread.

Prints one JSON line: iterations run, failures, and the first error line of each.
Run as ``python -m tests.harness.compile_race --mode lane --iters 2000``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import traceback
import types


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("module", "shared", "lane"), required=True)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval: smaller switches threads more often (more chances to race)")
    ap.add_argument("--traceback", action="store_true", help="print the first failure's traceback to stderr")
    args = ap.parse_args(argv)

    import torch
    import torch.nn as nn

    from trainer.compile import PerLane, lane

    torch._dynamo.config.recompile_limit = 64

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            return torch.relu(self.lin(x)) * 2

    stacks = [[Layer() for _ in range(args.layers)] for _ in range(args.threads)]
    if args.mode == "module":
        for stack in stacks:
            for layer in stack:
                layer.compile(dynamic=False)
    elif args.mode == "shared":
        shared = torch.compile(Layer.forward, dynamic=False)
        for stack in stacks:
            for layer in stack:
                layer.forward = types.MethodType(shared, layer)
    else:
        forward = PerLane(Layer.forward, dynamic=False)
        for stack in stacks:
            for layer in stack:
                layer.forward = types.MethodType(forward, layer)

    shapes = [(2, 16), (4, 16)]

    def step(r: int, shape) -> None:
        x = torch.randn(shape)
        for layer in stacks[r]:
            x = layer(x)
        x.sum().backward()

    names = [f"drafter-{r}" for r in range(args.threads)]
    for r in range(args.threads):  # the warm-up: every thread's shapes, one at a time
        for shape in shapes:
            with lane(names[r]):
                step(r, shape)
    torch.compiler.set_stance("fail_on_recompile")
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)

    errors: list[str] = []
    done = [0] * args.threads

    def run(r: int) -> None:
        for i in range(args.iters):
            try:
                step(r, shapes[i % 2])
            except Exception as e:  # counted and reported, as the soak counts them
                if args.traceback and not errors:
                    traceback.print_exc()
                errors.append(str(e).splitlines()[0][:200])
                return
            done[r] += 1

    t0 = time.monotonic()
    threads = [threading.Thread(target=run, args=(r,), name=names[r]) for r in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"mode": args.mode, "iterations": sum(done), "failures": len(errors),
                      "errors": sorted(set(errors)), "seconds": round(time.monotonic() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
