"""A rollout correction's rejections narrow the call's one effective mask for every term of the loss: the policy
term, the KL term, the entropy bonus and VAPO's NLL. With a KL-based rejection counted before the step (verl's
`rollout_rs`), the call is the call without a correction on the tokens the rejection keeps, for every
registered name: loss, metrics and gradients (∂/∂log_prob, ∂/∂entropy).

(Before `TokenBatch.restricted`: the entropy bonus summed the rejected tokens' entropy over the kept tokens'
count, while its metric, the KL and the policy term left them out.)"""

import loops
import pytest
import torch
from properties.call_inputs import ROWS, WIDTH, call_with_gradients, finite_inputs

import pgloss
from pgloss.correction.rejection import Rejection
from pgloss.correction.rollout import RolloutCorrection

REJECTION = RolloutCorrection(weight_level=None, rejection=(Rejection("token_k3", upper=0.01),))
TERMS = dict(kl_coef=0.1, entropy_coef=0.05, positive_nll_coef=0.1)


def inputs(seed=4):
    mask = torch.rand(ROWS, WIDTH, generator=torch.Generator().manual_seed(seed)) < 0.8
    values = finite_inputs(seed, mask, False, torch.float64)
    kept = REJECTION.keep_mask(mask, values["old_log_prob"], values["rollout_log_prob"])
    assert 0 < int(kept.sum()) < int(mask.sum())  # some tokens rejected, some kept
    return values, kept


@pytest.mark.parametrize(
    "name", [n for n in pgloss.names() if pgloss.get(n, generation_budget=WIDTH).takes_rollout_correction()]
)
def test_rejected_tokens_leave_every_term(name):
    values, kept = inputs()
    corrected = pgloss.get(name, generation_budget=WIDTH, rollout_correction=REJECTION, **TERMS)
    plain = pgloss.get(name, generation_budget=WIDTH, **TERMS)
    out, grads = call_with_gradients(corrected, values, step=True)
    expected, expected_grads = call_with_gradients(plain, values | {"mask": kept, "rollout_log_prob": None}, step=True)
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-12, atol=1e-15)
    for key, value in expected.metrics.items():
        torch.testing.assert_close(
            out.metrics[key], value, rtol=1e-12, atol=1e-15, equal_nan=True, msg=lambda m, key=key: f"metric {key}: {m}"
        )
    for key, grad in expected_grads.items():
        torch.testing.assert_close(grads[key], grad, rtol=1e-12, atol=1e-15, msg=lambda m, key=key: f"∂/∂{key}: {m}")
        assert (grads[key][values["mask"] & ~kept] == 0).all(), key


def test_the_entropy_bonus_is_the_loops_over_the_kept_tokens():
    """DAPO with an entropy bonus under the rejection: loss = policy term − c · (Σ_kept H) / N_kept, the loop's."""
    values, kept = inputs()
    algorithm = pgloss.get("dapo", rollout_correction=REJECTION, entropy_coef=0.05)
    out, grads = call_with_gradients(algorithm, values, step=False)
    entropy = loops.aggregate(values["entropy"].tolist(), kept.tolist(), "token-mean")
    assert (out.loss - out.metrics["pg_loss"]).item() == pytest.approx(-0.05 * entropy, rel=1e-12)
    torch.testing.assert_close(grads["entropy"], -0.05 * kept.double() / kept.sum(), rtol=1e-12, atol=0)
