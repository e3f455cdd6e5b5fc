"""The backends of the vocabulary statistics (pgloss.vocab.backends): the table of which statistic each runs, and
the gate on Triton's version (a Triton older than MIN_TRITON never takes the kernels: "auto" goes to torch, an
explicit request is refused naming the version it needs). Needs no Triton: the version is patched."""

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


@pytest.mark.parametrize("version", [(3, 0, 0), (3, 1, 9)])
def test_a_triton_below_the_minimum_takes_the_torch_route_or_is_refused(monkeypatch, version):
    monkeypatch.setattr(backends, "TRITON_VERSION", version)
    assert not backends.triton_runs(torch.device("cuda"))
    weight = torch.zeros(4, 2)
    statistic = LogProbEntropy(torch.zeros(1, dtype=torch.long))
    assert backends.route(statistic, (PLAIN,), weight) == "torch"
    found = ".".join(map(str, version))
    for which in ("kernel", "head-kernel"):
        with (
            backends.use(which),
            pytest.raises(RuntimeError, match=rf"^the {which} route needs Triton >= 3\.2, found Triton {found}"),
        ):
            backends.choose(statistic, (PLAIN,), weight)


def test_the_minimum_and_newer_tritons_take_the_kernels_on_cuda(monkeypatch):
    for version in [(3, 2, 0), (3, 6, 0), (4, 0)]:
        monkeypatch.setattr(backends, "TRITON_VERSION", version)
        assert backends.triton_runs(torch.device("cuda"))
        assert not backends.triton_runs(torch.device("cpu"))
    monkeypatch.setattr(backends, "TRITON_VERSION", None)
    assert not backends.triton_runs(torch.device("cuda"))
    with backends.use("kernel"), pytest.raises(RuntimeError, match=r"^the kernel route needs Triton \(pip install"):
        backends.choose(LogProbEntropy, (PLAIN,), torch.zeros(4, 2))
