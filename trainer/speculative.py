"""Speculative decoding with a DFlash drafter, run the way an inference engine runs it.

One decoding step (block size B, the last committed token at position ``start``):

1. draft: the block ``[t[start], MASK x (B-1)]`` at positions start..start+B-1 goes
   through the drafter in one forward; its context is the fused target features of
   positions 0..start-1 (strictly before the anchor, as in training); slot k's
   logits propose the token at start+k;
2. verify: the target runs the B block tokens at once over its KV cache; its
   prediction after block token i judges the proposal for slot i+1;
3. accept the longest agreeing prefix (``accepted``, 0..B-1) plus one token from the
   target (the bonus, or the correction): every step commits accepted + 1 tokens;
4. roll back: the target's KV cache is cut to the committed tokens, and the target
   features of the committed block tokens become the drafter's new context.

Greedy verification commits exactly what plain greedy decoding would. With a
temperature, proposals are sampled from the drafter and verified by the standard
rejection rule (accept x with probability min(1, p(x)/q(x)), else sample from
norm(max(p - q, 0)) and stop; a bonus from p when all pass), which keeps the
target's own sampling distribution. The drafter's slots are independent given the
context (all MASK inputs), so slot k's proposal distribution does not depend on
the tokens drawn for earlier slots.

The drafter keeps, per layer, the keys and values of its context (``DraftState``):
they depend only on the fused target features, never on the block, so each position
is projected once, as an engine's draft KV cache does. ``DraftState.logits`` is a
second implementation of ``Drafter.forward`` for one block; tests compare the two.

Tau (acceptance length) of a step is accepted + 1; ``accept_len`` as the trainer
reports it excludes the bonus token, so tau = accept_len + 1.

This module decodes and measures; it never trains or writes files.
"""

from __future__ import annotations

import functools
import inspect
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from trainer.masks import one_block_mask
from trainer.model import Drafter, apply_rope


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------- target side


@functools.lru_cache(maxsize=None)
def _takes(model_class, argument: str) -> bool:
    return argument in inspect.signature(model_class.forward).parameters


def _cache_keyword(model_class) -> str:
    """The forward argument that takes the KV cache: 'cache' in recent transformers,
    'past_key_values' before."""
    return "cache" if _takes(model_class, "cache") else "past_key_values"


class TargetStepper:
    """The frozen target with a KV cache: each call runs new tokens after the cached
    ones and returns their logits and (optionally) the captured layers' features."""

    def __init__(self, target, features: bool = True):
        from transformers import DynamicCache

        self.target = target
        self.features = features
        self.cache = DynamicCache()
        self.length = 0
        self.forwards = 0
        self._cache_kw = _cache_keyword(type(target.model))

    @torch.inference_mode()
    def forward(self, ids_1T: torch.Tensor, last_only: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(logits [1, T, V] fp32, or [1, 1, V] of the last token with ``last_only``
        (a prefill needs no more); features [1, T, K*H] or None) for T new tokens."""
        ids_1T = ids_1T.to(self.target.device)
        steps = ids_1T.shape[1]
        positions = torch.arange(self.length, self.length + steps, device=ids_1T.device)[None]
        extra = {"logits_to_keep": 1} if last_only and _takes(type(self.target.model), "logits_to_keep") else {}
        out = self.target.model(input_ids=ids_1T, position_ids=positions, use_cache=True,
                                output_hidden_states=self.features, **{self._cache_kw: self.cache}, **extra)
        self.length += steps
        self.forwards += 1
        features = None
        if self.features:
            # hidden_states[0] is the embedding output: layer i's output is [i + 1].
            features = torch.cat([out.hidden_states[i + 1] for i in self.target.layer_ids], dim=-1)
        return out.logits.float(), features

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cached positions."""
        if length < self.length:
            self.cache.crop(length - self.length)  # negative: tokens to remove (every transformers version)
            self.length = length


# ---------------------------------------------------------------------------- drafter side


class DraftState:
    """The drafter's per-layer context keys/values for positions [0, length)."""

    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        self.keys: list[Optional[torch.Tensor]] = [None] * len(drafter.layers)  # [1, kv_heads, S, D]
        self.values: list[Optional[torch.Tensor]] = [None] * len(drafter.layers)
        self.length = 0
        self.dtype = drafter.fuse.weight.dtype
        self.device = drafter.fuse.weight.device

    def _rope(self, positions_1T: torch.Tensor):
        ref = torch.empty(0, device=self.device, dtype=torch.float32)
        return self.drafter.rotary(ref, positions_1T)

    @torch.inference_mode()
    def extend(self, features_1TF: torch.Tensor) -> None:
        """Append the context of the next T positions (target features, [1, T, K*H])."""
        d = self.drafter
        steps = features_1TF.shape[1]
        ctx_1TH = d.fuse_norm(d.fuse(features_1TF.to(self.device, self.dtype)))
        positions = torch.arange(self.length, self.length + steps, device=self.device)[None]
        cos, sin = self._rope(positions)
        for i, layer in enumerate(d.layers):
            a = layer.attn
            k_1hTD = a.k_norm(a.k_proj(ctx_1TH).view(1, steps, a.kv_heads, a.head_dim)).transpose(1, 2)
            k_1hTD = apply_rope(k_1hTD, cos, sin)
            v_1hTD = a.v_proj(ctx_1TH).view(1, steps, a.kv_heads, a.head_dim).transpose(1, 2)
            self.keys[i] = k_1hTD if self.keys[i] is None else torch.cat([self.keys[i], k_1hTD], dim=2)
            self.values[i] = v_1hTD if self.values[i] is None else torch.cat([self.values[i], v_1hTD], dim=2)
        self.length += steps

    def _mask(self, layer_type: str, ctx_len: int, anchor: int, block: int) -> Optional[torch.Tensor]:
        """Boolean [B, ctx_len + B] (None: everything visible, the full-attention case)."""
        if layer_type != "sliding":
            return None
        return one_block_mask(anchor, block, self.drafter.sliding_window, self.drafter.sliding_semantics, self.device)

    @torch.inference_mode()
    def logits(self, block_ids: torch.Tensor, anchor: int) -> torch.Tensor:
        """[B, V] fp32 drafter logits for the block anchored at ``anchor`` (context =
        the cached positions before it). Slot 0 is the anchor token itself."""
        d = self.drafter
        if anchor > self.length:
            raise ValueError(f"anchor {anchor} is past the drafter's context ({self.length} positions)")
        block = block_ids.shape[-1]
        x_1BH = d.embed_tokens(block_ids.view(1, block).to(self.device)).to(self.dtype)
        cos, sin = self._rope(torch.arange(anchor, anchor + block, device=self.device)[None])
        for i, layer in enumerate(d.layers):
            a = layer.attn
            h_1BH = layer.input_norm(x_1BH)
            q_1hBD = apply_rope(a.q_norm(a.q_proj(h_1BH).view(1, block, a.heads, a.head_dim)).transpose(1, 2), cos, sin)
            kb_1hBD = apply_rope(a.k_norm(a.k_proj(h_1BH).view(1, block, a.kv_heads, a.head_dim)).transpose(1, 2), cos, sin)
            vb_1hBD = a.v_proj(h_1BH).view(1, block, a.kv_heads, a.head_dim).transpose(1, 2)
            k_1hKD = torch.cat([self.keys[i][:, :, :anchor], kb_1hBD], dim=2) if anchor else kb_1hBD
            v_1hKD = torch.cat([self.values[i][:, :, :anchor], vb_1hBD], dim=2) if anchor else vb_1hBD
            mask = self._mask(layer.layer_type, anchor, anchor, block)
            out_1hBD = F.scaled_dot_product_attention(q_1hBD.to(v_1hKD.dtype), k_1hKD.to(v_1hKD.dtype), v_1hKD,
                                                      attn_mask=mask, enable_gqa=True)
            x_1BH = x_1BH + a.o_proj(out_1hBD.transpose(1, 2).reshape(1, block, a.heads * a.head_dim))
            x_1BH = x_1BH + layer.mlp(layer.post_norm(x_1BH))
        return d.lm_head(d.norm(x_1BH)).float()[0]


# ---------------------------------------------------------------------------- verification rules


def accept_greedy(proposal: torch.Tensor, target_logits_BV: torch.Tensor) -> tuple[int, int]:
    """(accepted, next token): proposal [B-1] against the target's argmax after each
    block token; the next token is the target's own choice at the first miss."""
    choice_B = target_logits_BV.argmax(dim=-1)
    agree = (proposal == choice_B[:-1]).long()
    accepted = int(agree.cumprod(dim=0).sum())
    return accepted, int(choice_B[accepted])


def accept_sampled(proposal: torch.Tensor, draft_probs_KV: torch.Tensor, target_probs_BV: torch.Tensor,
                   generator: Optional[torch.Generator] = None) -> tuple[int, int]:
    """(accepted, next token) by the speculative-sampling rejection rule (module
    docstring). proposal [K] was drawn from draft_probs_KV (row k for slot k+1);
    target_probs_BV has K + 1 rows, the last one for the bonus."""
    gen_device = generator.device if generator is not None else target_probs_BV.device
    for k in range(proposal.shape[0]):
        x = int(proposal[k])
        p, q = target_probs_BV[k], draft_probs_KV[k]
        u = float(torch.rand((), generator=generator, device=gen_device))
        if u * float(q[x]) < float(p[x]):
            continue
        residual = (p - q).clamp(min=0)
        residual = residual if float(residual.sum()) > 0 else p
        return k, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    last = target_probs_BV[proposal.shape[0]]
    return proposal.shape[0], int(torch.multinomial(last, 1, generator=generator))


# ---------------------------------------------------------------------------- decoding


@dataclass
class Generation:
    """One prompt's decoding: exactly ``max_new`` new tokens and how they were made."""

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)
    """Accepted draft tokens per verification step (0..B-1); tau of a step = accepted + 1."""
    target_forwards: int = 0
    """Target forwards, the prefill included."""
    seconds: float = 0.0

    @property
    def tau(self) -> Optional[float]:
        return sum(a + 1 for a in self.accepted) / len(self.accepted) if self.accepted else None

    @property
    def tokens_per_forward(self) -> float:
        return len(self.tokens) / max(1, self.target_forwards)


def _prompt_tensor(prompt: list[int], device) -> torch.Tensor:
    return torch.tensor([prompt], dtype=torch.long, device=device)


def greedy_generate(target, prompt: list[int], max_new: int) -> Generation:
    """Plain greedy decoding with a KV cache, one target forward per token: the
    reference output and the speed baseline."""
    device = target.device
    _sync(device)
    begin = time.perf_counter()
    stepper = TargetStepper(target, features=False)
    logits, _ = stepper.forward(_prompt_tensor(prompt, device), last_only=True)
    token = int(logits[0, -1].argmax())
    out = [token]
    while len(out) < max_new:
        logits, _ = stepper.forward(torch.tensor([[token]], device=device))
        token = int(logits[0, -1].argmax())
        out.append(token)
    _sync(device)
    return Generation(tokens=out[:max_new], target_forwards=stepper.forwards, seconds=time.perf_counter() - begin)


def speculative_generate(target, drafter: Drafter, prompt: list[int], max_new: int, temperature: float = 0.0,
                         generator: Optional[torch.Generator] = None) -> Generation:
    """Decode ``max_new`` tokens after ``prompt`` with block drafting and target
    verification (module docstring); greedy when ``temperature`` is 0."""
    device = target.device
    block, mask_id = drafter.block_size, drafter.mask_token_id
    _sync(device)
    begin = time.perf_counter()
    stepper, state = TargetStepper(target), DraftState(drafter)

    # ---- prefill: the prompt's features become the drafter's context; the target picks the first token
    logits, features = stepper.forward(_prompt_tensor(prompt, device), last_only=True)
    state.extend(features)
    if temperature > 0:
        first = int(torch.multinomial(torch.softmax(logits[0, -1] / temperature, -1), 1, generator=generator))
    else:
        first = int(logits[0, -1].argmax())
    out, start, accepted = list(prompt) + [first], len(prompt), []

    while len(out) - len(prompt) < max_new:
        # ---- draft the block anchored at the last committed token
        block_ids = torch.full((block,), mask_id, dtype=torch.long, device=device)
        block_ids[0] = out[start]
        draft_KV = state.logits(block_ids, start)[1:]
        if temperature > 0:
            draft_probs = torch.softmax(draft_KV / temperature, dim=-1)
            proposal = torch.multinomial(draft_probs, 1, generator=generator).view(-1).to(device)
        else:
            proposal = draft_KV.argmax(dim=-1).to(device)
        block_ids[1:] = proposal

        # ---- verify all of it in one target forward, accept a prefix and one target token
        verify_BV, features = stepper.forward(block_ids[None])
        if temperature > 0:
            n_ok, nxt = accept_sampled(proposal, draft_probs.to(device), torch.softmax(verify_BV[0] / temperature, -1),
                                       generator)
        else:
            n_ok, nxt = accept_greedy(proposal, verify_BV[0])
        out += proposal[:n_ok].tolist() + [nxt]
        accepted.append(n_ok)

        # ---- roll back to what was committed; the accepted block tokens' features join the context
        stepper.crop(start + n_ok + 1)
        state.extend(features[:, : n_ok + 1])
        start += n_ok + 1

    _sync(device)
    return Generation(tokens=out[len(prompt):len(prompt) + max_new], accepted=accepted,
                      target_forwards=stepper.forwards, seconds=time.perf_counter() - begin)


# ---------------------------------------------------------------------------- acceptance against data


@torch.inference_mode()
def anchor_runs(target, drafter: Drafter, ids: list[int], loss_mask: list[int], chunk: int = 256) -> dict[int, int]:
    """{anchor a: accepted} for every response position a followed by a response
    token, verified against the data itself (teacher forced): the leading run of the
    drafter's greedy proposals for a+1.. that match the data, stopping where the data
    or its loss mask ends. The same statistic as the trainer's accept_len, computed
    by the training forward (Drafter.forward), at every anchor instead of a sample."""
    from trainer.anchors import build_block_inputs
    from trainer.attention import SDPA, AttentionPath, build_layer_masks

    device = target.device
    seq_1S = torch.tensor([ids], dtype=torch.long, device=device)
    mask_1S = torch.tensor([loss_mask], dtype=torch.long, device=device)
    features_1SF = target.features(seq_1S)
    block, n = drafter.block_size, len(ids)
    anchors = [a for a in range(n - 1) if loss_mask[a] and loss_mask[a + 1]]
    path = AttentionPath(SDPA, device.type)
    runs: dict[int, int] = {}
    for begin in range(0, len(anchors), chunk):
        part = anchors[begin:begin + chunk]
        anchors_1N = torch.tensor([part], dtype=torch.long, device=device)
        valid_1N = torch.ones_like(anchors_1N, dtype=torch.bool)
        block_ids, positions, labels, label_mask = build_block_inputs(
            seq_1S, anchors_1N, valid_1N, block, drafter.mask_token_id, mask_1S)
        masks = build_layer_masks(path, anchors_1N, valid_1N, n, block, drafter.layer_types, drafter.sliding_window,
                                  drafter.sliding_semantics)
        hidden_1QH = drafter(features_1SF, block_ids, positions, masks)
        guess_1Q = drafter.lm_head(hidden_1QH).argmax(dim=-1)
        correct_NK = ((guess_1Q == labels) & label_mask).view(len(part), block)
        run_N = correct_NK[:, 1:].long().cumprod(dim=1).sum(dim=1)
        runs.update(zip(part, run_N.tolist()))
    return runs


def chain_steps(runs: dict[int, int], first: int) -> list[int]:
    """Taus of decoding that follows the data from anchor ``first``: each step
    accepts runs[a] tokens and moves to a + runs[a] + 1, as speculative decoding
    moves along what the target writes."""
    steps, a = [], first
    while a in runs:
        steps.append(runs[a] + 1)
        a += runs[a] + 1
    return steps
