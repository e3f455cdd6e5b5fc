"""The backends of the vocabulary statistics (pgloss.vocab.backends): the table of which statistic each runs."""

import pytest
import torch

from pgloss.vocab import backends
from pgloss.vocab.divergence import ForwardKL, GeneralisedJSD, Normalisers
from pgloss.vocab.entropy import LogProbEntropy
from pgloss.vocab.full_kl import FullKL
from pgloss.vocab.head import PLAIN

STATISTICS = [LogProbEntropy, FullKL, ForwardKL, Normalisers, GeneralisedJSD]


def test_each_backend_runs_the_statistics_of_its_table():
    assert all(backends.TORCH.runs(s) and backends.TRITON_TILES.runs(s) for s in STATISTICS)
    assert [s for s in STATISTICS if backends.TRITON_HEAD.runs(s)] == [LogProbEntropy]

    class Custom(LogProbEntropy):  # a statistic of the user's: its torch code, which no kernel mirrors
        pass

    assert backends.TORCH.runs(Custom) and not backends.TRITON_TILES.runs(Custom)
    with backends.use("kernel"), pytest.raises(ValueError, match=r"^the kernel route runs .* got Custom"):
        backends.choose(Custom, (PLAIN,), torch.zeros(4, 2))
