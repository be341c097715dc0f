"""The real trainer, small: the tiny preset on the CPU, as a process
(``Trainer``, ``run_trainer``: ``python -m trainer``) or in this process
(``train``, ``cli``), its run files read back, a local target model directory and a
tokenizer written here (nothing is downloaded), and the environment of one rank of a
torch.distributed run.

torch is imported only inside the functions that need it: importing this module
costs nothing.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import subprocess
import sys
import time

from dflashctl.core import contract

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A drafter small enough to train hundreds of steps on 2 CPU cores in seconds.
TINY = {
    "model": {"preset": "tiny", "drafter_layers": 2, "block_size": 8},
    "data": {"buckets": [128, 256], "max_anchors": 16, "batch_size": 2, "synthetic_samples": 64},
    "optim": {"lr": 1e-2},
    "train": {"steps": 20, "log_every": 1, "checkpoint_every": 10},
    "placement": {"device": "cpu", "target": [0], "drafter": [0]},
}


def tiny_config(**sections) -> dict:
    cfg = copy.deepcopy(TINY)
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


# ---------------------------------------------------------------------------- the trainer as a process


class Trainer:
    """One ``python -m trainer`` process; output goes to files next to the run directory."""

    def __init__(self, cfg: dict, run_dir, *args: str):
        self.run_dir = str(run_dir)
        os.makedirs(self.run_dir, exist_ok=True)
        self.config_path = os.path.join(os.path.dirname(self.run_dir), os.path.basename(self.run_dir) + ".json")
        with open(self.config_path, "w") as f:
            json.dump(cfg, f)
        self.out_path = self.run_dir + f".{time.monotonic_ns()}.log"
        self.out = open(self.out_path, "w")
        argv = [sys.executable, "-m", "trainer", "--config", self.config_path, "--run-dir", self.run_dir, *args]
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=self.out, stderr=subprocess.STDOUT)

    def wait(self, timeout: float = 240) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.out.close()

    @property
    def output(self) -> str:
        with open(self.out_path) as f:
            return f.read()

    def status(self) -> dict:
        return read_status(self.run_dir)

    def metrics(self) -> list[dict]:
        return read_metrics(self.run_dir)

    def wait_for_step(self, step: int, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(m["step"] >= step for m in self.metrics()):
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"trainer exited {self.proc.returncode} before step {step}:\n{self.output[-3000:]}")
            time.sleep(0.05)
        raise AssertionError(f"no step {step} within {timeout}s:\n{self.output[-3000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def run_trainer(cfg: dict, run_dir, *args: str, timeout: float = 240) -> Trainer:
    t = Trainer(cfg, run_dir, *args)
    t.wait(timeout)
    return t


def read_status(run_dir) -> dict:
    with open(os.path.join(run_dir, contract.STATUS_FILE)) as f:
        return json.load(f)


def read_metrics(run_dir) -> list[dict]:
    return metrics_at(os.path.join(run_dir, contract.METRICS_FILE))


def metrics_at(path: str) -> list[dict]:
    """The complete lines of a metrics file (any rank's), parsed; [] before it exists."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def losses_by_step(run_dir) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(run_dir)}  # a resumed run's repeat wins


# ---------------------------------------------------------------------------- ranks of a distributed run


def rank_env(**extra: str) -> dict:
    """This process's environment without any torch.distributed variable it may carry,
    one intra-op thread, and ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def write_config(tmp_path, cfg: dict) -> str:
    path = str(tmp_path / "cfg.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


# ---------------------------------------------------------------------------- the trainer in this process

# A checkpoint for serving: one sliding layer with a window shorter than the block, so
# the window binds inside it.
RUN = {
    "model": {"preset": "tiny", "drafter_layers": 2, "block_size": 8, "layer_types": ["sliding", "full"],
              "sliding_window": 5},
    "data": {"buckets": [128], "max_anchors": 8, "batch_size": 1, "synthetic_samples": 16},
    # A large step so every weight (norms included) moves away from its initial value.
    "optim": {"lr": 0.05, "warmup_frac": 0.0},
    "train": {"steps": 4, "log_every": 2, "checkpoint_every": 0},
    "placement": {"device": "cpu", "target": [0], "drafter": [0]},
}


def run_config(**sections) -> dict:
    cfg = copy.deepcopy(RUN)
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def train(run_dir, raw: dict) -> int:
    """The real training loop, in this process (a subprocess would add seconds of imports)."""
    from trainer import config as config_mod
    from trainer.train import run

    os.makedirs(run_dir, exist_ok=True)
    return run(config_mod.from_dict(raw), str(run_dir), install_signals=False)


def cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m trainer ARGS`` run in this process (its main(), its output); a real
    process costs seconds of imports on every call. test_the_commands_run_as_a_process
    runs the module itself."""
    from trainer.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(["python", "-m", "trainer", *args], code, out.getvalue(), err.getvalue())


def latest(run_dir) -> str:
    from trainer import checkpoint

    return checkpoint.latest(str(run_dir))


def write_model_dir(path, tokenizer_size: int | None = None) -> str:
    """A local target directory (tiny Qwen3, seeded weights), with a word-level tokenizer
    of ``tokenizer_size`` tokens plus three special tokens when asked."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.target import preset_config

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(preset_config("tiny")).save_pretrained(path)
    if tokenizer_size is not None:
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(tokenizer_size)}, unk_token="w0"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="<|eos|>", pad_token="<|pad|>",
                                additional_special_tokens=["<|im_start|>"]).save_pretrained(path)
    return str(path)


def make_tokenizer(path, chat_template: bool) -> str:
    """A real (tiny, word-level) Hugging Face tokenizer saved to disk: nothing is downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>", "<end>"]
    words += "hello world how are you i am fine thanks what is two plus three five be brief".split()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    if chat_template:
        fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <end> {% endfor %}"
                              "{% if add_generation_prompt %}<|assistant|> {% endif %}")
    fast.save_pretrained(str(path))
    return str(path)
