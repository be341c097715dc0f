"""What each engine runs, written from its documented rule (not its code), against the
trainer's masks for both sliding semantics; and the export's decisions against them.

The rules, per layer, for the query at position qp (block slot o of the block anchored
at a, so qp = a + o) and a key at position kp (context 0..a-1, then the block
a..a+B-1), with window W:

- vLLM (vllm/model_executor/models/qwen3_dflash.py, ``_dflash_layer_causal``) and
  SGLang (python/sglang/srt/models/dflash.py): a ``sliding_attention`` layer is causal
  over keys qp-W+1..qp; a ``full_attention`` layer sees every key it is given. An
  explicit ``dflash_config.causal: false`` / ``is_causal: false`` makes vLLM's layers
  non-causal, windowed by its attention backend's own rule (not stated here: the
  export writes it only where the window never binds).
- z-lab's reference code (dflash/model.py: ``is_causal = False`` for every layer,
  ``dflash_generate`` passes no mask): non-causal; flash-attention turns the sliding
  window into a symmetric one, |qp - kp| < W; eager and sdpa drop it.
- speculators (src/speculators/models/dflash/, the anchor block mask): a sliding
  layer sees context keys a-W..a-1 and its block causally (o' <= o) when
  ``sliding_window_non_causal`` is false, the whole block when true.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness.engines import engine_visible
from trainer.export import ENGINES, engine_keys, engine_problems
from trainer.masks import SLIDING_SEMANTICS, dense_mask, one_block_mask

BLOCK = 8


def engine_mask(engine, layer_type, anchor, window, keys):
    qp = torch.arange(anchor, anchor + BLOCK)[:, None]
    kp = torch.arange(anchor + BLOCK)[None, :]
    return engine_visible(engine, layer_type, qp, kp, anchor, window, keys)


def trainer_mask(layer_type, anchor, window, semantics):
    if layer_type == "full":
        return dense_mask(torch.tensor([[anchor]]), torch.tensor([[True]]), anchor, BLOCK)[0, 0]
    return one_block_mask(anchor, BLOCK, window, semantics)


def stub(semantics: str, window: int, max_positions: int) -> dict:
    """The part of a serving section the engine checks read."""
    return {"drafter": {"layer_types": ["sliding", "full"]}, "sliding_semantics": semantics,
            "sliding_window": window, "rope": {"max_position_embeddings": max_positions}}


@pytest.mark.parametrize("engine", ENGINES)
def test_every_engine_runs_full_layers_as_trained(engine):
    for anchor in (0, 1, 9, 30):
        assert torch.equal(engine_mask(engine, "full", anchor, 4, {"sliding_window_non_causal": False}),
                           trainer_mask("full", anchor, None, "causal_in_block"))


def test_vllm_and_sglang_run_causal_in_block_as_trained_and_zlab_runs_bidirectional():
    for anchor in (0, 3, 17, 40):
        for window in (1, 3, 5, 12, 100):
            causal = trainer_mask("sliding", anchor, window, "causal_in_block")
            both = trainer_mask("sliding", anchor, window, "bidirectional")
            assert torch.equal(engine_mask("vllm", "sliding", anchor, window, {}), causal)
            assert torch.equal(engine_mask("sglang", "sliding", anchor, window, {}), causal)
            assert torch.equal(engine_mask("zlab", "sliding", anchor, window, {}), both)
            if window > 1:  # the two semantics differ in every block of a window of 2 or more
                assert not torch.equal(causal, both)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("semantics", SLIDING_SEMANTICS)
@pytest.mark.parametrize("window,max_positions", [(3, 4096), (5, 4096), (12, 4096), (48, 48), (4096, 4096)])
def test_the_export_refuses_exactly_where_the_engine_runs_another_mask(engine, semantics, window, max_positions):
    """An export is allowed iff the engine, with the keys the export writes, builds the
    trainer's mask at every anchor the target's positions allow."""
    serving = stub(semantics, window, max_positions)
    keys = engine_keys(serving, engine)
    anchors = range(0, min(max_positions - BLOCK, 64) + 1)
    same = True
    for anchor in anchors:
        theirs = engine_mask(engine, "sliding", anchor, window, keys)
        same &= theirs is not None and torch.equal(theirs, trainer_mask("sliding", anchor, window, semantics))
    problems = engine_problems(serving, engine)
    assert (problems == []) == same, (problems, same)
    if problems:  # the reason names the engine's rule and a setting that fits
        assert f"--engine {engine}" in problems[0] and "Fits:" in problems[0]


def test_a_drafter_without_sliding_layers_exports_for_every_engine():
    serving = {"drafter": {"layer_types": ["full", "full"]}, "sliding_semantics": "causal_in_block",
               "sliding_window": 3, "rope": {"max_position_embeddings": 4096}}
    assert all(engine_problems(serving, e) == [] for e in ENGINES)
    assert engine_keys(serving, "speculators") == {"sliding_window_non_causal": False}
    assert engine_keys(serving, "vllm") == {} and engine_keys(serving, "zlab") == {"is_causal": False}
