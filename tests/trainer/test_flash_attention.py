"""flash-attention 4's kernels behind flex_attention against flex_attention's own Triton
kernels, at the drafter's attention shape (``bench.trainer.flash_check``): their parity
against an fp32 reference on a full and a sliding layer's mask, then a short canary of
launches on fresh inputs. Only where they can run (a Hopper or Blackwell GPU,
flash-attn-4 at a fixed release, a torch with the FLASH backend); nothing of
flash-attention is imported here otherwise.
"""

import pytest
import torch

from trainer.attention import flash_usable

WHY_NOT = flash_usable("cuda")
pytestmark = [pytest.mark.skipif(WHY_NOT is not None, reason=f"flash-attention 4's kernels cannot run here: {WHY_NOT}"),
              pytest.mark.slow]  # both compile flash-attention 4's kernels and the Triton ones


def test_flash_attention_4_matches_the_triton_kernels_against_fp32():
    from bench.trainer.flash_check import Shape, parity

    rows = parity(Shape(), torch.device("cuda"))
    assert [row["mask"] for row in rows] == ["full", "sliding"]
    for row in rows:
        assert row["pass"], row


def test_flash_attention_4_gradients_stay_with_the_triton_kernels_launch_after_launch():
    from bench.trainer.flash_check import Shape, canary

    result = canary(Shape(), torch.device("cuda"), launches=200, progress=0)
    assert result["nonfinite"] == 0 and result["over_threshold"] == 0, result
