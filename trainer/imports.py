"""What a trainer start imports, and what it keeps other libraries from importing.

transformers imports some optional packages eagerly when they are installed, for
features the trainer never uses: scikit-learn (with scipy) for assisted
generation's candidate generator, 1.2 s of every start on an image that has it
(``python -X importtime``, H200 host, bench/RESULTS.md). ``hide_unused`` makes
those packages look absent (``sys.modules[name] = None``: ``importlib.util.find_spec``
then answers None and a plain ``import`` raises ImportError), before anything
imports transformers. Nothing here imports torch.
"""

from __future__ import annotations

import sys

# Packages the trainer's code paths never use, that a dependency imports when present.
UNUSED = ("sklearn",)

# What a start imports before its first step (a standby imports these while it waits).
MODULES = (
    "torch", "torch._dynamo", "torch._inductor.compile_fx", "torch.nn.attention.flex_attention",
    "transformers", "trainer.target", "trainer.model", "trainer.pipeline", "trainer.compile",
    "trainer.compile_cache", "trainer.checkpoint", "trainer.data", "trainer.optim", "trainer.step",
    "trainer.attention", "trainer.anchors", "trainer.profiling", "trainer.distributed",
)


def hide_unused(names: tuple[str, ...] = UNUSED) -> list[str]:
    """Make ``names`` look not installed to this process; returns those hidden (a
    package already imported is left alone)."""
    hidden = []
    for name in names:
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]
            hidden.append(name)
    return hidden
