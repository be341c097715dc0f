"""Threads calling compiled layers, the way the trainer's drafter threads do, on the CPU.

Each of ``--threads`` replicas is a stack of small layers; the first layer's input needs
no gradient and the others' do (two cache entries per shape), and two shapes alternate.
Every shape is compiled first, then ``fail_on_recompile`` is set and the threads run
free: any recompile raises. ``--mode``:

- ``module``: every layer compiled with its own ``layer.compile()`` (the old trainer);
- ``shared``: one compiled callable for every layer of every replica;
- ``lane``: ``trainer.compile.PerLane``, a compiled copy of the layer's forward per thread;
- ``aot``: ``trainer.compile.Shared``, each variant compiled once ahead of its call and
  called by every thread without Dynamo; every 50th step of each thread is also run
  eagerly on the same weights and input, and any difference counts as a failure.

Prints one JSON line: iterations run, failures, the first error line of each, the
warm-up's seconds and (``aot``) the variants compiled and those loaded (saved in the
compile cache by an earlier run on the same ``TORCHINDUCTOR_CACHE_DIR``).
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

import torch
import torch.nn as nn


class Layer(nn.Module):  # at module level: an ahead-of-time compile saves its type by name
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.lin(x)) * 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("module", "shared", "lane", "aot"), required=True)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval: smaller switches threads more often (more chances to race)")
    ap.add_argument("--traceback", action="store_true", help="print the first failure's traceback to stderr")
    args = ap.parse_args(argv)

    from trainer.compile import PerLane, Shared, freeze_shared, lane

    torch._dynamo.config.recompile_limit = 64

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
        forward = (Shared if args.mode == "aot" else PerLane)(Layer.forward, dynamic=False)
        for stack in stacks:
            for layer in stack:
                layer.forward = types.MethodType(forward, layer)

    shapes = [(2, 16), (4, 16)]

    def step(r: int, shape, check: bool = False) -> None:
        x = torch.randn(shape)
        y = x
        for layer in stacks[r]:
            y = layer(y)
        y.sum().backward()
        if check:  # the same weights and input, eagerly: the compiled call gave this thread's own answer
            grads = [layer.lin.weight.grad.clone() for layer in stacks[r]]
            for layer in stacks[r]:
                layer.lin.weight.grad = None
            e = x
            for layer in stacks[r]:
                e = Layer.forward(layer, e)
            e.sum().backward()
            if not torch.allclose(y, e, atol=1e-5) or not all(
                    torch.allclose(g, layer.lin.weight.grad, atol=1e-5) for g, layer in zip(grads, stacks[r])):
                raise AssertionError("a compiled step's output or gradient differs from the eager one's")
        for layer in stacks[r]:
            layer.lin.weight.grad = None

    names = [f"drafter-{r}" for r in range(args.threads)]
    warm = time.monotonic()
    for r in range(args.threads):  # the warm-up: every thread's shapes, one at a time
        for shape in shapes:
            with lane(names[r]):
                step(r, shape)
    warmup_s = time.monotonic() - warm
    torch.compiler.set_stance("fail_on_recompile")
    freeze_shared()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)

    errors: list[str] = []
    done = [0] * args.threads

    def run(r: int) -> None:
        for i in range(args.iters):
            try:
                step(r, shapes[i % 2], check=args.mode == "aot" and i % 50 == 0)
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
                      "errors": sorted(set(errors)), "seconds": round(time.monotonic() - t0, 1),
                      "warmup_s": round(warmup_s, 1),
                      "compiles": forward.compiles if args.mode == "aot" else None,
                      "loaded": forward.loaded if args.mode == "aot" else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
