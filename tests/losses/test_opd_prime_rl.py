"""`opd` against prime-rl's on-policy distillation (PrimeIntellect-ai/prime-rl, commit 559b44772, read from its
source through PGLOSS_PRIME_RL_SRC, the root of a checkout).

prime-rl's `opd` and `opsd` algorithms (src/prime_rl/orchestrator/algo/opd.py, opsd.py) assign no advantage: they
store the teacher's log-probs of each sample's tokens (`ref_logprobs`) and route the sampled tokens to the trainer's
`ref_kl` loss (src/prime_rl/trainer/rl/loss.py `ref_kl_loss_fn`, a sum per sample that `compute_loss` divides by
the step's count of ref_kl tokens: a token mean). With π_inf the inference engine's (sampling) policy:

    ℓ_t = −keep_t·r_t·sg[log π_T − log π_θ] + 10⁻³·(log r_t)²,   r_t = π_θ/π_inf,   keep_t = [π_θ − π_inf ≥ −0.2]

pgloss's `opd` (λ = 1, Â = 0, token-mean, old_log_prob = π_inf's log-probs) has ℓ_t = −r_t·(log π_T − log π_inf).
Measured (float64, make_batch 6 × 7):

- on-policy (π_θ = π_inf): the step's loss within 1.4e-17 (the order of the sums), its gradient identical, 4 seeds;
- off-policy, three conventions and nothing else: ℓ_prime = keep·(ℓ_opd + r·log r) + 10⁻³·(log r)² within 2.2e-16
  per token, and ∂ℓ_prime/∂log π_θ = keep·(∂ℓ_opd + r·log r) + 2·10⁻³·log r, 4 seeds. (1) prime-rl's advantage
  reads the current policy's log π_θ, pgloss's the sampling policy's: r·log r per token, up to 0.470 on seed 0
  (|log r| up to 0.94); (2) a one-sided trust region drops the policy term where π_θ fell more than 0.2 below
  π_inf: 1 token of 15 on seed 0, whose opd term is −0.121; (3) the (log r)² regulariser, pgloss's k2 KL term to
  π_inf with kl_coef = 2·10⁻³: at most 8.9e-4 per token. On seed 0 the step's loss is 0.0356 apart: 0.0274 from (1),
  0.0081 from (2), 0.0001 from (3); its gradient up to 0.031.
- with the three as opd's options (`PRIME_RL`: opd_advantage_policy="current", opd_trust_region=0.2, kl_coef=2·10⁻³,
  kl_estimator="k2", ref_log_prob = π_inf's log-probs): the step's loss within 3.5e-18, its gradient identical, 4 seeds.

opsd (self-distillation, SDFT arXiv 2601.19897) is `opd` whose teacher is the policy itself, as the inference pool
serves it when the sample is scored, with the expert demonstration prepended as a system message:
teacher_log_prob_t = log π_inf(y_t | demo ⊕ x ⊕ y_<t) (its `score_episode` run below on a two-turn trace with a
small policy: the same values, and then the same loss).
"""

import asyncio
from types import SimpleNamespace

import pytest
import torch
from advantages.trainer_sources import load, prime_rl, source_file
from conftest import make_batch

import pgloss

LOSS = "src/prime_rl/trainer/rl/loss.py"
F64 = dict(dtype=torch.float64)


def ref_kl_loss():
    """loss.py's `ref_kl_loss_fn` and `compute_loss`, with the functions they call."""
    ns = dict(torch=torch, LossInputs=SimpleNamespace, LossOutputs=SimpleNamespace)
    return load(
        source_file("PGLOSS_PRIME_RL_SRC", LOSS),
        ("_safe_mean", "compute_importance_ratio_and_mismatch_kl", "ref_kl_loss_fn", "compute_loss"),
        ns,
    )


def prime_rl_step(ns, log_prob, inference, teacher, mask):
    """The step's loss over rows of ref_kl samples: rl weights 0, ref_kl weights 1 on the sampled tokens."""
    rows, zeros = (lambda x: list(x.unbind(0))), torch.zeros_like(inference)
    loss, _ = ns["compute_loss"](
        rows(log_prob),
        rows(inference),
        rows(teacher),
        rows(zeros),
        rows(mask),
        rows(zeros),
        None,
        rows(mask.to(inference.dtype)),
        None,
        1,
        1,
        int(mask.sum()),
    )
    return loss


def prime_rl_per_token(ns, log_prob, inference, teacher, mask):
    """ℓ_t of `ref_kl_loss_fn`, one call per token (it returns a sum over the sample)."""
    out = torch.zeros_like(inference)
    for i, t in mask.nonzero().tolist():
        one = slice(t, t + 1)
        out[i, t] = ns["ref_kl_loss_fn"](
            SimpleNamespace(
                trainer_logprobs=log_prob[i, one],
                inference_logprobs=inference[i, one],
                ref_logprobs=teacher[i, one],
                loss_mask=torch.ones(1, dtype=torch.bool),
                loss_weights=None,
            )
        ).loss
    return out


def opd(log_prob, inference, teacher, mask):
    return pgloss.get("opd")(log_prob, inference, torch.zeros(log_prob.shape[0], **F64), mask, teacher_log_prob=teacher)


def both(log_prob, inference, teacher, mask):
    """(prime-rl's step loss, its gradient, opd's loss, its gradient) with respect to log π_θ."""
    ns = ref_kl_loss()
    theirs, ours = log_prob.clone().requires_grad_(), log_prob.clone().requires_grad_()
    loss_theirs = prime_rl_step(ns, theirs, inference, teacher, mask)
    loss_ours = opd(ours, inference, teacher, mask).loss
    loss_theirs.backward()
    loss_ours.backward()
    return loss_theirs, theirs.grad, loss_ours, ours.grad


@pytest.mark.parametrize("seed", range(4))
def test_on_policy_prime_rl_is_opd(seed):
    data = make_batch(batch=6, length=7, seed=seed)
    inference, teacher, mask = data["old_log_prob"], data["teacher_log_prob"], data["mask"]
    loss_theirs, grad_theirs, loss_ours, grad_ours = both(inference, inference, teacher, mask)
    torch.testing.assert_close(loss_theirs, loss_ours, rtol=0, atol=3e-17)
    assert torch.equal(grad_theirs, grad_ours)


def conventions(data):
    """r, log r and prime-rl's trust-region keep on the batch's current and sampling log-probs."""
    log_prob, inference = data["log_prob"], data["old_log_prob"]
    log_r = log_prob - inference
    return log_r.exp(), log_r, ~(log_prob.exp() - inference.exp() < -0.2)


@pytest.mark.parametrize("seed", range(4))
def test_off_policy_prime_rl_is_opd_with_three_conventions(seed):
    data = make_batch(batch=6, length=7, seed=seed)
    log_prob, inference, teacher, mask = (data[k] for k in ("log_prob", "old_log_prob", "teacher_log_prob", "mask"))
    r, log_r, keep = conventions(data)
    theirs = prime_rl_per_token(ref_kl_loss(), log_prob, inference, teacher, mask)
    ours = opd(log_prob, inference, teacher, mask).per_token
    expected = keep * (ours + r * log_r) + 1e-3 * log_r.square()
    torch.testing.assert_close(theirs[mask], expected[mask], rtol=0, atol=2e-16)
    _, grad_theirs, _, grad_ours = both(log_prob, inference, teacher, mask)
    tokens = mask.sum()
    expected_grad = torch.where(mask, keep * (grad_ours + r * log_r / tokens) + 2e-3 * log_r / tokens, 0.0)
    torch.testing.assert_close(grad_theirs, expected_grad, rtol=0, atol=1e-16)


PRIME_RL = dict(opd_advantage_policy="current", opd_trust_region=0.2, kl_coef=2e-3, kl_estimator="k2")
"""prime-rl's three conventions as opd's options; the k2 term's reference is the inference log-probs."""


@pytest.mark.parametrize("seed", range(4))
def test_off_policy_prime_rl_is_opd_with_its_options(seed):
    data = make_batch(batch=6, length=7, seed=seed)
    log_prob, inference, teacher, mask = (data[k] for k in ("log_prob", "old_log_prob", "teacher_log_prob", "mask"))
    loss_theirs = prime_rl_step(ref_kl_loss(), theirs := log_prob.clone().requires_grad_(), inference, teacher, mask)
    ours = log_prob.clone().requires_grad_()
    loss_ours = pgloss.get("opd", **PRIME_RL)(
        ours, inference, torch.zeros(6, **F64), mask, teacher_log_prob=teacher, ref_log_prob=inference
    ).loss
    (loss_theirs + loss_ours).backward()
    torch.testing.assert_close(loss_ours, loss_theirs, rtol=0, atol=3e-17)
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=0, atol=3e-17)


def test_the_size_of_each_convention():
    """Seed 0: the step's loss difference and each convention's part of it (the docstring's figures)."""
    data = make_batch(batch=6, length=7, seed=0)
    log_prob, inference, teacher, mask = (data[k] for k in ("log_prob", "old_log_prob", "teacher_log_prob", "mask"))
    r, log_r, keep = conventions(data)
    ours = opd(log_prob, inference, teacher, mask).per_token
    tokens, kept, dropped = mask.sum(), mask & keep, mask & ~keep
    assert (tokens.item(), dropped.sum().item()) == (15, 1)
    assert (r * log_r)[kept].abs().max().item() == pytest.approx(0.47020, abs=1e-5)
    assert ours[dropped].item() == pytest.approx(-0.12119, abs=1e-5)
    assert (1e-3 * log_r.square())[mask].max().item() == pytest.approx(8.9036e-4, abs=1e-8)
    parts = torch.stack([(r * log_r)[kept].sum(), -ours[dropped].sum(), 1e-3 * log_r.square()[mask].sum()]) / tokens
    assert parts.tolist() == pytest.approx([0.027391, 0.008079, 0.000111], abs=1e-6)
    with_k2 = pgloss.get("opd", kl_coef=2e-3, kl_estimator="k2")(
        log_prob, inference, torch.zeros(6, **F64), mask, teacher_log_prob=teacher, ref_log_prob=inference
    ).loss
    assert (with_k2 - opd(log_prob, inference, teacher, mask).loss).item() == pytest.approx(parts[2].item(), abs=1e-16)
    loss_theirs, grad_theirs, loss_ours, grad_ours = both(log_prob, inference, teacher, mask)
    assert (loss_theirs - loss_ours).item() == pytest.approx(parts.sum().item(), abs=1e-15)
    assert (grad_theirs - grad_ours).abs().max().item() == pytest.approx(0.031391, abs=1e-6)


# -- opsd: the policy as its own teacher, under the demonstration ----------------------------------------------------

VOCAB = 11
TEMPLATE = "Here is an example of an expert response:\n<demonstration>\n{demonstration}\n</demonstration>"


def small_policy(seed):
    """log π(x_t | x_<t) of a small autoregressive policy (the last token and the mean of the prefix): the
    inference engine's prefill scores, 0 at the first position, which has no context."""
    gen = torch.Generator().manual_seed(seed)
    last, prefix = (torch.randn(VOCAB, VOCAB, generator=gen, **F64) for _ in range(2))

    def score(ids):
        logits = [last[ids[t - 1]] + prefix[ids[:t]].mean(0) for t in range(1, len(ids))]
        return [0.0] + [torch.log_softmax(z, -1)[i].item() for z, i in zip(logits, ids[1:], strict=True)]

    return score


def node(ids, mask, sampled):
    return SimpleNamespace(token_ids=ids, mask=mask, sampled=sampled, reference_logprobs=None)


def test_opsd_is_opd_with_the_policy_under_the_demonstration_as_teacher():
    ns = prime_rl(("OPSDAlgorithm", "opsd.py"))
    score = small_policy(5)

    async def prefill(ids):
        return score(ids)

    # prompt, a completion (its last token not trained), a tool's output, a second completion
    nodes = [
        node([1, 4, 2], [False] * 3, False),
        node([7, 3, 9, 0], [True, True, True, False], True),
        node([5, 5], [False] * 2, False),
        node([8, 2, 6], [True] * 3, True),
    ]
    branch = SimpleNamespace(nodes=nodes, token_ids=[i for n in nodes for i in n.token_ids])
    trace = SimpleNamespace(
        has_error=False,
        agent=SimpleNamespace(trainable=True),
        nodes=nodes,
        branches=[branch],
        info={"demonstration": "reverse: 3 9 7"},
    )
    algo = ns["OPSDAlgorithm"](
        SimpleNamespace(demo_key="demonstration", template=TEMPLATE, renderer=None), SimpleNamespace(score=prefill)
    )
    algo.renderer = SimpleNamespace(
        render_ids=lambda messages, add_generation_prompt: [
            ord(c) % VOCAB for m in messages for c in m["role"] + m["content"]
        ]
    )
    asyncio.run(algo.score_episode(SimpleNamespace(traces=[trace])))

    sampled = torch.tensor([m for n in nodes for m in n.mask])
    hint = algo.renderer.render_ids(
        [{"role": "system", "content": TEMPLATE.format(demonstration="reverse: 3 9 7")}], add_generation_prompt=False
    )
    teacher = torch.tensor(score(hint + branch.token_ids)[len(hint) :], **F64)[sampled][None]
    stored = torch.tensor([v for n in nodes if n.reference_logprobs for v in n.reference_logprobs], **F64)[None]
    assert torch.equal(stored, teacher)

    inference = torch.tensor(score(branch.token_ids), **F64)[sampled][None]
    mask = torch.ones_like(inference, dtype=torch.bool)
    loss_theirs, grad_theirs, loss_ours, grad_ours = both(inference, inference, stored, mask)
    torch.testing.assert_close(loss_theirs, loss_ours, rtol=0, atol=1e-16)
    assert torch.equal(grad_theirs, grad_ours)
