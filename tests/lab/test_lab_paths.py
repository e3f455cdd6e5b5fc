"""The lab's update takes the same step as one plain call on the whole batch, for every name and each
kind of rollout correction: it counts with `algorithm.step_normalizer`, like every other path."""

import dataclasses

import pytest
import torch
from lab_helpers import TINY, fixed_batch, tiny_policy
from properties.steps import CORRECTIONS  # the same corrections as every other path's test

import pgloss
from pgloss.lab.config import LabConfig
from pgloss.lab.sampling import response_log_probs
from pgloss.lab.update import update

N_PROMPTS = 6


class Recorder:
    """An optimizer that keeps the gradient of its one step instead of moving the parameters."""

    def __init__(self, params):
        self.params, self.grads = list(params), None

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    def step(self):
        self.grads = [p.grad.clone() for p in self.params]


def cases():
    for name in pgloss.names():
        for kind, correction in CORRECTIONS.items():
            algorithm = pgloss.get(name, generation_budget=20)
            if correction is not None and algorithm.consumes_rollout_log_prob:
                continue  # VESPO weighs by the rollout log-probs itself and takes no correction
            marks = (
                [
                    pytest.mark.skip(
                        reason="Clip-Cov and KL-Cov select among a call's tokens: micro-batches "
                        "select differently (docs/reference.md)"
                    )
                ]
                if name in ("clip_cov", "kl_cov")
                else []
            )
            yield pytest.param(name, kind, id=f"{name}-{kind}", marks=marks)


@pytest.mark.parametrize("name, kind", list(cases()))
def test_the_labs_update_takes_the_step_of_one_call(name, kind):
    policy = tiny_policy()
    batch = fixed_batch(policy, n_prompts=N_PROMPTS)
    g = torch.Generator().manual_seed(1)
    noisy = lambda x, s: (x + s * torch.randn(x.shape, generator=g)).clamp(max=-1e-3)  # noqa: E731
    batch = dataclasses.replace(
        batch, old_log_prob=noisy(batch.old_log_prob, 0.1), rollout_log_prob=noisy(batch.old_log_prob, 0.2)
    )
    algorithm = pgloss.get(name, generation_budget=TINY["max_new_tokens"], rollout_correction=CORRECTIONS[kind])
    cfg = LabConfig(algorithm=name, epochs=1, minibatches=1, micro_batches=3, max_grad_norm=1e9, **TINY)
    recorder = Recorder(policy.parameters())
    torch.manual_seed(0)
    update(policy, recorder, algorithm, batch, cfg, N_PROMPTS, torch.Generator().manual_seed(0))

    log_prob, entropy = response_log_probs(policy, batch.rollout, temperature=cfg.temperature)
    torch.manual_seed(0)
    out = algorithm(
        log_prob=log_prob,
        old_log_prob=batch.old_log_prob,
        advantages=batch.advantages,
        mask=batch.rollout.mask,
        entropy=entropy,
        **batch.inputs(algorithm),
    )
    reference = torch.autograd.grad(out.loss, recorder.params, allow_unused=True)
    for got, want in zip(recorder.grads, reference, strict=True):
        want = torch.zeros_like(got) if want is None else want
        torch.testing.assert_close(got, want, rtol=2e-4, atol=1e-6)
