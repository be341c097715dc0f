"""Exports loaded by the engines' own code, from another working directory, against the
trainer's logits: z-lab's ``dflash`` package and vLLM speculators (tests/harness/
engine_loaders.py), on the CPU. vLLM and SGLang need a GPU build; their rules are
checked from their code in test_engine_rules.py.

Each trained drafter is exported once per engine that accepts it; the engine's model
loads it strictly (every tensor, nothing left over) and gives the trainer's logits
within 1e-4 at every block slot it drafts. Where an engine would run the drafter
otherwise, the export is refused.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from dflashctl.core import contract
from tests.harness.engine_loaders import available, speculators_dflash, zlab_model
from tests.harness.tiny import cli, latest, run_config, train, write_model_dir

ATOL = 1e-4
ANCHORS = [4, 17, 30]

pytestmark = pytest.mark.skipif(not (available("dflash") and available("speculators")),
                                reason="the engines' packages (scripts/setup.sh installs dflash and speculators)")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """The target as a model directory: speculators loads its embeddings, lm_head and
    final norm from it (the verifier)."""
    return os.path.abspath(write_model_dir(tmp_path_factory.mktemp("models") / "target"))


def trained(tmp_path_factory, target_dir, **model):
    from trainer import restore

    run_dir = tmp_path_factory.mktemp("run") / "run"
    raw = run_config(model={"path": target_dir, "preset": None, **model}, train={"steps": 2})
    assert train(run_dir, raw) == contract.EXIT_DONE
    return restore.load(latest(run_dir))


@pytest.fixture(scope="module")
def causal_binding(tmp_path_factory, target_dir):
    return trained(tmp_path_factory, target_dir, layer_types=["sliding", "full"], sliding_window=5)


@pytest.fixture(scope="module")
def bidirectional_binding(tmp_path_factory, target_dir):
    return trained(tmp_path_factory, target_dir, layer_types=["sliding", "sliding"], sliding_window=3,
                   sliding_semantics="bidirectional")


@pytest.fixture(scope="module")
def causal_unbounded(tmp_path_factory, target_dir):
    return trained(tmp_path_factory, target_dir, layer_types=["sliding", "full"], sliding_window=4096)


@pytest.fixture(scope="module")
def bidirectional_unbounded(tmp_path_factory, target_dir):
    return trained(tmp_path_factory, target_dir, layer_types=["sliding", "full"], sliding_window=4096,
                   sliding_semantics="bidirectional")


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """Load from a working directory that is neither the export's nor the repository's."""
    where = tmp_path / "elsewhere"
    where.mkdir()
    monkeypatch.chdir(where)
    return where


def trainer_logits(loaded, ids_1S, anchors) -> torch.Tensor:
    """[N, B-1, V]: the trainer's drafted slots at ``anchors``."""
    from trainer.anchors import build_block_inputs
    from trainer.attention import SDPA, AttentionPath, build_layer_masks

    drafter, target = loaded.drafter, loaded.target
    anchors_1N = torch.tensor([anchors])
    valid_1N = torch.ones_like(anchors_1N, dtype=torch.bool)
    block = drafter.block_size
    block_ids, positions, _, _ = build_block_inputs(ids_1S, anchors_1N, valid_1N, block, drafter.mask_token_id)
    masks = build_layer_masks(AttentionPath(SDPA, "cpu"), anchors_1N, valid_1N, ids_1S.shape[1], block,
                              drafter.layer_types, drafter.sliding_window, drafter.sliding_semantics)
    with torch.no_grad():
        hidden = drafter(target.features(ids_1S), block_ids, positions, masks)
        return drafter.lm_head(hidden).view(len(anchors), block, -1)[:, 1:].float()


def sequence(loaded, length=48, seed=3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, loaded.target.vocab_size - 1, (1, length), generator=g)


def export(loaded, out, *args) -> dict:
    done = cli("export", loaded.path, str(out), *args)
    assert done.returncode == 0, done.stderr
    return json.loads((out / "config.json").read_text())


# ---------------------------------------------------------------------------- z-lab's dflash package


def zlab_logits(out, loaded, ids_1S, anchors) -> torch.Tensor:
    """z-lab's DFlashDraftModel, loaded strictly from ``out``, run as its dflash_generate
    runs it: the context is the target's hidden states before the anchor
    (extract_context_feature), the block [anchor token, mask x (B-1)] at its positions."""
    zlab = zlab_model()
    model, info = zlab.DFlashDraftModel.from_pretrained(str(out), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    model.eval()
    target = loaded.target.model
    with torch.no_grad():
        hidden = target(ids_1S, output_hidden_states=True).hidden_states
        rows = []
        for anchor in anchors:
            block = torch.full((1, model.block_size), model.mask_token_id)
            block[0, 0] = ids_1S[0, anchor]
            drafted = model(position_ids=torch.arange(anchor + model.block_size)[None],
                            noise_embedding=target.get_input_embeddings()(block),
                            target_hidden=zlab.extract_context_feature(hidden, model.target_layer_ids)[:, :anchor])
            rows.append(target.get_output_embeddings()(drafted)[0, 1:])
    return torch.stack(rows).float()


def assert_close(theirs, ours):
    assert (theirs - ours).abs().max().item() <= ATOL, (theirs - ours).abs().max().item()
    assert torch.equal(theirs.argmax(-1), ours.argmax(-1))


@pytest.mark.parametrize("case", ["causal_binding", "bidirectional_binding", "causal_unbounded",
                                  "bidirectional_unbounded"])
def test_zlab_runs_every_export_it_accepts_as_trained(case, request, tmp_path, elsewhere):
    loaded = request.getfixturevalue(case)
    out = tmp_path / "exports" / "zlab"
    config = export(loaded, out, "--engine", "zlab")
    ids = sequence(loaded)
    assert_close(zlab_logits(out, loaded, ids, ANCHORS), trainer_logits(loaded, ids, ANCHORS))
    if case == "bidirectional_binding":  # dflash reads is_causal: without it the layers run causal
        assert config["is_causal"] is False
        del config["is_causal"]
        (out / "config.json").write_text(json.dumps(config))
        assert (zlab_logits(out, loaded, ids, ANCHORS) - trainer_logits(loaded, ids, ANCHORS)).abs().max() > 1e-2
    else:
        assert "is_causal" not in config
    if case == "bidirectional_unbounded":  # trained exactly as full layers: exported as such
        assert config["layer_types"] == ["full_attention", "full_attention"] and config["sliding_window"] is None
    if case != "bidirectional_binding":  # vLLM's and SGLang's exports are these very files (their GPU builds
        for engine in ("vllm", "sglang"):  # do not run here): z-lab's loader reads them from elsewhere too
            theirs = export(loaded, tmp_path / "exports" / engine, "--engine", engine)
            assert theirs == config
            assert_close(zlab_logits(tmp_path / "exports" / engine, loaded, ids, ANCHORS),
                         trainer_logits(loaded, ids, ANCHORS))


# ---------------------------------------------------------------------------- speculators


def speculators_logits(out, loaded, ids_1S, anchors) -> torch.Tensor:
    """speculators' DFlashDraftModel from ``out`` (its verifier loaded by the name in the
    config), run through its own training forward (``_backbone_forward``: its anchor
    block mask, its feature fusion, its rotary positions) with exactly ``anchors``
    selected. sdpa with its dense mask instead of its default compiled flex_attention,
    which the CPU does not run; the mask function is the same."""
    dflash = speculators_dflash()
    config = dflash.DFlashSpeculatorConfig.from_pretrained(str(out))
    config.transformer_layer_config._attn_implementation = "sdpa"
    model, info = dflash.DFlashDraftModel.from_pretrained(str(out), config=config, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    model.eval()
    target, seq = loaded.target.model, ids_1S.shape[1]
    loss_mask = torch.zeros_like(ids_1S)
    loss_mask[0, anchors] = 1  # select_anchors then takes exactly these, sorted
    with torch.no_grad():
        out_t = target(ids_1S, output_hidden_states=True)
        features = torch.cat([out_t.hidden_states[i] for i in model.target_layer_ids], dim=-1)
        _, logits, _, _, _ = model._backbone_forward(
            features, ids_1S, loss_mask, out_t.hidden_states[-1], torch.zeros_like(ids_1S), max_anchors=len(anchors))
    return logits.view(len(anchors), model.block_size, -1)[:, 1:].float()


@pytest.mark.parametrize("case", ["causal_unbounded", "bidirectional_unbounded"])
def test_speculators_runs_every_export_it_accepts_as_trained_from_another_directory(case, request, tmp_path,
                                                                                   target_dir, elsewhere):
    loaded = request.getfixturevalue(case)
    out = tmp_path / "exports" / "speculators"
    config = export(loaded, out, "--engine", "speculators", "--verifier", target_dir)
    assert config["speculators_config"]["verifier"]["name_or_path"] == target_dir  # absolute: any directory
    assert config["sliding_window_non_causal"] is False
    assert os.getcwd() == str(elsewhere)
    ids = sequence(loaded)
    assert_close(speculators_logits(out, loaded, ids, ANCHORS), trainer_logits(loaded, ids, ANCHORS))


@pytest.mark.parametrize("case,fits", [("causal_binding", "--engine vllm"), ("bidirectional_binding", "--engine zlab")])
def test_speculators_refuses_a_window_that_binds(case, fits, request, tmp_path, target_dir):
    loaded = request.getfixturevalue(case)
    done = cli("export", loaded.path, str(tmp_path / "out"), "--engine", "speculators", "--verifier", target_dir)
    assert done.returncode == contract.EXIT_CONFIG_ERROR and "a-W..a-1" in done.stderr and fits in done.stderr
    assert "create_anchor_block_mask_mod" in done.stderr
    assert not (tmp_path / "out").exists()


def test_a_relative_verifier_path_is_refused_and_one_that_exists_is_written_absolute(causal_unbounded, tmp_path,
                                                                                    target_dir, monkeypatch):
    monkeypatch.chdir(os.path.dirname(target_dir))
    done = cli("export", causal_unbounded.path, str(tmp_path / "a"), "--engine", "speculators", "--verifier", "target")
    assert done.returncode == 0, done.stderr
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == target_dir
    done = cli("export", causal_unbounded.path, str(tmp_path / "b"), "--engine", "speculators", "--verifier",
               "../nowhere/target")
    assert done.returncode == contract.EXIT_CONFIG_ERROR and "relative path" in done.stderr
    done = cli("export", causal_unbounded.path, str(tmp_path / "c"), "--engine", "speculators")
    assert done.returncode == contract.EXIT_CONFIG_ERROR and f"--verifier {target_dir}" in done.stderr


# ---------------------------------------------------------------------------- the demo's target


def test_the_demo_target_catches_a_wrong_layer_numbering(tmp_path_factory, tmp_path, elsewhere):
    """tiny-cycle's layers differ: the same drafter fed the next layers' features gives
    other logits (the negative control); before, every layer's hidden state was equal
    and a wrong numbering in an export went unseen on the demo."""
    from trainer import restore

    run_dir = tmp_path_factory.mktemp("cycle") / "run"
    assert train(run_dir, run_config(model={"preset": "tiny-cycle"}, train={"steps": 2})) == contract.EXIT_DONE
    loaded = restore.load(latest(run_dir))
    hidden = loaded.target.model(sequence(loaded), output_hidden_states=True).hidden_states
    assert all((hidden[i + 1] - hidden[i]).abs().max() > 1e-3 for i in range(len(hidden) - 2))

    out = tmp_path / "exports" / "cycle"
    config = export(loaded, out, "--engine", "zlab")
    ids = sequence(loaded)
    ours = trainer_logits(loaded, ids, ANCHORS)
    assert_close(zlab_logits(out, loaded, ids, ANCHORS), ours)
    config["dflash_config"]["target_layer_ids"] = [i + 1 for i in config["dflash_config"]["target_layer_ids"]]
    (out / "config.json").write_text(json.dumps(config))
    assert (zlab_logits(out, loaded, ids, ANCHORS) - ours).abs().max() > 1e-2


def test_zlabs_decode_loop_on_the_export_accepts_what_the_trainers_eval_accepts(tmp_path_factory, tmp_path):
    """z-lab's own speculative decoding (dflash_generate: its draft KV cache, its masks)
    with the exported drafter: the same tokens as the trainer's eval decoding, and the
    same tokens accepted at every verification step."""
    from trainer import restore
    from trainer.speculative import speculative_generate

    run_dir = tmp_path_factory.mktemp("decode") / "run"
    raw = run_config(model={"preset": "tiny-cycle"}, train={"steps": 30}, optim={"lr": 1e-2, "warmup_frac": 0.0},
                     data={"synthetic_samples": 32,  # the target writes the responses: the drafter learns some
                           "regenerate": {"source": "synthetic", "max_new_tokens": 48, "batch_size": 8}})
    assert train(run_dir, raw) == contract.EXIT_DONE
    loaded = restore.load(latest(run_dir))
    out = tmp_path / "zlab"
    export(loaded, out, "--engine", "zlab")
    zlab = zlab_model()
    model = zlab.DFlashDraftModel.from_pretrained(str(out)).eval()
    starts = []  # the first position of every target forward z-lab makes: the prefill, then each verification

    def record(module, args, kwargs):
        starts.append(int(kwargs["position_ids"][0, 0]))

    g = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(3):
        prompt = torch.randint(1, loaded.target.vocab_size - 1, (1, 24), generator=g)
        starts.clear()
        hook = loaded.target.model.register_forward_pre_hook(record, with_kwargs=True)
        try:
            theirs = zlab.dflash_generate(model, loaded.target.model, prompt, 40, None, 0.0)[0, 24:].tolist()
        finally:
            hook.remove()
        produced = [b - a for a, b in zip(starts[1:], starts[2:])]  # [0] is the prefill
        ours = speculative_generate(loaded.target, loaded.drafter, prompt[0].tolist(), 40)
        assert theirs == ours.tokens
        assert produced == [a + 1 for a in ours.accepted][:len(produced)] and len(produced) >= len(ours.accepted) - 1
        steps += produced
    assert max(steps) > 2 and min(steps) < max(steps)  # drafts partly accepted: the comparison sees acceptance
