"""One float64 optimizer step from hidden states, built for any registered name with every input its
configuration `needs`, and the helpers the shared properties use to call it whole, in micro-batches
and on ranks. A new family gets these properties by being registered."""

import pytest
import torch

import pgloss
from pgloss.correction.rejection import Rejection
from pgloss.correction.rollout import RolloutCorrection

# verl's rollout_rs="token_k1,seq_mean_k3,seq_max_k2" with rollout_rs_threshold="1.5,0.03,0.3": a sequence rule
# after a token rule, each reading the original mask (on `data()` the chain keeps 26 of 32 tokens; a sequence
# rule fed the token rule's output would keep 30)
CHAINED = (Rejection("token_k1", upper=1.5), Rejection("seq_mean_k3", upper=0.03), Rejection("seq_max_k2", upper=0.3))
VERL_CHAINED = dict(rollout_rs="token_k1,seq_mean_k3,seq_max_k2", rollout_rs_threshold="1.5,0.03,0.3")
CORRECTIONS = {
    "none": None,
    "token TIS": RolloutCorrection(upper=1.2),
    "k3 rejection": RolloutCorrection(rejection=(Rejection("token_k3", upper=0.02),)),
    "chained rejection": RolloutCorrection(weight_level=None, rejection=CHAINED),
    "batch-normalised": RolloutCorrection(upper=1.5, batch_normalize=True),
    "off-policy mask": RolloutCorrection(weight_level=None, off_policy_mask=0.05),
}
PARTS = [slice(0, 2), slice(2, 4), slice(4, 8)]  # uneven micro-batches holding whole groups
ROWS, WIDTH, HIDDEN, VOCAB = 8, 6, 5, 11


def cases():
    return list(_cases())


def _cases():
    for name in pgloss.names():
        for kind, correction in CORRECTIONS.items():
            if correction is not None and pgloss.get(name, generation_budget=WIDTH).consumes_rollout_log_prob:
                continue  # VESPO weighs by the rollout log-probs itself and takes no correction
            yield pytest.param(name, kind, id=f"{name}-{kind}")


def build(name, kind):
    return pgloss.get(name, generation_budget=WIDTH, rollout_correction=CORRECTIONS[kind])


def data(seed=0):
    """A float64 step from hidden states: every log-prob is a real model's, uneven lengths, one empty row."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, WIDTH, HIDDEN, generator=g, dtype=torch.float64)
    weight = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    targets = torch.randint(0, VOCAB, (ROWS, WIDTH), generator=g)
    lengths = torch.randint(1, WIDTH + 1, (ROWS,), generator=g)
    lengths[3] = 0
    mask = torch.arange(WIDTH)[None, :] < lengths[:, None]
    log_prob = log_probs(hidden, weight, targets)
    noise = lambda scale: scale * torch.randn(ROWS, WIDTH, generator=g, dtype=torch.float64)  # noqa: E731
    old = (log_prob + noise(0.1)).detach().clamp(max=-1e-3)
    inputs = dict(
        old_log_prob=old,
        advantages=torch.randn(ROWS, generator=g, dtype=torch.float64),
        mask=mask,
        ref_log_prob=(old + noise(0.2)).clamp(max=-1e-3),
        rollout_log_prob=(old + noise(0.2)).clamp(max=-1e-3),
        group_ids=torch.arange(ROWS) // 2,
        scores=torch.randn(ROWS, generator=g, dtype=torch.float64),
        teacher_log_prob=(old + noise(0.3)).clamp(max=-1e-3),
    )
    return hidden, weight, targets, inputs


def log_probs(hidden, weight, targets):
    return torch.log_softmax(hidden @ weight.T, dim=-1).gather(-1, targets[..., None])[..., 0]


def entropy(hidden, weight):
    logp = torch.log_softmax(hidden @ weight.T, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def call(algorithm, log_prob, inputs, part=slice(None), normalizer=None, **extra):
    torch.manual_seed(0)  # Clip-Cov and KL-Cov draw from the global generator
    return algorithm(log_prob, **{k: v[part] for k, v in inputs.items()}, normalizer=normalizer, **extra)


def step(algorithm, inputs):
    return algorithm.step_normalizer(
        [inputs["mask"][p] for p in PARTS],
        old_log_probs=[inputs["old_log_prob"][p] for p in PARTS],
        rollout_log_probs=[inputs["rollout_log_prob"][p] for p in PARTS],
        group_ids=[inputs["group_ids"][p] for p in PARTS],
    )


def splits(algorithm):
    """Micro-batches give the step's loss unless the loss couples a call's rows across groups."""
    return not algorithm.couples_rows
