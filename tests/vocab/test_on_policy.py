"""On-policy calls, `old_log_prob=None`: log π_old is the detached log π of the same pass (`TokenBatch.prepare`).

`from_hidden(..., old_log_prob=None)` must give what a trainer got from a second, no-grad pass over the head
(`log_prob_and_entropy_from_hidden`) passed as `old_log_prob`: loss, per-token values, metrics and gradients, on
both of the loss's routes (one pass, recompute), both vocabulary-loop routes (torch, kernel), for a token-level
loss with a KL and an entropy bonus, a sequence-level one (GSPO), a row-coupled one (Clip-Cov) and a rollout
correction whose rejection and batch normalisation read log π_old; with and without the step's `Normalizer`.
The plain call's `old_log_prob=None` equals `old_log_prob=log_prob.detach()` the same way.
"""

import pytest
import torch

import pgloss
from pgloss.vocab import kernels

B, T, H, V = 3, 5, 8, 37
TAU = 0.7
MASK = torch.arange(T)[None, :] < torch.tensor([5, 3, 2])[:, None]
# T = 5: chunks of 11 tokens hold two whole rows (the one-pass route); chunks of 4 recompute in backward.
ROUTES = {"one pass": 11, "recompute": 4}
CORRECTION = pgloss.RolloutCorrection(
    upper=1.2, rejection=(pgloss.Rejection("seq_mean_k3", upper=0.05),), batch_normalize=True
)
ALGORITHMS = {
    "grpo": pgloss.get("grpo", kl_coef=0.05, entropy_coef=0.01),  # token level, k3 KL (reads π_old), entropy
    "gspo": pgloss.get("gspo"),  # the sequence's geometric-mean ratio
    "clip_cov": pgloss.get("clip_cov"),  # couples the rows of the call: always the recompute route
    "grpo+correction": pgloss.get("grpo", kl_coef=0.0, rollout_correction=CORRECTION),
}


def make(seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: (scale * torch.randn(*s, generator=gen, dtype=torch.float64)).to(dtype)  # noqa: E731
    hidden, weight = r(B, T, H), r(V, H, scale=0.7)
    targets = torch.randint(0, V, (B, T), generator=gen).masked_fill(~MASK, -100)
    with torch.no_grad():  # π_old = π: the second pass a trainer ran before, its values passed as old_log_prob
        current, _ = pgloss.log_prob_and_entropy_from_hidden(hidden, weight, targets, temperature=TAU, mask=MASK)
    return dict(
        hidden=hidden,
        weight=weight,
        targets=targets,
        mask=MASK,
        current=current,
        advantages=r(B),
        ref_log_prob=(current + 0.2 * r(B, T)).masked_fill(~MASK, 0.0),
        # rows ever farther from π: the correction's weights clip and its rejection drops a sequence, not all
        rollout_log_prob=(current + torch.tensor([[0.05], [0.2], [0.6]]) * r(B, T)).masked_fill(~MASK, 0.0),
    )


def inputs_of(algorithm, x):
    """The call's inputs but the log-probs of the policy: those the configuration reads."""
    needs = {"ref_log_prob"} if algorithm.kl_coef != 0 else set()
    if algorithm.rollout_correction is not None:
        needs.add("rollout_log_prob")
    return dict(advantages=x["advantages"], mask=x["mask"], **{name: x[name] for name in needs})


def step_normalizer(algorithm, x):
    """The step's counts as a trainer counts them, before the loss: on the separate pass's log π_old."""
    extra = {}
    if algorithm.rollout_correction is not None:
        extra = dict(old_log_probs=x["current"], rollout_log_probs=x["rollout_log_prob"])
    return algorithm.step_normalizer(x["mask"], **extra)


def run(algorithm, x, old_log_prob, chunk_size, normalizer):
    h, w = x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()
    torch.manual_seed(0)  # Clip-Cov's random draw among its candidates: the same in both runs
    out = algorithm.from_hidden(
        h,
        w,
        x["targets"],
        old_log_prob=old_log_prob,
        temperature=TAU,
        chunk_size=chunk_size,
        normalizer=normalizer,
        **inputs_of(algorithm, x),
    )
    out.loss.backward()
    return [out.loss, out.per_token.detach(), *out.metrics.values(), h.grad, w.grad], list(out.metrics)


def assert_same(got, expected, atol):
    (got, got_names), (expected, expected_names) = got, expected
    assert got_names == expected_names
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=atol, equal_nan=True)  # NaN: a metric over no token


@pytest.mark.parametrize("counted", [False, True], ids=["no normalizer", "step normalizer"])
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", ALGORITHMS)
def test_from_hidden_on_policy_equals_the_separate_pass(name, route, counted):
    algorithm, x = ALGORITHMS[name], make(seed=1)
    normalizer = step_normalizer(algorithm, x) if counted else None
    got = run(algorithm, x, None, ROUTES[route], normalizer)
    expected = run(algorithm, x, x["current"], ROUTES[route], normalizer)
    # measured worst case over the cases: 4.4e-16 (the same log π, formed in other chunks)
    assert_same(got, expected, atol=1e-13)
    values, names = got
    metrics = dict(zip(names, values[2:-2], strict=True))
    assert values[-1].abs().max() > 1e-3  # the head has a gradient
    if "ratio_min" in metrics:  # on-policy: every ratio exactly 1
        assert metrics["ratio_min"] == metrics["ratio_max"] == 1.0
    if name == "grpo+correction":  # the correction's counts read π_old: one sequence rejected of three
        assert metrics["rollout_rejected_frac"] == 0.2  # its 2 tokens of 10


@pytest.mark.parametrize("route", ROUTES)
def test_from_hidden_on_policy_on_the_kernel_route(route):
    """The kernel route (Triton; its interpreter on CPU), float32: the same as the separate pass on that route."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = {k: v.to(device, torch.float32) if v.is_floating_point() else v.to(device) for k, v in make(seed=2).items()}
    algorithm = ALGORITHMS["grpo"]
    with kernels.use("kernel"):
        with torch.no_grad():  # the separate pass on this route
            x["current"], _ = pgloss.log_prob_and_entropy_from_hidden(
                x["hidden"], x["weight"], x["targets"], temperature=TAU, mask=x["mask"]
            )
        got = run(algorithm, x, None, ROUTES[route], None)
        expected = run(algorithm, x, x["current"], ROUTES[route], None)
    assert_same(got, expected, atol=1e-6)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_the_plain_call_on_policy_equals_the_detached_log_prob(name):
    algorithm, x = ALGORITHMS[name], make(seed=3)
    results = []
    for old in (None, "detached"):
        log_prob = x["current"].clone().requires_grad_()
        torch.manual_seed(0)
        out = algorithm(
            log_prob=log_prob,
            old_log_prob=log_prob.detach() if old else None,
            entropy=-log_prob.detach(),  # any [B, T] entropy, for grpo's bonus
            **inputs_of(algorithm, x),
        )
        out.loss.backward()
        results.append(([out.loss, out.per_token.detach(), *out.metrics.values(), log_prob.grad], list(out.metrics)))
    assert_same(*results, atol=0.0)  # one rule, one computation: bit for bit
    assert results[0][0][-1].abs().max() > 0
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'old_log_prob'"):
        algorithm(x["current"], advantages=x["advantages"], mask=x["mask"])  # None is asked for, never a default
