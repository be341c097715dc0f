"""One DFlash training step's forward: batch -> (loss, stats). Called by drafter threads.

batch (all on the drafter's device):
    features   [B, S, K*H]  Target.features of input_ids (any float dtype)
    input_ids  [B, S]       padded to the length bucket S
    loss_mask  [B, S]       1 on response tokens
    anchors    [B, N] long, valid [B, N] bool   from anchors.sample_anchors (sampled
               here with the global RNG when absent)
"""

from __future__ import annotations

import torch

from trainer.anchors import build_block_inputs, sample_anchors
from trainer.attention import FLEX_COMPILED, AttentionPath, build_layer_masks
from trainer.config import TrainerConfig
from trainer.loss import default_gamma, dflash_loss, resolve_kernel, slot_weights
from trainer.model import Drafter


def compute_loss(
    drafter: Drafter,
    batch: dict[str, torch.Tensor],
    cfg: TrainerConfig,
    attention_path: AttentionPath,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss (with grad) and detached stats; see loss.dflash_loss for the stats, plus
    ``query_tokens`` (valid blocks x B: the drafter's useful work) and ``anchors``."""
    block_size = drafter.block_size
    features_BSF = batch["features"]
    input_ids_BS = batch["input_ids"]
    loss_mask_BS = batch["loss_mask"]
    ctx_len = input_ids_BS.shape[1]

    # ---- anchors and block inputs
    if "anchors" in batch:
        anchors_BN, valid_BN = batch["anchors"], batch["valid"]
    else:
        anchors_BN, valid_BN = sample_anchors(loss_mask_BS, cfg.data.max_anchors, block_size)
    block_ids_BQ, position_ids_BQ, labels_BQ, label_mask_BQ = build_block_inputs(
        input_ids_BS, anchors_BN, valid_BN, block_size, drafter.mask_token_id, loss_mask_BS
    )

    # ---- masks: one per layer type, in the attention path's format
    masks = build_layer_masks(
        attention_path, anchors_BN, valid_BN, ctx_len, block_size, drafter.layer_types, drafter.sliding_window,
        drafter.sliding_semantics,
    )

    # ---- drafter forward and the chunked loss through the shared lm_head
    hidden_BQH = drafter(features_BSF, block_ids_BQ, position_ids_BQ, masks)
    gamma = cfg.train.gamma or default_gamma(block_size)
    weight_BQ = slot_weights(label_mask_BQ, block_size, gamma)
    loss, stats = dflash_loss(
        hidden_BQH, drafter.lm_head.weight, labels_BQ, weight_BQ, cfg.train.loss_chunk, block_size=block_size,
        compiled=attention_path.name == FLEX_COMPILED, kernel=resolve_kernel(cfg.train.loss_kernel, hidden_BQH.device),
    )
    stats["anchors"] = valid_BN.sum().float()
    stats["query_tokens"] = stats["anchors"] * block_size
    return loss, stats
