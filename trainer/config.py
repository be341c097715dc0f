"""Trainer configuration: one typed tree, stdlib only (no torch, no pydantic).

The same dict comes from ``--config FILE`` (JSON or YAML) or from a playbook's
``trainer:`` section. Unknown keys and bad values raise ``ConfigError`` naming the
dotted path and the closest valid key.
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from dflashctl.core.contract import did_you_mean


class ConfigError(ValueError):
    """A bad trainer configuration; ``problems`` lists one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


@dataclass
class ModelConfig:
    preset: Optional[str] = "tiny"
    """Built-in target with random weights ('tiny', 'small', 'qwen3-0.6b', ...); ignored when ``path`` is set."""
    path: Optional[str] = None
    """Local directory of a Hugging Face causal LM (config + weights); never fetched from a hub."""
    num_target_layers: int = 5
    """K: how many target layers' hidden states are captured (spread evenly) and fused."""
    drafter_layers: int = 5
    """N decoder layers in the drafter."""
    block_size: int = 16
    """B: positions the drafter fills in one forward pass."""
    layer_types: Optional[list[str]] = None
    """Per drafter layer 'full' or 'sliding'; default all 'full'."""
    sliding_window: int = 2048
    """Window W of 'sliding' layers over the joint positions (context before the anchor, then the block); how the block's own slots see each other is ``sliding_semantics``."""
    sliding_semantics: Literal["causal_in_block", "bidirectional"] = "causal_in_block"
    """How 'sliding' layers attend. 'causal_in_block': the query at position p sees keys p-W+1..p, so causal inside the block: vLLM, SGLang and z-lab's dflash package run sliding layers so by default, and SpecForge trains them so. 'bidirectional': keys within W-1 positions on either side, so a slot sees the slots after it: z-lab's dflash package with is_causal: false (the export writes it); a window that never binds trains exactly as a full layer and is exported as one. trainer/engines.py says where each engine's rule was read; export --engine refuses a drafter the engine would run otherwise."""
    mask_token_id: Optional[int] = None
    """Token id used for MASK; default: the first id past the target tokenizer's special tokens (151669 for Qwen3, as the public drafters) when model.path holds a tokenizer, else vocab_size - 1. Recorded in every checkpoint; resuming with another id is refused."""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """'auto': bf16 compute with fp32 master weights on GPU, fp32 on CPU."""
    residual: Literal["float32", "compute"] = "float32"
    """The drafter's residual stream between its layers: 'float32' (the master
    weights' dtype), or 'compute': the compute dtype (bf16 under autocast), as the
    target and the serving engines carry it; half the residual's memory traffic and
    saved activations. Without autocast (CPU) both are fp32."""


@dataclass
class RegenerateConfig:
    """Responses written by the target itself before training (trainer/data/regenerate.py): the prompts of ``source``, the target's continuations, shards in ``out``."""

    source: str = "synthetic"
    """'synthetic' (the prompts of the built-in synthetic task), shards (directory or glob) whose prompts (the tokens before each sample's first loss token) are kept and responses replaced, or a JSONL file of ShareGPT conversations, OpenAI messages or prompts (trainer/data/inputs.py)."""
    out: str = "regenerated"
    """Directory of the regenerated shards, relative to the run directory unless absolute."""
    max_new_tokens: int = 256
    """Tokens the target writes per prompt (at most; it stops at its end-of-sequence token)."""
    temperature: float = 0.0
    """0: greedy; > 0: sampled at this temperature (seeded per shard, so a resumed run writes the same shards)."""
    top_p: float = 1.0
    """Sampling only: the smallest set of tokens whose probability reaches top_p (1.0: every token)."""
    top_k: int = 0
    """Sampling only: the top_k most likely tokens (0: every token); applied before top_p."""
    seed: int = 0
    """Seed of sampling (temperature > 0) and of the synthetic prompts."""
    batch_size: int = 16
    """Prompts decoded together (prompts of one length share a batch)."""
    shard_size: int = 256
    """Prompts per output shard (a shard is the unit of resuming)."""
    samples: Optional[int] = None
    """Prompts taken from ``source`` at most (default: all; 'synthetic': data.synthetic_samples)."""
    thinking: Optional[bool] = None
    """Chat templates with a thinking switch (Qwen3's enable_thinking): recorded, passed to the template; None: the template's default."""
    threads: Optional[int] = None
    """CPU intra-op threads while the target writes (a CPU target only; default: torch's). 1 is fastest for a tiny target on a busy machine."""


@dataclass
class DataConfig:
    shards: Optional[str] = None
    """Directory (or glob) of token shards (see trainer/data/); None: the synthetic task."""
    synthetic_samples: int = 512
    """Size of the built-in learnable synthetic data set when ``shards`` is None."""
    synthetic_alphabet: int = 8
    """Synthetic task: responses walk a fixed cycle of this many tokens (smaller learns faster)."""
    buckets: list[int] = field(default_factory=lambda: [256])
    """Padded sequence lengths, each a multiple of 128; longer samples are truncated to the largest."""
    max_anchors: int = 512
    """Anchors (blocks) sampled per sequence at most."""
    batch_size: int = 1
    """Sequences per drafter step."""
    error_budget: int = 10
    """Bad records skipped (each reported) before the run stops with a data error."""
    seed: int = 0
    """Seed of the batch order (reshuffled per epoch from (seed, epoch)), the anchors and the synthetic task."""
    holdout: int = 0
    """Samples set aside (chosen from data.seed) that training never reads; ``python -m trainer eval`` measures its prompts, ones the drafter never saw."""
    regenerate: Optional[RegenerateConfig] = None
    """Before training, the target writes the responses (trainer/data/regenerate.py) and training reads them; see RegenerateConfig."""


@dataclass
class OptimConfig:
    lr: float = 6e-4
    """Peak learning rate of AdamW (fused on CUDA)."""
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_frac: float = 0.04
    """Linear warm-up over this fraction of train.steps, then cosine decay."""
    min_lr_frac: float = 0.1
    """The cosine ends at lr * min_lr_frac."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: no clipping)."""


@dataclass
class TrainConfig:
    steps: int = 100
    gamma: Optional[float] = None
    """Loss decay over block slots; default 7 for B=16, 4 for B=8, else B/2."""
    loss_chunk: int = 4096
    """Query positions per chunk of the vocabulary projection in the loss. Each chunk's
    logits and their gradient are held at once (2 x chunk x vocabulary in bf16): at a
    152K vocabulary, 2048 takes 1.7 GiB less peak memory for +0.5 % a step, 8192 costs
    3.5 GiB more and +2.4 % (bench/RESULTS.md, one H200)."""
    loss_kernel: Literal["auto", "triton", "inductor"] = "auto"
    """Each compiled loss chunk's softmax, top-1 and gradient: ``triton``, one kernel
    that reads the logits twice and writes the gradient once; ``inductor``, the
    pointwise expression fused by torch.compile; ``auto``, triton on a CUDA device
    where triton is installed, else inductor."""
    log_every: int = 10
    """Steps per metrics.jsonl line."""
    checkpoint_every: int = 50
    """Steps between checkpoints (0: only at the end and on SIGTERM/SIGINT)."""
    keep_checkpoints: int = 3
    """Newest complete checkpoints kept."""
    seed: int = 0
    """Seed of the drafter's initial weights."""
    profile_steps: int = 0
    """Profile this many training steps with torch.profiler (0: off), starting after
    ``profile_after`` steps: profile.txt (GPU kernels by time, from every thread;
    operators from the coordinator thread only) and profile.json (a Chrome/Perfetto
    trace) go to the run directory."""
    profile_after: int = 5
    """Steps to run before profiling starts (past the first steps' allocator effects)."""


@dataclass
class PlacementConfig:
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """'auto': cuda when torch sees a GPU. On cpu the indices below only count threads."""
    target: list[int] = field(default_factory=lambda: [0])
    """GPU indices running the frozen target (one thread each)."""
    drafter: list[int] = field(default_factory=lambda: [0])
    """GPU indices training drafter replicas (one thread each); a GPU may repeat or be shared with a target."""
    queue_depth: int = 4
    """Batches a target thread may make ahead for a drafter replica: waiting in the queue,
    or taken by the drafter whose backward is not launched yet."""


@dataclass
class CompileConfig:
    enabled: Literal["auto", "on", "off"] = "auto"
    """'auto': compiled flex_attention on GPU, dense SDPA on CPU. 'off' on GPU is refused unless allow_eager."""
    cache_dir: Optional[str] = None
    """Persistent TORCHINDUCTOR_CACHE_DIR; keyed inside by torch, triton and GPU model."""
    serialized_warmup: bool = True
    """Warm up every device x bucket forward+backward one at a time before threads run free."""
    unsafe_parallel_warmup: bool = False
    """DEBUG ONLY: let threads compile concurrently on a cold cache (reproduces the deadlock)."""
    allow_eager: bool = False
    """DEBUG ONLY: allow the dense flex_attention fallback on GPU."""
    drafter_layers: bool = True
    """On the compiled GPU path, compile each drafter layer whole (norms, projections,
    rotary, attention, MLP) instead of only its flex_attention call: fewer, fused
    kernels. Compiled in the same serialized warm-up."""
    target: bool = True
    """On the compiled GPU path, compile the target's decoder layers (each layer's
    forward, up to the last captured one; one graph shared by all of them), in the
    same serialized warm-up, before the drafters'."""
    artifacts: bool = True
    """Compile artifacts that travel: load ``compile_cache/`` from the run directory
    before the warm-up when its key (torch, triton, CUDA, flash-attn-4, GPU, bundle, shape config)
    matches, and save this start's compiled artifacts there after it."""
    mask_builder: Literal["direct", "compiled", "eager"] = "direct"
    """How BlockMasks are built on GPU: 'direct' computes the tile tables from the anchors (a few tensor ops on int32 [B,Q,KV/128] temporaries; nothing to compile, no [B,Q,KV] mask), 'compiled' runs torch.compile(create_block_mask) (fast per step once compiled, but its cold compile takes minutes at 3072-token buckets, per bucket and layer type) or 'eager' runs create_block_mask (about 0.2 s per call; materialises a boolean [B,Q,KV] mask, 1.5 GB at B=16, Q=8192, KV=11264)."""
    flex_kernel: Literal["auto", "triton", "default", "flash"] = "auto"
    """flex_attention's kernels on the compiled GPU path: 'triton' runs its own Triton kernels with the backward tiles measured fastest on the DFlash mask on Hopper GPUs (compute capability 9, 16-bit inputs, head dim <= 128; about -10 % backward on an H200, bench/RESULTS.md) and torch's defaults elsewhere; 'default' the Triton kernels with torch's defaults everywhere; 'flash' flash-attention 4's CuTe kernels through torch's experimental FLASH backend (16-bit inputs, head dim <= 128; refused, saying why, without a Hopper or Blackwell GPU, the flash-attn-4 package at 4.0.0b26 or later and a torch that has the backend); 'auto' (the default) 'flash' where it can run, else 'triton' (the start-up line says which, and why). On one H200 'flash' took 1.6 % off a reference step and passed a 10,000-launch canary against 'triton', but its kernels compile at every start: about 12 s more per warm start and 35-40 s or more per cold start of the threaded drill, over 140 s in all on a slow machine (bench/RESULTS.md); 'triton' is the choice for runs that start often."""
    share: Literal["per_thread", "shared", "auto"] = "auto"
    """How threads call compiled code. 'shared': each graph (a drafter layer's forward and backward, the loss chunk) compiled once, ahead of its first call, and called by every thread without Dynamo: a cold start compiles it once, not once per drafter thread; torch's on-disk AOTAutograd cache is bypassed for it, so each compiled graph is saved whole in the compile cache (``dflash-aot`` in the inductor cache directory) and in the run directory's compile artifacts, and a warm start loads it instead of compiling again (the 3-thread drill on one H200, two machines: cold 67.6 / 100.0 s against 82.7 / 107.8 s, warm 7.9-11.6 s against 15.5-24.9 s). 'per_thread': each thread compiles a copy of its own. 'auto' (the default): 'shared' where this torch has ``aot_compile`` (said at start-up), else 'per_thread'."""
    warmup_processes: Optional[int] = None
    """On a cold compile cache, length buckets compiled in helper processes beside the trainer's own warm-up, each helper the trainer started again on this config for some buckets (trainer/warmup_helpers.py): this process keeps the largest bucket and loads the others' compiled graphs from the cache once the helpers are done. Unset (the default): one helper per 8 CPUs, at most one per bucket but one, on the compiled GPU path of a single-process run without regeneration; 0: none. A helper's GPU memory is capped at its share of half the memory free; a helper that fails costs only time (its buckets compile here, its last log lines in trainer.log); a warm cache stops them."""
    recompile_margin: int = 4
    """Dynamo recompile limit = devices x buckets x 2 + this; hitting it raises (never a silent eager fallback)."""


@dataclass
class DistributedConfig:
    """Used only when the trainer is started by torchrun (RANK and WORLD_SIZE set); see trainer/distributed.py."""

    timeout: float = 300.0
    """Seconds a collective (start-up, the per-step gradient all-reduce) waits for the other processes; past it, or when a peer dies, every process ends failed, naming the rank that failed first."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """'auto': NCCL on GPU, gloo on CPU."""


@dataclass
class FaultConfig:
    """Fault injection for tests and drills. Never set in a production playbook."""

    kind: Optional[Literal["exit", "hang", "slow", "raise_in_thread"]] = None
    """exit: crash with ``message``; hang: stop progressing until a signal; slow: steps ``factor`` x longer; raise_in_thread: a drafter thread raises RuntimeError(message)."""
    after_steps: int = 0
    """Fire once this many optimiser steps are done (counted across restarts)."""
    message: str = "injected fault"
    """With kind=exit: printed to stderr as the error text before exiting; with raise_in_thread: the exception's message."""
    exit_code: int = 1
    """With kind=exit: the process exit status."""
    factor: float = 3.0
    """With kind=slow: each step takes this many times longer."""
    once: bool = True
    """Fire only in the first process of a run (a marker file in the run dir), so a restart recovers."""


@dataclass
class TrainerConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    run_dir: str = "./run"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def check(self) -> None:
        problems = []
        m, d = self.model, self.data
        if m.layer_types is not None:
            if len(m.layer_types) != m.drafter_layers:
                problems.append(
                    f"model.layer_types: {len(m.layer_types)} entries for {m.drafter_layers} drafter_layers"
                )
            for i, t in enumerate(m.layer_types):
                if t not in ("full", "sliding"):
                    problems.append(f"model.layer_types[{i}]: '{t}' is not 'full' or 'sliding'{did_you_mean(t, ['full', 'sliding'])}")
        problems += model_bounds(m)
        problems += target_problems(m)
        if self.placement.device != "auto":
            problems += compile_problems(self.compile.enabled, self.placement.device, self.compile.allow_eager)
        if self.compile.warmup_processes is not None and self.compile.warmup_processes < 0:
            problems.append(f"compile.warmup_processes: {self.compile.warmup_processes} is negative; "
                            "leave it unset (one helper per 8 CPUs) or set 0 for none")
        if not d.buckets:
            problems.append("data.buckets: at least one length bucket is needed")
        for i, b in enumerate(d.buckets):
            if b <= 0 or b % 128:
                problems.append(f"data.buckets[{i}]: {b} is not a positive multiple of 128")
        if d.batch_size < 1:
            problems.append("data.batch_size: must be at least 1")
        if d.holdout < 0:
            problems.append("data.holdout: must not be negative")
        if d.regenerate is not None:
            r = d.regenerate
            if d.shards is not None:
                problems.append("data.shards, data.regenerate: set one (regenerate writes the shards training reads)")
            if r.max_new_tokens < 1 or r.batch_size < 1 or r.shard_size < 1:
                problems.append("data.regenerate: max_new_tokens, batch_size and shard_size must be at least 1")
            if r.temperature < 0:
                problems.append("data.regenerate.temperature: must not be negative (0: greedy)")
            if not 0 < r.top_p <= 1 or r.top_k < 0:
                problems.append("data.regenerate.top_p, top_k: top_p in (0, 1], top_k at least 0 (0: no limit)")
            elif r.temperature == 0 and (r.top_p < 1 or r.top_k):
                problems.append("data.regenerate.top_p, top_k: sampling settings, but temperature is 0 (greedy); "
                                "set data.regenerate.temperature")
        if d.synthetic_alphabet < 1:
            problems.append("data.synthetic_alphabet: must be at least 1")
        if self.placement.queue_depth < 1:
            problems.append("placement.queue_depth: must be at least 1")
        if self.train.steps < 1:
            problems.append("train.steps: must be at least 1")
        if self.train.profile_steps < 0 or self.train.profile_after < 0:
            problems.append("train.profile_steps, train.profile_after: must not be negative")
        if not self.distributed.timeout > 0:
            problems.append("distributed.timeout: must be a positive number of seconds")
        if not self.placement.target or not self.placement.drafter:
            problems.append("placement: needs at least one target and one drafter device")
        if problems:
            raise ConfigError(problems)


# --------------------------------------------------------------------------- the target's presets
#
# Built-in targets (Qwen3 shapes, random seeded weights: trainer/target.py builds them).
# Their shapes live here, torch-free, so that a playbook's ``model`` section is checked
# with them where the playbook is loaded (the controller, before any deploy).

_QWEN3_COMMON = dict(rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=40960, vocab_size=151936)

PRESETS: dict[str, dict] = {
    # 8 layers so that the default K=5 gets 5 distinct layers (1..5).
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=8,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                 rope_theta=10_000.0, max_position_embeddings=4096, tie_word_embeddings=False),
    "tiny-cycle": dict(vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=8,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                       rope_theta=10_000.0, max_position_embeddings=4096, tie_word_embeddings=False),
    "small": dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=12,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=32, rms_norm_eps=1e-6,
                  rope_theta=10_000.0, max_position_embeddings=8192, tie_word_embeddings=False),
    "qwen3-0.6b": dict(_QWEN3_COMMON, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-1.7b": dict(_QWEN3_COMMON, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-4b": dict(_QWEN3_COMMON, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3_COMMON, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}


def target_layer_ids(num_layers: int, k: int) -> list[int]:
    """K decoder layers (0-based) spread evenly from layer 1 to layer L-3.

    id_i = round(1 + i * (L - 4) / (K - 1)), i = 0..K-1 (Python round, half to even);
    K = 1 takes the middle layer L // 2. 36 layers, K=5: 1, 9, 17, 25, 33 (the
    published Qwen3-8B drafter); 28 layers, K=5: 1, 7, 13, 19, 25. The first layer
    and the last three are skipped: too close to the embeddings / the logits.
    """
    if k < 1:
        raise ConfigError([f"model.num_target_layers: must be at least 1, got {k}"])
    if k == 1:
        return [num_layers // 2]
    start, end = 1, num_layers - 3
    if end - start < k - 1:
        raise ConfigError([
            f"model.num_target_layers: {k} distinct layers do not fit a {num_layers}-layer target "
            f"(layers 1..{end} are used); at most {max(1, end - start + 1)}"
        ])
    return [int(round(start + i * (end - start) / (k - 1))) for i in range(k)]


def preset_problem(name: object) -> str | None:
    """Why ``model.preset`` names no preset (with the closest name), or None."""
    if name in PRESETS:
        return None
    return f"model.preset: unknown preset '{name}'{did_you_mean(name, PRESETS)}; one of {', '.join(PRESETS)}"


def target_problems(m: "ModelConfig") -> list[str]:
    """What a model section asks of its target that the target cannot give, known
    without loading it: a preset that does not exist, more distinct target layers
    than the preset has, a MASK token outside its vocabulary. A ``path`` target is
    only known once read on its host."""
    if m.path:
        return []
    if not m.preset:
        return ["model: set either 'path' (a local model directory) or 'preset'"]
    unknown = preset_problem(m.preset)
    if unknown:
        return [unknown]
    shape, problems = PRESETS[m.preset], []
    if isinstance(m.num_target_layers, int) and m.num_target_layers >= 1:
        try:
            target_layer_ids(shape["num_hidden_layers"], m.num_target_layers)
        except ConfigError as e:
            problems += [f"{p} (preset '{m.preset}')" for p in e.problems]
    mask = m.mask_token_id
    if isinstance(mask, int) and not isinstance(mask, bool) and mask >= shape["vocab_size"]:
        problems.append(f"model.mask_token_id: {mask} is outside the target vocabulary [0, {shape['vocab_size']}) "
                        f"of preset '{m.preset}'")
    return problems


def compile_problems(enabled: str, device_type: str, allow_eager: bool) -> list[str]:
    """A ``compile.enabled`` the device cannot run (trainer/attention.py asks with the
    device it resolved; ``TrainerConfig.check`` with an explicit ``placement.device``)."""
    if device_type == "cpu" and enabled == "on":
        return ["compile.enabled: 'on' needs a GPU: flex_attention has no backward on CPU; "
                "use 'auto' (dense SDPA on CPU)"]
    if device_type != "cpu" and enabled == "off" and not allow_eager:
        return [f"compile.enabled: 'off' on {device_type} would run flex_attention uncompiled, which "
                "materialises the full score matrix (about 3x slower and O(S^2) memory); use 'auto', "
                "or set compile.allow_eager: true to debug"]
    return []


# Bounds of the drafter's shape: past them a value is a typo or damage, never a drafter
# (the public ones have 1-8 layers and B = 16), and building it would allocate until killed.
MODEL_BOUNDS = {"num_target_layers": (1, 64), "drafter_layers": (1, 64), "block_size": (2, 256),
                "sliding_window": (1, 1 << 24)}


def model_bounds(m: "ModelConfig", where: str = "model") -> list[str]:
    """One line per ModelConfig field outside MODEL_BOUNDS (or of the wrong type)."""
    problems = []
    for name, (lo, hi) in MODEL_BOUNDS.items():
        value = getattr(m, name)
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{where}.{name}: expected an integer, got {value!r}")
        elif not lo <= value <= hi:
            problems.append(f"{where}.{name}: {value} is outside [{lo}, {hi}]")
    if m.mask_token_id is not None and (isinstance(m.mask_token_id, bool) or not isinstance(m.mask_token_id, int)
                                        or m.mask_token_id < 0):
        problems.append(f"{where}.mask_token_id: expected a non-negative integer token id, got {m.mask_token_id!r}")
    return problems


def _convert(tp: Any, value: Any, path: str, problems: list[str]) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping, got {type(value).__name__}")
            return tp()
        return _from_dict(tp, value, path, problems)
    if origin is typing.Union:
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, path, problems)
    if origin is Literal:
        if value not in args:
            problems.append(f"{path}: {value!r} is not one of {', '.join(map(repr, args))}{did_you_mean(value, args)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            problems.append(f"{path}: expected a list, got {type(value).__name__}")
            return []
        return [_convert(args[0], v, f"{path}[{i}]", problems) for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            problems.append(f"{path}: expected true or false, got {value!r}")
        return value
    if tp in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (tp is int and isinstance(value, float) and not value.is_integer()):
            problems.append(f"{path}: expected {'an integer' if tp is int else 'a number'}, got {value!r}")
            return value
        return tp(value)
    if tp is str:
        if not isinstance(value, str):
            problems.append(f"{path}: expected a string, got {value!r}")
        return value
    return value


def _from_dict(cls: Any, raw: dict, path: str, problems: list[str]) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in hints:
            problems.append(f"{where}: unknown key{did_you_mean(key, names)}")
            continue
        kwargs[key] = _convert(hints[key], value, where, problems)
    return cls(**kwargs)


def from_dict(raw: dict[str, Any] | None, prefix: str = "") -> TrainerConfig:
    """Build and check a TrainerConfig; ``prefix`` names where the dict came from (e.g. 'trainer')."""
    problems: list[str] = []
    cfg = _from_dict(TrainerConfig, raw or {}, prefix, problems)
    if problems:
        raise ConfigError(problems)
    try:
        cfg.check()
    except ConfigError as e:
        if prefix:
            raise ConfigError([f"{prefix}.{p}" for p in e.problems]) from None
        raise
    return cfg


def load(path: str) -> TrainerConfig:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith((".yaml", ".yml")):
        import yaml  # only needed for YAML configs

        raw = yaml.safe_load(text) or {}
    else:
        raw = json.loads(text)
    if "trainer" in raw and isinstance(raw["trainer"], dict) and len(raw) > 1 and "model" not in raw:
        raw = raw["trainer"]  # a playbook given directly
    return from_dict(raw)


def save(cfg: TrainerConfig, path: str) -> None:
    from dflashctl.core.contract import atomic_write_text

    atomic_write_text(path, json.dumps(cfg.to_dict(), indent=2, sort_keys=True))


def resolve_dir(path: Optional[str]) -> Optional[str]:
    return os.path.expanduser(path) if path else path
