"""VAPO's positive-example NLL term (`positive_nll_coef`, Yue et al. 2025, arXiv 2504.05118, eq. 10) against
its float64 loop (tests/loops/terms.py), its split and rank invariance, and NeMo-RL's `ClippedPGLossFn`.

Parity: PGLOSS_NEMO_RL_SRC, the root of a NeMo-RL checkout (NVIDIA-NeMo/RL commit 7ea279abf) holding
nemo_rl/algorithms/loss/loss_functions.py and nemo_rl/algorithms/utils.py. The package imports Ray,
Megatron and the rest of the trainer, so `ClippedPGLossFn` and `masked_mean` are cut from the files by
path (with `calculate_kl`, which its metrics call) and run with the interface enums they name. Measured (clip 0.2, token-level loss, μ ∈ {0.1, 1},
3 seeds, B = 8, T = 7, rewards 0/1 and real-valued, one call = the step): float64 |Δ loss| ≤ 1.2e-9,
|Δ ∂/∂log π| ≤ 2.9e-10: NeMo-RL divides every mean by its count + 1e-8 (relative 1e-8/N); asserted
relative 1e-8 on the loss, 1e-9 absolute on the gradient. With several micro-batches NeMo-RL divides the NLL by each
micro-batch's own rewarded-token count and sums the micro-batches (its `metric_normalizations` marks
`positive_nll_loss` as a per-micro-batch mean): the term then grows with the number of micro-batches
(test_nemo_rl_micro_batches_differ: one call 1.445, the same step in two micro-batches 2.593, μ = 1);
pgloss divides by the step's count.
"""

from __future__ import annotations

import enum
from types import SimpleNamespace

import loops
import pytest
import torch
from conftest import algorithm, make_batch
from properties.micro_batches import cut, split_call
from test_algorithms import reference_loss

import pgloss

F64 = dict(dtype=torch.float64)


def data_with_rewards(seed, rows=8, length=7, real=False):
    data = make_batch(batch=rows, length=length, seed=seed, per_token_adv=False)
    gen = torch.Generator().manual_seed(100 + seed)
    data["scores"] = (
        torch.randn(rows, generator=gen, **F64) if real else torch.randint(0, 2, (rows,), generator=gen).double()
    )
    return data


def call(alg, data, **extra):
    return alg(
        data["log_prob"],
        data["old_log_prob"],
        data["advantages"],
        data["mask"],
        ref_log_prob=data["ref_log_prob"],
        entropy=data["entropy"],
        scores=data["scores"],
        **extra,
    )


@pytest.mark.parametrize("name", ["grpo", "dapo", "cispo", "dr_grpo"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_term_matches_loop(name, seed):
    data = data_with_rewards(seed, real=seed == 2)
    alg = algorithm(name, positive_nll_coef=0.3, entropy_coef=0.01)
    out = call(alg, data)
    nll = loops.positive_nll(data["log_prob"].tolist(), data["mask"].tolist(), data["scores"].tolist())
    assert out.metrics["positive_nll_loss"].item() == pytest.approx(nll, rel=1e-13)
    assert out.loss.item() == pytest.approx(reference_loss(alg, data) + 0.3 * nll, rel=1e-12)


def test_no_rewarded_token_gives_zero():
    data = data_with_rewards(3)
    data["scores"] = -data["scores"].abs()
    alg = pgloss.get("dapo", positive_nll_coef=0.5)
    out = call(alg, data)
    assert out.metrics["positive_nll_loss"].item() == 0.0
    assert out.loss.item() == pytest.approx(call(pgloss.get("dapo"), data).loss.item(), rel=1e-15)


def test_gradient_is_minus_mu_over_rewarded_tokens():
    """∂(μ·L_NLL)/∂log π_{i,t} = -μ/N_rew on a rewarded row's valid token, 0 elsewhere."""
    data = data_with_rewards(4)
    lp = data["log_prob"].clone().requires_grad_(True)
    alg = pgloss.get("dapo", positive_nll_coef=0.7)
    base = pgloss.get("dapo")
    with_term = torch.autograd.grad(
        alg(lp, data["old_log_prob"], data["advantages"], data["mask"], scores=data["scores"]).loss, lp
    )[0]
    without = torch.autograd.grad(base(lp, data["old_log_prob"], data["advantages"], data["mask"]).loss, lp)[0]
    rewarded = (data["scores"] > 0)[:, None] & data["mask"]
    expected = torch.where(rewarded, -0.7 / rewarded.sum().double(), 0.0)
    torch.testing.assert_close(with_term - without, expected, rtol=1e-13, atol=1e-16)


def test_gradcheck():
    data = data_with_rewards(5, rows=6, length=5)
    alg = pgloss.get("grpo", positive_nll_coef=0.4, loss_agg_mode="delta-l-norm", norm_constant=5.0)

    def loss(log_prob):
        return alg(
            log_prob,
            data["old_log_prob"],
            data["advantages"],
            data["mask"],
            ref_log_prob=data["ref_log_prob"],
            scores=data["scores"],
        ).loss

    assert torch.autograd.gradcheck(loss, (data["log_prob"].clone().requires_grad_(True),))


@pytest.mark.parametrize("parts", [[slice(0, 9)], [slice(0, 2), slice(2, 9)], [slice(0, 1), slice(1, 4), slice(4, 9)]])
def test_micro_batches_add_up(parts):
    data = data_with_rewards(6, rows=9, length=6)
    alg = pgloss.get("grpo", positive_nll_coef=0.5)
    whole_lp = data["log_prob"].clone().requires_grad_(True)
    whole = call(alg, {**data, "log_prob": whole_lp}).loss
    whole.backward()
    norm = alg.step_normalizer(cut(data["mask"], parts), scores=cut(data["scores"], parts))
    total, grad = split_call(
        alg,
        data["log_prob"],
        parts,
        norm,
        old_log_prob=data["old_log_prob"],
        advantages=data["advantages"],
        mask=data["mask"],
        ref_log_prob=data["ref_log_prob"],
        scores=data["scores"],
    )
    torch.testing.assert_close(total, whole.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, whole_lp.grad, rtol=1e-12, atol=1e-14)


def test_needs_scores_and_a_counted_normalizer():
    data = data_with_rewards(7)
    alg = pgloss.get("dapo", positive_nll_coef=0.5)
    assert "scores" in alg.needs
    with pytest.raises(ValueError, match=r"needs scores in the call \(\[B\], the sequence rewards: positive_nll_coef"):
        alg(data["log_prob"], data["old_log_prob"], data["advantages"], data["mask"])
    bare = pgloss.Normalizer.count(data["mask"])
    with pytest.raises(ValueError, match="needs a Normalizer counted with scores"):
        call(alg, data, normalizer=bare)
    few = alg.count_step(data["mask"], scores=torch.zeros(8, **F64))
    with pytest.raises(ValueError, match="counted 0 tokens of rewarded sequences"):
        call(alg, data, normalizer=few)
    with pytest.raises(ValueError, match="positive_nll_coef must be >= 0"):
        pgloss.get("dapo", positive_nll_coef=-0.1)


def test_inspect_keeps_the_term_out_of_the_policy_gradient():
    data = data_with_rewards(9)
    alg = pgloss.get("dapo", positive_nll_coef=0.5)
    from pgloss.diagnostics.inspect import inspect

    report = inspect(
        alg, data["log_prob"], data["old_log_prob"], data["advantages"], data["mask"], scores=data["scores"]
    )
    plain = inspect(pgloss.get("dapo"), data["log_prob"], data["old_log_prob"], data["advantages"], data["mask"])
    torch.testing.assert_close(report.policy_grad, plain.policy_grad, rtol=1e-13, atol=1e-16)
    rewarded = (data["scores"] > 0)[:, None] & data["mask"]
    torch.testing.assert_close(
        report.grad - report.policy_grad,
        torch.where(rewarded, -0.5 / rewarded.sum().double(), 0.0),
        rtol=1e-12,
        atol=1e-16,
    )


# -- NeMo-RL ------------------------------------------------------------------------------------------------------


def _nemo_rl():
    from advantages.trainer_sources import load, source_file

    utils = load(
        source_file("PGLOSS_NEMO_RL_SRC", "nemo_rl/algorithms/utils.py"),
        ("masked_mean", "calculate_kl"),
        {"torch": torch, "Optional": __import__("typing").Optional},
    )
    path = source_file("PGLOSS_NEMO_RL_SRC", "nemo_rl/algorithms/loss/loss_functions.py")
    enums = load(
        source_file("PGLOSS_NEMO_RL_SRC", "nemo_rl/algorithms/loss/interfaces.py"),
        ("LossType", "MetricNormalizer", "LossInputType"),
        {"enum": enum},
    )
    namespace = {
        "torch": torch,
        "Tensor": torch.Tensor,
        "LossFunction": object,
        "BatchedDataDict": dict,
        "ClippedPGLossConfig": object,
        "ClippedPGLossDataDict": object,
        "masked_mean": utils["masked_mean"],
        "calculate_kl": utils["calculate_kl"],
        **{k: enums[k] for k in ("LossType", "MetricNormalizer", "LossInputType")},
    }
    return load(path, ("ClippedPGLossFn",), namespace)["ClippedPGLossFn"]


def _nemo_config(mu):
    return SimpleNamespace(
        disable_ppo_ratio=False,
        ratio_clip_min=0.2,
        ratio_clip_max=0.2,
        ratio_clip_c=None,
        reference_policy_kl_penalty=0.0,
        use_kl_in_reward=False,
        reference_policy_kl_type="k3",
        kl_input_clamp_value=None,
        kl_output_clamp_value=None,
        use_importance_sampling_correction=False,
        truncated_importance_sampling_type=None,
        truncated_importance_sampling_ratio=None,
        truncated_importance_sampling_ratio_min=None,
        use_on_policy_kl_approximation=False,
        force_on_policy_ratio=False,
        sequence_level_importance_ratios=False,
        positive_example_nll_weight=mu,
        token_level_loss=True,
        use_cispo=False,
    )


def _nemo_call(fn, data, lp, rows, tokens, part=slice(None)):
    """NeMo-RL's inputs carry one leading position that its loss drops ([:, 1:])."""

    def pad(x):
        return torch.cat([torch.zeros_like(x[:, :1]), x], dim=1)

    mask = data["mask"][part].double()
    adv = data["advantages"][part][:, None].expand_as(mask)
    batch = dict(
        token_mask=pad(mask),
        sample_mask=torch.ones(mask.shape[0], **F64),
        advantages=pad(adv),
        prev_logprobs=pad(data["old_log_prob"][part]),
        generation_logprobs=pad(data["old_log_prob"][part]),
        rewards=data["scores"][part],
    )
    return fn(lp[part], batch, torch.tensor(rows, **F64), torch.tensor(tokens, **F64))[0]


@pytest.mark.parametrize("mu", [0.1, 1.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_nemo_rl(mu, seed):
    fn = _nemo_rl()(_nemo_config(mu))
    data = data_with_rewards(seed, real=seed == 2)
    theirs_lp = data["log_prob"].clone().requires_grad_(True)
    theirs = _nemo_call(fn, data, theirs_lp, float(data["mask"].any(-1).sum()), float(data["mask"].sum()))
    theirs.backward()
    ours_lp = data["log_prob"].clone().requires_grad_(True)
    ours = pgloss.get("bnpo", positive_nll_coef=mu)(
        ours_lp, data["old_log_prob"], data["advantages"], data["mask"], scores=data["scores"]
    ).loss
    ours.backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-8, atol=0)
    torch.testing.assert_close(ours_lp.grad, theirs_lp.grad, rtol=1e-8, atol=1e-9)


def test_nemo_rl_micro_batches_differ():
    """NeMo-RL's NLL per micro-batch: two micro-batches of one step give a different loss than one call."""
    fn = _nemo_rl()(_nemo_config(1.0))
    data = data_with_rewards(0)
    data["scores"] = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1], **F64)
    rows, tokens = float(data["mask"].any(-1).sum()), float(data["mask"].sum())
    lp = data["log_prob"]
    one = _nemo_call(fn, data, lp, rows, tokens)
    two = sum(_nemo_call(fn, data, lp, rows, tokens, p) for p in (slice(0, 4), slice(4, 8)))
    ours = pgloss.get("bnpo", positive_nll_coef=1.0)(
        lp, data["old_log_prob"], data["advantages"], data["mask"], scores=data["scores"]
    ).loss
    assert ours.item() == pytest.approx(one.item(), rel=1e-8)
    assert abs(two.item() - one.item()) > 0.1 * abs(one.item())
