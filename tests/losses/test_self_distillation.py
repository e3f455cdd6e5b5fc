"""SDPO's token-level self-distillation term (`self_distill_coef`, terms/self_distillation.py) and `sdpo` against
their float64 loop (tests/loops/distillation.py) with a gradient check, and against TRL 1.16.0's own
`SDPOTrainer._compute_self_distillation_loss` and `_compute_policy_loss` (trl/experimental/sdpo/sdpo_trainer.py,
imported from the installed package; the trainer object stood in for by the attributes they read), on value and
gradient with respect to the student's logits.

Measured (float64 logits, 3 seeds, B = 5, T = 6, V = 11, no empty row, is-clip 2 and None, on-policy and
off-policy old log-probs, distillation_weight 1 and 0.4, one row without a teacher): |Δ loss| ≤ 3.4e-16,
|Δ ∂/∂logits| ≤ 1.2e-16 (asserted 1e-12). A row with no valid token differs: TRL's mean runs over every row
of the batch, pgloss's seq-mean-token-mean over the rows that hold a token (test_an_empty_row_differs: a
factor B/(B - 1)).
"""

from __future__ import annotations

import os

import loops
import pytest
import torch

import pgloss
from pgloss.conformance import trl_sdpo

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
F64 = dict(dtype=torch.float64)


def logits_batch(seed, rows=5, length=6, vocab=11, empty=False):
    gen = torch.Generator().manual_seed(seed)
    student = torch.randn(rows, length, vocab, generator=gen, **F64)
    teacher = student + 0.8 * torch.randn(rows, length, vocab, generator=gen, **F64)
    ids = torch.randint(0, vocab, (rows, length), generator=gen)
    lengths = torch.randint(1, length + 1, (rows,), generator=gen)
    if empty:
        lengths[2] = 0
    mask = torch.arange(length)[None, :] < lengths[:, None]
    old = torch.log_softmax(student + 0.3 * torch.randn(rows, length, vocab, generator=gen, **F64), -1)
    old = old.gather(-1, ids[..., None]).squeeze(-1)
    advantages = torch.randn(rows, generator=gen, **F64)
    return dict(student=student, teacher=teacher, ids=ids, mask=mask, old=old, advantages=advantages)


def sampled(logits, ids):
    return torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)


def pgloss_loss(batch, alg, *, on_policy=False, has_teacher=None):
    logits = batch["student"].clone().requires_grad_(True)
    lp = sampled(logits, batch["ids"])
    teacher = sampled(batch["teacher"], batch["ids"])
    if has_teacher is not None:  # a row without a teacher: the student's own log-probs, so the term is 0 there
        teacher = torch.where(has_teacher[:, None], teacher, lp.detach())
    old = None if on_policy else batch["old"]
    out = alg(lp, old, batch["advantages"], batch["mask"], teacher_log_prob=teacher)
    (grad,) = torch.autograd.grad(out.loss, logits)
    return out, grad


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("cap", [2.0, 1.05, None])
def test_term_matches_loop(seed, cap):
    batch = logits_batch(seed)
    lp = sampled(batch["student"], batch["ids"]).requires_grad_(True)
    teacher = sampled(batch["teacher"], batch["ids"])
    alg = pgloss.get("sdpo", self_distill_is_cap=cap, self_distill_coef=0.6)
    out = alg(lp, batch["old"], batch["advantages"], batch["mask"], teacher_log_prob=teacher)
    (grad,) = torch.autograd.grad(out.loss, lp)
    mask = batch["mask"].tolist()
    values, grads = loops.sdpo(lp.tolist(), batch["old"].tolist(), teacher.tolist(), cap=cap)
    assert out.loss.item() == pytest.approx(0.6 * loops.aggregate(values, mask, "seq-mean-token-mean"), rel=1e-12)
    lengths = batch["mask"].sum(-1, keepdim=True).double()
    rows = (lengths > 0).sum()
    expected = 0.6 * torch.tensor(grads, **F64) * batch["mask"] / (lengths.clamp(min=1) * rows)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)


def trl_loss(batch, *, cap, weight, on_policy=False, has_teacher=None):
    """TRL's SDPO loss and its gradient to the student's logits, as `pgloss conformance` runs it
    (`pgloss.conformance.trl_sdpo.trl_loss`: TRL's two methods on a stand-in trainer)."""
    pytest.importorskip("trl.experimental.sdpo.sdpo_trainer")
    if has_teacher is None:
        has_teacher = torch.ones(len(batch["mask"]), dtype=torch.bool)
    return trl_sdpo.trl_loss(batch, has_teacher, cap=cap, weight=weight, on_policy=on_policy)


CASES = [
    dict(cap=2.0, weight=1.0),
    dict(cap=None, weight=1.0),
    dict(cap=2.0, weight=1.0, on_policy=True),
    dict(cap=2.0, weight=0.4),
    dict(cap=2.0, weight=1.0, no_teacher_row=1),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_against_trl(seed, case):
    batch = logits_batch(seed)
    has_teacher = None
    if "no_teacher_row" in case:
        has_teacher = torch.ones(5, dtype=torch.bool)
        has_teacher[case["no_teacher_row"]] = False
    on_policy = case.get("on_policy", False)
    expected, expected_grad = trl_loss(
        batch, cap=case["cap"], weight=case["weight"], on_policy=on_policy, has_teacher=has_teacher
    )
    alg = pgloss.get(
        "sdpo", self_distill_is_cap=case["cap"], self_distill_coef=case["weight"], policy_coef=1 - case["weight"]
    )
    out, grad = pgloss_loss(batch, alg, on_policy=on_policy, has_teacher=has_teacher)
    assert abs(out.loss.item() - expected.item()) <= 1e-12
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-12)


def test_an_empty_row_differs():
    """TRL averages the rows' token means over every row of the batch, an empty one included; pgloss over the
    rows that hold a token: with one empty row of five, TRL's loss is 4/5 of pgloss's."""
    batch = logits_batch(0, empty=True)
    expected, _ = trl_loss(batch, cap=2.0, weight=1.0)
    out, _ = pgloss_loss(batch, pgloss.get("sdpo"))
    assert expected.item() == pytest.approx(0.8 * out.loss.item(), rel=1e-12)


def test_sdpo_is_the_term_alone():
    batch = logits_batch(3)
    out, _ = pgloss_loss(batch, pgloss.get("sdpo"))
    assert out.loss.item() == pytest.approx(out.metrics["self_distill_loss"].item(), rel=1e-15)
    with pytest.raises(ValueError, match="teacher_log_prob"):
        pgloss.get("sdpo")(batch["old"], None, batch["advantages"], batch["mask"])
    with pytest.raises(ValueError, match="self_distill_is_cap"):
        pgloss.get("sdpo", self_distill_is_cap=0.0)
