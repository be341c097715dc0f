"""Each engine's attention, built from its code (tests/harness/engines.py) and the keys the
export writes, against the trainer's masks: an export is allowed exactly where the
engine builds the mask the drafter trained with, at every anchor.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness.engines import engine_visible
from trainer.engines import (
    ENGINE_RULES,
    ENGINES,
    engine_keys,
    engine_problems,
    exported_layer_types,
)
from trainer.masks import SLIDING_SEMANTICS, dense_mask, one_block_mask

BLOCK = 8


def trainer_mask(layer_type, anchor, window, semantics):
    if layer_type == "full":
        return dense_mask(torch.tensor([[anchor]]), torch.tensor([[True]]), anchor, BLOCK)[0, 0]
    return one_block_mask(anchor, BLOCK, window, semantics)


def stub(semantics: str, window: int, max_positions: int, types=("sliding", "full")) -> dict:
    """The part of a serving section the engine checks read."""
    return {"drafter": {"layer_types": list(types)}, "sliding_semantics": semantics,
            "sliding_window": window, "rope": {"max_position_embeddings": max_positions}}


def exported(serving: dict, engine: str) -> dict:
    """The config keys an engine reads, as trainer/export.py writes them."""
    types = ["sliding_attention" if t == "sliding" else "full_attention" for t in exported_layer_types(serving)]
    window = serving["sliding_window"] if "sliding_attention" in types else None
    keys = engine_keys(serving, engine)
    if engine == "speculators":
        return {"transformer_layer_config": {"layer_types": types, "sliding_window": window}, **keys}
    config = {"layer_types": types, "sliding_window": window, "dflash_config": {}}
    for key, value in keys.items():
        section, _, leaf = key.rpartition(".")
        (config[section] if section else config)[leaf] = value
    return config


def test_every_rule_names_the_file_and_the_function_it_was_read_from():
    for engine in ENGINES:
        rule = ENGINE_RULES[engine]
        assert ".py: " in rule.code and "_" in rule.code.split(".py: ")[1], rule.code  # a file, then a function


@pytest.mark.parametrize("engine", ENGINES)
def test_every_engine_runs_full_layers_as_trained(engine):
    config = exported(stub("causal_in_block", 4, 4096, types=("full", "full")), engine)
    for anchor in (0, 1, 9, 30):
        assert torch.equal(engine_visible(engine, config, 0, anchor, BLOCK), trainer_mask("full", anchor, None, None))


def test_vllm_sglang_and_zlab_run_causal_in_block_sliding_layers_as_trained_by_default():
    for window in (1, 3, 5, 12, 100):
        serving = stub("causal_in_block", window, 4096)
        for engine in ("vllm", "sglang", "zlab"):
            config = exported(serving, engine)
            assert "is_causal" not in config and config["dflash_config"] == {}
            for anchor in (0, 3, 17, 40):
                causal = trainer_mask("sliding", anchor, window, "causal_in_block")
                assert torch.equal(engine_visible(engine, config, 0, anchor, BLOCK), causal), (engine, window)
                if window > 1:  # the two semantics differ in every block of a window of 2 or more
                    assert not torch.equal(causal, trainer_mask("sliding", anchor, window, "bidirectional"))


def test_vllm_with_is_causal_false_runs_no_single_window_and_is_causal_true_would_make_full_layers_causal():
    """Why the vLLM export never writes is_causal: it sets every layer at once."""
    both = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5, "dflash_config": {}}
    assert engine_visible("vllm", {**both, "is_causal": False}, 0, 9, BLOCK) is None
    assert engine_visible("vllm", {**both, "dflash_config": {"causal": False}}, 0, 9, BLOCK) is None
    causal_full = engine_visible("vllm", {**both, "is_causal": True}, 1, 9, BLOCK)
    assert not torch.equal(causal_full, trainer_mask("full", 9, None, None))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("semantics", SLIDING_SEMANTICS)
@pytest.mark.parametrize("window,max_positions", [(3, 4096), (5, 4096), (12, 4096), (48, 48), (4096, 4096)])
def test_the_export_refuses_exactly_where_the_engine_runs_another_mask(engine, semantics, window, max_positions):
    """Allowed iff the engine, with the config as exported, builds the trainer's mask of
    every layer at every anchor the target's positions allow."""
    serving = stub(semantics, window, max_positions)
    config = exported(serving, engine)
    same = True
    for layer, trained in enumerate(serving["drafter"]["layer_types"]):
        for anchor in [a for a in (*range(0, 14), 20, 31, 40, 64) if a <= max_positions - BLOCK]:
            theirs = engine_visible(engine, config, layer, anchor, BLOCK)
            same &= theirs is not None and torch.equal(theirs, trainer_mask(trained, anchor, window, semantics))
    problems = engine_problems(serving, engine)
    assert (problems == []) == same, (problems, same)
    if problems:  # the reason names the engine's rule and a setting that fits
        assert f"--engine {engine}" in problems[0] and "Fits:" in problems[0]
        assert ENGINE_RULES[engine].code in problems[0]


def test_a_bidirectional_window_that_never_binds_is_exported_as_full_attention_and_a_causal_one_is_not():
    assert exported_layer_types(stub("bidirectional", 4096, 4096)) == ["full", "full"]
    assert exported_layer_types(stub("bidirectional", 48, 48)) == ["full", "full"]
    assert exported_layer_types(stub("bidirectional", 47, 48)) == ["sliding", "full"]
    assert exported_layer_types(stub("causal_in_block", 4096, 4096)) == ["sliding", "full"]  # causal in the block
    for engine in ENGINES:  # no causality key left to write
        assert engine_keys(stub("bidirectional", 4096, 4096), engine) in ({}, {"sliding_window_non_causal": False})
        assert engine_problems(stub("bidirectional", 4096, 4096), engine) == []


def test_the_fix_for_vllm_no_is_causal_false_for_a_bidirectional_drafter():
    """A bidirectional drafter was once exported for vLLM with is_causal: false, which
    vLLM's flash-attention path ran with the window (W-1, 0)."""
    for window, max_positions in ((5, 4096), (4096, 4096)):
        keys = engine_keys(stub("bidirectional", window, max_positions), "vllm")
        assert keys == {}
    assert engine_problems(stub("bidirectional", 5, 4096), "vllm")


def test_zlab_reads_is_causal_false_for_a_bidirectional_sliding_drafter():
    serving = stub("bidirectional", 5, 4096)
    assert engine_keys(serving, "zlab") == {"is_causal": False} and engine_problems(serving, "zlab") == []
    assert engine_keys(stub("causal_in_block", 5, 4096), "zlab") == {}


def test_a_drafter_reading_the_last_layer_is_refused_for_speculators_with_the_reason():
    from trainer.export import export_problems

    serving = {**stub("causal_in_block", 4096, 4096, types=("full",)), "mask_token_id": 5,
               "target": {"num_hidden_layers": 8, "vocab_size": 512}, "target_layer_ids": [1, 7]}
    problems = export_problems(serving, "speculators", ("speculators",))
    assert len(problems) == 1 and "hidden_states[8] is the last layer's output after the final norm" in problems[0]
    assert export_problems({**serving, "target_layer_ids": [1, 5]}, "speculators", ("speculators",)) == []
