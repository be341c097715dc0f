"""What a checkpoint records for serving, the mask-token policy, and the export formats.

Checkpoints come from the real trainer (``trainer.train.run`` in this process, tiny
preset, CPU). The public formats are checked with loaders written here from the
formats' documented structure (z-lab's DFlash drafter; vLLM speculators' DFlash
config), not with the trainer's own model code.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from dflashctl.core import contract
from tests import harness
from tests.harness.tiny import cli, latest, run_config, train, write_model_dir
from trainer.export import EXPORT_META

REPO = str(harness.REPO)


def meta_of(ckpt: str) -> dict:
    with open(os.path.join(ckpt, "meta.json")) as f:
        return json.load(f)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: these models are tiny, and on a loaded machine torch's
    thread pool spins against other processes. The results do not depend on it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("export") / "run"
    assert train(run_dir, run_config()) == contract.EXIT_DONE
    return latest(run_dir)


@pytest.fixture(scope="module")
def loaded(trained):
    from trainer import restore

    return restore.load(trained)


def block_logits(drafter, target, ids_1S: torch.Tensor, anchors: list[int]) -> torch.Tensor:
    """[N, B, V] logits of the drafter's training forward at ``anchors``."""
    from trainer.anchors import build_block_inputs
    from trainer.attention import SDPA, AttentionPath, build_layer_masks

    anchors_1N = torch.tensor([anchors])
    valid_1N = torch.ones_like(anchors_1N, dtype=torch.bool)
    block = drafter.block_size
    block_ids, positions, _, _ = build_block_inputs(ids_1S, anchors_1N, valid_1N, block, drafter.mask_token_id)
    masks = build_layer_masks(AttentionPath(SDPA, "cpu"), anchors_1N, valid_1N, ids_1S.shape[1], block,
                              drafter.layer_types, drafter.sliding_window, drafter.sliding_semantics)
    with torch.no_grad():
        hidden = drafter(target.features(ids_1S), block_ids, positions, masks)
        return drafter.lm_head(hidden).view(len(anchors), block, -1).float()


def sequence(target, length=40, seed=3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, target.vocab_size - 1, (1, length), generator=g)


# ---------------------------------------------------------------------------- metadata


def test_every_checkpoint_records_what_serving_needs(trained):
    from trainer import serving
    from trainer.config import ModelConfig
    from trainer.target import preset_config

    s = meta_of(trained)["serving"]
    assert s["format"] == serving.SERVING_FORMAT
    assert s["target"]["preset"] == "tiny" and s["target"]["path"] is None
    assert s["target"]["config_hash"] == serving.target_config_hash(preset_config("tiny"))
    assert s["target"]["num_hidden_layers"] == 8 and s["target"]["vocab_size"] == 512
    assert s["target_layer_ids"] == [1, 2, 3, 4, 5] and "hidden_states[id + 1]" in s["layer_id_convention"]
    assert (s["mask_token_id"], s["mask_token_source"]) == (511, "vocab_size-1")
    assert s["block_size"] == 8
    assert s["drafter"]["layer_types"] == ["sliding", "full"] and s["drafter"]["num_target_features"] == 5
    assert s["drafter"]["num_key_value_heads"] == 2 and s["drafter"]["head_dim"] == 16
    assert s["sliding_window"] == 5 and s["sliding_semantics"] == "causal_in_block"
    assert s["rope"]["rope_theta"] == 10000.0 and s["rope"]["max_position_embeddings"] == 4096
    assert s["dtype"] == {"weights": "float32", "compute": "float32"}
    assert s["tokenizer"] is None
    # Round trip: the same section from the same inputs.
    cfg = ModelConfig(**run_config()["model"])
    assert s == json.loads(json.dumps(serving.metadata(cfg, preset_config("tiny"), 511, "vocab_size-1", "float32")))


def test_info_shows_the_metadata_as_text_and_json(trained, tmp_path):
    done = cli("info", os.path.dirname(os.path.dirname(trained)))  # a run directory: its newest checkpoint
    assert done.returncode == 0, done.stderr
    for line in ("mask token id   511 (vocab_size-1)", "target layers   [1, 2, 3, 4, 5]", "block size      8",
                 "sliding window  5 (causal_in_block)", "rope            theta 10000.0"):
        assert line in done.stdout
    as_json = json.loads(cli("info", trained, "--json").stdout)
    assert as_json["serving"] == meta_of(trained)["serving"] and as_json["step"] == 4

    # A checkpoint written before the serving section: rebuilt from its configuration, and said so.
    old = tmp_path / "step-00000004"
    shutil.copytree(trained, old)
    meta = meta_of(str(old))
    del meta["serving"]
    (old / "meta.json").write_text(json.dumps(meta))
    rebuilt = json.loads(cli("info", str(old), "--json").stdout)["serving"]
    assert rebuilt.pop("derived") is True
    assert rebuilt == meta_of(trained)["serving"]
    assert "predates this metadata" in cli("info", str(old)).stdout


def test_info_shows_a_checkpoints_control_characters_and_refuses_deep_nesting(trained, tmp_path):
    """A checkpoint is data someone else may have written: an escape sequence in its
    metadata is shown, never obeyed by the terminal; metadata nested past
    contract.MAX_DEPTH is refused with the file named, not a bare RecursionError."""
    hostile = tmp_path / "step-00000004"
    shutil.copytree(trained, hostile)
    meta = meta_of(str(hostile))
    meta["serving"]["target"]["model_type"] = "qwen3\x1b]0;owned\x07\x1b[2J\r\u202e"
    (hostile / "meta.json").write_text(json.dumps(meta))
    done = cli("info", str(hostile))
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout and "\r" not in done.stdout and "\u202e" not in done.stdout
    assert "qwen3\\x1b]0;owned\\x07\\x1b[2J\\x0d\\u202e" in done.stdout

    deep = tmp_path / "deep" / "step-00000004"
    shutil.copytree(trained, deep)
    (deep / "meta.json").write_text('{"step": 4, "config": ' + "[" * 100_000 + "]" * 100_000 + "}")
    for args in (("info", str(deep)), ("info", str(deep.parent))):
        done = cli(*args)
        assert done.returncode == contract.EXIT_CONFIG_ERROR, done.stderr
        assert "RecursionError" not in done.stderr
    assert f"{deep}/meta.json: nests deeper than {contract.MAX_DEPTH} levels" in cli("info", str(deep)).stderr


def test_info_names_a_missing_checkpoint(tmp_path):
    done = cli("info", str(tmp_path))
    assert done.returncode == contract.EXIT_CONFIG_ERROR and "not a checkpoint" in done.stderr


def test_the_commands_run_as_a_process(trained):
    done = subprocess.run([sys.executable, "-m", "trainer", "info", trained, "--json"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["serving"]["mask_token_id"] == 511
    helped = subprocess.run([sys.executable, "-m", "trainer", "export", "--help"], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    for option in ("--engine", "--format", "--dtype", "--verifier", "--target", "--force", "--json"):
        assert option in helped.stdout


# ---------------------------------------------------------------------------- mask token


def test_mask_token_default_is_the_first_id_past_the_tokenizer(tmp_path):
    from trainer.config import ModelConfig
    from trainer.model import Drafter
    from trainer.target import build_target

    with_tok = write_model_dir(tmp_path / "with", tokenizer_size=300)  # 300 words + 3 special tokens
    without = write_model_dir(tmp_path / "without")
    target = build_target(ModelConfig(path=with_tok), "cpu", torch.float32)

    def mask_of(**model):
        d = Drafter(ModelConfig(**model), target.config, target.embed_tokens, target.lm_head)
        return d.mask_token_id, d.mask_token_source

    assert mask_of(path=with_tok) == (303, "tokenizer")
    assert mask_of(path=without) == (511, "vocab_size-1")
    assert mask_of(preset="tiny") == (511, "vocab_size-1")
    assert mask_of(path=with_tok, mask_token_id=7) == (7, "config")
    full = write_model_dir(tmp_path / "full", tokenizer_size=520)  # no id left past the tokenizer
    assert mask_of(path=full) == (511, "vocab_size-1")


def test_resume_with_another_mask_token_id_is_refused(tmp_path, capsys):
    model_dir = write_model_dir(tmp_path / "target", tokenizer_size=300)
    raw = run_config(model={"path": model_dir, "preset": None}, train={"steps": 2})
    run_dir = tmp_path / "run"
    assert train(run_dir, raw) == contract.EXIT_DONE
    assert meta_of(latest(run_dir))["serving"]["mask_token_id"] == 303
    assert meta_of(latest(run_dir))["serving"]["tokenizer"]["size"] == 303

    capsys.readouterr()
    other = run_config(model={"path": model_dir, "preset": None, "mask_token_id": 7}, train={"steps": 3})
    assert train(run_dir, other) == contract.EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert "trained with mask token id 303 (tokenizer)" in err and "gives 7 (config)" in err
    assert "Set model.mask_token_id: 303" in err
    assert json.loads((run_dir / contract.STATUS_FILE).read_text())["phase"] == contract.PHASE_FAILED
    assert train(run_dir, run_config(model={"path": model_dir, "preset": None, "mask_token_id": 303},
                                     train={"steps": 3})) == contract.EXIT_DONE

    # A checkpoint from before the mask id was recorded used vocab_size - 1 whatever the
    # tokenizer: continuing it under the tokenizer default would change the id.
    ckpt = latest(run_dir)
    meta = meta_of(ckpt)
    del meta["serving"]
    meta["config"]["model"]["mask_token_id"] = None
    (tmp_path / "run" / "checkpoints" / os.path.basename(ckpt) / "meta.json").write_text(json.dumps(meta))
    capsys.readouterr()
    assert train(run_dir, run_config(model={"path": model_dir, "preset": None}, train={"steps": 4})) \
        == contract.EXIT_CONFIG_ERROR
    assert "trained with mask token id 511 (vocab_size-1)" in capsys.readouterr().err


# ---------------------------------------------------------------------------- export: round trip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_then_import_gives_identical_logits(trained, loaded, tmp_path, dtype):
    from trainer.export import import_dflash

    out = tmp_path / "out"
    done = cli("export", trained, str(out), "--dtype", dtype)
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(out)) == ["README.md", "config.json", "dflashctl_export.json", "model.safetensors"]
    fresh = import_dflash(str(out), loaded.target)
    original = copy.deepcopy(loaded.drafter).to(getattr(torch, dtype))
    ids = sequence(loaded.target)
    assert torch.equal(block_logits(fresh, loaded.target, ids, [3, 11, 20, 31]),
                       block_logits(original, loaded.target, ids, [3, 11, 20, 31]))
    # Another drafter's weights would not pass: the comparison sees the weights.
    other = copy.deepcopy(original)
    with torch.no_grad():
        other.layers[1].post_norm.weight.mul_(1.5)
    assert not torch.equal(block_logits(other, loaded.target, ids, [3]), block_logits(fresh, loaded.target, ids, [3]))


def test_hugging_faces_last_hidden_state_is_after_the_final_norm_and_the_trainers_features_before(loaded):
    """Why an export that reads the target's last layer is refused for speculators (its
    aux ids index Hugging Face's hidden_states): that entry is normed, the trainer's is not."""
    target = loaded.target
    ids = sequence(target, length=12)
    captured = {}
    hook = target.model.model.layers[-1].register_forward_hook(
        lambda m, a, out: captured.setdefault("last", out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():
            hidden = target.model(ids, output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    assert torch.allclose(hidden[-1], target.model.model.norm(captured["last"]))
    assert not torch.allclose(hidden[-1], captured["last"])


def test_tensor_names_map_one_to_one(loaded):
    from trainer.export import dflash_name, trainer_name

    names = list(loaded.drafter.trainable_state_dict())
    public = [dflash_name(n) for n in names]
    assert len(set(public)) == len(names) and [trainer_name(p) for p in public] == names
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight",
            "layers.0.post_attention_layernorm.weight", "layers.0.mlp.gate_proj.weight"} <= set(public)


# ---------------------------------------------------------------------------- the public formats


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class PublicLayer(nn.Module):
    """One DFlash draft layer as the format documents it: Qwen3 pre-norm attention whose
    keys/values are [context ; block], then a SwiGLU MLP."""

    def __init__(self, config, index: int, rule):
        from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

        super().__init__()
        self.rule, self.index = rule, index  # (layer, anchor, block) -> visible [B, anchor + B]
        h, heads, kv, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.heads, self.kv, self.d = heads, kv, d
        self.input_layernorm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.self_attn = nn.Module()
        for name, fan_out in (("q_proj", heads * d), ("k_proj", kv * d), ("v_proj", kv * d)):
            setattr(self.self_attn, name, nn.Linear(h, fan_out, bias=config.attention_bias))
        self.self_attn.o_proj = nn.Linear(heads * d, h, bias=config.attention_bias)
        self.self_attn.q_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
        self.self_attn.k_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)

    def forward(self, x, ctx, cos, sin, positions):
        a, n_ctx, n_blk = self.self_attn, ctx.shape[1], x.shape[1]
        h = self.input_layernorm(x)
        q = a.q_norm(a.q_proj(h).view(1, n_blk, self.heads, self.d)).transpose(1, 2)
        k = a.k_norm(torch.cat([a.k_proj(ctx), a.k_proj(h)], 1).view(1, n_ctx + n_blk, self.kv, self.d)).transpose(1, 2)
        v = torch.cat([a.v_proj(ctx), a.v_proj(h)], 1).view(1, n_ctx + n_blk, self.kv, self.d).transpose(1, 2)
        q = q * cos[:, None, -n_blk:] + rotate_half(q) * sin[:, None, -n_blk:]
        k = k * cos[:, None] + rotate_half(k) * sin[:, None]
        k, v = (t.repeat_interleave(self.heads // self.kv, dim=1) for t in (k, v))
        scores = q @ k.transpose(-1, -2) / self.d ** 0.5
        visible = self.rule(self.index, n_ctx, n_blk)
        scores = scores.masked_fill(~visible, float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, n_blk, self.heads * self.d)
        x = x + a.o_proj(out)
        return x + self.mlp(self.post_attention_layernorm(x))


class PublicDFlash(nn.Module):
    """z-lab's DFlash drafter rebuilt from its config.json: ``fc`` and ``hidden_norm``
    fuse the target features, Qwen3 layers, final ``norm``; no embedding or lm_head."""

    def __init__(self, config, num_features: int, engine: str, raw: dict):
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

        from tests.harness.engines import engine_visible

        super().__init__()
        h = config.hidden_size
        self.fc = nn.Linear(num_features * h, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)

        def rule(layer, anchor, block):  # the engine's mask, from its code (test_engine_rules)
            return engine_visible(engine, raw, layer, anchor, block)

        self.layers = nn.ModuleList(PublicLayer(config, i, rule) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)

    def forward(self, target_hidden, noise_embedding, positions):
        ctx = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rotary_emb(noise_embedding, positions[None])
        x = noise_embedding
        for layer in self.layers:
            x = layer(x, ctx, cos, sin, positions)
        return self.norm(x)


def public_logits(model, target_model, feature_ids: list[int], mask_id: int, block: int, ids_1S, anchor: int,
                  embed=None, lm_head=None):
    """Slots 1..B-1 logits of the block at ``anchor``, computed as the format prescribes:
    target features = hidden_states[i] for the listed i, context = positions < anchor."""
    with torch.no_grad():
        hidden = target_model(ids_1S, output_hidden_states=True).hidden_states
        target_hidden = torch.cat([hidden[i] for i in feature_ids], dim=-1)[:, :anchor]
        block_ids = torch.full((1, block), mask_id)
        block_ids[0, 0] = ids_1S[0, anchor]
        embed = embed or target_model.get_input_embeddings()
        lm_head = lm_head or target_model.get_output_embeddings()
        positions = torch.arange(anchor + block)
        return lm_head(model(target_hidden, embed(block_ids), positions))[0, 1:]


def public_dflash(out, engine: str):
    """(raw config, model) of an exported dflash directory, loaded as ``engine`` reads it."""
    from safetensors.torch import load_file
    from transformers import Qwen3Config

    raw = json.loads((out / "config.json").read_text())
    model = PublicDFlash(Qwen3Config.from_pretrained(out), len(raw["dflash_config"]["target_layer_ids"]), engine, raw)
    model.load_state_dict(load_file(out / "model.safetensors"), strict=True)  # every name and shape, nothing extra
    return raw, model


def assert_public_logits_match(model, raw, loaded, anchors, atol, seed=3):
    ids = sequence(loaded.target, seed=seed)
    ours = block_logits(loaded.drafter, loaded.target, ids, anchors)
    for n, anchor in enumerate(anchors):
        theirs = public_logits(model, loaded.target.model, [i + 1 for i in raw["dflash_config"]["target_layer_ids"]],
                               raw["dflash_config"]["mask_token_id"], raw["block_size"], ids, anchor)
        assert (theirs - ours[n, 1:]).abs().max() <= atol, (theirs - ours[n, 1:]).abs().max()
        assert torch.equal(theirs.argmax(-1), ours[n, 1:].argmax(-1))


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_causal_in_block_drafter_runs_as_trained_under_vllms_and_sglangs_rule(trained, loaded, tmp_path, engine):
    out = tmp_path / "dflash"
    done = cli("export", trained, str(out), "--engine", engine)
    assert done.returncode == 0, done.stderr
    raw, model = public_dflash(out, engine)
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["model_type"] == "qwen3"
    assert raw["block_size"] == 8 and raw["num_target_layers"] == 8 and raw["num_hidden_layers"] == 2
    assert raw["dflash_config"] == {"mask_token_id": 511, "target_layer_ids": [1, 2, 3, 4, 5], "block_size": 8}
    assert raw["layer_types"] == ["sliding_attention", "full_attention"] and raw["sliding_window"] == 5
    assert "is_causal" not in raw and "causal" not in raw["dflash_config"]  # per layer type: sliding causal, full not
    assert_public_logits_match(model, raw, loaded, [4, 17, 30], atol=1e-5)
    # The same weights with every layer bidirectional (z-lab's code with is_causal: false) give other logits.
    from transformers import Qwen3Config

    zlab = PublicDFlash(Qwen3Config.from_pretrained(out), 5, "zlab", {**raw, "is_causal": False})
    zlab.load_state_dict(model.state_dict())
    ids = sequence(loaded.target)
    ours = block_logits(loaded.drafter, loaded.target, ids, [17])[0, 1:]
    assert (public_logits(zlab, loaded.target.model, [2, 3, 4, 5, 6], 511, 8, ids, 17) - ours).abs().max() > 1e-2


def test_export_for_vllm_of_a_bidirectional_sliding_drafter_is_refused_with_the_reason(bidirectional, tmp_path):
    """vLLM runs a non-causal sliding layer with flash-attention's (W-1, 0) window in
    releases before _maybe_symmetrize_window: the export once wrote is_causal: false."""
    out = tmp_path / "out"
    done = cli("export", bidirectional.path, str(out), "--engine", "vllm")
    assert done.returncode == contract.EXIT_CONFIG_ERROR
    assert "layers [0, 1] were trained with model.sliding_semantics: bidirectional" in done.stderr
    assert "qwen3_dflash.py: _dflash_layer_causal" in done.stderr and "FlashAttentionImpl.__init__" in done.stderr
    assert "Fits: --engine zlab" in done.stderr
    assert not out.exists()


@pytest.fixture(scope="module")
def bidirectional(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("bidirectional") / "run"
    raw = run_config(model={"layer_types": ["sliding", "sliding"], "sliding_window": 3,
                            "sliding_semantics": "bidirectional"})
    assert train(run_dir, raw) == contract.EXIT_DONE
    from trainer import restore

    return restore.load(latest(run_dir))


def test_bidirectional_drafter_runs_as_trained_under_zlabs_rule(bidirectional, tmp_path):
    assert meta_of(bidirectional.path)["serving"]["sliding_semantics"] == "bidirectional"
    out = tmp_path / "zlab"
    done = cli("export", bidirectional.path, str(out), "--engine", "zlab")
    assert done.returncode == 0, done.stderr
    assert "dflash package 0.1.0 or later" in done.stderr  # earlier revisions ran every layer non-causal: said
    raw, model = public_dflash(out, "zlab")
    assert raw["is_causal"] is False and raw["layer_types"] == ["sliding_attention"] * 2 and raw["sliding_window"] == 3
    assert_public_logits_match(model, raw, bidirectional, [4, 17, 30], atol=1e-5)
    for engine in ("vllm", "sglang", "speculators"):  # each would run it otherwise: refused, with what fits
        done = cli("export", bidirectional.path, str(tmp_path / engine), "--engine", engine)
        assert done.returncode == contract.EXIT_CONFIG_ERROR and "--engine zlab" in done.stderr, done.stderr


def test_speculators_export_only_where_its_anchored_window_is_the_trained_one(trained, tmp_path):
    done = cli("export", trained, str(tmp_path / "refused"), "--engine", "speculators")
    assert done.returncode == contract.EXIT_CONFIG_ERROR
    assert "a-W..a-1" in done.stderr and "Fits: model.sliding_window: 4096" in done.stderr
    assert cli("export", trained, str(tmp_path / "refused"), "--format", "speculators").returncode \
        == contract.EXIT_CONFIG_ERROR  # the layout alone is checked for speculators too


@pytest.fixture(scope="module")
def unbounded(tmp_path_factory):
    """A sliding drafter whose window covers every position of the tiny target (4096)."""
    run_dir = tmp_path_factory.mktemp("unbounded") / "run"
    assert train(run_dir, run_config(model={"sliding_window": 4096}, train={"steps": 2})) == contract.EXIT_DONE
    from trainer import restore

    return restore.load(latest(run_dir))


def test_public_speculators_loader_reads_the_export(unbounded, tmp_path):
    from safetensors.torch import load_file
    from transformers import Qwen3Config

    out = tmp_path / "spec"
    done = cli("export", unbounded.path, str(out), "--engine", "speculators")
    assert done.returncode == 0, done.stderr
    raw = json.loads((out / "config.json").read_text())
    assert raw["speculators_model_type"] == "dflash"
    assert raw["aux_hidden_state_layer_ids"] == [2, 3, 4, 5, 6]  # z-lab ids + 1: hidden-state indices
    assert raw["mask_token_id"] == 511 and raw["block_size"] == 8 and raw["draft_vocab_size"] == 512
    assert raw["sliding_window_non_causal"] is False and raw["sample_from_anchor"] is False
    sc = raw["speculators_config"]
    assert sc["algorithm"] == "dflash" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 7, "verifier_accept_k": 1,
                                       "accept_tolerance": 0.0}]
    assert sc["verifier"]["name_or_path"] == "dflashctl-preset:tiny"
    tensors = load_file(out / "model.safetensors")
    assert tensors["embed_tokens.weight"].shape == (512, 64) and tensors["lm_head.weight"].shape == (512, 64)
    assert torch.equal(tensors["lm_head.weight"], unbounded.target.lm_head.weight)

    config = Qwen3Config(**raw["transformer_layer_config"])
    model = PublicDFlash(config, len(raw["aux_hidden_state_layer_ids"]), "speculators", raw)
    body = {k: v for k, v in tensors.items() if k not in ("embed_tokens.weight", "lm_head.weight")}
    model.load_state_dict(body, strict=True)
    embed = nn.Embedding.from_pretrained(tensors["embed_tokens.weight"])
    head = nn.Linear(64, 512, bias=False)
    head.weight = nn.Parameter(tensors["lm_head.weight"])
    ids = sequence(unbounded.target, seed=5)
    ours = block_logits(unbounded.drafter, unbounded.target, ids, [9, 30])
    for n, anchor in enumerate([9, 30]):
        theirs = public_logits(model, unbounded.target.model, raw["aux_hidden_state_layer_ids"], raw["mask_token_id"],
                               raw["block_size"], ids, anchor, embed=embed, lm_head=head)
        assert (theirs - ours[n, 1:]).abs().max() <= 1e-5


def test_a_damaged_semantics_is_refused_with_the_field(trained, tmp_path):
    odd = tmp_path / "step-00000004"
    shutil.copytree(trained, odd)
    meta = meta_of(str(odd))
    meta["serving"]["sliding_semantics"] = "bidirectional-in-block"
    (odd / "meta.json").write_text(json.dumps(meta))
    for engine in ("vllm", "speculators"):
        done = cli("export", str(odd), str(tmp_path / "out"), "--engine", engine)
        assert done.returncode == contract.EXIT_CONFIG_ERROR
        assert "serving.sliding_semantics: 'bidirectional-in-block' is not one of" in done.stderr


def test_export_keeps_an_existing_directory_unless_forced(trained, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    done = cli("export", trained, str(out))
    assert done.returncode == contract.EXIT_CONFIG_ERROR and "--force" in done.stderr
    assert (out / "keep.txt").exists()
    assert cli("export", trained, str(out), "--force").returncode == 0
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()


# ---------------------------------------------------------------------------- another environment


def config_forms(model_dir: str, tmp_path) -> tuple[str, str]:
    """The same model in two directories whose config.json differ only as transformers
    4.57 and 5.x write it: ``rope_theta`` at the top level with ``rope_scaling: null``,
    or inside ``rope_parameters``."""
    old, new = tmp_path / "t457", tmp_path / "t5x"
    shutil.copytree(model_dir, old)
    shutil.copytree(model_dir, new)
    raw = json.loads((old / "config.json").read_text())
    params = raw.pop("rope_parameters")
    raw.update(rope_theta=params["rope_theta"], rope_scaling=None, transformers_version="4.57.1")
    (old / "config.json").write_text(json.dumps(raw))
    raw5 = json.loads((new / "config.json").read_text())
    assert raw5["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"} and "rope_theta" not in raw5
    return str(old), str(new)


def test_one_target_under_two_transformers_versions_is_the_same_target(tmp_path):
    from trainer import serving

    old, new = config_forms(write_model_dir(tmp_path / "target"), tmp_path)
    raw_old = json.loads(open(os.path.join(old, "config.json")).read())
    raw_new = json.loads(open(os.path.join(new, "config.json")).read())
    assert serving.rope_settings(raw_old) == serving.rope_settings(raw_new)
    assert serving.target_config_hash(raw_old) != serving.target_config_hash(raw_new)  # why the hash cannot decide

    # Trained where transformers 4.57 read the target: the recorded hash is that of its to_dict.
    run_dir = tmp_path / "run"
    assert train(run_dir, run_config(model={"path": old, "preset": None}, train={"steps": 2})) == contract.EXIT_DONE
    ckpt = latest(run_dir)
    meta = meta_of(ckpt)
    meta["serving"]["target"]["config_hash"] = serving.target_config_hash(raw_old)
    with open(os.path.join(ckpt, "meta.json"), "w") as f:
        json.dump(meta, f)
    for target in (old, new):
        done = cli("eval", ckpt, "--target", target, "--prompts", "1", "--max-new-tokens", "4", "--no-greedy",
                   "--no-reference", "--device", "cpu", "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["prompts"] == 1
    done = cli("export", ckpt, str(tmp_path / "spec"), "--format", "speculators", "--target", new)
    assert done.returncode == contract.EXIT_CONFIG_ERROR and "a-W..a-1" in done.stderr  # W=5 slides: refused for that
    full = tmp_path / "full-run"
    assert train(full, run_config(model={"path": old, "preset": None, "layer_types": None},
                                  train={"steps": 1})) == contract.EXIT_DONE
    assert cli("export", latest(full), str(tmp_path / "spec"), "--engine", "speculators", "--target", new,
               "--verifier", new).returncode == 0


def test_a_different_target_is_refused_naming_the_field(tmp_path):
    model_dir = write_model_dir(tmp_path / "target")
    run_dir = tmp_path / "run"
    assert train(run_dir, run_config(model={"path": model_dir, "preset": None}, train={"steps": 1})) == contract.EXIT_DONE
    other = tmp_path / "other"
    shutil.copytree(model_dir, other)
    raw = json.loads((other / "config.json").read_text())
    raw["rope_parameters"]["rope_theta"] = 20000.0
    (other / "config.json").write_text(json.dumps(raw))
    done = cli("eval", latest(run_dir), "--target", str(other), "--prompts", "1", "--device", "cpu")
    assert done.returncode == contract.EXIT_CONFIG_ERROR
    assert "rope.rope_theta: trained 10000.0, this target 20000.0" in done.stderr
    assert f"({model_dir}) with --target PATH" in done.stderr
    # The same directory changed in place: said so, not "give the same path".
    (tmp_path / "target" / "config.json").write_text(json.dumps(raw))
    done = cli("eval", latest(run_dir), "--prompts", "1", "--device", "cpu")
    assert done.returncode == contract.EXIT_CONFIG_ERROR and "changed since checkpoint" in done.stderr
    assert done.stderr.count(model_dir) == 1, done.stderr


def test_exported_files_are_readable_by_another_user_and_name_no_training_path(tmp_path):
    model_dir = write_model_dir(tmp_path / "models" / "target")
    run_dir = tmp_path / "run"
    assert train(run_dir, run_config(model={"path": model_dir, "preset": None, "layer_types": None},
                                     data={"shards": None, "synthetic_samples": 16}, train={"steps": 1})) \
        == contract.EXIT_DONE
    out = tmp_path / "exports" / "spec"
    done = cli("export", latest(run_dir), str(out), "--engine", "speculators")  # which verifier? said, with the fix
    assert done.returncode == contract.EXIT_CONFIG_ERROR and f"--verifier {model_dir}" in done.stderr
    assert cli("export", latest(run_dir), str(out), "--engine", "speculators", "--verifier", model_dir).returncode == 0
    for name in os.listdir(out):
        assert os.stat(out / name).st_mode & 0o777 == 0o644, name
    assert os.stat(out).st_mode & 0o777 == 0o755
    assert sorted(os.listdir(out)) == ["README.md", "config.json", "dflashctl_export.json", "model.safetensors"]
    verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"]
    assert verifier == model_dir  # given by the user, absolute: resolved from any working directory
    provenance = (out / EXPORT_META).read_text()
    assert str(tmp_path) not in provenance and '"/' not in provenance, provenance
    assert json.loads(provenance)["serving"]["target"]["path"] == "target"
    assert cli("export", latest(run_dir), str(out), "--engine", "speculators", "--force",
               "--verifier", "Qwen/Qwen3-0.6B").returncode == 0
    assert json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] \
        == "Qwen/Qwen3-0.6B"
    assert str(tmp_path) not in (out / "README.md").read_text()


def test_the_dflash_config_names_only_files_it_ships(trained, tmp_path):
    out = tmp_path / "out"
    assert cli("export", trained, str(out), "--engine", "vllm").returncode == 0
    raw = json.loads((out / "config.json").read_text())
    assert "auto_map" not in raw  # it named a dflash.py the export never had
    for entry in raw.get("auto_map", {}).values():
        assert (out / (entry.split(".")[0] + ".py")).exists()


def test_the_model_card_says_what_serving_needs_and_the_measured_tau(trained, loaded, tmp_path):
    report = tmp_path / "eval.json"
    done = cli("eval", trained, "--prompts", "2", "--max-new-tokens", "8", "--device", "cpu", "--json",
               "--out", str(report))
    assert done.returncode == 0, done.stderr
    measured = json.loads(report.read_text())
    out = tmp_path / "out"
    assert cli("export", trained, str(out), "--engine", "vllm", "--eval", str(report)).returncode == 0
    card = (out / "README.md").read_text()
    serving = meta_of(trained)["serving"]
    for text in ("# DFlash drafter for preset tiny", serving["target"]["config_hash"], "| block size | 8",
                 "| mask token id | 511 (vocab_size-1)", "| target layer ids | [1, 2, 3, 4, 5]", "hidden_states[i + 1]",
                 "sliding_attention, full_attention; sliding window 5, trained causal_in_block",
                 f"tau **{measured['tau']:.2f}**", f"prompts: {measured['prompts']} of ", "Trained on the synthetic task"):
        assert text in card, (text, card)
    assert json.loads((out / EXPORT_META).read_text())["measured"]["tau"] == measured["tau"]
    # A report of another step would put a figure in the card this drafter never had: refused.
    measured["step"] = 99
    report.write_text(json.dumps(measured))
    done = cli("export", trained, str(tmp_path / "other"), "--eval", str(report))
    assert done.returncode == contract.EXIT_CONFIG_ERROR and "measured step 99, this checkpoint is step 4" in done.stderr
    assert cli("export", trained, str(tmp_path / "none")).returncode == 0
    assert "Not measured." in (tmp_path / "none" / "README.md").read_text()


# ---------------------------------------------------------------------------- metadata within bounds


@pytest.mark.parametrize("field,value,message", [
    ("block_size", -4, "serving.block_size: -4 is outside [2, 256]"),
    ("target.hidden_size", 1e9, "serving.target.hidden_size: expected an integer, got 1000000000.0"),
    ("drafter.num_hidden_layers", 100000, "serving.drafter.num_hidden_layers: 100000 is outside [1, 64]"),
    ("mask_token_id", "511", "serving.mask_token_id: '511' is not a token id of the target's vocabulary of 512"),
    ("sliding_window", 0, "serving.sliding_window: 0 is not a window"),
    ("target_layer_ids", [1, 2, 3, 4, 99], "serving.target_layer_ids: [1, 2, 3, 4, 99] is not a list of layers"),
])
def test_damaged_serving_metadata_is_refused_naming_the_field(trained, tmp_path, field, value, message):
    ckpt = tmp_path / "step-00000004"
    shutil.copytree(trained, ckpt)
    meta = meta_of(str(ckpt))
    section, _, leaf = field.rpartition(".")
    (meta["serving"][section] if section else meta["serving"])[leaf] = value
    (ckpt / "meta.json").write_text(json.dumps(meta))
    for command in (["export", str(ckpt), str(tmp_path / "out")], ["info", str(ckpt)],
                    ["eval", str(ckpt), "--prompts", "1", "--device", "cpu"]):
        done = cli(*command)
        assert done.returncode == contract.EXIT_CONFIG_ERROR, (command, done.stderr)
        assert message in done.stderr and str(ckpt / "meta.json") in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key,value,message", [
    ("drafter_layers", 100000, "model.drafter_layers: 100000 is outside [1, 64]"),
    ("block_size", -4, "model.block_size: -4 is outside [2, 256]"),
    ("mask_token_id", "x", "model.mask_token_id: expected an integer, got 'x'"),
])
def test_damaged_run_config_in_a_checkpoint_is_refused_before_anything_is_built(trained, tmp_path, key, value, message):
    ckpt = tmp_path / "step-00000004"
    shutil.copytree(trained, ckpt)
    meta = meta_of(str(ckpt))
    meta["config"]["model"][key] = value
    del meta["serving"]  # the run's config is then all there is to go by
    (ckpt / "meta.json").write_text(json.dumps(meta))
    for command in (["eval", str(ckpt), "--prompts", "1", "--device", "cpu"], ["info", str(ckpt)]):
        done = cli(*command)
        assert done.returncode == contract.EXIT_CONFIG_ERROR and message in done.stderr, done.stderr
