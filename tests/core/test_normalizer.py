"""The Normalizer's counts and the aggregation weights."""

import loops
import pytest
import torch

import pgloss
from pgloss.core.aggregate import aggregate


def test_counts_over_micro_batches():
    masks = [torch.tensor([[1, 1, 0], [0, 0, 0]]), torch.tensor([[1, 1, 1]])]
    ids = [torch.tensor([0, 1]), torch.tensor([3])]
    n = pgloss.Normalizer.count(masks, group_ids=ids)
    assert n.tokens.item() == 5 and n.sequences.item() == 2  # the empty row is not a sequence
    assert n.group_tokens.tolist() == [2, 0, 0, 3] and n.groups.item() == 2
    assert n.world_size == 1


@pytest.mark.parametrize("mode", pgloss.AGG_MODES)
def test_aggregate_matches_loop(mode):
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    mask = torch.rand(6, 5, generator=gen) > 0.4
    mask[2] = False
    ids = torch.tensor([0, 0, 1, 1, 2, 2])
    out = aggregate(values, mask, mode, norm_constant=7.0, group_ids=ids)
    expected = loops.aggregate(values.tolist(), mask.tolist(), mode, norm_constant=7.0, group_ids=ids.tolist())
    assert out.item() == pytest.approx(expected, rel=1e-12)


def test_bad_inputs():
    with pytest.raises(ValueError, match="masks must hold one tensor per micro-batch"):
        pgloss.Normalizer.count([])
    with pytest.raises(ValueError, match=r"group_ids must hold one tensor per micro-batch \(2, as masks\), got 1"):
        pgloss.Normalizer.count([torch.ones(1, 2), torch.ones(1, 2)], group_ids=[torch.tensor([0])])
    with pytest.raises(ValueError, match="non-negative"):
        pgloss.Normalizer.count(torch.ones(2, 2), group_ids=torch.tensor([0, -1]))
    with pytest.raises(ValueError, match="needs norm_constant"):
        aggregate(torch.ones(2, 2), torch.ones(2, 2, dtype=torch.bool), "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="needs a Normalizer counted with group_ids"):
        n = pgloss.Normalizer.count(torch.ones(2, 2))
        aggregate(
            torch.ones(2, 2),
            torch.ones(2, 2, dtype=torch.bool),
            "group-mean-token-mean",
            normalizer=n,
            group_ids=torch.tensor([0, 1]),
        )
