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


@pytest.mark.parametrize("chunk_size", [4, 15], ids=["recompute", "one_pass"])
def test_a_call_from_hidden_states_chooses_its_backend_once(monkeypatch, chunk_size):
    """`plan.plan` is the only caller of `choose`, once per loop of a call: the loss from hidden states on either
    path, and once more for the exact KL's own loop (another statistic)."""
    import pgloss
    from pgloss.vocab import plan

    calls = []

    def counted(*args):
        calls.append(args[0])
        return backends.choose(*args)

    monkeypatch.setattr(plan, "choose", counted)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(37, 8, generator=g, dtype=torch.float64, requires_grad=True)
    targets, mask = torch.randint(0, 37, (3, 5), generator=g), torch.ones(3, 5, dtype=torch.bool)
    kw = dict(old_log_prob=None, advantages=torch.randn(3, generator=g, dtype=torch.float64), mask=mask)
    pgloss.get("grpo", kl_coef=0.0).from_hidden(hidden, weight, targets, chunk_size=chunk_size, **kw).loss.backward()
    assert calls == [LogProbEntropy]
    calls.clear()
    exact = pgloss.get("grpo", kl_estimator="full", kl_coef=0.1)
    exact.from_hidden(hidden, weight, targets, ref_hidden=hidden, ref_weight=weight, chunk_size=chunk_size, **kw)
    assert [getattr(c, "__name__", type(c).__name__) for c in calls] == ["LogProbEntropy", "FullKL"]


def test_the_moved_driver_is_refused_at_its_old_path_with_the_new_one_named():
    import pgloss
    import pgloss.from_hidden

    with pytest.raises(ImportError, match=r"^pgloss\.vocab\.fused\.loss_from_hidden moved to pgloss\.from_hidden\."):
        from pgloss.vocab.fused import loss_from_hidden  # noqa: F401
    assert pgloss.loss_from_hidden is pgloss.from_hidden.loss_from_hidden
