"""The triton loss kernel (trainer.loss_kernel) against the eager reference
(trainer.loss.chunk_cross_entropy), run by triton's interpreter on the CPU
(TRITON_INTERPRET=1) in a child process: the same kernel code the GPU compiles,
executed element by element. scripts/test.sh installs triton and a NumPy the
interpreter runs with into .venv/triton-interp, apart from the test environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests import harness

REPO = str(harness.REPO)
INTERP = os.path.join(REPO, ".venv", "triton-interp")

CHECK = r"""
import json, sys, torch
from trainer import loss_kernel
from trainer.loss import chunk_cross_entropy

torch.manual_seed(0)
C, V = 8, 10000                      # V: two full blocks of 4096 and a masked tail
logits = (torch.randn(C, V) * 4).to(torch.bfloat16)
labels = torch.tensor([0, V - 1, 123, 4096, 9000, 5, 77, 8191])
weight = torch.tensor([1.0, 0.5, 0.0, 2.0, 1.0, 0.25, 1.0, 1.0])
top = float(logits.float().max()) + 4
logits[0, 0] = top                   # row 0: its label is the top-1
logits[1, V - 1] = top               # row 1: the top-1 is the last column, in the tail
logits[6, 77] = top; logits[6, 5000] = top   # row 6: a tie across blocks, the first (the label) wins
logits[7, 4000] = top; logits[7, 8191] = top # row 7: a tie across blocks, the label is the second
logits[3, 4096] = top; logits[3, 4097] = top # row 3: a tie inside a block, the label is the first
out = {}
ref = chunk_cross_entropy(logits.clone(), labels, weight, True)
got = loss_kernel.chunk_cross_entropy(logits, labels, weight, True)
nograd = loss_kernel.chunk_cross_entropy(logits, labels, weight, False)
out["loss"] = [float(ref[0]), float(got[0]), float(nograd[0])]
out["top1"] = [ref[1].tolist(), got[1].tolist(), nograd[1].tolist()]
out["grad_dtype"] = str(got[2].dtype)
out["grad_max_diff"] = float((got[2].float() - ref[2].float()).abs().max())
out["grad_max"] = float(ref[2].float().abs().max())
out["row2_grad_zero"] = bool((got[2][2] == 0).all())
out["nograd_grad"] = nograd[2] is None
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def kernel_vs_reference():
    if not os.path.isdir(os.path.join(INTERP, "triton")):
        if os.environ.get("CI"):
            pytest.fail(f"{INTERP} is missing: scripts/test.sh installs triton there")
        pytest.skip(f"triton's interpreter is not installed in {INTERP} (scripts/test.sh installs it)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([INTERP, REPO])}
    proc = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_loss_matches_the_reference(kernel_vs_reference):
    ref, got, nograd = kernel_vs_reference["loss"]
    assert ref > 0
    assert got == pytest.approx(ref, rel=1e-5)
    assert nograd == got


def test_top1_is_the_first_of_tied_maxima_as_in_the_reference(kernel_vs_reference):
    ref, got, nograd = kernel_vs_reference["top1"]
    assert got == ref == nograd
    # rows 0, 1 and 6 are right (6 by a tie its label comes first in); 3 and 7 are ties it loses
    assert [got[i] for i in (0, 1, 3, 6, 7)] == [True, True, True, True, False]


def test_gradient_matches_the_reference_within_one_rounding(kernel_vs_reference):
    r = kernel_vs_reference
    assert r["grad_dtype"] == "torch.bfloat16"
    assert r["grad_max"] > 0.5  # the labels' -1 (times their weights) is in it
    assert r["grad_max_diff"] <= 2 ** -7 * 2  # one bf16 step at the largest magnitudes (|g| <= 2)
    assert r["row2_grad_zero"]  # weight 0: no gradient
    assert r["nograd_grad"]
