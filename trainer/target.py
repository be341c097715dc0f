"""The frozen target model: a Hugging Face causal LM, from a local path or a preset.

Presets are Qwen3 shapes with random, seeded weights: 'tiny' and 'small' for CPU
tests (no tokenizer: the synthetic task draws token ids directly), 'tiny-cycle' for
the demo (the tiny shape arranged to write a cycle of tokens, ``arrange_cycle``: a
target whose own text a small drafter learns in seconds, so the demo's measured tau
is real), and
real Qwen3 shapes ('qwen3-0.6b', 'qwen3-1.7b', 'qwen3-4b', 'qwen3-8b') to measure
throughput on GPUs without downloading weights.

``features`` returns the hidden states of K decoder layers spread evenly over the
depth (``target_layer_ids``), concatenated per position: the drafter's context. On the
compiled GPU path each decoder layer's forward is compiled (``compile_layers``, in the
trainer's serialized warm-up). The target is frozen: nothing here may keep a gradient.
"""

from __future__ import annotations

import threading
import types
from typing import Union

import torch
import torch.nn as nn

from trainer import config
from trainer.config import ConfigError, ModelConfig

PRESET_SEED = 0

# The presets' shapes and the layer formula live in trainer/config.py (torch-free), where
# the controller validates a playbook's model section with them before any deploy.
PRESETS = config.PRESETS
target_layer_ids = config.target_layer_ids


CYCLE_PRESETS = {"tiny-cycle": 8}  # preset -> length of the cycle its weights write
# What each layer of a cycle preset keeps of its seeded attention and MLP output: enough
# that every layer's hidden state differs from the next (a drafter fed the wrong layers
# gets other logits, so an export check on the demo sees a wrong layer numbering), little
# enough that the greedy continuation stays in the cycle (at 1.0 it leaves it now and then).
CYCLE_LAYER_SCALE = 0.25


def preset_cycle(name: str) -> list[int]:
    """The tokens a cycle preset writes, in order (never 0, the padding, nor the last
    id, the default MASK token)."""
    import random

    vocab = PRESETS[name]["vocab_size"]
    return random.Random(f"{name}-{PRESET_SEED}").sample(range(1, vocab - 1), CYCLE_PRESETS[name])


def arrange_cycle(model: nn.Module, cycle: list[int]) -> None:
    """Make a causal LM's greedy continuation of a ``cycle`` token its successor in the
    cycle: every layer adds a little to the residual stream (o_proj and down_proj scaled
    by CYCLE_LAYER_SCALE), so the last hidden state stays close to the token's
    normalised embedding while each layer's differs, and the lm_head row of each
    successor is its predecessor's normalised embedding. Any other token's largest
    logit is then almost always one of those rows: the target falls into the cycle at
    once and stays there."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(CYCLE_LAYER_SCALE)
            layer.mlp.down_proj.weight.mul_(CYCLE_LAYER_SCALE)
        emb = model.model.embed_tokens.weight
        normed = emb * torch.rsqrt(emb.pow(2).mean(-1, keepdim=True) + model.config.rms_norm_eps)
        for i, token in enumerate(cycle):
            model.lm_head.weight[cycle[(i + 1) % len(cycle)]] = normed[token]


def _dtype_kwarg() -> str:
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def preset_config(name: str):
    from transformers import Qwen3Config

    if config.preset_problem(name):
        raise ConfigError([config.preset_problem(name)])
    return Qwen3Config(**PRESETS[name])


class _FeaturesCaptured(Exception):
    """Raised by the last captured layer's hook: ends the target's forward there."""


class Target:
    """A frozen causal LM and the feature capture the drafter trains on."""

    def __init__(self, model: nn.Module, layer_ids: list[int], device: torch.device, dtype: torch.dtype):
        model.eval().requires_grad_(False)
        self.model = model
        self.config = model.config
        self.device, self.dtype = device, dtype
        self.layer_ids = list(layer_ids)
        self.hidden_size = self.config.hidden_size
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.embed_tokens: nn.Embedding = model.get_input_embeddings()
        self.lm_head: nn.Linear = model.get_output_embeddings()
        self._base = model.base_model
        layers = self._base.layers
        if max(self.layer_ids) >= len(layers):
            raise ConfigError([f"model.num_target_layers: layer {max(self.layer_ids)} does not exist ({len(layers)} layers)"])
        # Hooks registered once; captures are per thread, so one Target may serve several threads.
        self._captured = threading.local()
        for i in self.layer_ids:
            layers[i].register_forward_hook(self._capture_hook(i))

    def _capture_hook(self, layer_id: int):
        last = max(self.layer_ids)

        def hook(module, args, output):
            store = getattr(self._captured, "store", None)
            if store is not None:
                store[layer_id] = output[0] if isinstance(output, tuple) else output
                if layer_id == last:
                    raise _FeaturesCaptured  # the layers after it (and the final norm) need not run

        return hook

    def compile_layers(self, **options) -> None:
        """Compile the forward of each decoder layer the features run through (static
        shapes; norms, rotary, projections, attention and MLP fused per layer). The
        layers share one compiled graph (their weights are inputs, not constants), one
        entry per device and length bucket. Only ``forward`` is compiled: the capture
        hooks stay outside, in the module's call, so the forward still ends at the
        last captured layer."""
        from trainer.compile import PerLane

        layers = self._base.layers[: max(self.layer_ids) + 1]
        forward = PerLane(type(layers[0]).forward, dynamic=False, **options)  # a copy per thread
        for layer in layers:
            layer.forward = types.MethodType(forward, layer)

    def features(self, input_ids_BS: torch.Tensor) -> torch.Tensor:
        """[B, S, K*H]: the captured layers' outputs, concatenated in layer order.

        Computed in inference mode, and only up to the last captured layer (its hook
        ends the forward); the result is cloned out of inference mode so the drafter
        (another thread, maybe another device after .to()) can use it under autograd.
        """
        self._captured.store = {}
        try:
            with torch.inference_mode():
                try:
                    self._base(input_ids=input_ids_BS.to(self.device), use_cache=False)
                except _FeaturesCaptured:
                    pass
                features_BSF = torch.cat([self._captured.store[i] for i in self.layer_ids], dim=-1)
        finally:
            self._captured.store = None
        return features_BSF.clone()

    def greedy_next(self, input_ids_BS: torch.Tensor) -> torch.Tensor:
        """[B, S]: the target's greedy next token after every prefix (teacher forced)."""
        with torch.inference_mode():
            logits_BSV = self.model(input_ids=input_ids_BS.to(self.device), use_cache=False).logits
            return logits_BSV.argmax(dim=-1).clone()

    def greedy_generate(self, prompt_BP: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """[B, P + new_tokens]: the prompt followed by the target's greedy continuation
        (what "responses regenerated by the target" are, for a synthetic data set)."""
        with torch.inference_mode():
            prompt_BP = prompt_BP.to(self.device)
            out_BT = self.model.generate(
                prompt_BP,
                attention_mask=torch.ones_like(prompt_BP),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            return out_BT.clone()


def build_target(cfg: ModelConfig, device: Union[str, torch.device], dtype: torch.dtype) -> Target:
    """Load ``cfg.path`` (local files only) or build ``cfg.preset`` with seeded random weights."""
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    kwargs = {_dtype_kwarg(): dtype, "attn_implementation": "sdpa"}
    if cfg.path:
        try:
            model = AutoModelForCausalLM.from_pretrained(cfg.path, local_files_only=True, **kwargs)
        except (OSError, ValueError) as e:
            raise ConfigError([f"model.path: cannot load a causal LM from '{cfg.path}': {str(e).splitlines()[0]}"]) from None
        model.to(device)
    else:
        if not cfg.preset:
            raise ConfigError(["model: set either 'path' (a local model directory) or 'preset'"])
        config = preset_config(cfg.preset)
        # Same seed, same init order: every replica of a preset on the same kind of
        # device gets identical weights, without building them on the CPU first.
        fork = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=fork):
            torch.manual_seed(PRESET_SEED)
            with device:
                model = AutoModelForCausalLM.from_config(config, **kwargs)
            if cfg.preset in CYCLE_PRESETS:
                arrange_cycle(model, preset_cycle(cfg.preset))
    layer_ids = target_layer_ids(model.config.num_hidden_layers, cfg.num_target_layers)
    return Target(model, layer_ids, device, dtype)


def default_dtype(cfg: ModelConfig, device: Union[str, torch.device]) -> torch.dtype:
    """The target's dtype for ``model.dtype``: 'auto' is bf16 on GPU, fp32 on CPU."""
    if cfg.dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[cfg.dtype]

