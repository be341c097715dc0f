"""Target feature capture and the drafter, on CPU at the 'tiny' preset."""

import threading

import pytest
import torch

from trainer.anchors import build_block_inputs, sample_anchors
from trainer.attention import FLEX_EAGER, SDPA, AttentionPath, build_layer_masks, paths_ran, select_attention_path
from trainer.config import ConfigError, ModelConfig, TrainerConfig
from trainer.model import Drafter
from trainer.step import compute_loss
from trainer.target import build_target, target_layer_ids

CPU = AttentionPath(SDPA, "cpu")


@pytest.fixture(scope="module")
def target():
    return build_target(ModelConfig(preset="tiny"), "cpu", torch.float32)


def make_cfg(**model):
    cfg = TrainerConfig()
    cfg.model = ModelConfig(**{"block_size": 4, "drafter_layers": 3, **model})
    cfg.data.max_anchors = 8
    cfg.train.loss_chunk = 24
    return cfg


def make_batch(target, seq_len=48, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, target.vocab_size - 1, (batch, seq_len), generator=g)
    loss_mask = torch.zeros(batch, seq_len)
    loss_mask[:, 8:] = 1
    anchors, valid = sample_anchors(loss_mask, 8, 4, g)
    return dict(features=target.features(input_ids), input_ids=input_ids, loss_mask=loss_mask, anchors=anchors, valid=valid)


def make_drafter(target, cfg, seed=0):
    torch.manual_seed(seed)
    return Drafter(cfg.model, target.config, target.embed_tokens, target.lm_head)


# ----------------------------------------------------------------------------- target


def test_target_layer_ids_formula():
    assert target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B, the published drafter
    assert target_layer_ids(28, 5) == [1, 7, 13, 19, 25]  # Qwen3-0.6B / 1.7B
    assert target_layer_ids(8, 5) == [1, 2, 3, 4, 5]  # the tiny preset
    assert target_layer_ids(36, 1) == [18]
    assert target_layer_ids(36, 3) == [1, 17, 33]
    with pytest.raises(ConfigError, match="num_target_layers"):
        target_layer_ids(6, 5)


def test_presets_are_seeded_and_unknown_ones_are_named():
    a = build_target(ModelConfig(preset="tiny"), "cpu", torch.float32)
    b = build_target(ModelConfig(preset="tiny"), "cpu", torch.float32)
    for (name, pa), pb in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(pa, pb), name
    with pytest.raises(ConfigError, match="did you mean 'qwen3-0.6b'"):
        build_target(ModelConfig(preset="qwen3-0.6"), "cpu", torch.float32)


def test_features_are_the_chosen_layers_outputs(target):
    ids = torch.randint(0, 500, (2, 12))
    feats = target.features(ids)
    h, k = target.hidden_size, len(target.layer_ids)
    assert feats.shape == (2, 12, k * h) and target.layer_ids == [1, 2, 3, 4, 5]
    with torch.no_grad():
        hs = target.model(input_ids=ids, output_hidden_states=True).hidden_states  # [embeddings, layer 0, ...]
    want = torch.cat([hs[i + 1] for i in target.layer_ids], dim=-1)
    assert torch.allclose(feats, want, atol=1e-6)
    # A normal tensor: another thread's autograd can use it (inference tensors cannot be saved for backward).
    assert not feats.is_inference() and not feats.requires_grad


def test_features_stop_after_the_last_captured_layer(target):
    ran = []
    layers = target.model.base_model.layers
    handles = [layer.register_forward_pre_hook(lambda m, a, i=i: ran.append(i)) for i, layer in enumerate(layers)]
    try:
        target.features(torch.randint(0, 500, (1, 10)))
        assert ran == list(range(max(target.layer_ids) + 1))  # 0..5 of the tiny preset's 8 layers
        ran.clear()
        target.greedy_next(torch.randint(0, 500, (1, 10)))  # the whole model still runs for its own outputs
        assert ran == list(range(len(layers)))
    finally:
        for h in handles:
            h.remove()


def test_features_feed_autograd_in_another_thread(target):
    feats = target.features(torch.randint(0, 500, (1, 10)))
    errors, grads = [], []

    def drafter_thread():
        try:
            w = torch.randn(feats.shape[-1], 3, requires_grad=True)
            (feats @ w).tanh().sum().backward()
            grads.append(w.grad)
        except Exception as e:  # relayed to the test thread
            errors.append(e)

    th = threading.Thread(target=drafter_thread, name="drafter-test")
    th.start()
    th.join()
    assert not errors and grads[0] is not None


def test_greedy_helpers_agree(target):
    prompt = torch.randint(1, 500, (2, 5), generator=torch.Generator().manual_seed(1))
    out = target.greedy_generate(prompt, 6)
    assert out.shape == (2, 11) and torch.equal(out[:, :5], prompt)
    assert torch.equal(target.greedy_next(out)[:, 4:10], out[:, 5:11])


# ----------------------------------------------------------------------------- drafter


def test_drafter_trains_on_cpu_and_leaves_the_target_frozen(target):
    cfg = make_cfg(layer_types=["full", "sliding", "full"], sliding_window=6)
    drafter = make_drafter(target, cfg)
    batch = make_batch(target)
    loss, stats = compute_loss(drafter, batch, cfg, select_attention_path("cpu"))
    loss.backward()
    assert torch.isfinite(loss) and stats["anchors"] == 16 and stats["query_tokens"] == 64

    trainable = list(drafter.trainable_parameters())
    frozen = [drafter.embed_tokens.weight, drafter.lm_head.weight]
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in trainable)
    assert all(p.grad is None and not p.requires_grad for p in frozen)
    assert not any(p is f for p in trainable for f in frozen)
    assert all(p.grad is None for p in target.model.parameters())
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in drafter.trainable_state_dict())

    # The frozen modules are the drafter's own wrappers: casting the drafter leaves the target alone.
    drafter.to(torch.float64)
    assert target.embed_tokens.weight.dtype == torch.float32 and target.lm_head.weight.dtype == torch.float32


def test_trainable_state_round_trip(target):
    cfg = make_cfg()
    a, b = make_drafter(target, cfg, seed=1), make_drafter(target, cfg, seed=2)
    b.load_trainable_state_dict(a.trainable_state_dict())
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    with pytest.raises(KeyError, match="missing"):
        b.load_trainable_state_dict({})


def test_flex_and_sdpa_drafter_forwards_agree(target):
    cfg = make_cfg(layer_types=["sliding", "full", "sliding"], sliding_window=5)
    drafter = make_drafter(target, cfg)
    batch = make_batch(target, seed=3)
    batch["valid"][1, 3] = False  # an invalid block among valid ones
    with torch.no_grad():
        sdpa, _ = compute_loss(drafter, batch, cfg, CPU)
        flex, _ = compute_loss(drafter, batch, cfg, AttentionPath(FLEX_EAGER, "cpu"))
    assert abs(sdpa.item() - flex.item()) < 1e-5


def test_drafter_counts_its_attention_calls_per_path(target):
    cfg = make_cfg(layer_types=["sliding", "full", "sliding"], sliding_window=5)
    drafter = make_drafter(target, cfg)
    batch = make_batch(target, seed=3)
    before = paths_ran()
    with torch.no_grad():
        compute_loss(drafter, batch, cfg, CPU)
        compute_loss(drafter, batch, cfg, AttentionPath(FLEX_EAGER, "cpu"))
    after = paths_ran()
    assert after.get(SDPA, 0) - before.get(SDPA, 0) == 3
    assert after.get(FLEX_EAGER, 0) - before.get(FLEX_EAGER, 0) == 3


def test_compiled_layers_trace_whole_and_match_eager(target):
    """On a GPU each drafter layer is compiled (compile.drafter_layers). A graph break
    would split it and leave ops eager; Dynamo + AOTAutograd (no inductor: CPU tests
    have no C++ toolchain to count on) must take a layer whole, forward and backward,
    with the same loss and gradients."""
    cfg = make_cfg(layer_types=["sliding", "full", "sliding"], sliding_window=5)
    batch = make_batch(target, seed=5)
    results = []
    for compiled in (False, True):
        drafter = make_drafter(target, cfg)
        if compiled:
            torch._dynamo.reset()
            drafter.compile_layers(backend="aot_eager", fullgraph=True)
        loss, _ = compute_loss(drafter, batch, cfg, CPU)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in drafter.trainable_parameters()]))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    assert torch.allclose(eager_loss, compiled_loss, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(eager_grads, compiled_grads))
    assert {k for k in drafter.state_dict()} == {k for k in make_drafter(target, cfg).state_dict()}  # same keys


def block_outputs(drafter, batch, features):
    ids, pos, _, _ = build_block_inputs(batch["input_ids"], batch["anchors"], batch["valid"], 4, drafter.mask_token_id)
    masks = build_layer_masks(
        CPU, batch["anchors"], batch["valid"], features.shape[1], 4, drafter.layer_types, drafter.sliding_window
    )
    with torch.no_grad():
        return drafter(features, ids, pos, masks)


@pytest.mark.parametrize("layer_types", [["full", "full", "full"], ["sliding", "full", "sliding"]])
def test_context_injection_ends_strictly_before_the_anchor(target, layer_types):
    # End to end through every layer: the features at the anchor (and after) cannot
    # move the block's output; the feature just before the anchor must.
    cfg = make_cfg(layer_types=layer_types, sliding_window=6)
    drafter = make_drafter(target, cfg)
    batch = make_batch(target, batch=1)
    anchor = batch["anchors"][0, 2].item()
    base = block_outputs(drafter, batch, batch["features"])
    block = slice(2 * 4, 3 * 4)

    later = batch["features"].clone()
    later[0, anchor:] += 5.0
    assert torch.allclose(block_outputs(drafter, batch, later)[0, block], base[0, block], atol=1e-6)
    before = batch["features"].clone()
    before[0, anchor - 1] += 5.0
    assert not torch.allclose(block_outputs(drafter, batch, before)[0, block], base[0, block], atol=1e-3)


def test_blocks_are_independent_end_to_end(target):
    cfg = make_cfg()
    drafter = make_drafter(target, cfg)
    batch = make_batch(target, batch=1)
    base = block_outputs(drafter, batch, batch["features"])
    changed = dict(batch, input_ids=batch["input_ids"].clone())
    changed["input_ids"][0, batch["anchors"][0, 0]] += 1  # block 0's anchor token
    out = block_outputs(drafter, changed, batch["features"])
    assert not torch.allclose(out[0, :4], base[0, :4])
    assert torch.allclose(out[0, 4:], base[0, 4:], atol=1e-6)


def test_drafter_learns_a_fixed_batch(target):
    cfg = make_cfg()
    drafter = make_drafter(target, cfg)
    batch = make_batch(target, seed=5)
    opt = torch.optim.AdamW(drafter.trainable_parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss, stats = compute_loss(drafter, batch, cfg, CPU)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # The shared lm_head is frozen (random here), so the loss falls slowly; accuracy shows the fit.
    assert losses[-1] < losses[0] - 0.5
    assert stats["acc"] > 0.8 and stats["accept_len"] > 1


@pytest.mark.parametrize("autocast", [False, True])
def test_the_residual_stream_is_fp32_or_the_compute_dtype(target, autocast):
    """model.residual: under bf16 autocast 'compute' carries the residual in bf16 (the
    final norm's output shows it) with a loss within bf16 rounding of the fp32 stream;
    without autocast both settings are the same fp32 computation."""
    batch = make_batch(target)
    out = {}
    for residual in ("float32", "compute"):
        cfg = make_cfg(residual=residual)
        drafter = make_drafter(target, cfg)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            block_ids, positions, _, _ = build_block_inputs(batch["input_ids"], batch["anchors"], batch["valid"], 4,
                                                            drafter.mask_token_id, batch["loss_mask"])
            masks = build_layer_masks(CPU, batch["anchors"], batch["valid"], 48, 4, drafter.layer_types,
                                      drafter.sliding_window, drafter.sliding_semantics)
            hidden = drafter(batch["features"], block_ids, positions, masks)
            loss, _ = compute_loss(drafter, batch, cfg, CPU)
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in drafter.trainable_parameters())
        out[residual] = (hidden.dtype, float(loss.detach()))
    if autocast:
        assert out["float32"][0] == torch.float32 and out["compute"][0] == torch.bfloat16
        assert out["compute"][1] == pytest.approx(out["float32"][1], rel=2e-2)
    else:
        assert out["float32"] == out["compute"] and out["compute"][0] == torch.float32


def test_mask_token_must_be_in_the_vocabulary(target):
    with pytest.raises(ConfigError, match="mask_token_id"):
        make_drafter(target, make_cfg(mask_token_id=target.vocab_size))
    assert make_drafter(target, make_cfg()).mask_token_id == target.vocab_size - 1
