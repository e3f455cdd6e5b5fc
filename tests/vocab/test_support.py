"""Sampling-support replay (`pgloss.vocab.support`): log π(y) and H over the rollout's recorded support per
position, from logits and from hidden states, against a float64 loop (logits outside the support set to −inf,
log-softmax: slime's `_build_topp_keep_mask` rule) and SkyRL 0.4.0's own `sample_support_scores`
(`skyrl/backends/skyrl_train/utils/sample_support_replay.py`, read through PGLOSS_SKYRL_SRC)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

import pgloss
from pgloss.conformance import sources
from pgloss.vocab import backends

B, T, V, H, K = 2, 5, 37, 8, 6


def batch(seed: int, dtype=torch.float64):
    """Logits, targets and a support holding each target once and k − 1 other distinct ids; row (0, 1) padded
    after 3 ids, row (1, 2) with no id at all."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=dtype) * 3
    targets = torch.randint(0, V, (B, T), generator=g)
    others = torch.stack([torch.randperm(V - 1, generator=g)[: K - 1] for _ in range(B * T)]).view(B, T, K - 1)
    support = torch.cat([targets[..., None], (targets[..., None] + 1 + others) % V], dim=-1)
    support[0, 1, 3:] = -1
    support[1, 2, :] = -1
    return logits, targets, support


def reference(logits: torch.Tensor, targets: torch.Tensor, support: torch.Tensor, temperature: float = 1.0):
    """The float64 loop: per position, logits outside the support set to −inf, log-softmax, log π(y) and
    H = −Σ π log π over the support; a position with no id: 0, 0."""
    log_probs, entropies = [], []
    flat, ys, rows = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), support.reshape(-1, support.shape[-1])
    for z, y, ids in zip(flat, ys, rows, strict=True):
        ids = ids[ids >= 0]
        if ids.numel() == 0:
            log_probs.append((z * 0).sum())
            entropies.append((z * 0).sum())
            continue
        keep = torch.zeros_like(z, dtype=torch.bool)
        keep[ids] = True
        log_pi = torch.log_softmax((z / temperature).masked_fill(~keep, float("-inf")), dim=-1)
        log_probs.append(log_pi[y])
        entropies.append(-(log_pi[ids].exp() * log_pi[ids]).sum())
    shape = logits.shape[:-1]
    return torch.stack(log_probs).view(shape), torch.stack(entropies).view(shape)


@pytest.mark.parametrize("vocab_block", [None, 7, 16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logits_value_and_gradient_match_the_loop(vocab_block, temperature):
    logits, targets, support = batch(0)
    ours = logits.clone().requires_grad_()
    theirs = logits.clone().requires_grad_()
    log_prob, entropy = pgloss.log_prob_and_entropy(
        ours, targets, support=support, temperature=temperature, vocab_block=vocab_block, chunk_size=3
    )
    ref_lp, ref_h = reference(theirs, targets, support, temperature)
    torch.testing.assert_close(log_prob, ref_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(entropy, ref_h, rtol=0, atol=1e-12)
    w1, w2 = torch.randn(B, T, dtype=torch.float64), torch.randn(B, T, dtype=torch.float64)
    (log_prob * w1 + entropy * w2).sum().backward()
    (ref_lp * w1 + ref_h * w2).sum().backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=0, atol=1e-12)
    assert ours.grad[1, 2].abs().max() == 0  # no support id: no gradient
    outside = torch.ones(V, dtype=torch.bool)
    outside[support[0, 0]] = False
    assert ours.grad[0, 0, outside].abs().max() == 0  # nothing reaches a column outside the support


def test_log_prob_only_gradient_and_float32():
    logits, targets, support = batch(1)
    ours = logits.float().requires_grad_()
    theirs = logits.clone().requires_grad_()
    log_prob, _ = pgloss.log_prob_and_entropy(ours, targets, support=support)
    log_prob.sum().backward()
    reference(theirs, targets, support)[0].sum().backward()
    torch.testing.assert_close(log_prob.double(), reference(logits, targets, support)[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(ours.grad.double(), theirs.grad, rtol=0, atol=2e-6)


def test_a_whole_vocabulary_support_is_the_plain_call():
    logits, targets, _ = batch(2)
    every = torch.arange(V).expand(B, T, V)
    plain = pgloss.log_prob_and_entropy(logits, targets)
    replay = pgloss.log_prob_and_entropy(logits, targets, support=every)
    for a, b in zip(plain, replay, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)


def test_a_target_outside_the_support_reads_its_logit():
    """As SkyRL's function: z_y − lse over the support, with no mask on the target (log π may exceed 0)."""
    logits, targets, support = batch(3)
    support[0, 0, 0] = (targets[0, 0] + K + 3) % V  # drop the target, keep the ids distinct
    support[0, 0] = torch.where(support[0, 0] == targets[0, 0], -1, support[0, 0])
    log_prob, _ = pgloss.log_prob_and_entropy(logits, targets, support=support)
    ids = support[0, 0][support[0, 0] >= 0]
    expected = logits[0, 0, targets[0, 0]] - torch.logsumexp(logits[0, 0, ids], dim=-1)
    torch.testing.assert_close(log_prob[0, 0], expected, rtol=0, atol=1e-13)


def test_bad_support_is_named():
    logits, targets, support = batch(0)
    bad = support.clone()
    bad[1, 0, 2] = V
    with pytest.raises(ValueError, match=r"support must hold token ids in \[0, 37\).*got 37 at \(1, 0, 2\)"):
        pgloss.log_prob_and_entropy(logits, targets, support=bad)
    bad[1, 0, 2] = -2
    with pytest.raises(ValueError, match="got -2"):
        pgloss.log_prob_and_entropy(logits, targets, support=bad)
    with pytest.raises(ValueError, match=r"support must have shape \[2, 5, k\]"):
        pgloss.log_prob_and_entropy(logits, targets, support=support[:, :4])
    with pytest.raises(ValueError, match=r"support must have shape"):
        pgloss.log_prob_and_entropy(logits, targets, support=support[..., 0])
    with pytest.raises(TypeError, match="support must hold integer token ids"):
        pgloss.log_prob_and_entropy(logits, targets, support=support.double())
    with pytest.raises(TypeError, match="support must be a Tensor"):
        pgloss.log_prob_and_entropy(logits, targets, support=support.tolist())


def test_the_kernel_routes_refuse_it_by_name():
    logits, targets, support = batch(0)
    with backends.use("kernel"), pytest.raises(ValueError, match="SupportLogProbEntropy"):
        pgloss.log_prob_and_entropy(logits.float(), targets, support=support)
    assert not backends.TRITON_TILES.runs(pgloss.vocab.support.SupportLogProbEntropy)
    assert not backends.TRITON_HEAD.runs(pgloss.vocab.support.SupportLogProbEntropy)


# -- SkyRL 0.4.0's own function -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SampleSupportScores:  # SkyRL's dataclass (its decorator is not executed by `sources.load`)
    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    valid_mask: torch.Tensor


def skyrl():
    root = os.environ.get("PGLOSS_SKYRL_SRC")
    if not root:
        pytest.skip("PGLOSS_SKYRL_SRC is not set (the root of the trainer's source)")
    path = Path(root) / "skyrl/backends/skyrl_train/utils/sample_support_replay.py"
    if not path.is_file():
        pytest.skip(f"PGLOSS_SKYRL_SRC={root} holds no {path.name}")
    namespace = {"torch": torch, "SampleSupportScores": SampleSupportScores, "SAMPLE_SUPPORT_TORCH_DTYPE": torch.int32}
    names = (
        "_project_pair_chunk",
        "_ChunkedCandidateProjection",
        "_project_candidate_pairs",
        "_selected_hidden_projection",
        "sample_support_scores",
    )
    return sources.load(path, names, namespace)["sample_support_scores"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_logits_match_skyrl(seed):
    scores = skyrl()
    logits, targets, support = batch(seed)
    ours = logits.clone().requires_grad_()
    theirs = logits.clone().requires_grad_()
    log_prob, entropy = pgloss.log_prob_and_entropy(ours, targets, support=support, vocab_block=16)
    out = scores(
        theirs,
        targets,
        support.to(torch.int32),
        vocab_start_index=0,
        vocab_end_index=V,
        tp_group=None,
        compute_entropy=True,
        entropy_requires_grad=True,
    )
    torch.testing.assert_close(log_prob, out.logprobs, rtol=0, atol=1e-12)
    torch.testing.assert_close(entropy, out.entropy, rtol=0, atol=1e-12)
    w1, w2 = torch.randn(B, T, dtype=torch.float64), torch.randn(B, T, dtype=torch.float64)
    (log_prob * w1 + entropy * w2).sum().backward()
    (out.logprobs * w1 + out.entropy * w2).sum().backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=0, atol=1e-12)


# -- from hidden states -------------------------------------------------------------------------------------------


def hidden_batch(seed: int):
    g = torch.Generator().manual_seed(seed + 100)
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    _, targets, support = batch(seed)
    return hidden, weight, targets, support


@pytest.mark.parametrize("vocab_block", [None, 7])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_hidden_value_and_gradient_match_the_loop(vocab_block, temperature):
    hidden, weight, targets, support = hidden_batch(0)
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    x_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    log_prob, entropy = pgloss.log_prob_and_entropy_from_hidden(
        x, w, targets, support=support, temperature=temperature, vocab_block=vocab_block, chunk_size=3
    )
    ref_lp, ref_h = reference(x_ref @ w_ref.T, targets, support, temperature)
    torch.testing.assert_close(log_prob, ref_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(entropy, ref_h, rtol=0, atol=1e-12)
    w1, w2 = torch.randn(B, T, dtype=torch.float64), torch.randn(B, T, dtype=torch.float64)
    (log_prob * w1 + entropy * w2).sum().backward()
    (ref_lp * w1 + ref_h * w2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=0, atol=1e-12)


def test_hidden_masked_positions_reach_nothing():
    """NaN hidden states, -100 targets and out-of-range support ids under the mask change no value or gradient."""
    hidden, weight, targets, support = hidden_batch(1)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 3:] = False
    dirty_h, dirty_y, dirty_s = hidden.clone(), targets.clone(), support.clone()
    dirty_h[0, 3:] = float("nan")
    dirty_y[0, 3:] = -100
    dirty_s[0, 3:] = V + 5
    clean_s = support.clone()
    clean_s[0, 3:] = -1
    results = []
    for h, y, s in ((dirty_h, dirty_y, dirty_s), (hidden, targets, clean_s)):
        x, w = h.clone().requires_grad_(), weight.clone().requires_grad_()
        log_prob, entropy = pgloss.log_prob_and_entropy_from_hidden(x, w, y, support=s, mask=mask, vocab_block=7)
        (log_prob + 0.3 * entropy).sum().backward()
        results.append((log_prob, entropy, x.grad, w.grad))
    for a, b in zip(*results, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert results[0][2][0, 3:].abs().max() == 0
    assert (results[0][0][0, 3:] == 0).all() and (results[0][1][0, 3:] == 0).all()


def test_hidden_bad_support_is_named():
    hidden, weight, targets, support = hidden_batch(0)
    bad = support.clone()
    bad[0, 4, 1] = V + 1
    with pytest.raises(ValueError, match=r"support must hold token ids in \[0, 37\).*got 38 at \(0, 4, 1\)"):
        pgloss.log_prob_and_entropy_from_hidden(hidden, weight, targets, support=bad)
    with pytest.raises(ValueError, match=r"support must have shape \[2, 5, k\]"):
        pgloss.log_prob_and_entropy_from_hidden(hidden, weight, targets, support=support[:1])
    with backends.use("head-kernel"), pytest.raises(ValueError, match="SupportLogProbEntropy"):
        pgloss.log_prob_and_entropy_from_hidden(hidden.float(), weight.float(), targets, support=support)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_hidden_matches_skyrl(temperature):
    """SkyRL's hidden-state path writes its projected logits into float32 whatever the inputs' dtype
    (`_project_candidate_pairs`), so both run on float32 inputs here."""
    scores = skyrl()
    hidden, weight, targets, support = (t.float() if t.is_floating_point() else t for t in hidden_batch(2))
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    x_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    log_prob, entropy = pgloss.log_prob_and_entropy_from_hidden(
        x, w, targets, support=support, temperature=temperature, vocab_block=16
    )
    out = scores(
        x_ref,
        targets,
        support.to(torch.int32),
        vocab_start_index=0,
        vocab_end_index=V,
        tp_group=None,
        compute_entropy=True,
        entropy_requires_grad=True,
        lm_head_weight=w_ref,
        temperature=temperature,
        chunk_size=4,
    )
    torch.testing.assert_close(log_prob, out.logprobs, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, out.entropy, rtol=0, atol=1e-5)
    w1, w2 = torch.randn(B, T), torch.randn(B, T)
    (log_prob * w1 + entropy * w2).sum().backward()
    (out.logprobs * w1 + out.entropy * w2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-5, atol=1e-5)


# -- the loss from hidden states ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["grpo", "dapo"])
@pytest.mark.parametrize("vocab_block", [None, 7])
def test_from_hidden_is_the_plain_call_on_the_support(name, vocab_block):
    """`algorithm.from_hidden(support=)` is `algorithm(log_prob=log π_S, entropy=H_S, ...)` in value and in the
    gradients of hidden and weight; NaN hidden states and bad ids under the mask reach nothing."""
    algorithm = pgloss.get(name, entropy_coef=0.01, kl_coef=0.0)
    hidden, weight, targets, support = hidden_batch(3)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 3:] = False
    mask[1, 2] = False  # the row without a support id
    g = torch.Generator().manual_seed(7)
    old_log_prob = -torch.rand(B, T, generator=g, dtype=torch.float64)
    advantages = torch.randn(B, generator=g, dtype=torch.float64)
    dirty_h, dirty_s, dirty_y = hidden.clone(), support.clone(), targets.clone()
    dirty_h[1, 3:] = float("nan")
    dirty_s[1, 3:] = -7
    dirty_y[1, 3:] = -100
    x, w = dirty_h.clone().requires_grad_(), weight.clone().requires_grad_()
    out = algorithm.from_hidden(
        x,
        w,
        dirty_y,
        old_log_prob=old_log_prob,
        advantages=advantages,
        mask=mask,
        support=dirty_s,
        vocab_block=vocab_block,
        temperature=0.8,
    )
    out.loss.backward()
    x_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    log_prob, entropy = reference(x_ref @ w_ref.T, targets, support, 0.8)
    ref = algorithm(
        log_prob=torch.where(mask, log_prob, 0.0),
        entropy=torch.where(mask, entropy, 0.0),
        old_log_prob=old_log_prob,
        advantages=advantages,
        mask=mask,
    )
    ref.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, rtol=0, atol=1e-12)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=0, atol=1e-12)
    assert x.grad[1, 2:].abs().max() == 0


def test_from_hidden_without_support_is_unchanged():
    """No support: the one pass, bit for bit as before (the support's reason to recompute is not taken)."""
    algorithm = pgloss.get("grpo", kl_coef=0.0)
    hidden, weight, targets, _ = hidden_batch(4)
    mask = torch.ones(B, T, dtype=torch.bool)
    kwargs = dict(old_log_prob=-torch.rand(B, T, dtype=torch.float64), advantages=torch.randn(B, dtype=torch.float64))
    a = algorithm.from_hidden(hidden, weight, targets, mask=mask, **kwargs)
    b = algorithm.from_hidden(hidden, weight, targets, mask=mask, support=None, **kwargs)
    assert torch.equal(a.loss, b.loss)


@pytest.mark.parametrize("vocab_block", [None, 7])
def test_meta_tensors(vocab_block):
    """Forward and backward on meta tensors, from logits and from hidden states: nothing reads a value on the
    host."""
    meta = lambda *s: torch.empty(*s, device="meta")  # noqa: E731
    targets = torch.zeros(B, T, dtype=torch.long, device="meta")
    support = torch.zeros(B, T, K, dtype=torch.long, device="meta")
    logits = meta(B, T, V).requires_grad_()
    log_prob, entropy = pgloss.log_prob_and_entropy(logits, targets, support=support, vocab_block=vocab_block)
    (log_prob + entropy).sum().backward()
    assert logits.grad.shape == logits.shape
    hidden, weight = meta(B, T, H).requires_grad_(), meta(V, H).requires_grad_()
    mask = torch.ones(B, T, dtype=torch.bool, device="meta")
    log_prob, entropy = pgloss.log_prob_and_entropy_from_hidden(
        hidden, weight, targets, support=support, mask=mask, vocab_block=vocab_block
    )
    (log_prob + entropy).sum().backward()
    assert hidden.grad.shape == hidden.shape and weight.grad.shape == weight.shape


@pytest.mark.compile
def test_compiles_whole_forward_and_backward():
    """torch.compile(fullgraph=True) of the call from hidden states over vocabulary tiles, with the eager value
    and gradients (a host read or an untraceable call would fail here)."""
    hidden, weight, targets, support = (t.float() if t.is_floating_point() else t for t in hidden_batch(5))
    mask = torch.ones(B, T, dtype=torch.bool)

    def call(h, w):
        log_prob, entropy = pgloss.log_prob_and_entropy_from_hidden(
            h, w, targets, support=support, mask=mask, chunk_size=4, vocab_block=16
        )
        return (log_prob + 0.1 * entropy).sum()

    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=True, backend="inductor")
    (h1, w1), (h2, w2) = [(hidden.clone().requires_grad_(), weight.clone().requires_grad_()) for _ in range(2)]
    loss = compiled(h1, w1)
    loss.backward()
    expected = call(h2, w2)
    expected.backward()
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-5, atol=1e-6)


# -- slime's own functions (a checkout: PGLOSS_SLIME_SRC) ---------------------------------------------------------


def slime():
    """slime's `calculate_log_probs_and_entropy` (`slime/utils/ppo_utils.py`, with its `_VocabParallelLogProbEntropy`)
    and `_build_topp_keep_mask` (`slime/backends/megatron_utils/loss.py`), read from a checkout of THUDM/slime
    (PGLOSS_SLIME_SRC; tested at commit 624b824a), on one rank: a stand-in for Megatron's `mpu`."""
    root = os.environ.get("PGLOSS_SLIME_SRC")
    if not root:
        pytest.skip("PGLOSS_SLIME_SRC is not set (the root of a slime checkout)")
    ppo, loss = Path(root) / "slime/utils/ppo_utils.py", Path(root) / "slime/backends/megatron_utils/loss.py"
    if not (ppo.is_file() and loss.is_file()):
        pytest.skip(f"PGLOSS_SLIME_SRC={root} holds no slime/utils/ppo_utils.py and megatron_utils/loss.py")

    class OneRank:  # Megatron's mpu without parallelism
        get_context_parallel_world_size = staticmethod(lambda: 1)
        get_tensor_model_parallel_rank = staticmethod(lambda: 0)

    namespace = {"torch": torch, "dist": torch.distributed, "mpu": OneRank}
    names = (
        "_maybe_all_reduce",
        "_get_vocab_parallel_rank_size",
        "_VocabParallelLogProbEntropy",
        "_calculate_log_probs_and_entropy_chunk",
        "calculate_log_probs_and_entropy",
    )
    sources.load(ppo, names, namespace)
    return sources.load(loss, ("_fill_topp_mask_rows", "_build_topp_keep_mask"), namespace)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_logits_match_slime(seed):
    """One packed sample (prompt 3 tokens, response 6): slime's keep mask from its ragged ids and offsets (each
    nucleus holding the sampled token, as a rollout's does), its log π over the response rows, against ours on
    the same rows with the nucleus as a [R, k] support padded with -1; float32 (slime's compute dtype)."""
    ns = slime()
    g = torch.Generator().manual_seed(seed)
    prompt, response = 3, 6
    total = prompt + response
    tokens = torch.randint(0, V, (total,), generator=g)
    sizes = [1 + int(n) for n in torch.randint(0, K, (response,), generator=g)]
    nuclei = []
    for r, size in enumerate(sizes):
        others = (tokens[prompt + r] + 1 + torch.randperm(V - 1, generator=g)[: size - 1]) % V
        nuclei.append([int(tokens[prompt + r])] + others.tolist())
    ids = [i for nucleus in nuclei for i in nucleus]
    offsets = [0]
    for nucleus in nuclei:
        offsets.append(offsets[-1] + len(nucleus))
    keep = ns["_build_topp_keep_mask"](total, V, torch.device("cpu"), [ids], [offsets], [total], [response], False)
    logits = torch.randn(total, V, generator=g) * 3
    shifted = torch.cat([tokens[1:], tokens[:1]])  # row i predicts token i + 1 (the last row's is not read)
    theirs = logits.clone().requires_grad_()
    log_prob, _ = ns["calculate_log_probs_and_entropy"](theirs, shifted, None, log_prob_keep_mask=keep)
    rows = slice(prompt - 1, total - 1)
    support = torch.full((response, K), -1)
    for r, nucleus in enumerate(nuclei):
        support[r, : len(nucleus)] = torch.tensor(nucleus)
    ours = logits.clone().requires_grad_()
    mine, _ = pgloss.log_prob_and_entropy(ours[rows], shifted[rows], support=support)
    torch.testing.assert_close(mine, log_prob.squeeze(-1)[rows], rtol=0, atol=2e-6)
    weights = torch.randn(response, generator=g)
    (mine * weights).sum().backward()
    (log_prob.squeeze(-1)[rows] * weights).sum().backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=0, atol=2e-6)
