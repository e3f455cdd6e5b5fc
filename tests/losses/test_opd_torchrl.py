"""torchrl 0.14.1's `DistillationLoss` (torchrl/objectives/llm/distillation.py) against pgloss: it is not `opd` but
the k3 KL term to the teacher, `pgloss.kl_estimate(log π_θ, log π_T, "k3")` aggregated per sequence, the term of
any loss with kl_coef = 1, kl_estimator="k3", ref_log_prob = the teacher's log-probs and Â = 0.

Its `forward` runs from the source of the unpacked wheel (PGLOSS_TORCHRL_SRC; `make test` unpacks it), its student
network and tensordict stood in for: torchrl 0.14.1 needs tensordict >= 0.14.3, and the test environment pins
tensordict <= 0.10.0 for verl (Makefile). Measured (float64, 3 seeds of make_batch 6 × 7, its empty row left out,
as torchrl refuses one): `kl_direction="reverse"` is pgloss's k3 of KL(π_θ‖π_T), "forward" the same estimator with
the two log-probs swapped; reduction "mean" with normalize_by_seq_length is loss_agg_mode "seq-mean-token-mean",
without it "seq-mean-token-sum", and "sum" is the same times the number of sequences: the value within 1.1e-16 per
sequence, the gradient within 5.6e-17.

Two differences: pgloss clamps k3 at max_kl = 10 (as verl), torchrl does not (a token the teacher finds e⁴ times
likelier: torchrl 49.598, pgloss 10 with no gradient); and the gradient. torchrl's per-token gradient through
log π_θ is (1 − π_T/π_θ)·∇log π_θ, `opd`'s at r = 1 is −(log π_T − log π_θ)·∇log π_θ. Over the student's samples
(exact expectation on a 9-way categorical) the first is ∇KL(π_T‖π_θ), mass-covering, in both of torchrl's
directions (on the teacher's samples for "forward"), the second ∇KL(π_θ‖π_T), mode-seeking, each within 1.1e-16;
the two gradients are 0.202 apart (max over the logits, norms 0.488 and 0.363). torchrl's docstring says as much.
"""

import contextlib
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from advantages.trainer_sources import load, source_file
from conftest import make_batch

import pgloss

DISTILLATION = "torchrl/objectives/llm/distillation.py"
F64 = dict(dtype=torch.float64)


class _LossModule:
    """torchrl's LossModule, as far as DistillationLoss.__init__ uses it."""

    def register_buffer(self, name, value, persistent=True):
        setattr(self, name, value)

    @property
    def tensor_keys(self):
        return self.default_keys()


class _Sequences:
    """A lazily stacked tensordict of sequences: entries read as lists of `[T_i]` tensors."""

    ndim = 1

    def __init__(self, entries):
        self.entries = entries

    def __getitem__(self, key):
        return self.entries[key]

    def get(self, key, default=None, as_list=False):
        return self.entries.get(key, default)

    def select(self, *keys):
        return self


def torchrl():
    ns = dict(
        torch=torch,
        contextlib=contextlib,
        dataclass=dataclass,
        LossModule=_LossModule,
        DistillationLossOutput=SimpleNamespace,
        _zip_strict=lambda *xs: zip(*xs, strict=True),
        _runtime_device=lambda *args, **kwargs: None,
    )
    return load(
        source_file("PGLOSS_TORCHRL_SRC", DISTILLATION),
        ("k3_kl_token_estimate", "_distillation_loss", "DistillationLoss"),
        ns,
    )


def distillation_loss(log_prob, teacher, mask, **options):
    """`DistillationLoss(**options).forward` on rows of student log-probs (the sequences, all tokens attended)."""

    def student(_):  # the actor network: the student's log-probs of the sequences
        return _Sequences({("log_probs", "full"): list(log_prob)})

    loss = torchrl()["DistillationLoss"](student, **options)
    return loss.forward(
        _Sequences(
            {
                ("history", "full"): None,
                ("next", "teacher_log_probs", "full"): list(teacher),
                ("masks", "all_assistant_mask"): list(mask),
                ("masks", "all_attention_mask"): list(torch.ones_like(mask)),
            }
        )
    )


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("direction", ["reverse", "forward"])
@pytest.mark.parametrize(
    "reduction, normalize, mode",
    [
        ("mean", True, "seq-mean-token-mean"),
        ("mean", False, "seq-mean-token-sum"),
        ("sum", True, "seq-mean-token-mean"),
    ],
)
def test_distillation_loss_is_the_k3_kl_term_to_the_teacher(seed, direction, reduction, normalize, mode):
    data = make_batch(batch=6, length=7, seed=seed)
    rows = data["mask"].any(-1)
    log_prob, teacher, mask = (data[k][rows] for k in ("log_prob", "teacher_log_prob", "mask"))
    theirs, ours = log_prob.clone().requires_grad_(), log_prob.clone().requires_grad_()
    loss_theirs = distillation_loss(
        theirs, teacher, mask, kl_direction=direction, reduction=reduction, normalize_by_seq_length=normalize
    ).loss_distill
    pair = (ours, teacher) if direction == "reverse" else (teacher, ours)
    sequences = mask.shape[0] if reduction == "sum" else 1
    loss_ours = pgloss.aggregate(pgloss.kl_estimate(*pair, "k3"), mask, mode) * sequences
    loss_theirs.backward()
    loss_ours.backward()
    torch.testing.assert_close(loss_theirs, loss_ours, rtol=0, atol=2e-16 * mask.shape[0])
    torch.testing.assert_close(theirs.grad, ours.grad, rtol=0, atol=2e-16)
    if direction == "reverse" and reduction == "mean":  # the same as a loss's KL term with Â = 0
        term = pgloss.get("ppo", kl_coef=1.0, loss_agg_mode=mode)(
            log_prob, log_prob, torch.zeros(mask.shape[0], **F64), mask, ref_log_prob=teacher
        ).loss
        torch.testing.assert_close(term, loss_theirs.detach(), rtol=0, atol=2e-16)


def test_pgloss_clamps_k3_at_max_kl_and_torchrl_does_not():
    student, teacher = torch.tensor([[-4.5]], **F64), torch.tensor([[-0.5]], **F64)
    theirs = torchrl()["k3_kl_token_estimate"](teacher, student)
    assert theirs.item() == pytest.approx(49.598150, abs=1e-6)
    assert pgloss.kl_estimate(student, teacher, "k3").item() == 10.0
    assert pgloss.kl_estimate(student, teacher, "k3", max_kl=100.0).item() == pytest.approx(theirs.item(), abs=1e-13)


def test_torchrl_descends_the_forward_kl_and_opd_the_reverse_kl():
    """E over the sampling policy of each per-token gradient, exactly on a 9-way categorical."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(9, generator=gen, **F64)
    teacher = torch.log_softmax(torch.randn(9, generator=gen, **F64), -1)
    k3 = torchrl()["k3_kl_token_estimate"]

    def gradient(objective):
        z = logits.clone().requires_grad_()
        objective(torch.log_softmax(z, -1)).backward()
        return z.grad

    def expected(per_token, sampler):  # Σ_y p(y)·∇ℓ(y), p the sampling policy, held fixed
        return gradient(lambda lp: ((lp.detach() if sampler == "student" else teacher).exp() * per_token(lp)).sum())

    def opd(lp):
        return pgloss.get("opd")(
            lp[None],
            lp.detach()[None],
            torch.zeros(1, **F64),
            torch.ones(1, 9, dtype=torch.bool),
            teacher_log_prob=teacher[None],
        ).per_token[0]

    forward_kl = gradient(lambda lp: (teacher.exp() * (teacher - lp)).sum())
    reverse_kl = gradient(lambda lp: (lp.exp() * (lp - teacher)).sum())
    torch.testing.assert_close(expected(lambda lp: k3(teacher, lp), "student"), forward_kl, rtol=0, atol=2e-16)
    torch.testing.assert_close(expected(lambda lp: k3(lp, teacher), "teacher"), forward_kl, rtol=0, atol=2e-16)
    torch.testing.assert_close(expected(opd, "student"), reverse_kl, rtol=0, atol=2e-16)
    assert (forward_kl - reverse_kl).abs().max().item() == pytest.approx(0.201693, abs=1e-6)
    assert (forward_kl.norm().item(), reverse_kl.norm().item()) == pytest.approx((0.488032, 0.363072), abs=1e-6)
