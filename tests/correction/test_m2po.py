"""M2PO's second-moment mask against AReaL's algorithm as a plain loop, split into micro-batches,
and over two gloo ranks (`on_rank`, `check_ranks`: run by properties/test_two_ranks_step_statistics.py)."""

import loops
import pytest
import torch
from conftest import log_probs, make_batch

from pgloss.correction.m2po import m2po_cutoff, m2po_mask

PARTS = [slice(0, 2), slice(2, 5), slice(5, 9)]


def data(seed=41):
    d = make_batch(batch=9, length=8, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    d["behave"] = log_probs(d["old_log_prob"] + 0.3 * torch.randn(d["mask"].shape, generator=gen, dtype=torch.float64))
    return d


@pytest.mark.parametrize("threshold", [0.01, 0.04, 0.2, 10.0])
def test_mask_matches_areal_loop(threshold):
    d = data()
    cutoff = m2po_cutoff(d["behave"], d["old_log_prob"], d["mask"], threshold=threshold)
    keep = m2po_mask(d["behave"], d["old_log_prob"], d["mask"], cutoff)
    expected = loops.m2po_keep(d["behave"].tolist(), d["old_log_prob"].tolist(), d["mask"].tolist(), threshold)
    assert torch.equal(keep, torch.tensor(expected))
    m2 = (d["behave"] - d["old_log_prob"]).square()[keep]
    assert float(m2.mean()) < threshold or int(keep.sum()) == 1
    if threshold == 10.0:
        assert torch.equal(keep, d["mask"])


def test_keeps_one_token_when_nothing_is_below():
    d = data()
    cutoff = m2po_cutoff(d["behave"], d["old_log_prob"], d["mask"], threshold=1e-12)
    assert int(m2po_mask(d["behave"], d["old_log_prob"], d["mask"], cutoff).sum()) == 1


def test_cutoff_is_global_over_micro_batches():
    d = data()
    whole = m2po_cutoff(d["behave"], d["old_log_prob"], d["mask"], threshold=0.04)
    split = m2po_cutoff(
        [d["behave"][p] for p in PARTS],
        [d["old_log_prob"][p] for p in PARTS],
        [d["mask"][p] for p in PARTS],
        threshold=0.04,
    )
    assert float(split) == float(whole)
    local = m2po_cutoff(d["behave"][PARTS[0]], d["old_log_prob"][PARTS[0]], d["mask"][PARTS[0]], threshold=0.04)
    assert float(local) != float(whole), "AReaL's per-micro-batch cut differs: the test can fail"


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda d: m2po_cutoff(d["behave"], d["old_log_prob"], d["mask"], threshold=0.0), ValueError, "threshold"),
        (lambda d: m2po_cutoff(d["behave"], d["old_log_prob"], [], threshold=0.1), ValueError, "one tensor per"),
        (lambda d: m2po_mask(d["behave"], d["old_log_prob"][:, :3], d["mask"], 0.1), ValueError, "one shape"),
        (lambda d: m2po_mask(d["behave"].tolist(), d["old_log_prob"], d["mask"], 0.1), TypeError, "behave_log_prob"),
    ],
)
def test_bad_input_is_named(call, error, match):
    with pytest.raises(error, match=match):
        call(data())


RANK_PARTS = {0: [slice(0, 2), slice(2, 3)], 1: [slice(3, 9)]}


def on_rank(rank):  # inside a gloo process of properties/test_two_ranks_step_statistics.py
    d = data()
    parts = RANK_PARTS[rank]
    return m2po_cutoff(
        [d["behave"][p] for p in parts],
        [d["old_log_prob"][p] for p in parts],
        [d["mask"][p] for p in parts],
        threshold=0.04,
    )


def check_ranks(results):
    d = data()
    whole = m2po_cutoff(d["behave"], d["old_log_prob"], d["mask"], threshold=0.04)
    assert float(results[0]) == float(results[1]) == float(whole)
