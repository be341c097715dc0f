"""One DFlash training step's forward: batch -> (loss, stats). Called by drafter threads.

batch (all on the drafter's device):
    features   [B, S, K*H]  Target.features of input_ids (any float dtype)
    input_ids  [B, S]       padded to the length bucket S
    loss_mask  [B, S]       1 on response tokens
    anchors    [B, N] long, valid [B, N] bool   from anchors.sample_anchors (sampled
               here with the global RNG when absent)
    blocks     optional: prepare_blocks of the above (then input_ids, loss_mask and
               the anchors are not read)
"""

from __future__ import annotations

import torch

from trainer.anchors import build_block_inputs, sample_anchors
from trainer.attention import FLEX_COMPILED, AttentionPath, build_layer_masks
from trainer.config import TrainerConfig
from trainer.loss import default_gamma, dflash_loss, resolve_kernel, slot_weights
from trainer.model import Drafter


def prepare_blocks(
    drafter: Drafter,
    input_ids_BS: torch.Tensor,
    loss_mask_BS: torch.Tensor,
    anchors_BN: torch.Tensor,
    valid_BN: torch.Tensor,
    cfg: TrainerConfig,
    attention_path: AttentionPath,
) -> dict:
    """What a step needs besides the features and the drafter's weights: the block
    inputs, labels, slot weights and the attention masks (small index kernels, no
    gradient). The pipeline's target thread makes them beside the target's forward
    (``Pipeline.make_item``), so that the drafter's thread starts a step with its
    compiled layers; ``compute_loss`` makes them when the batch comes without."""
    block_size = drafter.block_size
    block_ids_BQ, position_ids_BQ, labels_BQ, label_mask_BQ = build_block_inputs(
        input_ids_BS, anchors_BN, valid_BN, block_size, drafter.mask_token_id, loss_mask_BS
    )
    # ---- masks: one per layer type, in the attention path's format
    masks = build_layer_masks(
        attention_path, anchors_BN, valid_BN, input_ids_BS.shape[1], block_size, drafter.layer_types,
        drafter.sliding_window, drafter.sliding_semantics,
    )
    gamma = cfg.train.gamma or default_gamma(block_size)
    return {"block_ids": block_ids_BQ, "position_ids": position_ids_BQ, "labels": labels_BQ,
            "weight": slot_weights(label_mask_BQ, block_size, gamma), "masks": masks,
            "anchors": valid_BN.sum().float()}


def compute_loss(
    drafter: Drafter,
    batch: dict,
    cfg: TrainerConfig,
    attention_path: AttentionPath,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss (with grad) and detached stats; see loss.dflash_loss for the stats, plus
    ``query_tokens`` (valid blocks x B: the drafter's useful work) and ``anchors``.
    ``batch["blocks"]``, when present, is ``prepare_blocks``'s output for this batch."""
    block_size = drafter.block_size
    blocks = batch.get("blocks")
    if blocks is None:
        if "anchors" in batch:
            anchors_BN, valid_BN = batch["anchors"], batch["valid"]
        else:
            anchors_BN, valid_BN = sample_anchors(batch["loss_mask"], cfg.data.max_anchors, block_size)
        blocks = prepare_blocks(drafter, batch["input_ids"], batch["loss_mask"], anchors_BN, valid_BN, cfg,
                                attention_path)

    # ---- drafter forward and the chunked loss through the shared lm_head
    hidden_BQH = drafter(batch["features"], blocks["block_ids"], blocks["position_ids"], blocks["masks"])
    loss, stats = dflash_loss(
        hidden_BQH, drafter.lm_head.weight, blocks["labels"], blocks["weight"], cfg.train.loss_chunk,
        block_size=block_size, compiled=attention_path.name == FLEX_COMPILED,
        kernel=resolve_kernel(cfg.train.loss_kernel, hidden_BQH.device),
    )
    stats["anchors"] = blocks["anchors"]
    stats["query_tokens"] = stats["anchors"] * block_size
    return loss, stats
