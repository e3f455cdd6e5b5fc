"""The top-entropy mask with a step-global quantile and truncated-completion masking: against a
plain loop, split into micro-batches, entering the normaliser, and over two gloo ranks (`on_rank`,
`check_ranks`: run by properties/test_two_ranks_step_statistics.py)."""

import loops
import pytest
import torch
from conftest import make_batch
from properties.micro_batches import micro_batches

import pgloss
from pgloss.correction.token_masks import entropy_threshold, top_entropy_mask, truncated_completion_mask

PARTS = [slice(0, 3), slice(3, 5), slice(5, 9)]


def data():
    return make_batch(batch=9, length=7, seed=21)


@pytest.mark.parametrize("top", [0.2, 0.5, 1.0])
def test_threshold_is_the_loop_quantile_over_the_whole_step(top):
    d = data()
    valid = [
        e
        for row, m in zip(d["entropy"].tolist(), d["mask"].tolist(), strict=True)
        for e, k in zip(row, m, strict=True)
        if k
    ]
    expected = loops.quantile(valid, 1 - top)
    whole = entropy_threshold(d["entropy"], d["mask"], top=top)
    split = entropy_threshold([d["entropy"][p] for p in PARTS], [d["mask"][p] for p in PARTS], top=top)
    assert float(whole) == pytest.approx(expected, rel=1e-12) and float(split) == float(whole)
    kept = top_entropy_mask(d["entropy"], d["mask"], whole)
    assert torch.equal(kept, d["mask"] & (d["entropy"] >= expected))
    share = float(kept.sum() / d["mask"].sum())
    assert share == pytest.approx(top, abs=1.0 / int(d["mask"].sum()))
    local = entropy_threshold(d["entropy"][PARTS[0]], d["mask"][PARTS[0]], top=top)
    if top < 1:
        assert float(local) != float(whole), "a per-micro-batch quantile differs: the split test can fail"


def test_masked_tokens_leave_the_normaliser():
    # The loss over the entropy-masked batch equals the loss of the kept tokens alone (token-mean).
    d = data()
    keep = top_entropy_mask(d["entropy"], d["mask"], entropy_threshold(d["entropy"], d["mask"], top=0.3))
    alg = pgloss.get("dapo")
    args = (d["log_prob"], d["old_log_prob"], d["advantages"])
    masked = alg(*args, keep).loss
    per_token = alg(*args, d["mask"]).per_token
    torch.testing.assert_close(masked, per_token[keep].sum() / keep.sum())
    assert not torch.allclose(masked, per_token[keep].sum() / d["mask"].sum())


def test_truncated_completions_are_cleared():
    d = data()
    finished = torch.tensor([True, False, True, True, False, True, True, True, False])
    out = truncated_completion_mask(d["mask"], finished)
    assert torch.equal(out, d["mask"] & finished[:, None])
    assert torch.equal(truncated_completion_mask(d["mask"].int(), finished), out)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda d: entropy_threshold(d["entropy"], d["mask"], top=0.0), ValueError, "top must be a share"),
        (lambda d: entropy_threshold(d["entropy"], d["mask"], top=True), TypeError, "top must be a real number"),
        (lambda d: entropy_threshold([d["entropy"]], [], top=0.2), ValueError, "one tensor per micro-batch"),
        (lambda d: entropy_threshold(d["entropy"][0], d["mask"][0], top=0.2), ValueError, "entropies.0. must have 2"),
        (lambda d: top_entropy_mask(d["entropy"], d["mask"][:2], 0.1), ValueError, "mask must have shape"),
        (lambda d: truncated_completion_mask(d["mask"], torch.ones(9)), TypeError, "finished must be a bool"),
        (lambda d: truncated_completion_mask(d["mask"], torch.ones(3, dtype=torch.bool)), ValueError, "finished must"),
    ],
)
def test_bad_input_is_named(call, error, match):
    with pytest.raises(error, match=match):
        call(data())


def test_empty_step_keeps_nothing():
    d = data()
    none = torch.zeros_like(d["mask"])
    threshold = entropy_threshold(d["entropy"], none, top=0.2)
    assert threshold == -torch.inf and not top_entropy_mask(d["entropy"], none, threshold).any()


RANK_PARTS = {0: [slice(0, 1), slice(1, 3)], 1: [slice(3, 9)]}


def on_rank(rank):  # inside a gloo process of properties/test_two_ranks_step_statistics.py
    d = data()
    parts = RANK_PARTS[rank]
    threshold = entropy_threshold([d["entropy"][p] for p in parts], [d["mask"][p] for p in parts], top=0.25)
    masks = [top_entropy_mask(d["entropy"][p], d["mask"][p], threshold) for p in parts]
    normalizer = pgloss.Normalizer.count(masks)
    log_prob = d["log_prob"].clone().requires_grad_(True)
    alg = pgloss.get("dapo")

    def micro_batch(rows_and_mask):
        p, m = rows_and_mask
        return alg(log_prob[p], d["old_log_prob"][p], d["advantages"][p], m, normalizer=normalizer)

    micro_batches(micro_batch, zip(parts, masks, strict=True))
    grad = log_prob.grad.clone()
    torch.distributed.all_reduce(grad)
    return threshold, grad / 2


def check_ranks(results):
    d = data()
    threshold = entropy_threshold(d["entropy"], d["mask"], top=0.25)
    log_prob = d["log_prob"].clone().requires_grad_(True)
    pgloss.get("dapo")(
        log_prob, d["old_log_prob"], d["advantages"], top_entropy_mask(d["entropy"], d["mask"], threshold)
    ).loss.backward()
    for rank in (0, 1):
        assert float(results[rank][0]) == float(threshold)
        torch.testing.assert_close(results[rank][1], log_prob.grad, rtol=1e-12, atol=1e-14)
