"""Speculative decoding with the trained drafter and the frozen target (trainer/speculative.py,
trainer/eval.py), on CPU at the tiny preset, with drafters trained by the real trainer."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dflashctl.core import contract
from tests.harness import REPO
from tests.harness.tiny import cli, latest, run_config, train, write_model_dir


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: batch-1 decoding of a tiny model is latency-bound, and on
    a loaded machine torch's thread pool spins against other processes (a forward
    takes 10x longer). The results do not depend on it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


DEMO = {  # playbooks/demo.yaml's trainer section as it was: a random target and synthetic data it never wrote
    "model": {"preset": "tiny", "drafter_layers": 2, "block_size": 8},
    "data": {"buckets": [256], "batch_size": 2, "max_anchors": 16},
    "optim": {"lr": 1.0e-2},
    "train": {"steps": 300, "log_every": 10, "checkpoint_every": 50},
    "placement": {"device": "cpu", "target": [0], "drafter": [0]},
}


# ---------------------------------------------------------------------------- the cached drafter


@pytest.mark.parametrize("layer_types,semantics", [(["full", "full"], "causal_in_block"),
                                                   (["sliding", "full"], "causal_in_block"),
                                                   (["sliding", "full"], "bidirectional")])
def test_cached_block_forward_matches_the_training_forward(layer_types, semantics):
    from trainer.attention import SDPA, AttentionPath, build_layer_masks
    from trainer.config import ModelConfig
    from trainer.model import Drafter
    from trainer.speculative import DraftState
    from trainer.target import build_target

    target = build_target(ModelConfig(preset="tiny"), "cpu", torch.float32)
    torch.manual_seed(1)
    cfg = ModelConfig(preset="tiny", drafter_layers=2, block_size=8, layer_types=layer_types, sliding_window=3,
                      sliding_semantics=semantics)
    drafter = Drafter(cfg, target.config, target.embed_tokens, target.lm_head).eval()
    ids = torch.randint(1, 500, (1, 48), generator=torch.Generator().manual_seed(2))
    features = target.features(ids)
    state = DraftState(drafter)
    for begin, end in ((0, 10), (10, 11), (11, 48)):  # the context arrives in pieces, as decoding adds it
        state.extend(features[:, begin:end])
    for anchor in (0, 1, 9, 10, 30, 40):
        block = torch.full((8,), drafter.mask_token_id)
        block[0] = ids[0, anchor]
        cached = state.logits(block, anchor)
        anchors, valid = torch.tensor([[anchor]]), torch.tensor([[True]])
        masks = build_layer_masks(AttentionPath(SDPA, "cpu"), anchors, valid, 48, 8, drafter.layer_types, 3, semantics)
        with torch.no_grad():
            dense = drafter.lm_head(drafter(features, block[None], torch.arange(anchor, anchor + 8)[None], masks))[0]
        assert torch.allclose(cached, dense, atol=1e-5, rtol=1e-5), (anchor, (cached - dense).abs().max())


# ---------------------------------------------------------------------------- verification rules


def test_rejection_rule_keeps_the_target_distribution():
    from trainer.speculative import accept_sampled

    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0], [0.1, 0.1, 0.1, 0.1, 0.6]])  # the target at slot 1, then the bonus
    q = torch.tensor([[0.1, 0.6, 0.1, 0.1, 0.1]])  # a poor draft distribution
    counts = torch.zeros(5)
    n = 20000
    draws = torch.multinomial(q[0], n, replacement=True, generator=g)
    for x in draws.tolist():
        accepted, nxt = accept_sampled(torch.tensor([x]), q, p, g)
        counts[x if accepted else nxt] += 1
    assert torch.allclose(counts / n, p[0], atol=0.015), counts / n
    # A perfect draft is always accepted and the bonus comes from the last row.
    assert accept_sampled(torch.tensor([4]), p[1:], torch.stack([p[1], p[0]]), g)[0] == 1


def test_greedy_rule_accepts_the_agreeing_prefix():
    from trainer.speculative import accept_greedy

    logits = torch.nn.functional.one_hot(torch.tensor([5, 6, 9, 8]), 10).float()  # target picks 5, 6, 9, 8
    assert accept_greedy(torch.tensor([5, 6, 7]), logits) == (2, 9)
    assert accept_greedy(torch.tensor([1, 6, 9]), logits) == (0, 5)
    assert accept_greedy(torch.tensor([5, 6, 9]), logits) == (3, 8)


# ---------------------------------------------------------------------------- a drafter for the random target


@pytest.fixture(scope="module")
def written_by_target(tmp_path_factory):
    """Shards whose responses the tiny random target wrote (greedy), and a drafter
    trained on them briefly: it gets some blocks right and many wrong, so decoding
    goes through every kind of partial acceptance and roll-back."""
    from trainer.config import ModelConfig
    from trainer.eval import target_data
    from trainer.target import build_target

    root = tmp_path_factory.mktemp("written")
    target = build_target(ModelConfig(preset="tiny"), "cpu", torch.float32)
    shards = target_data(target, str(root / "shards"), samples=48, prompt_len=12, new_tokens=60, warmup_tokens=4,
                         seed=1, reserved=(511,), batch=48)
    raw = run_config(model={"layer_types": None, "sliding_window": 2048},
                     data={"shards": shards, "buckets": [128], "max_anchors": 32, "batch_size": 2},
                     optim={"lr": 1e-2, "warmup_frac": 0.04}, train={"steps": 120, "log_every": 10})
    assert train(root / "run", raw) == contract.EXIT_DONE
    return {"ckpt": latest(root / "run"), "shards": shards, "target": target}


def test_speculative_greedy_output_is_plain_greedy_output_on_20_prompts(written_by_target):
    from trainer.eval import run_eval

    report = run_eval(written_by_target["ckpt"], written_by_target["shards"], prompts=20, max_new_tokens=40,
                      reference=False)
    assert report["prompts"] == 20 and report["new_tokens"] == 20 * 40
    assert report["greedy_identical"] is True and report["mismatched_prompts"] == []
    assert all(row["identical"] for row in report["per_prompt"])
    hist = report["accept_len_hist"]
    assert sum(1 for c in hist if c) >= 3, hist  # full rejections, partial and longer acceptances all happened
    assert report["steps"] == sum(hist) == sum(len(r["accepted"]) for r in report["per_prompt"])
    assert report["tokens_per_target_forward"] == pytest.approx(
        report["new_tokens"] / sum(r["target_forwards"] for r in report["per_prompt"]))
    assert 1 <= report["tau"] <= 8


def test_the_greedy_baseline_is_the_targets_own_greedy_decoding(written_by_target):
    from trainer import restore
    from trainer.eval import load_samples, split_prompt
    from trainer.speculative import greedy_generate

    loaded = restore.load(written_by_target["ckpt"])
    for ids, mask in load_samples(loaded.cfg, written_by_target["shards"], 512, 511, 3)[0]:
        start = split_prompt(ids, mask)
        ours = greedy_generate(loaded.target, ids[:start], 30).tokens
        hf = loaded.target.greedy_generate(torch.tensor([ids[:start]]), 30)[0, start:].tolist()
        assert ours == hf
        assert ours == ids[start:start + 30]  # the shards hold exactly the target's continuation


def test_decoding_accepts_what_the_training_statistic_predicts_step_by_step(written_by_target):
    """When the target wrote the data, decoding follows the data, so each verification
    step must accept what the trainer's own statistic (the training forward, verified
    against the data) gives at that anchor."""
    from trainer import restore
    from trainer.eval import load_samples, split_prompt
    from trainer.speculative import anchor_runs, speculative_generate

    loaded = restore.load(written_by_target["ckpt"])
    steps = 0
    for ids, mask in load_samples(loaded.cfg, written_by_target["shards"], 512, 511, 6)[0]:
        start = split_prompt(ids, mask)
        runs = anchor_runs(loaded.target, loaded.drafter, ids, mask)
        gen = speculative_generate(loaded.target, loaded.drafter, ids[:start], len(ids) - start)
        assert gen.tokens == ids[start:]
        anchor = start
        for accepted in gen.accepted:
            if anchor + accepted + 1 >= len(ids):  # the data ends inside this block: decoding goes on
                break
            assert accepted == runs[anchor], (anchor, accepted, runs[anchor])
            anchor += accepted + 1
            steps += 1
    assert steps > 30


def test_eval_command_writes_the_json_report(written_by_target, tmp_path):
    out = tmp_path / "eval.json"
    done = cli("eval", written_by_target["ckpt"], "--data", written_by_target["shards"], "--prompts", "3",
               "--max-new-tokens", "16", "--device", "cpu", "--json", "--out", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert json.loads(out.read_text()) == report
    for key in ("format", "checkpoint", "step", "device", "dtype", "data", "temperature", "block_size",
                "mask_token_id", "prompts", "new_tokens", "steps", "tau", "tau_mean", "tau_per_prompt",
                "accept_len_hist", "tokens_per_target_forward", "greedy_identical", "speed", "training",
                "reference", "per_prompt"):
        assert key in report, key
    assert report["step"] == 120 and report["training"]["step"] == 120
    assert report["training"]["tau_estimate"] == pytest.approx(report["training"]["accept_len"] + 1)
    metrics = [json.loads(line) for line in open(os.path.join(os.path.dirname(os.path.dirname(report["checkpoint"])),
                                                               contract.METRICS_FILE))]
    last5 = [m["accept_len"] for m in metrics[-5:]]
    assert report["training"]["accept_len_recent"] == pytest.approx(sum(last5) / 5)
    assert report["training"]["recent_from_step"] == metrics[-5]["step"] == 80
    assert set(report["speed"]) == {"speculative_s", "speculative_tok_s", "greedy_s", "greedy_tok_s", "speedup"}
    assert report["reference"]["target_agreement"] > 0.95  # the target wrote these responses
    text = cli("eval", written_by_target["ckpt"], "--data", written_by_target["shards"], "--prompts", "2",
               "--max-new-tokens", "8", "--device", "cpu")
    assert "identical to plain greedy decoding" in text.stdout and "tokens per target forward" in text.stdout


def test_sampling_with_a_temperature_is_reproducible(written_by_target):
    from trainer.eval import run_eval

    args = dict(prompts=3, max_new_tokens=24, temperature=0.8, seed=7, reference=False)
    first = run_eval(written_by_target["ckpt"], written_by_target["shards"], **args)
    again = run_eval(written_by_target["ckpt"], written_by_target["shards"], **args)
    assert first["greedy_identical"] is None and first["new_tokens"] == 3 * 24
    assert first["accept_len_hist"] == again["accept_len_hist"] and first["tau"] == again["tau"]


def test_eval_takes_the_target_from_another_path_only_when_it_is_the_same_network(written_by_target, tmp_path):
    same = write_model_dir(tmp_path / "same")  # the tiny preset's weights, saved: the target moved
    done = cli("eval", written_by_target["ckpt"], "--data", written_by_target["shards"], "--target", same,
               "--prompts", "1", "--max-new-tokens", "8", "--device", "cpu", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["greedy_identical"] is True

    other = write_model_dir(tmp_path / "other")
    cfg_path = os.path.join(other, "config.json")
    with open(cfg_path) as f:
        raw = json.load(f)
    raw["rms_norm_eps"] = 1e-5  # another network
    with open(cfg_path, "w") as f:
        json.dump(raw, f)
    done = cli("eval", written_by_target["ckpt"], "--target", other, "--prompts", "1", "--device", "cpu")
    assert done.returncode == contract.EXIT_CONFIG_ERROR and "drafter.rms_norm_eps: trained 1e-06, this target 1e-05" in done.stderr


# ---------------------------------------------------------------------------- agreement with training


def cycle_target(path, cycle: list[int]) -> str:
    """A tiny Qwen3 whose greedy continuation of a cycle token is its successor in
    ``cycle`` (trainer.target.arrange_cycle): the synthetic task assumes the target
    writes the cycle; the random preset does not, this one does."""
    from transformers import AutoModelForCausalLM

    from trainer.target import arrange_cycle, preset_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config("tiny"))
    arrange_cycle(model, cycle)
    model.save_pretrained(path)
    return str(path)


@pytest.mark.slow
def test_measured_tau_agrees_with_training_after_the_demo_run(tmp_path):
    """The demo's 300 steps on the demo's synthetic task, with a target that writes the
    cycle: measured tau is near the block size and within 10% of accept_len + 1."""
    from trainer.data import SyntheticDataset
    from trainer.eval import format_text, run_eval

    cycle = SyntheticDataset(1, 512, 256, 16, seed=0, alphabet=8, reserved=(511,)).cycle  # the demo data's cycle
    raw = json.loads(json.dumps(DEMO))
    raw["model"].update(path=cycle_target(tmp_path / "target", cycle), preset=None)
    assert train(tmp_path / "run", raw) == contract.EXIT_DONE
    report = run_eval(str(tmp_path / "run"), prompts=20, max_new_tokens=256, greedy=False)
    print(format_text(report))
    trained = report["training"]["tau_estimate"]
    assert report["reference"]["target_agreement"] > 0.95
    assert report["tau"] > 0.85 * 8, report["accept_len_hist"]
    assert abs(report["tau"] - trained) <= 0.1 * trained, (report["tau"], trained)


@pytest.mark.slow
def test_data_the_target_did_not_write_shows_a_gap_and_its_reason(tmp_path):
    """The old demo: the random target never writes the synthetic cycle, so the drafter
    learns the data (accept_len well above 5) yet decoding with that target accepts
    almost nothing, and the report says why."""
    from trainer.eval import format_text, run_eval

    assert train(tmp_path / "run", json.loads(json.dumps(DEMO))) == contract.EXIT_DONE
    report = run_eval(str(tmp_path / "run"), prompts=4, max_new_tokens=32, greedy=False)
    assert report["training"]["accept_len"] > 5 and report["reference"]["chain_tau"] > 5
    assert report["reference"]["target_agreement"] < 0.2 and report["tau"] < 1.5
    assert "the data was not written by this target" in format_text(report)
    assert "not written by this target" in contract.tau_gap(report["training"]["tau_estimate"], report["tau"])


@pytest.mark.slow
def test_the_demo_as_shipped_measures_tau_near_accept_len_plus_one(tmp_path):
    """playbooks/demo.yaml as shipped: the tiny-cycle target regenerates the responses
    (data.regenerate) before training, the drafter trains on them, and real
    speculative decoding on the held-out prompts measures tau within 10 % of
    accept_len + 1, its output identical to greedy decoding."""
    import yaml

    from trainer.eval import format_text, run_eval
    from trainer.info import describe
    from trainer.info import format_text as info_text

    with open(REPO / "playbooks" / "demo.yaml") as f:
        playbook = yaml.safe_load(f)
    assert train(tmp_path / "run", playbook["trainer"]) == contract.EXIT_DONE
    with open(tmp_path / "run" / "regenerated" / "manifest.json") as f:
        manifest = json.load(f)
    assert manifest["complete"] and manifest["provenance"]["target"]["preset"] == "tiny-cycle"
    settings = playbook["eval"]
    report = run_eval(str(tmp_path / "run"), prompts=settings["prompts"], max_new_tokens=settings["max_new_tokens"])
    print(format_text(report))
    assert "held-out" in report["data"] and report["complete"]
    assert report["greedy_identical"] is True
    estimate = report["training"]["tau_estimate"]
    assert abs(report["tau"] - estimate) <= 0.1 * estimate, (report["tau"], estimate)
    assert report["tau"] > 0.8 * 8 and report["speed"]["speedup"] > 1
    assert "regenerated by preset tiny-cycle" in info_text(describe(str(tmp_path / "run")))


def test_eval_reports_each_prompt_and_keeps_what_it_measured_at_its_budget(written_by_target):
    """Each prompt hands over the report so far; past the budget (the clock is an
    argument) no new prompt is begun and the report says it is partial."""
    from trainer.eval import format_text, run_eval

    ticks = iter(range(0, 10_000, 10))  # every reading of the clock is 10 s later
    seen = []
    report = run_eval(written_by_target["ckpt"], written_by_target["shards"], prompts=6, max_new_tokens=8,
                      reference=False, timeout=35, on_prompt=seen.append, clock=lambda: next(ticks))
    assert [r["prompts"] for r in seen] == list(range(1, report["prompts"] + 1))
    assert 0 < report["prompts"] < 6 and report["prompts_planned"] == 6
    assert report["complete"] is False and report["stopped"] == "timeout"
    assert all(not r["complete"] for r in seen) and seen[-1]["tau"] == report["tau"]
    assert "partial" in format_text(report)
    whole = run_eval(written_by_target["ckpt"], written_by_target["shards"], prompts=2, max_new_tokens=8,
                     reference=False)
    assert whole["complete"] is True and whole["stopped"] is None


def test_eval_measures_the_held_out_prompts_by_default(tmp_path):
    """data.holdout: training never reads those samples; eval's default prompts are them."""
    from trainer import config as config_mod
    from trainer.data import build_source
    from trainer.eval import load_samples

    cfg = config_mod.from_dict({"data": {"holdout": 5, "synthetic_samples": 40}, "model": {"block_size": 8}})
    source = build_source(cfg, 512, 511)
    assert len(source.dataset) == 35 and len(source.holdout) == 5
    trained = {tuple(source.dataset.get(i)[0]) for i in range(len(source.dataset))}
    held = [tuple(source.holdout.get(i)[0]) for i in range(len(source.holdout))]
    assert not trained & set(held)
    samples, what = load_samples(cfg, None, 512, 511, 3)
    assert [tuple(ids) for ids, _ in samples] == held[:3] and "held-out" in what
    again = build_source(cfg, 512, 511)  # from the seed alone: the same split every time
    assert [again.holdout.get(i) for i in range(5)] == [source.holdout.get(i) for i in range(5)]
