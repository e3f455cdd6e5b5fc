"""A*-PO (losses/a2po.py) against the float64 loop of tests/loops/losses.py, with gradcheck, and against TRL 1.16's
own `A2POTrainer.compute_loss` and `_get_sequence_logps` (trl/experimental/a2po/a2po_trainer.py), called on a stand-in
trainer whose model returns fixed logits: the loss within 5.6e-17 and its gradient with respect to the logits
within 3.5e-18, 3 seeds, float64 (TRL casts nothing in these two methods; the difference is the order of the sums).

V* is computed by TRL inside `_estimate_optimal_values`, which generates the N reference samples with the reference
model and scores them; the function cannot run without a model, a tokenizer and reward functions, so its one line
(`beta1 * (torch.logsumexp(rewards / beta1, dim=1) - math.log(n))`) is reproduced below and held equal to
`a2po_optimal_value`, which is also held to the float64 loop.

Deliberate difference: TRL's mean is over every row; pgloss's seq-mean-token-mean leaves out a row without a valid
token (TRL's completion mask always keeps the first token, so it has none).
"""

import math
from collections import defaultdict
from types import SimpleNamespace

import loops
import pytest
import torch
from conftest import make_batch

import pgloss
from pgloss.losses.a2po import a2po_advantages, a2po_optimal_value

F64 = dict(dtype=torch.float64)


def call(data, lp=None, **kw):
    lp = data["log_prob"] if lp is None else lp
    alg = pgloss.get("a2po", **kw)
    return alg(lp, data["old_log_prob"], data["advantages"], data["mask"], ref_log_prob=data["ref_log_prob"])


def batch(seed):
    data = make_batch(batch=7, length=8, seed=seed, spread=0.5)
    data["ref_log_prob"] = data["ref_log_prob"] - 3.0 * torch.rand(7, 8, generator=torch.Generator().manual_seed(seed))
    return data


@pytest.mark.parametrize("beta2", [1e-3, 0.1])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_loop(beta2, seed):
    data = batch(seed)
    lp, _, adv, mask = loops.lists(data)
    expected = loops.a2po(lp, data["ref_log_prob"].tolist(), adv, mask, beta2=beta2)
    assert call(data, a2po_beta2=beta2).loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_gradcheck():
    data = batch(3)
    x = data["log_prob"].clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda y: call(data, y, a2po_beta2=0.1).loss, (x,))


def test_optimal_value_and_advantages():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 2, (5, 8), generator=gen).double()  # binary rewards, 8 reference samples
    rewards[0] = 0.0
    for beta1 in (0.5, 2.0):
        ours = a2po_optimal_value(rewards, beta1=beta1)
        n = rewards.shape[1]
        trl = beta1 * (torch.logsumexp(rewards / beta1, dim=1) - math.log(n))  # A2POTrainer._estimate_optimal_values
        torch.testing.assert_close(ours, trl, rtol=0, atol=0)
        loop = [loops.a2po_value(row, beta1=beta1) for row in rewards.tolist()]
        torch.testing.assert_close(ours, torch.tensor(loop, **F64), rtol=0, atol=2e-15)
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0], **F64)
    torch.testing.assert_close(a2po_advantages(scores, rewards), scores - a2po_optimal_value(rewards), rtol=0, atol=0)
    assert a2po_optimal_value(rewards)[0] == 0.0  # no success among the reference samples: V* = 0
    with pytest.raises(ValueError, match="reference_rewards"):
        a2po_advantages(scores, rewards[:3])
    with pytest.raises(ValueError, match="beta1"):
        a2po_optimal_value(rewards, beta1=0.0)


class Logits(torch.nn.Module):
    """A model whose logits are fixed, `[B, P + T, V]`."""

    def __init__(self, logits):
        super().__init__()
        self.logits = torch.nn.Parameter(logits)

    def forward(self, input_ids, attention_mask):
        return SimpleNamespace(logits=self.logits)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_trl(seed):
    trainer = pytest.importorskip("trl.experimental.a2po.a2po_trainer")
    gen = torch.Generator().manual_seed(seed)
    rows, prompt, length, vocab = 6, 3, 7, 11
    ids = torch.randint(0, vocab, (rows, prompt + length), generator=gen)
    lengths = torch.randint(1, length + 1, (rows,), generator=gen)  # every completion keeps its first token
    completion = torch.arange(length)[None, :] < lengths[:, None]
    attention = torch.cat([torch.ones(rows, prompt, dtype=torch.long), completion.long()], dim=1)
    model = Logits(torch.randn(rows, prompt + length, vocab, generator=gen, **F64))
    ref_tokens = -torch.rand(rows, length, generator=gen, **F64) * 3
    rewards = torch.randint(0, 2, (rows,), generator=gen).double()
    v_star = a2po_optimal_value(torch.randint(0, 2, (rows, 8), generator=gen).double())
    beta2 = 0.05

    stand_in = SimpleNamespace(
        args=SimpleNamespace(beta2=beta2),
        model=SimpleNamespace(training=True),
        model_kwarg_keys=(),
        _metrics={"train": defaultdict(list)},
    )
    stand_in._get_sequence_logps = lambda *a: trainer.A2POTrainer._get_sequence_logps(stand_in, *a)
    inputs = dict(
        input_ids=ids,
        attention_mask=attention,
        logits_to_keep=length,
        ref_logps=(ref_tokens * completion).sum(1),
        rewards=rewards,
        v_star=v_star,
    )
    loss_theirs = trainer.A2POTrainer.compute_loss(stand_in, model, inputs)
    (grad_theirs,) = torch.autograd.grad(loss_theirs, model.logits)

    logits = model.logits.detach().clone().requires_grad_()
    log_prob = torch.log_softmax(logits[:, prompt - 1 : -1], -1).gather(-1, ids[:, prompt:, None]).squeeze(-1)
    loss_ours = pgloss.get("a2po", a2po_beta2=beta2)(
        log_prob, log_prob.detach(), rewards - v_star, completion, ref_log_prob=ref_tokens
    ).loss
    (grad_ours,) = torch.autograd.grad(loss_ours, logits)
    torch.testing.assert_close(loss_ours, loss_theirs, rtol=0, atol=1e-16)
    torch.testing.assert_close(grad_ours, grad_theirs, rtol=0, atol=1e-17)
