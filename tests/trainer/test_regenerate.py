"""`python -m trainer.data regenerate`: the target writes the responses (trainer/data/regenerate.py).
Real parts: the tiny preset target on CPU, real processes (one killed with SIGKILL
mid-run), shards read back by the trainer's own loader, `trainer info` on a run
trained on them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.harness.tiny import REPO, make_tokenizer

ARGS = ["--model", "tiny", "--samples", "20", "--shard-size", "4", "--batch-size", "2", "--max-new-tokens", "24",
        "--device", "cpu"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Batch decoding of a tiny model on a loaded machine: torch's thread pool spins
    against other processes; the results do not depend on it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def regenerate_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainer.data", "regenerate", *args]


def shards_of(path) -> dict[str, bytes]:
    return {n: (path / n).read_bytes() for n in sorted(os.listdir(path)) if n.endswith(".jsonl")}


def test_regenerated_shards_are_the_targets_greedy_decoding_and_read_back(tmp_path):
    from trainer.config import ModelConfig
    from trainer.data import ErrorBudget, ShardDataset, shard_paths
    from trainer.data.__main__ import main
    from trainer.target import build_target

    assert main(["regenerate", "synthetic", str(tmp_path / "out"), "--model", "tiny", "--shard-size", "8",
                 "--batch-size", "4", "--max-new-tokens", "24", "--samples", "12", "--device", "cpu"]) == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["samples"] == 12 and len(manifest["shards"]) == 2
    prov = manifest["provenance"]
    assert prov["target"]["preset"] == "tiny" and len(prov["target"]["config_hash"]) >= 8
    assert prov["decoding"]["mode"] == "greedy" and prov["decoding"]["max_new_tokens"] == 24
    target = build_target(ModelConfig(preset="tiny"), "cpu", torch.float32)
    dataset = ShardDataset(shard_paths(str(tmp_path / "out")), 1024, 1, target.vocab_size, ErrorBudget(0))
    for i in range(len(dataset)):  # batched, left-padded decoding is the target's own greedy decoding
        ids, mask = dataset.get(i)
        start = mask.index(1)
        assert sum(mask) == 24 and all(mask[start:])
        expected = target.greedy_generate(torch.tensor([ids[:start]]), 24)[0].tolist()
        assert ids == expected, i


@pytest.mark.slow
def test_regenerate_resumed_after_kill_9_writes_identical_shards(tmp_path, capsys):
    """A real process killed with SIGKILL between shards, then resumed: the same bytes
    as one uninterrupted run (both of those in this process: a process start costs
    seconds of imports)."""
    from trainer.data.__main__ import main

    assert main(["regenerate", "synthetic", str(tmp_path / "whole"), *ARGS]) == 0
    expected = shards_of(tmp_path / "whole")
    assert len(expected) == 5

    out = tmp_path / "killed"
    proc = subprocess.Popen(regenerate_cli("synthetic", str(out), *ARGS), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while not (out / "shard-00001.jsonl").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the regeneration ended before it could be killed"
    before = shards_of(out)
    assert 2 <= len(before) < 5 and all(expected[n] == data for n, data in before.items())
    assert not json.loads((out / "manifest.json").read_text())["complete"]

    capsys.readouterr()
    assert main(["regenerate", "synthetic", str(out), *ARGS]) == 0
    assert f"{len(before)} of 5 shards already in" in capsys.readouterr().err
    assert shards_of(out) == expected
    assert not [n for n in os.listdir(out) if n.startswith(".tmp-")]  # a killed writer's temporary file is gone
    assert json.loads((out / "manifest.json").read_text())["provenance"] == \
        json.loads((tmp_path / "whole" / "manifest.json").read_text())["provenance"]


def test_resuming_with_other_settings_is_refused_and_keeps_the_shards(tmp_path):
    from trainer.data.__main__ import main

    base = ["regenerate", "synthetic", str(tmp_path / "out"), "--model", "tiny", "--samples", "4", "--shard-size",
            "4", "--max-new-tokens", "8", "--device", "cpu"]
    assert main(base) == 0
    kept = shards_of(tmp_path / "out")
    assert main(base[:-2] + ["--temperature", "0.7", "--device", "cpu"]) == 3
    assert shards_of(tmp_path / "out") == kept


def test_sampled_regeneration_is_seeded_per_shard(tmp_path):
    from trainer.data.__main__ import main

    common = ["--model", "tiny", "--samples", "8", "--shard-size", "4", "--max-new-tokens", "12", "--temperature",
              "1.0", "--device", "cpu"]
    assert main(["regenerate", "synthetic", str(tmp_path / "a"), *common]) == 0
    written = shards_of(tmp_path / "a")
    (tmp_path / "a" / "shard-00001.jsonl").unlink()  # a lost shard is written again, the same bytes
    assert main(["regenerate", "synthetic", str(tmp_path / "a"), *common]) == 0
    assert shards_of(tmp_path / "a") == written
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["provenance"]["decoding"]["mode"] == "sampled at temperature 1.0"
    greedy = tmp_path / "g"
    assert main(["regenerate", "synthetic", str(greedy), *common[:-4], "--device", "cpu"]) == 0
    assert shards_of(greedy) != shards_of(tmp_path / "a")


def test_chat_prompts_go_through_the_template_with_the_thinking_switch_recorded(tmp_path):
    from tests.harness.tiny import write_model_dir
    from trainer.data.__main__ import main
    from trainer.data.inputs import template_hash

    model = write_model_dir(tmp_path / "model")
    make_tokenizer(tmp_path / "model", chat_template=True)
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": "what is two plus three"}) + "\n"
                                       + json.dumps({"prompt": "hello", "system": "be brief"}) + "\n")
    assert main(["regenerate", str(tmp_path / "in.jsonl"), str(tmp_path / "out"), "--model", model,
                 "--max-new-tokens", "6", "--thinking", "off", "--device", "cpu"]) == 0
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    first = json.loads((tmp_path / "out" / "shard-00000.jsonl").read_text().splitlines()[0])
    start = first["loss_mask"].index(1)
    assert tok.convert_ids_to_tokens(first["input_ids"][:start]) == \
        ["<|user|>", "what", "is", "two", "plus", "three", "<end>", "<|assistant|>"]
    prov = json.loads((tmp_path / "out" / "manifest.json").read_text())["provenance"]
    assert prov["decoding"]["chat_template"] == template_hash(tok) and prov["decoding"]["thinking"] is False
    assert prov["source_format"] == "prompt"
    assert prov["target"]["path"] == os.path.abspath(model) and prov["target"]["weights"]


def test_bad_input_names_itself_in_one_line(tmp_path, capsys):
    from tests.harness.tiny import write_model_dir
    from trainer.data.__main__ import main

    def error(*args) -> str:
        capsys.readouterr()
        code = main(["regenerate", *args, "--device", "cpu"])
        err = capsys.readouterr().err.strip()
        assert code in (2, 3) and len(err.splitlines()) == 1 and err.startswith("error: "), (code, err)
        assert "Traceback" not in err and "unknown preset" not in err
        return err

    out = str(tmp_path / "out")
    assert "nothing: no such file or directory" in error(str(tmp_path / "nothing"), out, "--model", "tiny")
    (tmp_path / "empty.jsonl").write_text("\n")
    assert "empty.jsonl: empty file, no prompt to regenerate" in error(str(tmp_path / "empty.jsonl"), out,
                                                                       "--model", "tiny")
    (tmp_path / "chat.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    assert "--model /no/such/model: no such model directory" in error(str(tmp_path / "chat.jsonl"), out,
                                                                      "--model", "/no/such/model")
    assert "neither a model directory here nor a preset" in error(str(tmp_path / "chat.jsonl"), out, "--model", "tinyy")
    no_tok = write_model_dir(tmp_path / "no-tokenizer")
    err = error(str(tmp_path / "chat.jsonl"), out, "--model", no_tok)
    assert "prompt JSONL needs the target's tokenizer" in err and "no tokenizer_config.json there" in err
    assert "preset tiny has none" in error(str(tmp_path / "chat.jsonl"), out, "--model", "tiny")
    (tmp_path / "odd.jsonl").write_text(json.dumps({"question": "hi"}) + "\n")
    assert "odd.jsonl:1: a record with ['question']; expected" in error(str(tmp_path / "odd.jsonl"), out,
                                                                       "--model", "tiny")
    assert "top_p in (0, 1]" in error("synthetic", out, "--model", "tiny", "--temperature", "1", "--top-p", "0")
    assert "temperature is 0" in error("synthetic", out, "--model", "tiny", "--top-k", "5")


@pytest.fixture
def chat_model(tmp_path):
    from tests.harness.tiny import write_model_dir

    model = write_model_dir(tmp_path / "model")
    make_tokenizer(tmp_path / "model", chat_template=True)
    return model


FORMS = {  # one conversation, as each format writes it
    "sharegpt": {"id": "1", "conversations": [{"from": "system", "value": "be brief"},
                                              {"from": "human", "value": "what is two plus three"},
                                              {"from": "gpt", "value": "five"}]},
    "sharegpt-roles": {"conversations": [{"role": "system", "content": "be brief"},
                                         {"role": "user", "content": "what is two plus three"},
                                         {"role": "assistant", "content": "five"}]},
    "messages": {"messages": [{"role": "system", "content": "be brief"},
                              {"role": "user", "content": [{"type": "text", "text": "what is two plus three"}]},
                              {"role": "assistant", "content": "five"}]},
    "prompt": {"prompt": "what is two plus three", "system": "be brief"},
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_sharegpt_messages_and_prompt_jsonl_give_the_same_prompt_and_say_which_they_are(form, chat_model, tmp_path,
                                                                                      capsys):
    from transformers import AutoTokenizer

    from trainer.data.__main__ import main

    bad = {"conversations": [{"from": "gpt", "value": "no user turn"}]} if form.startswith("sharegpt") else \
        {"messages": "not a list"} if form == "messages" else {"prompt": 3}
    (tmp_path / "in.jsonl").write_text(json.dumps(FORMS[form]) + "\n" + json.dumps(bad) + "\n"
                                       + json.dumps(FORMS[form]) + "\n")
    capsys.readouterr()
    assert main(["regenerate", str(tmp_path / "in.jsonl"), str(tmp_path / "out"), "--model", chat_model,
                 "--max-new-tokens", "4", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    said = {"sharegpt": "ShareGPT conversations JSONL (SpecForge)", "sharegpt-roles": "ShareGPT conversations JSONL (SpecForge)",
            "messages": "OpenAI messages JSONL", "prompt": "prompt JSONL"}[form]
    assert f"in.jsonl: {said}, 2 prompts, chat template sha256 " in err
    assert "in.jsonl:2:" in err  # the bad line, named and skipped
    tok = AutoTokenizer.from_pretrained(chat_model, local_files_only=True)
    lines = (tmp_path / "out" / "shard-00000.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    start = first["loss_mask"].index(1)
    assert tok.convert_ids_to_tokens(first["input_ids"][:start]) == \
        ["<|system|>", "be", "brief", "<end>", "<|user|>", "what", "is", "two", "plus", "three", "<end>",
         "<|assistant|>"]  # the reply "five" is the target's to write, not kept
    prov = json.loads((tmp_path / "out" / "manifest.json").read_text())["provenance"]
    assert prov["source_format"] == ("sharegpt" if form.startswith("sharegpt") else form)


def test_a_multi_turn_conversation_is_answered_at_its_last_user_turn():
    from trainer.data.inputs import conversation

    turns = [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}, {"from": "human", "value": "c"},
             {"from": "gpt", "value": "d"}]
    assert conversation(turns, "from", "value") == [{"role": "user", "content": "a"},
                                                    {"role": "assistant", "content": "b"},
                                                    {"role": "user", "content": "c"}]
    with pytest.raises(ValueError, match="role 'narrator'"):
        conversation([{"from": "narrator", "value": "x"}], "from", "value")


def test_a_resume_with_another_chat_template_is_refused_and_keeps_the_shards(chat_model, tmp_path, capsys):
    from trainer.data.__main__ import main
    from trainer.data.inputs import template_hash

    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("hello", "how are you",
                                                                                          "what is two plus three")))
    args = ["regenerate", str(tmp_path / "in.jsonl"), str(tmp_path / "out"), "--model", chat_model, "--shard-size",
            "1", "--max-new-tokens", "4", "--device", "cpu"]
    assert main(args) == 0
    kept = shards_of(tmp_path / "out")
    (tmp_path / "out" / "shard-00002.jsonl").unlink()  # as a kill would leave it: one shard to write on resume
    jinja = tmp_path / "model" / "chat_template.jinja"  # where transformers 5 saves it
    if jinja.exists():
        jinja.write_text(jinja.read_text().replace("<end>", "<end> "))
    else:
        config = json.loads((tmp_path / "model" / "tokenizer_config.json").read_text())
        config["chat_template"] = config["chat_template"].replace("<end>", "<end> ")
        (tmp_path / "model" / "tokenizer_config.json").write_text(json.dumps(config))
    from transformers import AutoTokenizer

    now = template_hash(AutoTokenizer.from_pretrained(chat_model, local_files_only=True))
    then = json.loads((tmp_path / "out" / "manifest.json").read_text())["provenance"]["decoding"]["chat_template"]
    assert now != then
    capsys.readouterr()
    assert main(args) == 3
    err = capsys.readouterr().err
    assert f"another chat template (sha256 {then} then, {now} now)" in err and "mix two templates" in err
    assert shards_of(tmp_path / "out") == {k: v for k, v in kept.items() if k != "shard-00002.jsonl"}


def test_top_p_and_top_k_are_applied_and_recorded(tmp_path):
    from trainer.data.__main__ import main
    from trainer.data.regenerate import filter_logits

    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    assert torch.isinf(filter_logits(logits, top_k=2)).tolist() == [[False, False, True, True, True]]
    probs = torch.softmax(logits, -1)[0]  # 0.64, 0.24, 0.09, ...
    assert torch.isinf(filter_logits(logits, top_p=0.5)).tolist() == [[False, True, True, True, True]]
    assert torch.isinf(filter_logits(logits, top_p=float(probs[0] + 0.01))).tolist() == \
        [[False, False, True, True, True]]
    assert not torch.isinf(filter_logits(logits)).any()

    common = ["--model", "tiny", "--samples", "4", "--shard-size", "4", "--max-new-tokens", "12", "--temperature",
              "1.0", "--device", "cpu"]
    assert main(["regenerate", "synthetic", str(tmp_path / "k"), *common, "--top-k", "1"]) == 0
    decoding = json.loads((tmp_path / "k" / "manifest.json").read_text())["provenance"]["decoding"]
    assert (decoding["top_k"], decoding["top_p"]) == (1, 1.0)
    assert decoding["mode"] == "sampled at temperature 1.0, top_k 1"
    assert main(["regenerate", "synthetic", str(tmp_path / "g"), *common[:-4], "--device", "cpu"]) == 0
    assert shards_of(tmp_path / "k") == shards_of(tmp_path / "g")  # top_k 1 is greedy, whatever the temperature
    assert main(["regenerate", "synthetic", str(tmp_path / "p"), *common, "--top-p", "0.9"]) == 0
    decoding = json.loads((tmp_path / "p" / "manifest.json").read_text())["provenance"]["decoding"]
    assert decoding["top_p"] == 0.9 and decoding["mode"] == "sampled at temperature 1.0, top_p 0.9"


@pytest.mark.slow
def test_the_trainer_regenerates_at_its_start_and_stops_cleanly_while_it_does(tmp_path):
    """data.regenerate in a trainer config: the trainer writes the shards into its run
    directory before training; a SIGTERM while it does ends it with EXIT_STOPPED
    within a batch, the shards written kept; started again, it goes on from them."""
    from dflashctl.core import contract

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = {"model": {"preset": "tiny", "drafter_layers": 1, "block_size": 4},
              "data": {"synthetic_samples": 24, "holdout": 2,
                       "regenerate": {"max_new_tokens": 24, "batch_size": 2, "shard_size": 4}},
              "train": {"steps": 2, "log_every": 1, "checkpoint_every": 2},
              "placement": {"device": "cpu", "target": [0], "drafter": [0]}}
    (run_dir / "config.json").write_text(json.dumps(config))
    argv = [sys.executable, "-m", "trainer", "--run-dir", str(run_dir)]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = run_dir / "regenerated"
    phases = set()
    try:
        deadline = time.monotonic() + 600
        while not (out / "shard-00000.jsonl").exists() and proc.poll() is None and time.monotonic() < deadline:
            try:
                phases.add(json.loads((run_dir / "status.json").read_text())["phase"])
            except (OSError, ValueError, KeyError):
                pass  # not written yet
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == contract.EXIT_STOPPED
    finally:
        if proc.poll() is None:
            proc.kill()
    # The controller judges this phase by its sign of life, not by the start budget.
    assert contract.PHASE_REGENERATING in phases, phases
    kept = shards_of(out)
    assert 1 <= len(kept) < 6
    status = json.loads((run_dir / "status.json").read_text())
    assert status["phase"] == "stopped" and status["detail"]["regenerate"] == "stopped"
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == contract.EXIT_DONE, done.stderr[-2000:]
    assert f"{len(kept)} of 6 shards already in" in done.stdout + done.stderr
    assert {n: d for n, d in shards_of(out).items() if n in kept} == kept
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and manifest["samples"] == 24


def test_a_long_batch_rewrites_its_progress_while_it_decodes(tmp_path):
    """One batch of a large model can decode for minutes: the regeneration reports
    (status.json, through on_progress) while it decodes, not only between batches,
    so the controller sees it alive. The clock is an argument: here each reading
    advances it by a second."""
    from dflashctl.core import contract
    from trainer import config as config_mod
    from trainer.data.regenerate import regenerate

    # Two batches of synthetic prompts (not the default 512): what is asserted is the
    # reports during each 40-step batch.
    cfg = config_mod.from_dict({"model": {"preset": "tiny", "drafter_layers": 1, "block_size": 4},
                                "data": {"synthetic_samples": 8,
                                         "regenerate": {"max_new_tokens": 40, "batch_size": 4, "shard_size": 4}},
                                "placement": {"device": "cpu", "target": [0], "drafter": [0]}})
    ticks = iter(range(10**6))
    reports: list[dict] = []
    manifest = regenerate("synthetic", str(tmp_path / "out"), cfg, "cpu", log=lambda line: None,
                          on_progress=reports.append, clock=lambda: float(next(ticks)))
    assert manifest is not None and manifest["samples"] > 0
    during = [r for r in reports if "batch_step" in r]
    # a beat every REGENERATE_BEAT_S / 2 of the clock: several per 40-step batch at a second a reading
    assert len(during) >= 4 and contract.REGENERATE_BEAT_S / 2 >= 1
    assert all(0 <= r["batch_step"] < r["batch_steps"] == 40 for r in during)
    assert reports[-1]["prompts_done"] == reports[-1]["prompts"]
