"""The DFlash drafter: a few Qwen3-style decoder layers with KV injection.

- context: the K captured target hidden states per position, concatenated
  [B, S, K*H], fused by Linear(K*H -> H, no bias) then RMSNorm;
- block queries: embeddings of [t[a], MASK, ...] through the target's (frozen)
  embed_tokens;
- every layer: queries from the block positions only; keys/values =
  [k/v_proj(context) ; k/v_proj(block)] with q/k RMSNorm per head and RoPE over the
  joint positions (context 0..S-1, block a..a+B-1); visibility from trainer/masks.py;
- output: final RMSNorm; logits come from the target's (frozen) lm_head in the loss.

Shape suffixes: B batch, S context, Q block queries (N*B), K keys (S+Q), H hidden,
F fused features (K*H), h heads, D head dim.
"""

from __future__ import annotations

import types
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from trainer.attention import AttentionPath, LayerMasks, attend, record_attention
from trainer.config import ConfigError, ModelConfig
from trainer.serving import resolve_mask_token_id

FROZEN_PREFIXES = ("embed_tokens.", "lm_head.")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # the statistics in fp32, as the target computes them
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # The (fp32 master) weight in x's dtype: a bf16 input stays bf16, as in the target.
        return self.weight.to(x.dtype) * x32.to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def apply_rope(x_BhTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor) -> torch.Tensor:
    cos_B1TD = cos_BTD[:, None].to(x_BhTD.dtype)
    sin_B1TD = sin_BTD[:, None].to(x_BhTD.dtype)
    x1, x2 = x_BhTD.chunk(2, dim=-1)
    return x_BhTD * cos_B1TD + torch.cat((-x2, x1), dim=-1) * sin_B1TD


class InjectedAttention(nn.Module):
    """GQA whose keys/values are the context followed by the block itself."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def forward(self, x_BQH, ctx_BSH, cos_BKD, sin_BKD, mask, path: AttentionPath):
        batch, q_len, _ = x_BQH.shape
        num_keys = ctx_BSH.shape[1] + q_len
        q_BQhD = self.q_proj(x_BQH).view(batch, q_len, self.heads, self.head_dim)
        q_BhQD = self.q_norm(q_BQhD).transpose(1, 2)
        kv_in_BKH = torch.cat([ctx_BSH.to(x_BQH.dtype), x_BQH], dim=1)  # one projection for both parts
        k_BKhD = self.k_proj(kv_in_BKH).view(batch, num_keys, self.kv_heads, self.head_dim)
        k_BhKD = self.k_norm(k_BKhD).transpose(1, 2)
        v_BhKD = self.v_proj(kv_in_BKH).view(batch, num_keys, self.kv_heads, self.head_dim).transpose(1, 2)

        q_BhQD = apply_rope(q_BhQD, cos_BKD[:, -q_len:], sin_BKD[:, -q_len:])
        k_BhKD = apply_rope(k_BhKD, cos_BKD, sin_BKD)
        # The kernels want one dtype: v's.
        out_BhQD = attend(q_BhQD.to(v_BhKD.dtype), k_BhKD.to(v_BhKD.dtype), v_BhKD, mask, path)
        return self.o_proj(out_BhQD.transpose(1, 2).reshape(batch, q_len, self.heads * self.head_dim))


class DrafterLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, eps: float, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.input_norm = RMSNorm(hidden, eps)
        self.attn = InjectedAttention(hidden, heads, kv_heads, head_dim, eps)
        self.post_norm = RMSNorm(hidden, eps)
        self.mlp = SwiGLU(hidden, intermediate)

    def forward(self, x_BQH, ctx_BSH, cos_BKD, sin_BKD, masks: LayerMasks):
        mask = masks.for_layer(self.layer_type)
        x_BQH = x_BQH + self.attn(self.input_norm(x_BQH), ctx_BSH, cos_BKD, sin_BKD, mask, masks.path)
        return x_BQH + self.mlp(self.post_norm(x_BQH))


def _frozen_embedding(source: nn.Embedding) -> nn.Embedding:
    # A new module around the same storage: moving or casting the drafter never
    # touches the target's own module (it may live on another GPU, in another thread).
    return nn.Embedding.from_pretrained(source.weight.detach(), freeze=True)


def _frozen_linear(source: nn.Linear) -> nn.Linear:
    out_features, in_features = source.weight.shape
    head = nn.Linear(in_features, out_features, bias=False, device="meta")
    head.weight = nn.Parameter(source.weight.detach(), requires_grad=False)
    return head


class Drafter(nn.Module):
    def __init__(self, cfg: ModelConfig, target_config, embed_tokens: nn.Embedding, lm_head: nn.Linear):
        super().__init__()
        hidden = target_config.hidden_size
        heads = target_config.num_attention_heads
        kv_heads = getattr(target_config, "num_key_value_heads", None) or heads
        head_dim = getattr(target_config, "head_dim", None) or hidden // heads
        eps = getattr(target_config, "rms_norm_eps", 1e-6)
        vocab = embed_tokens.num_embeddings

        self.block_size = cfg.block_size
        self.layer_types = list(cfg.layer_types or ["full"] * cfg.drafter_layers)
        self.sliding_window = cfg.sliding_window
        self.sliding_semantics = cfg.sliding_semantics
        self.num_target_layers = cfg.num_target_layers
        self.hidden_size = hidden
        # What a checkpoint records for serving (trainer/serving.py): the target's
        # config, this drafter's settings and where the mask id came from.
        self.model_cfg, self.target_config = cfg, target_config
        self.mask_token_id, self.mask_token_source = resolve_mask_token_id(cfg, vocab)
        if not 0 <= self.mask_token_id < vocab:
            raise ConfigError([f"model.mask_token_id: {self.mask_token_id} is outside the target vocabulary [0, {vocab})"])
        if len(self.layer_types) != cfg.drafter_layers:
            raise ConfigError([f"model.layer_types: {len(self.layer_types)} entries for {cfg.drafter_layers} drafter_layers"])

        self.embed_tokens = _frozen_embedding(embed_tokens)
        self.lm_head = _frozen_linear(lm_head)
        self.fuse = nn.Linear(cfg.num_target_layers * hidden, hidden, bias=False)
        self.fuse_norm = RMSNorm(hidden, eps)
        self.layers = nn.ModuleList(
            DrafterLayer(hidden, heads, kv_heads, head_dim, target_config.intermediate_size, eps, t) for t in self.layer_types
        )
        self.norm = RMSNorm(hidden, eps)
        self.rotary = Qwen3RotaryEmbedding(target_config)  # the target's own RoPE (theta, scaling)

        std = getattr(target_config, "initializer_range", 0.02)
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.weight.requires_grad:
                nn.init.normal_(module.weight, std=std)

    def trainable_parameters(self) -> Iterator[nn.Parameter]:
        """What the optimiser updates: everything but the shared embed_tokens and lm_head."""
        return (p for name, p in self.named_parameters() if not name.startswith(FROZEN_PREFIXES))

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The drafter's own weights (checkpoints): the frozen target modules are left out."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(FROZEN_PREFIXES)}

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        own = self.trainable_state_dict()
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        if missing or unexpected:
            raise KeyError(f"drafter weights do not match: missing {missing[:5]}, unexpected {unexpected[:5]}")
        self.load_state_dict(state, strict=False)

    def forward(
        self,
        features_BSF: torch.Tensor,
        block_ids_BQ: torch.Tensor,
        position_ids_BQ: torch.Tensor,
        mask: LayerMasks,
    ) -> torch.Tensor:
        """hidden_BQH (final norm applied) for the packed blocks."""
        batch, ctx_len, num_features = features_BSF.shape
        if num_features != self.fuse.in_features:
            raise ValueError(
                f"features have {num_features} channels; the drafter fuses "
                f"{self.num_target_layers} layers x {self.hidden_size} = {self.fuse.in_features}"
            )
        param_dtype = self.fuse.weight.dtype
        device_type = features_BSF.device.type
        autocast = torch.is_autocast_enabled(device_type)
        if not autocast:
            features_BSF = features_BSF.to(param_dtype)  # target features may be bf16
        ctx_BSH = self.fuse_norm(self.fuse(features_BSF))
        # The residual stream: the master weights' dtype, or the compute dtype (model.residual).
        residual_dtype = torch.get_autocast_dtype(device_type) if autocast and self.model_cfg.residual == "compute" \
            else param_dtype
        x_BQH = self.embed_tokens(block_ids_BQ).to(residual_dtype)

        context_pos_BS = torch.arange(ctx_len, device=block_ids_BQ.device).expand(batch, ctx_len)
        key_pos_BK = torch.cat([context_pos_BS, position_ids_BQ], dim=1)
        rope_dtype_ref = torch.empty(0, device=block_ids_BQ.device, dtype=torch.float32)
        cos_BKD, sin_BKD = self.rotary(rope_dtype_ref, key_pos_BK)

        for layer in self.layers:
            x_BQH = layer(x_BQH, ctx_BSH, cos_BKD, sin_BKD, mask)
        record_attention(mask.path, len(self.layers))
        return self.norm(x_BQH)

    def compile_layers(self, **options) -> None:
        """Compile each decoder layer whole (norms, projections, rotary, attention, MLP:
        one graph forward, one backward), static shapes. Layers share compiled graphs
        (their weights are inputs, not constants): one per layer type, plus one for
        the first layer, whose input needs no gradient. Threads never share Dynamo's
        cache (``compile.thread_safe_compile``: compiled once and called without Dynamo,
        or a copy per thread)."""
        from trainer.compile import thread_safe_compile

        forward = thread_safe_compile(DrafterLayer.forward, dynamic=False, **options)
        for layer in self.layers:
            layer.forward = types.MethodType(forward, layer)
