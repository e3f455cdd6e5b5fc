"""Top-k distillation against each trainer's own function, on value and gradient:

- verl 0.9.1 `verl/trainer/distillation/fsdp/losses.py` `compute_forward_kl_topk` (imported; both of its paths,
  log_softmax + gather and `use_chunked_topk`), then the two clamps of `verl/trainer/distillation/losses.py`
  (`compute_forward_kl_topk`: `clamp_min(0.0)`; `distillation_loss`: `clamp(-loss_max_clamp, loss_max_clamp)`).
  Its KL runs in float32 (`kl_divergence` calls `.float()`);
- TRL 1.16 `trl/experimental/async_distillation/async_distillation_trainer.py` `_jsd_loss_chunk` (imported; from
  hidden states and an LM head with bias, scale and soft-cap; its head runs in float32), with the β > 0 support of
  `_narrow_top1_actual_support` ({teacher top-1, sampled token});
- TRL 1.16 `trl/experimental/server_distillation/server_distillation_trainer.py` `ServerDistillationTrainer`:
  `_compute_server_forward_kl_loss` (β = 0, the teacher's top-k) and `_compute_sparse_top_1_divergence_loss` (β > 0,
  {teacher top-1, sampled token}), called on a stand-in trainer; float64, 1e-10;
- TRL 1.16 `trl/experimental/sdpo/loss_utils.py` `compute_topk_self_distillation_loss` (imported; SDPO and SDFT;
  it runs in the logits' dtype: float64, 1e-10);
- ms-swift 4.6.0 `swift/rlhf_trainers/gkd_loss.py` `gkd_loss` (`TeacherOutput` in top-k mode), cut from its source
  file (`pgloss.conformance.sources`; $PGLOSS_MS_SWIFT_SRC or the installed distribution), float64;
- NeMo-RL `nemo_rl/algorithms/loss/loss_functions.py` `DistillationLossFn` with
  `nemo_rl/distributed/model_utils.py` `get_distillation_topk_logprobs_from_logits`, cut from a checkout
  ($PGLOSS_NEMO_RL_SRC; skipped when unset): the loss in float64 on float64 log-probs (1e-10), and the whole
  pipeline (its log-probs in float32).
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.tensor  # NeMo-RL's isinstance check reads torch.distributed.tensor.DTensor
import torch.nn.functional as F

import pgloss
from pgloss.conformance import sources

B, T, V, H, K = 2, 6, 41, 8, 5
MASK = torch.tensor([[True] * 6, [True, True, True, True, False, False]])


def teacher_topk(seed, dtype=torch.float64, k=K):
    g = torch.Generator().manual_seed(seed)
    teacher = torch.log_softmax(torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2, dim=-1)
    lp, ids = teacher.topk(k, dim=-1)
    return ids, lp.to(dtype), g


def student_logits(g, dtype=torch.float64):
    return (torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2).to(dtype)


# -- verl ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunked", [False, True])
def test_verl_forward_kl_topk(chunked):
    fsdp = pytest.importorskip("verl.trainer.distillation.fsdp.losses")
    ids, lp, g = teacher_topk(0)
    logits = student_logits(g) * 2  # spread out: some student log-probs at the teacher's ids fall below −10
    flat_ids, flat_lp = ids[MASK], lp[MASK]  # verl's packed (no padding) rows
    nested = lambda x: torch.nested.as_nested_tensor([x], layout=torch.jagged)  # noqa: E731  (one packed sequence)
    config = SimpleNamespace(
        distillation_loss=SimpleNamespace(log_prob_min_clamp=-10.0, use_chunked_topk=chunked, chunked_topk_chunk_size=4)
    )
    theirs_z = logits[MASK].unsqueeze(0).clone().requires_grad_()
    out = fsdp.compute_forward_kl_topk(theirs_z, nested(flat_lp), nested(flat_ids), config, "thd")
    theirs = out["distillation_losses"].clamp_min(0.0).clamp(min=-10.0, max=10.0)[0]
    ours_z = logits.clone().requires_grad_()
    ours = pgloss.topk_divergence_from_logits(
        ours_z, ids, lp, MASK, beta=0.0, log_prob_min=-10.0, value_range=(0.0, 10.0), chunk_size=5, vocab_block=16
    )
    assert (out["student_mass"] < 1).all() and (
        theirs_z.detach().log_softmax(-1).gather(-1, flat_ids[None]) < -10
    ).any()
    torch.testing.assert_close(ours.per_token[MASK], theirs.double(), rtol=0, atol=2e-6)
    upstream = torch.randn(theirs.shape, generator=g, dtype=torch.float64)
    (g_theirs,) = torch.autograd.grad((theirs.double() * upstream).sum(), theirs_z)
    full = torch.zeros(B, T, dtype=torch.float64)
    full[MASK] = upstream
    (g_ours,) = torch.autograd.grad((ours.per_token * full).sum(), ours_z)
    torch.testing.assert_close(g_ours[MASK], g_theirs[0], rtol=0, atol=2e-6)


# -- TRL ------------------------------------------------------------------------------------------------------------


def _trl_async():
    return pytest.importorskip("trl.experimental.async_distillation.async_distillation_trainer")


@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_trl_async_distillation_from_hidden(tail, beta):
    trainer = _trl_async()
    ids, lp, g = teacher_topk(1, dtype=torch.float32, k=8)
    ids[0, 2, 5:], lp[0, 2, 5:] = -1, float("-inf")  # a teacher that returned fewer candidates
    hidden = torch.randn(B, T, H, generator=g)
    weight, bias = torch.randn(V, H, generator=g) * 0.5, torch.randn(V, generator=g) * 0.3
    scale, softcap, tau = 1.2, 4.0, 0.8
    actual = torch.randint(0, V, (B, T), generator=g)
    actual[0, 0] = ids[0, 0, 0]  # the sampled token is the teacher's top-1: counted once
    actual[1, 1] = ids[1, 1, 3]
    wide = ids != -1
    if beta == 0.0:
        target, teacher, valid = ids, lp, wide
    else:
        target, teacher, valid = trainer._narrow_top1_actual_support(ids, lp, actual, wide, beta)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    per_token, total = torch.zeros(B, T), 0.0
    for b, t in zip(*torch.nonzero(MASK, as_tuple=True), strict=True):
        loss, *_ = trainer._jsd_loss_chunk(
            leaves[0][b, t][None], leaves[1], leaves[2], scale, softcap, target[b, t][None], teacher[b, t][None],
            valid[b, t][None], beta, tau, tail, None, 1,
        )  # fmt: skip
        per_token[b, t] = loss.detach()
        total = total + loss
    g_theirs = torch.autograd.grad(total, leaves)
    ours_leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    ours = pgloss.topk_divergence_from_hidden(
        ours_leaves[0], ours_leaves[1], torch.where(valid, target, -1), teacher, MASK, beta=beta,
        tail="bucket" if tail else "renormalise", temperature=tau,
        head=pgloss.HeadOptions(ours_leaves[2], logit_scale=scale, softcap=softcap), chunk_size=5, vocab_block=16,
    )  # fmt: skip
    torch.testing.assert_close(ours.per_token, per_token, rtol=0, atol=2e-6)
    assert per_token.abs().max() > 1e-3 or (beta == 1.0 and not tail)  # one slot renormalised: D = 0
    for mine, theirs in zip(torch.autograd.grad(ours.per_token.sum(), ours_leaves), g_theirs, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=5e-6)


@pytest.mark.parametrize(("k", "alpha", "tail"), [(4, 0.5, False), (4, 0.5, True), (7, 1.0, False), (3, 0.0, True)])
def test_trl_sdpo_topk_self_distillation(k, alpha, tail):
    utils = pytest.importorskip("trl.experimental.sdpo.loss_utils")
    g = torch.Generator().manual_seed(2)
    logits, teacher = student_logits(g), student_logits(g)
    theirs_z = logits.clone().requires_grad_()
    theirs = utils.compute_topk_self_distillation_loss(
        theirs_z, teacher, distillation_topk=k, distillation_alpha=alpha, distillation_add_tail=tail
    )
    ours_z = logits.clone().requires_grad_()
    ours = pgloss.student_topk_divergence_from_logits(
        ours_z, teacher, MASK, k=k, beta=alpha, tail="bucket" if tail else "renormalise", chunk_size=5, vocab_block=16
    )
    torch.testing.assert_close(ours.per_token[MASK], theirs[MASK], rtol=0, atol=1e-10)
    (g_theirs,) = torch.autograd.grad((theirs * MASK).sum(), theirs_z)
    (g_ours,) = torch.autograd.grad(ours.per_token.sum(), ours_z)
    torch.testing.assert_close(g_ours, g_theirs, rtol=0, atol=1e-10)


def _server():
    module = pytest.importorskip("trl.experimental.server_distillation.server_distillation_trainer")
    return module.ServerDistillationTrainer


@pytest.mark.parametrize("tail", [True, False])
def test_trl_server_distillation_forward_kl_over_the_teacher_top_k(tail):
    """`_compute_server_forward_kl_loss` (β = 0): the server's top-k padded with log-prob −inf (id 0 there)."""
    trainer = _server()
    ids, lp, g = teacher_topk(5)
    lp[1, 3, 2:] = float("-inf")  # fewer candidates from the server
    logits, tau = student_logits(g), 0.8
    standin = SimpleNamespace(loss_add_tail=tail, _reduce_divergence_loss=trainer._reduce_divergence_loss)
    theirs_z = logits.clone().requires_grad_()
    result = {"topk_logprobs": lp, "topk_token_ids": torch.where(torch.isinf(lp), 0, ids)}
    labels = torch.where(MASK, 1, -100)
    theirs = trainer._compute_server_forward_kl_loss(standin, result, torch.log_softmax(theirs_z / tau, -1), labels)
    ours_z = logits.clone().requires_grad_()
    ours = pgloss.topk_divergence_from_logits(
        ours_z, torch.where(torch.isinf(lp), -1, ids), lp, MASK, beta=0.0, tail="bucket" if tail else "renormalise",
        temperature=tau, chunk_size=5, vocab_block=16,
    )  # fmt: skip
    torch.testing.assert_close(ours.loss, theirs, rtol=0, atol=1e-10)
    (g_theirs,) = torch.autograd.grad(theirs, theirs_z)
    (g_ours,) = torch.autograd.grad(ours.loss, ours_z)
    torch.testing.assert_close(g_ours, g_theirs, rtol=0, atol=1e-10)


@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("beta", [0.5, 0.9, 1.0])
def test_trl_server_distillation_top_1_and_the_sampled_token(tail, beta):
    """`_compute_sparse_top_1_divergence_loss` (β > 0): the support {teacher top-1, sampled token}, the sampled
    token alone at β = 1, a duplicate counted once: here its ids, the duplicate marked −1."""
    trainer = _server()
    ids, lp, g = teacher_topk(6)
    logits, tau = student_logits(g), 1.0
    sampled = torch.randint(0, V, (B, T), generator=g)
    sampled[0, 1], sampled[1, 2] = ids[0, 1, 0], ids[1, 2, 0]  # the teacher's top-1 sampled
    actual_lp = torch.randn(B, T, generator=g, dtype=torch.float64).abs().neg() - 1.0
    actual_lp = torch.where(sampled == ids[..., 0], lp[..., 0], actual_lp)
    standin = SimpleNamespace(beta=beta, loss_add_tail=tail, _reduce_divergence_loss=trainer._reduce_divergence_loss)
    theirs_z = logits.clone().requires_grad_()
    labels = torch.where(MASK, 1, -100)
    theirs = trainer._compute_sparse_top_1_divergence_loss(
        standin, torch.log_softmax(theirs_z / tau, -1), ids[..., 0], lp[..., 0], sampled, actual_lp, labels
    )
    if beta == 1.0:
        support, support_lp = sampled[..., None], actual_lp[..., None]
    else:
        support = torch.stack([ids[..., 0], torch.where(sampled == ids[..., 0], -1, sampled)], dim=-1)
        support_lp = torch.stack([lp[..., 0], actual_lp], dim=-1)
    ours_z = logits.clone().requires_grad_()
    ours = pgloss.topk_divergence_from_logits(
        ours_z, support, support_lp, MASK, beta=beta, tail="bucket" if tail else "renormalise", chunk_size=5
    )
    torch.testing.assert_close(ours.loss, theirs, rtol=0, atol=1e-10)
    (g_theirs,) = torch.autograd.grad(theirs, theirs_z)
    (g_ours,) = torch.autograd.grad(ours.loss, ours_z)
    torch.testing.assert_close(g_ours, g_theirs, rtol=0, atol=1e-10)


# -- ms-swift -------------------------------------------------------------------------------------------------------


def _ms_swift():
    path = sources.locate("ms-swift", "swift/rlhf_trainers/gkd_loss.py", "PGLOSS_MS_SWIFT_SRC", "pip install ms-swift")
    if isinstance(path, str):
        pytest.skip(path)
    names = ("TeacherOutput", "default_log_softmax", "default_kl_div", "default_gather", "jsd_loss")
    namespace = {"torch": torch, "F": F, **{n: getattr(typing, n) for n in ("Callable", "List", "Optional", "Tuple")}}
    code = sources.load(path, names + ("extract_active", "gkd_loss"), namespace)
    code["TeacherOutput"] = dataclasses.dataclass(code["TeacherOutput"])  # its @dataclass, dropped with decorators
    return code


@pytest.mark.parametrize(("beta", "tau"), [(0.5, 1.0), (0.5, 0.7), (0.0, 1.0), (1.0, 0.9), (0.2, 1.0)])
def test_ms_swift_gkd_loss_topk(beta, tau):
    code = _ms_swift()
    ids, lp, g = teacher_topk(3)
    logits = student_logits(g)
    labels = torch.where(MASK, 1, -100)
    teacher = code["TeacherOutput"](topk_logprobs=lp, topk_indices=ids, labels=labels)
    theirs_z = logits.clone().requires_grad_()
    total, count = code["gkd_loss"](theirs_z, teacher, labels, beta, tau, chunk_size=4)
    ours_z = logits.clone().requires_grad_()
    ours = pgloss.topk_divergence_from_logits(  # ms-swift divides the teacher's log-probs by τ too
        ours_z, ids, lp / tau, MASK, beta=beta, tail="renormalise", temperature=tau, chunk_size=5, vocab_block=16
    )
    assert int(count) == int(MASK.sum())
    torch.testing.assert_close(ours.per_token.sum(), total, rtol=0, atol=1e-10)
    (g_theirs,) = torch.autograd.grad(total, theirs_z)
    (g_ours,) = torch.autograd.grad(ours.per_token.sum(), ours_z)
    torch.testing.assert_close(g_ours, g_theirs, rtol=0, atol=1e-10)
    per_row = []  # one position at a time: the per-token values
    for b, t in zip(*torch.nonzero(MASK, as_tuple=True), strict=True):
        one = torch.full_like(labels, -100)
        one[b, t] = 1
        teacher = code["TeacherOutput"](topk_logprobs=lp, topk_indices=ids, labels=one)
        per_row.append(code["gkd_loss"](logits, teacher, one, beta, tau)[0])
    torch.testing.assert_close(ours.per_token[MASK], torch.stack(per_row), rtol=0, atol=1e-10)


# -- NeMo-RL --------------------------------------------------------------------------------------------------------


def _nemo_rl():
    from advantages.trainer_sources import load, source_file

    utils = load(
        source_file("PGLOSS_NEMO_RL_SRC", "nemo_rl/algorithms/utils.py"),
        ("masked_mean",),
        {"torch": torch, "Optional": typing.Optional},
    )
    enums = load(
        source_file("PGLOSS_NEMO_RL_SRC", "nemo_rl/algorithms/loss/interfaces.py"),
        ("LossType", "LossInputType"),
        {"enum": enum},
    )
    namespace = {"torch": torch, "Any": typing.Any, "LossFunction": object, "masked_mean": utils["masked_mean"]}
    namespace |= {k: enums[k] for k in ("LossType", "LossInputType")}
    path = source_file("PGLOSS_NEMO_RL_SRC", "nemo_rl/algorithms/loss/loss_functions.py")
    loss = load(path, ("DistillationLossFn",), namespace)["DistillationLossFn"]
    path = source_file("PGLOSS_NEMO_RL_SRC", "nemo_rl/distributed/model_utils.py")
    prepare = load(path, ("get_distillation_topk_logprobs_from_logits",), {"torch": torch, "Optional": typing.Optional})
    return loss, prepare["get_distillation_topk_logprobs_from_logits"]


NEMO = [("forward", False), ("reverse", False), ("mixed", False), ("forward", True), ("reverse", True), ("mixed", True)]


@pytest.mark.parametrize(("kl_type", "zero_outside_topk"), NEMO)
@pytest.mark.parametrize("weight", [0.5, 0.3])
def test_nemo_rl_distillation_loss(kl_type, zero_outside_topk, weight):
    loss_fn, prepare = _nemo_rl()
    cfg = SimpleNamespace(kl_type=kl_type, mixed_kl_weight=weight, zero_outside_topk=zero_outside_topk)
    beta = {"forward": 0.0, "reverse": 1.0, "mixed": 1.0 - weight}[kl_type]
    options = dict(beta=beta, blend="sum")
    options |= dict(tail="drop", outside_log_prob=-100.0) if zero_outside_topk else dict(tail="renormalise")
    ids, lp, g = teacher_topk(4)
    teacher_logits = lp + 1.5  # NeMo-RL is handed the teacher's top-k logits and log-softmaxes them over the k
    logits = student_logits(g)
    # NeMo-RL's rows are [B, S]: position s predicts token s + 1, its loss reads the first S − 1 positions
    mask = torch.cat([MASK[:, :1], MASK], dim=1)
    data = {"token_mask": mask.double(), "sample_mask": torch.ones(B, dtype=torch.float64), "input_ids": mask}
    count = MASK.sum().double()
    pad = lambda x: torch.cat([x, x[:, :1]], dim=1)  # noqa: E731  (a position S whose values are dropped)

    # the loss function in float64 on float64 log-probs of the student's logits
    z64 = logits.clone().requires_grad_()
    log_p = torch.log_softmax(z64, dim=-1)
    student = log_p.gather(-1, ids) if zero_outside_topk else torch.log_softmax(z64.gather(-1, ids), dim=-1)
    h_all = (log_p.exp() * log_p).sum(-1) if zero_outside_topk and kl_type != "forward" else None
    theirs, _ = loss_fn(cfg)(student, torch.log_softmax(teacher_logits, -1), h_all, data, None, count)
    # tail "drop" takes the teacher's values as they are: NeMo-RL's are its top-k logits log-softmaxed over the k
    given = torch.log_softmax(teacher_logits, -1) if zero_outside_topk else teacher_logits
    ours_z = logits.clone().requires_grad_()
    ours = pgloss.topk_divergence_from_logits(ours_z, ids, given, MASK, **options, chunk_size=5, vocab_block=16)
    mean = ours.per_token.sum() / (count + 1e-8)  # masked_mean's Σ / (global_valid_toks + 1e-8)
    torch.testing.assert_close(mean, theirs, rtol=0, atol=1e-10)
    (g_theirs,) = torch.autograd.grad(theirs, z64)
    (g_ours,) = torch.autograd.grad(mean, ours_z)
    torch.testing.assert_close(g_ours, g_theirs, rtol=0, atol=1e-10)

    # the whole pipeline: its log-probs from the logits (in float32)
    z32 = pad(logits).clone().requires_grad_()
    student, teacher, h_all = prepare(z32, pad(teacher_logits), pad(ids), zero_outside_topk, h_all is not None)
    theirs32, _ = loss_fn(cfg)(student, teacher, h_all, data, None, count)
    torch.testing.assert_close(mean.detach(), theirs32.double(), rtol=0, atol=5e-6)
    (g32,) = torch.autograd.grad(theirs32, z32)
    torch.testing.assert_close(g_ours, g32[:, :-1].double(), rtol=0, atol=5e-6)
