"""Anchor sampling, block inputs and the DFlash loss, on hand-built examples."""

import math

import pytest
import torch

from trainer.anchors import anchor_slots, build_block_inputs, eligible_anchors, sample_anchors
from trainer.loss import chunk_cross_entropy, default_gamma, dflash_loss, slot_weights

MASK = 99


# ----------------------------------------------------------------------------- anchors


def test_eligible_anchors_follow_the_rules():
    loss = torch.zeros(1, 30)
    loss[0, 10:26] = 1  # 16 loss tokens, B = 4 -> enough (>= 2B)
    loss[0, 15] = 0  # a hole
    got = eligible_anchors(loss, 4)[0].nonzero().flatten().tolist()
    # a needs loss at a and a+1, and a + 3 <= 29
    assert got == [10, 11, 12, 13, 16, 17, 18, 19, 20, 21, 22, 23, 24]


def test_sequences_with_fewer_than_2b_loss_tokens_are_skipped():
    loss = torch.zeros(2, 40)
    loss[0, 5:12] = 1  # 7 < 8
    loss[1, 5:13] = 1  # 8: kept
    anchors, valid = sample_anchors(loss, 16, 4, torch.Generator().manual_seed(0))
    assert not valid[0].any() and (anchors[0] == 0).all()
    assert valid[1].sum() == 7  # a in 5..11


def test_anchors_are_sorted_distinct_eligible_and_static_in_shape():
    torch.manual_seed(0)
    seq_len, bs, max_anchors = 64, 4, 20
    for trial in range(20):
        loss = (torch.rand(3, seq_len) > 0.3).float()
        anchors, valid = sample_anchors(loss, max_anchors, bs, torch.Generator().manual_seed(trial))
        assert anchors.shape == valid.shape == (3, anchor_slots(seq_len, max_anchors, bs)) == (3, 20)
        eligible = eligible_anchors(loss, bs)
        for b in range(3):
            n = int(valid[b].sum())
            assert valid[b, :n].all() and not valid[b, n:].any(), "valid anchors first, padding after"
            chosen = anchors[b, :n].tolist()
            assert chosen == sorted(set(chosen))
            assert all(eligible[b, a] for a in chosen)
            assert n == min(max_anchors, int(eligible[b].sum()))


def test_anchor_slots_depend_only_on_the_bucket():
    assert anchor_slots(3072, 512, 16) == 512
    assert anchor_slots(256, 512, 16) == 241  # every position a full block fits at
    with pytest.raises(ValueError):
        anchor_slots(8, 4, 16)


def test_sampling_is_seeded_and_roughly_uniform():
    loss = torch.ones(1, 40)
    a1 = sample_anchors(loss, 5, 4, torch.Generator().manual_seed(3))
    a2 = sample_anchors(loss, 5, 4, torch.Generator().manual_seed(3))
    assert torch.equal(a1[0], a2[0])
    counts = torch.zeros(40)
    for seed in range(400):
        anchors, _ = sample_anchors(loss, 5, 4, torch.Generator().manual_seed(seed))
        counts[anchors[0]] += 1
    assert counts[37:].sum() == 0  # no room for a block there
    assert counts[:37].min() > 20 and counts[:37].max() < 100  # expected 400*5/37 = 54


# ----------------------------------------------------------------------------- bug 1: alignment


def test_bug1_slot_k_is_labelled_with_the_token_at_anchor_plus_k():
    t = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]])
    loss = torch.ones_like(t)
    loss[0, 9:] = 0  # labels at positions 9.. are not supervised
    anchors, valid = torch.tensor([[2, 6, 0]]), torch.tensor([[True, True, False]])
    ids, pos, labels, label_mask = build_block_inputs(t, anchors, valid, 4, MASK, loss)
    assert ids.tolist() == [[12, MASK, MASK, MASK, 16, MASK, MASK, MASK, MASK, MASK, MASK, MASK]]
    assert pos.tolist() == [[2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3]]
    assert labels[0, :8].tolist() == [12, 13, 14, 15, 16, 17, 18, 19]  # same position, not the next
    assert label_mask.tolist() == [[False, True, True, True, False, True, True, False] + [False] * 4]


def test_bug1_loss_weights_on_a_hand_built_example():
    label_mask = torch.tensor([[False, True, True, True, False, True, False, True]])
    w = slot_weights(label_mask, 4, gamma=2.0)
    e = math.exp
    want = [0, 1, e(-1 / 2), e(-2 / 2), 0, 1, 0, e(-2 / 2)]
    assert torch.allclose(w[0], torch.tensor(want))
    # Slot 0 (the anchor, given as input) is never supervised, whatever the mask says.
    assert slot_weights(torch.ones(1, 8, dtype=torch.bool), 4, 2.0)[0, ::4].tolist() == [0, 0]
    assert default_gamma(16) == 7 and default_gamma(8) == 4 and default_gamma(4) == 2


def oracle_hidden(labels_BQ, vocab):
    """Hidden states that make an identity lm_head predict exactly ``labels``."""
    return torch.nn.functional.one_hot(labels_BQ, vocab).float() * 20


def test_bug1_an_aligned_oracle_is_perfect_and_a_shifted_one_is_not():
    vocab, bs = 32, 4
    t = torch.arange(3, 3 + 20)[None]
    anchors, valid = torch.tensor([[1, 5, 9]]), torch.ones(1, 3, dtype=torch.bool)
    _, _, labels, label_mask = build_block_inputs(t, anchors, valid, bs, MASK % vocab)
    weight = slot_weights(label_mask, bs, default_gamma(bs))
    eye = torch.eye(vocab)

    # A drafter that outputs t[a+k] at slot k: what inference verifies.
    slot = torch.arange(12) % bs
    truth = t[0, anchors[0].repeat_interleave(bs) + slot][None]
    loss, stats = dflash_loss(oracle_hidden(truth, vocab), eye, labels, weight, chunk=5, block_size=bs)
    assert loss < 1e-6
    assert stats["acc"] == 1 and stats["accept_len"] == bs - 1 and stats["tokens"] == 9

    # The off-by-one drafter (t[a+k+1] at slot k) must look bad, not good.
    shifted = t[0, anchors[0].repeat_interleave(bs) + slot + 1][None]
    loss, stats = dflash_loss(oracle_hidden(shifted, vocab), eye, labels, weight, chunk=5, block_size=bs)
    assert loss > 10 and stats["acc"] == 0 and stats["accept_len"] == 0


# ----------------------------------------------------------------------------- loss


def test_loss_is_the_normalised_weighted_cross_entropy():
    torch.manual_seed(0)
    hidden = torch.randn(2, 8, 6)
    head = torch.randn(11, 6)
    labels = torch.randint(0, 11, (2, 8))
    weight = slot_weights(torch.rand(2, 8) > 0.3, 4, 3.0)
    loss, _ = dflash_loss(hidden, head, labels, weight, chunk=3, block_size=4)
    ce = torch.nn.functional.cross_entropy((hidden @ head.T).reshape(-1, 11), labels.reshape(-1), reduction="none")
    want = (ce * weight.reshape(-1)).sum() / weight.sum()
    assert torch.allclose(loss, want, atol=1e-6)


def test_stats_per_slot_and_acceptance_length():
    vocab, bs = 16, 4
    labels = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3, 4]])
    label_mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1, 0, 1, 1, 1, 0, 1, 0, 1]], dtype=torch.bool)
    preds = labels.clone()
    preds[0, 3] = 0  # block 0: slots 1, 2 right, 3 wrong -> run 2
    preds[0, 5] = 0  # block 1: slot 1 wrong -> run 0
    #                  block 2: all right -> run 3
    #                  block 3: slot 2 unsupervised stops the run -> run 1 (slot 3 right but not counted)
    weight = slot_weights(label_mask, bs, 7.0)
    _, stats = dflash_loss(oracle_hidden(preds, vocab), torch.eye(vocab), labels, weight, chunk=16, block_size=bs)
    assert stats["accept_len"].item() == pytest.approx((2 + 0 + 3 + 1) / 4)
    assert stats["blocks"] == 4 and stats["tokens"] == 11
    assert stats["slot_count"].tolist() == [0, 4, 3, 4]
    assert stats["slot_correct"].tolist() == [0, 3, 3, 3]
    assert math.isnan(stats["slot_acc"][0]) and stats["slot_acc"][1] == 0.75
    assert stats["acc"].item() == pytest.approx(9 / 11)


def test_chunked_loss_equals_unchunked_loss_and_grads():
    torch.manual_seed(1)
    hidden = torch.randn(2, 24, 8)
    head = torch.randn(50, 8)
    labels = torch.randint(0, 50, (2, 24))
    weight = slot_weights(torch.rand(2, 24) > 0.2, 8, 4.0)
    results = []
    for chunk in (1000, 48, 7, 1):
        h = hidden.clone().requires_grad_()
        loss, stats = dflash_loss(h, head, labels, weight, chunk=chunk, block_size=8)
        loss.backward()
        results.append((loss.detach(), h.grad, stats["acc"], stats["accept_len"]))
    ref = results[0]
    for loss, grad, acc, accept in results[1:]:
        assert torch.allclose(loss, ref[0], atol=1e-6)
        assert torch.allclose(grad, ref[1], atol=1e-7)
        assert acc == ref[2] and accept == ref[3]


def test_the_anchor_slot_never_reaches_the_vocabulary_projection():
    """Slot 0 of each block has weight 0 and is left out of the projection (the step's
    largest matmul): a NaN hidden state there changes nothing, and gets no gradient."""
    torch.manual_seed(4)
    bs = 4
    hidden = torch.randn(2, 12, 6)
    head = torch.randn(10, 6)
    labels = torch.randint(0, 10, (2, 12))
    weight = slot_weights(torch.ones(2, 12, dtype=torch.bool), bs, 2.0)
    clean, clean_stats = dflash_loss(hidden, head, labels, weight, chunk=5, block_size=bs)
    poisoned = hidden.clone()
    poisoned[:, ::bs] = float("nan")
    h = poisoned.requires_grad_()
    loss, stats = dflash_loss(h, head, labels, weight, chunk=5, block_size=bs)
    loss.backward()
    assert torch.isfinite(loss) and torch.allclose(loss, clean)
    assert (h.grad[:, ::bs] == 0).all() and torch.isfinite(h.grad).all()
    assert stats["slot_count"].tolist() == clean_stats["slot_count"].tolist() == [0, 6, 6, 6]


def test_empty_batch_gives_zero_loss_not_nan():
    h = torch.randn(1, 8, 4, requires_grad=True)
    loss, stats = dflash_loss(h, torch.randn(9, 4), torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8), 4, block_size=4)
    loss.backward()
    assert loss == 0 and torch.isfinite(h.grad).all() and stats["tokens"] == 0 and stats["accept_len"] == 0


def test_loss_gradient_matches_autograd_through_the_dense_reference():
    """The loss computes d loss / d hidden in its forward (the lm_head is frozen): it
    must equal autograd through plain weighted cross-entropy over full logits."""
    torch.manual_seed(3)
    hidden = torch.randn(2, 16, 6, dtype=torch.float64)
    head = torch.randn(13, 6, dtype=torch.float64)
    labels = torch.randint(0, 13, (2, 16))
    labels[0, 5] = -100  # "no label": no weight, no gradient
    weight = torch.rand(2, 16, dtype=torch.float64)
    weight[:, ::8] = 0  # slot 0 of each block

    h_ref = hidden.clone().requires_grad_()
    ce = torch.nn.functional.cross_entropy((h_ref @ head.T).reshape(-1, 13), labels.reshape(-1), reduction="none")
    w = torch.where(labels.reshape(-1) >= 0, weight.reshape(-1), 0.0)
    ((ce * w).sum() / w.sum()).backward()

    h = hidden.clone().requires_grad_()
    loss, _ = dflash_loss(h, head, labels, weight, chunk=5, block_size=8)
    (3.0 * loss).backward()  # the incoming gradient scales the stored one
    assert torch.allclose(h.grad, 3.0 * h_ref.grad, atol=1e-6)  # the loss is accumulated in fp32
    assert h.grad[0, 5].abs().max() == 0 and head.grad is None


@pytest.mark.parametrize("in_place", [True, False])  # False: the form the GPU path compiles
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_cross_entropy_traces_as_one_graph_with_the_same_results(dtype, in_place):
    """On a GPU the trainer compiles chunk_cross_entropy; a graph break would run part
    of it eagerly and compile it per thread. Dynamo + AOTAutograd (no inductor: CPU
    tests have no C++ toolchain to count on) must take it whole and agree with eager,
    in-place updates of the logits included."""
    torch.manual_seed(4)
    logits = (torch.randn(12, 40) * 3).to(dtype)
    labels = torch.randint(0, 40, (12,))
    weight = torch.rand(12)
    weight[3] = 0
    traced = torch.compile(chunk_cross_entropy, backend="aot_eager", fullgraph=True, dynamic=False)
    for need_grad in (True, False):
        want = chunk_cross_entropy(logits.clone(), labels, weight, need_grad)
        got = traced(logits.clone(), labels, weight, need_grad, in_place)
        assert torch.allclose(got[0], want[0]) and torch.equal(got[1], want[1])
        if need_grad:
            assert got[2].dtype == dtype and torch.allclose(got[2].float(), want[2].float(), atol=1e-6)
        else:
            assert got[2] is None and want[2] is None
    # and the gradient is weight * (softmax - onehot)
    grad = chunk_cross_entropy(logits.clone(), labels, weight, True)[2].float()
    onehot = torch.nn.functional.one_hot(labels, 40).float()
    expected = ((torch.softmax(logits.float(), -1) - onehot) * weight[:, None]).to(dtype).float()
    assert torch.allclose(grad, expected, atol=1e-6)


def test_top1_is_greedy_argmax_when_the_largest_logits_tie():
    """bf16 logits tie often at a large vocabulary: top-1 is what greedy decoding
    picks (the first of the tied maxima), not "the label's logit equals the max"."""
    logits = torch.tensor([[1.0, 5.0, 5.0, 0.0], [1.0, 5.0, 5.0, 0.0]], dtype=torch.bfloat16)
    labels = torch.tensor([1, 2])
    _, correct, _ = chunk_cross_entropy(logits, labels, torch.ones(2), False)
    assert correct.tolist() == [True, False]
