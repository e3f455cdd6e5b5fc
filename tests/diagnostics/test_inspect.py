"""pgloss.diagnostics.inspect: the per-token gradient ∂L/∂log π against autograd, a plain loop and finite differences."""

import math

import pytest
import torch
from conftest import algorithm, log_probs, make_batch

import pgloss
from pgloss.diagnostics.inspect import inspect, token_gradients
from pgloss.losses.ppo import clip_factor

# The families with a closed form today; an algorithm added later may have none (closed_form None).
CLOSED = (
    "ppo",
    "dual_clip_ppo",
    "grpo",
    "sample_grpo",
    "gspo",
    "gspo_token",
    "dapo",
    "bnpo",
    "dr_grpo",
    "cispo",
    "sapo",
    "fipo",
    "gpg",
    "tis_pg",
    "topr",
)


def loop_gradient(name, batch, *, clip_low, clip_high, norm_constant=None):
    """∂L/∂log π_{i,t} written from the formulas with Python floats, for the clipped family:
    L = Σ_i (aggregation of ℓ_i,t), ℓ = max(-A·r, -A·clip(r)), at token, sequence or whole-sequence level."""
    lp, old, adv, mask = (batch[k].tolist() for k in ("log_prob", "old_log_prob", "advantages", "mask"))
    lens = [sum(row) for row in mask]
    n_seq = sum(1 for n in lens if n)
    n_tok = sum(lens)
    out = [[0.0] * len(row) for row in mask]

    def slope(r, a):  # d max(-a r, -a clip(r)) / dr, away from ties
        clipped = (a > 0 and r > 1 + clip_high) or (a < 0 and r < 1 - clip_low)
        return 0.0 if clipped else -a

    for i, row in enumerate(mask):
        if not lens[i]:
            continue
        log_ratios = [lp[i][t] - old[i][t] for t in range(len(row)) if row[t]]
        for t, valid in enumerate(row):
            if not valid:
                continue
            if name in ("grpo", "bnpo", "dr_grpo"):
                r = math.exp(lp[i][t] - old[i][t])
                weight = (
                    1 / (n_seq * lens[i])
                    if name == "grpo"
                    else 1 / n_tok
                    if name == "bnpo"
                    else 1 / (n_seq * norm_constant)
                )
                out[i][t] = slope(r, adv[i]) * r * weight
            elif name == "gspo":  # s = exp(mean log r); L_i = ℓ(s)/N_seq; ∂s/∂log π_t = s/|y|
                s = math.exp(sum(log_ratios) / lens[i])
                out[i][t] = slope(s, adv[i]) * s / (lens[i] * n_seq)
            elif name == "sample_grpo":  # ρ = exp(Σ log r); L_i = ℓ(ρ)/N_seq; ∂ρ/∂log π_t = ρ
                rho = math.exp(sum(log_ratios))
                out[i][t] = slope(rho, adv[i]) * rho / n_seq
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("name", ["grpo", "bnpo", "dr_grpo", "gspo", "sample_grpo"])
def test_closed_form_matches_a_plain_loop(name):
    batch = make_batch(6, 9, seed=3, spread=0.25)
    alg = algorithm(name, kl_coef=0.0) if name == "grpo" else algorithm(name)
    if name == "gspo":  # a band wide enough that some sequences are inside and some clipped
        alg = algorithm(name, clip_low=0.05, clip_high=0.05)
    result = inspect(alg, batch["log_prob"], batch["old_log_prob"], batch["advantages"], batch["mask"])
    expected = loop_gradient(
        name, batch, clip_low=alg.clip_low, clip_high=alg.clip_high, norm_constant=alg.norm_constant
    )
    torch.testing.assert_close(result.closed_form, expected, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(result.policy_grad, expected, rtol=1e-10, atol=1e-14)
    valid = expected[batch["mask"]]
    assert (valid == 0).any() and (valid != 0).any()  # both the clipped and the unclipped branch are exercised


@pytest.mark.parametrize("name", pgloss.names())
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_closed_form_equals_autograd_for_every_algorithm(name, per_token_adv):
    batch = make_batch(6, 9, seed=1, spread=0.4, per_token_adv=per_token_adv)
    alg = algorithm(name)
    kwargs = {key: batch[key] for key in alg.needs}  # e.g. TOPR's raw rewards, OPD's teacher
    result = inspect(alg, batch["log_prob"], batch["old_log_prob"], batch["advantages"], batch["mask"], **kwargs)
    assert result.grad.shape == batch["mask"].shape and torch.isfinite(result.grad).all()
    assert (result.grad[~batch["mask"]] == 0).all()
    sequence_level = getattr(alg, "ratio_level", "token") != "token"
    if name in CLOSED and not (per_token_adv and sequence_level):
        assert result.closed_form is not None, result.reason
        torch.testing.assert_close(result.closed_form, result.policy_grad, rtol=1e-9, atol=1e-13)
    elif result.closed_form is None:
        assert result.reason  # says why
    else:
        torch.testing.assert_close(result.closed_form, result.policy_grad, rtol=1e-9, atol=1e-13)
    if per_token_adv and sequence_level and name in CLOSED:
        assert result.closed_form is None and "vary within a sequence" in result.reason


@pytest.mark.parametrize("name", ["grpo", "sample_grpo", "gspo", "dapo", "sapo"])
def test_closed_form_matches_finite_differences(name):
    """The gradient check: central differences of the loss, independent of autograd. (Not CISPO or
    FIPO: their detached weights make the gradient differ from the loss's slope by design.)"""
    batch = make_batch(4, 6, seed=5, spread=0.3)
    alg = algorithm(name, kl_coef=0.0) if name == "grpo" else algorithm(name)
    args = (batch["old_log_prob"], batch["advantages"], batch["mask"])
    closed = inspect(alg, batch["log_prob"], *args).closed_form
    h = 1e-6
    for i, t in batch["mask"].nonzero().tolist():
        up, down = batch["log_prob"].clone(), batch["log_prob"].clone()
        up[i, t] += h
        down[i, t] -= h
        numeric = (float(alg(up, *args).loss) - float(alg(down, *args).loss)) / (2 * h)
        assert math.isclose(numeric, float(closed[i, t]), rel_tol=1e-5, abs_tol=1e-9), (i, t)


def test_ratio_one_is_reinforce_under_each_aggregation():
    """At log π = log π_old every clipped loss gives -Â·w, and the whole-sequence ratio |y_i|·(-Â·w)."""
    batch = make_batch(6, 8, seed=2)
    lp = batch["old_log_prob"]
    lens = batch["mask"].sum(1, keepdim=True).double()
    for name in ("grpo", "bnpo", "dr_grpo", "gspo", "sample_grpo"):
        alg = algorithm(name, kl_coef=0.0) if name == "grpo" else algorithm(name)
        result = inspect(alg, lp, lp, batch["advantages"], batch["mask"])
        expected = -result.advantage * result.weight * (lens if name == "sample_grpo" else 1.0)
        torch.testing.assert_close(result.policy_grad, expected, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(
            result.factor[batch["mask"]],
            (lens.expand_as(lp) if name == "sample_grpo" else torch.ones_like(lp))[batch["mask"]],
        )


def test_aggregation_weights():
    batch = make_batch(6, 8, seed=2)
    mask = batch["mask"]
    lens = mask.sum(1, keepdim=True).double()
    n_seq, n_tok = float((lens > 0).sum()), float(lens.sum())
    expected = {
        "grpo": 1 / (n_seq * lens.clamp(min=1)),
        "bnpo": 1 / n_tok + 0 * lens,
        "dr_grpo": 1 / (n_seq * 9.0) + 0 * lens,
    }
    for name, weight in expected.items():
        result = inspect(
            algorithm(name, kl_coef=0.0) if name == "grpo" else algorithm(name),
            batch["log_prob"],
            batch["old_log_prob"],
            batch["advantages"],
            mask,
        )
        torch.testing.assert_close(result.weight, torch.where(mask, weight.expand_as(result.weight), 0.0))


def test_clipped_tokens_get_exactly_zero_and_cispo_does_not():
    old = torch.full((1, 3), -1.0, dtype=torch.float64)
    lp = old + torch.tensor([[math.log(2.0), 0.0, math.log(0.5)]], dtype=torch.float64)
    mask = torch.ones_like(lp, dtype=torch.bool)
    pos, neg = torch.tensor([1.0], dtype=torch.float64), torch.tensor([-1.0], dtype=torch.float64)
    ppo = inspect(algorithm("ppo"), lp, old, pos, mask)
    assert ppo.grad[0, 0] == 0 and ppo.factor[0, 0] == 0  # A > 0, r = 2 > 1.2
    assert ppo.grad[0, 1] == pytest.approx(-1 / 3) and ppo.grad[0, 2] == pytest.approx(-0.5 / 3)
    low = inspect(algorithm("ppo"), lp, old, neg, mask)
    assert low.grad[0, 2] == 0 and low.grad[0, 0] == pytest.approx(2 / 3)  # A < 0, r = 0.5 < 0.8 clipped
    dual = inspect(
        algorithm("dual_clip_ppo"),
        torch.zeros(1, 1, dtype=torch.float64),
        torch.full((1, 1), -math.log(5.0), dtype=torch.float64),
        neg,
        torch.ones(1, 1, dtype=torch.bool),
    )
    assert dual.grad[0, 0] == 0 and dual.factor[0, 0] == 0  # r = 5 > c = 3: the dual clip holds the loss
    cispo = inspect(algorithm("cispo"), lp, old, pos, mask)
    torch.testing.assert_close(cispo.grad, torch.tensor([[-2.0, -1.0, -0.5]], dtype=torch.float64) / 3)


def test_clip_factor_ties_split_like_autograd():
    ratio = torch.tensor([[0.8, 1.0, 1.2, 1.5]], dtype=torch.float64)
    b = clip_factor(ratio, torch.tensor([[1.0, 1.0, 1.0, 1.0]], dtype=torch.float64), clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(b, torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64))


def test_masked_positions_and_nan_padding():
    batch = make_batch(5, 7, seed=4)
    mask = batch["mask"]
    lp = batch["log_prob"].masked_fill(~mask, float("nan"))
    old = batch["old_log_prob"].masked_fill(~mask, float("inf"))
    result = inspect(algorithm("dapo"), lp, old, batch["advantages"], mask)
    for values in (result.grad, result.closed_form, result.weight):
        assert torch.isfinite(values).all() and (values[~mask] == 0).all()


def test_kl_term_is_in_grad_not_in_the_closed_form():
    batch = make_batch(5, 7, seed=6)
    alg = algorithm("grpo")  # kl_coef 0.04
    result = inspect(
        alg,
        batch["log_prob"],
        batch["old_log_prob"],
        batch["advantages"],
        batch["mask"],
        ref_log_prob=batch["ref_log_prob"],
    )
    torch.testing.assert_close(result.closed_form, result.policy_grad)
    assert (result.grad - result.policy_grad).abs().max() > 1e-4


def test_normalizer_and_rollout_correction():
    """A micro-batch's gradient with the step's Normalizer, and truncated importance sampling."""
    batch = make_batch(6, 8, seed=7)
    normalizer = pgloss.Normalizer.count([batch["mask"], batch["mask"][:2]])
    rollout = log_probs(
        batch["old_log_prob"]
        + 0.5
        * torch.randn(batch["old_log_prob"].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    )
    for name in ("bnpo", "gspo", "gspo_token", "sample_grpo", "sapo"):
        result = inspect(
            algorithm(name),
            batch["log_prob"],
            batch["old_log_prob"],
            batch["advantages"],
            batch["mask"],
            normalizer=normalizer,
            rollout_log_prob=rollout,
        )
        torch.testing.assert_close(result.closed_form, result.policy_grad, rtol=1e-9, atol=1e-13)


@pytest.mark.parametrize(
    "correction",
    [
        dict(weight_level="sequence_geometric", weight_mode="mask", lower=0.7, upper=1.4),
        dict(weight_level="token", upper=1.5, rejection=(pgloss.Rejection("token_k3", upper=0.08),)),
        dict(weight_level="token", upper=2.0, bypass=True),
    ],
)
def test_closed_form_follows_a_configured_rollout_correction(correction):
    """The closed form takes the call's own correction: its weight, its rejections and, in bypass
    mode, its old log-probs."""
    batch = make_batch(6, 8, seed=9)
    rollout = log_probs(
        batch["old_log_prob"]
        + 0.3
        * torch.randn(batch["old_log_prob"].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    )
    for name in ("dapo", "gspo", "cispo"):
        alg = algorithm(name, rollout_correction=pgloss.RolloutCorrection(**correction))
        result = inspect(
            alg, batch["log_prob"], batch["old_log_prob"], batch["advantages"], batch["mask"], rollout_log_prob=rollout
        )
        torch.testing.assert_close(result.closed_form, result.policy_grad, rtol=1e-9, atol=1e-13)


def test_token_gradients_is_autograd_of_the_loss():
    batch = make_batch(5, 7, seed=8)
    alg = algorithm("dapo")
    leaf = batch["log_prob"].clone().requires_grad_(True)
    alg(leaf, batch["old_log_prob"], batch["advantages"], batch["mask"]).loss.backward()
    got = token_gradients(alg, batch["log_prob"], batch["old_log_prob"], batch["advantages"], batch["mask"])
    torch.testing.assert_close(got, leaf.grad)


def test_bad_input():
    batch = make_batch(3, 4)
    args = (batch["log_prob"], batch["old_log_prob"], batch["advantages"], batch["mask"])
    with pytest.raises(TypeError, match="algorithm must be a pgloss Algorithm"):
        inspect("grpo", *args)
    with pytest.raises(TypeError, match="log_prob must be a tensor"):
        token_gradients(algorithm("dapo"), [[0.0]], *args[1:])
    with pytest.raises(ValueError, match="mask"):
        inspect(algorithm("dapo"), args[0], args[1], args[2], args[3][:, :2])


def test_group_mean_token_mean_weights():
    """w = 1/(N_grp·n_g): each prompt's tokens share its group's weight."""
    batch = make_batch(6, 8, seed=9)
    alg = algorithm("bnpo", loss_agg_mode="group-mean-token-mean")
    result = inspect(
        alg, batch["log_prob"], batch["old_log_prob"], batch["advantages"], batch["mask"], group_ids=batch["group_ids"]
    )
    mask, ids = batch["mask"], batch["group_ids"]
    tokens = {int(g): float(mask[ids == g].sum()) for g in ids.unique()}
    groups = sum(1 for n in tokens.values() if n > 0)
    expected = torch.tensor([[1 / (groups * tokens[int(g)])] for g in ids], dtype=torch.float64) * mask
    torch.testing.assert_close(result.weight, expected)
    torch.testing.assert_close(result.closed_form, result.policy_grad, rtol=1e-9, atol=1e-13)


def cov_batch():
    batch = make_batch(6, 8, seed=11, spread=0.3, per_token_adv=True)
    batch["advantages"] = 2 * batch["advantages"]  # covariances of order one: candidates inside (lb, ub)
    return batch


@pytest.mark.parametrize("seeded", [True, False])
def test_clip_cov_draws_once_and_leaves_the_generator_as_it_found_it(seeded):
    """grad, policy_grad and the closed form share one draw, the one the next training call makes;
    the algorithm's generator (or torch's global one) is where it was."""
    batch = cov_batch()
    args = (batch["log_prob"], batch["old_log_prob"], batch["advantages"], batch["mask"])
    generator = torch.Generator().manual_seed(5) if seeded else None
    alg = algorithm(
        "clip_cov", clip_cov_ratio=0.2, clip_cov_lb=0.05, generator=generator, entropy_coef=0.01
    )  # with an entropy term: grad and policy_grad are two loss calls
    torch.manual_seed(123)
    before = generator.get_state() if seeded else torch.get_rng_state()
    result = inspect(alg, *args, entropy=batch["entropy"])
    after = generator.get_state() if seeded else torch.get_rng_state()
    assert torch.equal(before, after)
    torch.testing.assert_close(result.grad, result.policy_grad, rtol=0, atol=0)  # the entropy adds nothing on log π(y)
    torch.testing.assert_close(result.closed_form, result.policy_grad, rtol=1e-12, atol=1e-15)
    leaf = batch["log_prob"].clone().requires_grad_()
    training = alg(leaf, *args[1:], entropy=batch["entropy"])  # the next training call draws what inspect showed
    training.loss.backward()
    torch.testing.assert_close(leaf.grad, result.grad, rtol=0, atol=0)
    picked = batch["mask"] & (result.factor == 0) & (result.grad == 0)
    assert training.metrics["clip_cov_fraction"] > 0 and picked.sum() >= int(0.2 * batch["mask"].sum())
    assert not (generator.get_state() if seeded else torch.get_rng_state()).equal(before)  # training did draw


def test_kl_estimator_full_can_be_inspected():
    batch = make_batch(4, 5, seed=12)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 5, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    ref_logits = torch.randn(4, 5, 7, generator=gen, dtype=torch.float64)
    full_kl = pgloss.full_kl_from_logits(logits, ref_logits)
    alg = algorithm("grpo", kl_estimator="full", kl_coef=0.1)
    args = (batch["log_prob"], batch["old_log_prob"], batch["advantages"], batch["mask"])
    with pytest.raises(ValueError, match="needs full_kl"):
        inspect(alg, *args)
    result = inspect(alg, *args, full_kl=full_kl)
    # The exact KL is a function of the logits, not of log π(y_t): it adds nothing to g.
    torch.testing.assert_close(result.grad, result.policy_grad, rtol=0, atol=0)
    torch.testing.assert_close(result.closed_form, result.policy_grad, rtol=1e-10, atol=1e-14)
    assert logits.grad is None and full_kl.requires_grad  # the caller's graph is left alone
    full_kl.sum().backward()
    assert logits.grad is not None


@pytest.mark.parametrize(
    "name, closed",
    [
        ("luspo", True),
        ("dppo_tv", True),
        ("dppo_kl", True),
        ("vespo", True),
        ("clip_cov", True),
        ("gmpo", False),
        ("kl_cov", False),
        ("real", False),
    ],
)
def test_each_family_owns_its_closed_form(name, closed):
    """inspect reads the family's own `gradient_factor`; a family without one says so."""
    batch = cov_batch() if name == "clip_cov" else make_batch(6, 8, seed=13, spread=0.3)
    alg = algorithm(name, clip_cov_lb=0.05, clip_cov_ratio=0.2) if name == "clip_cov" else algorithm(name)
    kwargs = {"group_ids": batch["group_ids"]} if "group_ids" in alg.needs else {}
    if name == "vespo":
        kwargs["rollout_log_prob"] = batch["old_log_prob"] + 0.05
    result = inspect(alg, batch["log_prob"], batch["old_log_prob"], batch["advantages"], batch["mask"], **kwargs)
    assert hasattr(type(alg), "gradient_factor") == closed
    if closed:
        torch.testing.assert_close(result.closed_form, result.policy_grad, rtol=1e-10, atol=1e-14)
    else:
        assert result.closed_form is None and "no closed form for the" in result.reason
