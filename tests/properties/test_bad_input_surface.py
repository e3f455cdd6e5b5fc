"""Bad input on the surface beyond the losses' call (`RolloutCorrection`, `pgloss.advantages`,
`token_masks`, `m2po`, `full_kl`, the `Normalizer`), class by class: the silent wrong answers,
the torch-internal crashes, the metrics that went infinite, the messages that did not name the
argument, and the plausible mistakes (a probability for a log-probability, a step counted on other
masks). Each is a ValueError/TypeError naming the argument, or a finite, documented result."""

import math

import pytest
import torch
from conftest import log_probs, make_batch
from host_sync import no_host_sync

import pgloss
from pgloss import advantages as est
from pgloss.advantages import dynamic_sampling_keep, gae, group_advantages, overlong_penalty
from pgloss.core.checks import as_on_accelerator
from pgloss.core.normalizer import MAX_GROUPS
from pgloss.correction.m2po import m2po_cutoff, m2po_mask
from pgloss.correction.mismatch import mismatch_metrics
from pgloss.correction.rejection import Rejection
from pgloss.correction.rollout import RolloutCorrection
from pgloss.correction.token_masks import entropy_threshold, top_entropy_mask
from pgloss.vocab.entropy import sum_pi_squared

F64 = torch.float64
META = torch.device("meta")  # a second device: no accelerator is needed to mix two


def rollout_step(seed=0, rows=5, width=6):
    data = make_batch(batch=rows, length=width, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    rollout = log_probs(data["old_log_prob"] + 0.3 * torch.randn(rows, width, generator=gen, dtype=F64))
    return data["mask"], data["old_log_prob"], rollout


# ---- silent wrong answers ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "chunk_size, error, message",
    [
        (-1, ValueError, "chunk_size must be >= 1, got -1"),
        (0, ValueError, "chunk_size must be >= 1, got 0"),
        ("8", TypeError, "chunk_size must be an int or None, got str"),
        (2.0, TypeError, "chunk_size must be an int or None, got float"),
    ],
)
def test_sum_pi_squared_refuses_a_chunk_size_below_one(chunk_size, error, message):
    logits = torch.randn(3, 4, 5, dtype=F64)
    with pytest.raises(error, match=message):
        sum_pi_squared(logits, chunk_size=chunk_size)
    exact = logits.softmax(-1).square().sum(-1)
    for size in (1, 5, 12, 13, None):  # every chunking gives the exact sum, never uninitialised memory
        torch.testing.assert_close(sum_pi_squared(logits, chunk_size=size), exact, rtol=1e-12, atol=0)


@pytest.mark.parametrize("method", ["normalizer", "keep_mask", "step_weight_mean"])
@pytest.mark.parametrize("which", ["old", "rollout"])
def test_rollout_counting_checks_the_log_probs_like_a_call(method, which):
    """Broadcastable shapes gave the step's counts and weight mean from the wrong values; [B, T+1]
    failed inside torch; integer log-probs were accepted."""
    mask, old, rollout = rollout_step()
    corr = RolloutCorrection(upper=2.0, batch_normalize=True, rejection=(Rejection("token_k3", upper=0.05),))
    call = getattr(corr, method)
    name = {"normalizer": "log_probs", "keep_mask": "log_prob", "step_weight_mean": "log_probs"}[method]
    name = f"{which}_{name}"
    good = {"old": old, "rollout": rollout}
    for bad in (good[which][:, :1], good[which][:1], torch.cat([good[which], good[which][:, :1]], 1)):
        args = {**good, which: bad}
        with pytest.raises(ValueError, match=rf"{name} must have the shape of its mask \(5, 6\), got"):
            call(mask, args["old"], args["rollout"])
    args = {**good, which: good[which].round().long()}
    with pytest.raises(TypeError, match=rf"{name} must be a floating tensor, got dtype torch.int64"):
        call(mask, args["old"], args["rollout"])
    args = {**good, which: good[which].to(META)}
    with pytest.raises(ValueError, match=rf"{name} is on meta but mask"):
        call(mask, args["old"], args["rollout"])


def test_ce_gppo_gradient_stays_finite_where_the_ratio_underflows_float32():
    """r/sg[r] formed as ratio / ratio.detach() is 0/0 where exp(log r) underflows (log r < -88 in
    float32): the gradient was infinite. From the log-ratio it is float64's."""
    old = torch.tensor([[0.0, -1.0, 0.0]], dtype=F64)
    lp64 = torch.tensor([[-95.0, -1.5, -0.05]], dtype=F64)
    adv = torch.tensor([[-1.0, 1.0, 1.0]], dtype=F64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    alg = pgloss.get("ce_gppo", max_log_ratio=100.0)
    grads = {}
    for dtype in (torch.float32, F64):
        lp = lp64.to(dtype).requires_grad_()
        out = alg(lp, old.to(dtype), adv.to(dtype), mask)
        out.loss.backward()
        assert torch.isfinite(out.loss) and all(torch.isfinite(v) for v in out.metrics.values())
        grads[dtype] = lp.grad
    # the low branch: -β₁(1 - ε_low)·Â per token, over 3 tokens
    assert grads[F64][0, 0].item() == pytest.approx(0.75 * 0.8 / 3)
    torch.testing.assert_close(grads[torch.float32].double(), grads[F64], rtol=1e-6, atol=1e-7)


def test_a_nan_cut_is_refused_instead_of_keeping_no_token():
    data = make_batch(seed=3)
    entropy, mask = data["entropy"], data["mask"]
    for threshold in (math.nan, torch.tensor(math.nan, dtype=F64)):
        with pytest.raises(ValueError, match="threshold is NaN: no value passes it"):
            top_entropy_mask(entropy, mask, threshold)
    behave = log_probs(data["old_log_prob"] + 0.2)
    for cutoff in (math.nan, torch.tensor(math.nan)):
        with pytest.raises(ValueError, match="cutoff is NaN: no value passes it"):
            m2po_mask(behave, data["old_log_prob"], mask, cutoff)
    assert top_entropy_mask(entropy, mask, -math.inf).equal(mask)  # ±inf: keep all or nothing
    assert not m2po_mask(behave, data["old_log_prob"], mask, -math.inf).any()


def test_one_nan_at_a_valid_position_does_not_empty_the_step():
    """The quantile of entropies with one NaN was NaN and kept no token; the cut of M2PO sorted a NaN
    first. Both functions read the host anyway: a NaN at a valid position is refused, by position."""
    data = make_batch(seed=3)
    entropy, mask = data["entropy"].clone(), data["mask"]
    row, column = mask.nonzero()[2].tolist()
    entropy[row, column] = math.nan
    with pytest.raises(ValueError, match=rf"entropies\[0\] is nan at a valid position \({row}, {column}\)"):
        entropy_threshold(entropy, mask, top=0.2)
    entropy[~mask] = math.nan  # at masked positions: harmless
    entropy[row, column] = 0.5
    assert torch.isfinite(entropy_threshold(entropy, mask, top=0.2))
    behave = data["old_log_prob"].clone()
    behave[row, column] = math.nan
    with pytest.raises(
        ValueError,
        match=rf"m2 of behave_log_probs\[0\] and prox_log_probs\[0\] is nan at a valid "
        rf"position \({row}, {column}\)",
    ):
        m2po_cutoff(behave, data["old_log_prob"], mask, threshold=0.01)


@pytest.mark.parametrize("fn", [est.passk_advantages, group_advantages])
def test_an_eps_that_lets_equal_scores_divide_by_zero_is_refused(fn):
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=F64)  # group 0: all equal, σ = 0
    ids = torch.tensor([0, 0, 1, 1])
    for eps, error, message in (
        (0.0, ValueError, "eps must be > 0, got 0.0"),
        (-1, ValueError, "eps must be > 0"),
        ("1e-6", TypeError, "eps must be a real number"),
        (math.nan, ValueError, "eps must be finite"),
    ):
        with pytest.raises(error, match=message):
            fn(scores, ids, eps=eps)
    assert torch.isfinite(fn(scores, ids, eps=1e-6)).all()


# ---- crashes with torch-internal messages -----------------------------------------------------


@pytest.mark.parametrize("shape", [(0, 4), (3, 0)])
def test_the_exact_kl_from_hidden_states_handles_empty_batches(shape):
    rows, width = shape
    hidden = torch.randn(rows, width, 5, dtype=F64, requires_grad=True)
    weight = torch.randn(7, 5, dtype=F64, requires_grad=True)
    ref_hidden, ref_weight = torch.randn(rows, width, 3, dtype=F64), torch.randn(7, 3, dtype=F64)
    kl = pgloss.full_kl_from_hidden(hidden, weight, ref_hidden, ref_weight)
    assert kl.shape == shape
    kl.sum().backward()
    assert weight.grad.shape == weight.shape and not weight.grad.any()
    alg = pgloss.get("grpo", kl_estimator="full")
    hidden.grad = weight.grad = None
    out = alg.from_hidden(
        hidden,
        weight,
        torch.zeros(shape, dtype=torch.long),
        old_log_prob=torch.zeros(shape, dtype=F64),
        advantages=torch.zeros(rows, dtype=F64),
        mask=torch.ones(shape, dtype=torch.bool),
        ref_hidden=ref_hidden,
        ref_weight=ref_weight,
    )
    out.loss.backward()
    assert out.loss.item() == 0.0 and not weight.grad.any()


def estimator_calls(scores, ids, mask, rewards):
    """Every estimator that takes group ids, with the other inputs it needs."""
    lengths = mask.sum(-1)
    return {
        "grpo_advantages": lambda ids: est.grpo_advantages(scores, ids),
        "rloo_advantages": lambda ids: est.rloo_advantages(scores, ids),
        "reinforce_pp_baseline_advantages": lambda ids: est.reinforce_pp_baseline_advantages(scores, ids, mask),
        "opo_advantages": lambda ids: est.opo_advantages(scores, ids, lengths),
        "gpg_advantages": lambda ids: est.gpg_advantages(scores, ids),
        "gdpo_advantages": lambda ids: est.gdpo_advantages(scores[:, None], ids),
        "passk_advantages": lambda ids: est.passk_advantages(scores, ids),
        "optimal_token_baseline_advantages": lambda ids: est.optimal_token_baseline_advantages(
            rewards, mask, ids, torch.full(mask.shape, -1.0, dtype=F64), torch.full(mask.shape, 0.5, dtype=F64)
        ),
        "group_advantages": lambda ids: group_advantages(scores, ids),
        "dynamic_sampling_keep": lambda ids: dynamic_sampling_keep(scores, ids),
    }


@pytest.mark.parametrize("name", list(estimator_calls(*[torch.zeros(1)] * 4)))
def test_group_ids_on_another_device_are_named(name):
    data = make_batch(batch=6, seed=2)
    ids = torch.arange(6) // 2
    calls = estimator_calls(data["scores"], ids, data["mask"], torch.rand(6, 7, dtype=F64))
    calls[name](ids)  # the right device: fine
    with pytest.raises(ValueError, match="group_ids is on meta but (scores|token_rewards) is on cpu"):
        calls[name](ids.to(META))


def test_other_estimator_inputs_on_another_device_are_named():
    data = make_batch(batch=6, seed=2)
    scores, ids, mask = data["scores"], torch.arange(6) // 2, data["mask"]
    rewards = torch.rand(6, 7, dtype=F64)
    with pytest.raises(ValueError, match="baseline is on meta but token_rewards is on cpu"):
        est.remax_advantages(rewards, mask, torch.zeros(6, dtype=F64, device=META))
    with pytest.raises(ValueError, match="lengths is on meta but scores is on cpu"):
        est.opo_advantages(scores, ids, mask.sum(-1).to(META))
    with pytest.raises(ValueError, match="mask is on meta but scores is on cpu"):
        est.reinforce_pp_baseline_advantages(scores, ids, mask.to(META))
    with pytest.raises(ValueError, match="weights is on meta but scores is on cpu"):
        est.gdpo_advantages(scores[:, None], ids, weights=torch.ones(1, dtype=F64, device=META))
    with pytest.raises(ValueError, match="mask is on meta but token_rewards is on cpu"):
        est.discounted_returns(rewards, mask.to(META))


def test_the_loss_call_names_group_ids_and_scores_on_another_device():
    data = make_batch(seed=2)
    args = (data["log_prob"], data["old_log_prob"], data["advantages"], data["mask"])
    with pytest.raises(ValueError, match="group_ids is on meta but log_prob is on cpu"):
        pgloss.get("real")(*args, group_ids=data["group_ids"].to(META))
    with pytest.raises(ValueError, match="scores is on meta but log_prob is on cpu"):
        pgloss.get("topr")(*args, scores=data["scores"].to(META))


@pytest.mark.parametrize("missing", ["old_log_prob", "sum_pi_sq"])
def test_optimal_token_baseline_names_a_missing_input(missing):
    mask = torch.ones(4, 3, dtype=torch.bool)
    inputs = dict(old_log_prob=torch.full((4, 3), -1.0, dtype=F64), sum_pi_sq=torch.full((4, 3), 0.4, dtype=F64))
    inputs[missing] = None
    with pytest.raises(TypeError, match=rf"{missing} must be a \[B, T\] tensor, got None"):
        est.optimal_token_baseline_advantages(torch.rand(4, 3, dtype=F64), mask, torch.tensor([0, 0, 1, 1]), **inputs)


# ---- metrics that went infinite from finite input ---------------------------------------------


@pytest.mark.parametrize("gap", [1e4, -1e4])
def test_rollout_mismatch_metrics_stay_finite(gap):
    mask = torch.ones(2, 3, dtype=torch.bool)
    train = torch.zeros(2, 3) if gap > 0 else torch.full((2, 3), gap)
    rollout = torch.full((2, 3), -gap) if gap > 0 else torch.zeros(2, 3)
    metrics = {k: stat.value for k, stat in mismatch_metrics(train, rollout, mask).items()}
    assert all(torch.isfinite(v) for v in metrics.values()), metrics
    assert metrics["rollout_ppl_ratio"].item() == pytest.approx(math.exp(-20.0 if gap > 0 else 20.0), rel=1e-5)
    out = pgloss.get("dapo")(train, train, torch.ones(2), mask, rollout_log_prob=rollout)
    assert all(torch.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize("clip_range", [0.2, None])
def test_fipo_future_kl_stays_finite_at_the_lowest_float32_log_prob(clip_range):
    data = make_batch(seed=6, dtype=torch.float32)
    log_prob = data["log_prob"].clone()
    log_prob[data["mask"]] = torch.finfo(torch.float32).min
    log_prob.requires_grad_()
    out = pgloss.get("fipo", fipo_clip_range=clip_range)(
        log_prob, data["old_log_prob"], data["advantages"], data["mask"]
    )
    out.loss.backward()
    assert all(torch.isfinite(v) for v in out.metrics.values()), out.metrics
    assert torch.isfinite(out.loss) and torch.isfinite(log_prob.grad).all()


# ---- messages that name the argument ----------------------------------------------------------


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda d: est.gpg_advantages(d["scores"], d["ids"], f_norm="1"),
            TypeError,
            "f_norm must be a real number, got '1'",
        ),
        (lambda d: est.gpg_advantages(d["scores"], d["ids"], f_norm=0), ValueError, "f_norm must be > 0, got 0"),
        (
            lambda d: top_entropy_mask(d["entropy"], d["mask"], "1.0"),
            TypeError,
            "threshold must be a real number or a 0-d floating tensor, got '1.0'",
        ),
        (
            lambda d: top_entropy_mask(d["entropy"], d["mask"], torch.ones(2)),
            TypeError,
            "threshold must be a real number or a 0-d",
        ),
        (lambda d: m2po_mask(d["old"], d["old"], d["mask"], "0.1"), TypeError, "cutoff must be a real number"),
        (lambda d: sum_pi_squared(d["logits"], chunk_size=0), ValueError, "chunk_size must be >= 1, got 0"),
        (lambda d: sum_pi_squared(d["logits"], temperature="1"), TypeError, "temperature must be a real number"),
        (
            lambda d: est.discounted_returns(d["entropy"], d["mask"], gamma="0.9"),
            TypeError,
            "gamma must be a real number",
        ),
        (
            lambda d: est.passk_advantages(d["scores"], d["ids"], scale="no"),
            TypeError,
            "scale must be a bool, got 'no'",
        ),
        (
            lambda d: est.optimal_token_baseline_advantages(
                d["entropy"], d["mask"], d["ids"], d["old"], d["entropy"], zero_tail=1
            ),
            TypeError,
            "zero_tail must be a bool",
        ),
        (
            lambda d: gae(d["entropy"], d["entropy"], d["mask"], gamma=1.0, lam="0.95"),
            TypeError,
            "lam must be a real number",
        ),
        (
            lambda d: overlong_penalty(torch.tensor([3]), max_length=8.0, cache_length=2),
            TypeError,
            "max_length must be an int",
        ),
        (lambda d: group_advantages(d["scores"], d["ids"].double()), ValueError, "group_ids must be integers of shape"),
    ],
)
def test_messages_name_the_argument(call, error, message):
    data = make_batch(seed=1)
    inputs = dict(
        scores=data["scores"],
        ids=torch.tensor([0, 0, 1, 1, 2]),
        entropy=data["entropy"],
        mask=data["mask"],
        old=data["old_log_prob"],
        logits=torch.randn(2, 3, 4),
    )
    with pytest.raises(error, match=message):
        call(inputs)


# ---- plausible mistakes -----------------------------------------------------------------------


@pytest.mark.parametrize("key", ["log_prob", "old_log_prob", "ref_log_prob", "rollout_log_prob"])
def test_probabilities_passed_for_log_probabilities_are_refused(key):
    data = make_batch(seed=11)
    data["rollout_log_prob"] = data["old_log_prob"].clone()
    row, column = data["mask"].nonzero()[3].tolist()
    alg = pgloss.get("grpo")

    def call(d):
        return alg(
            d["log_prob"],
            d["old_log_prob"],
            d["advantages"],
            d["mask"],
            ref_log_prob=d["ref_log_prob"],
            rollout_log_prob=d["rollout_log_prob"],
        )

    probabilities = dict(data, **{key: data[key].exp()})  # every valid value positive: the first is named
    first = tuple(data["mask"].nonzero()[0].tolist())
    with pytest.raises(
        ValueError,
        match=rf"{key} must hold log-probabilities \(<= 0\), got .* at a valid position "
        rf"\({first[0]}, {first[1]}\); were probabilities passed",
    ):
        call(probabilities)
    one = dict(data, **{key: data[key].clone()})
    one[key][row, column] = 0.25
    with pytest.raises(
        ValueError,
        match=rf"{key} must hold log-probabilities \(<= 0\), got 0.25 at a valid position "
        rf"\({row}, {column}\)",
    ):
        call(one)
    masked = dict(data, **{key: data[key].clone()})
    masked[key][~data["mask"]] = 3.0  # at masked positions: never read
    masked[key][row, column] = 0.0  # probability one: a log-prob of 0 is valid
    assert torch.isfinite(call(masked).loss)


@pytest.mark.parametrize("key", ["log_prob", "old_log_prob", "ref_log_prob", "rollout_log_prob", "teacher_log_prob"])
def test_a_positive_log_prob_is_refused_on_every_device_without_a_host_sync(key):
    """One behaviour on every device: refused. Where the host reads the values for free (CPU), a
    ValueError with the position (above); on an accelerator, simulated on CPU tensors by the host-sync
    detector (`as_on_accelerator`: the path a CUDA call takes), an assert on the device
    (`torch._assert_async`: a RuntimeError here, a device-side assert on CUDA) and no host sync; inside
    `detect_anomaly()`, the ValueError with the position on every device."""
    data = make_batch(seed=11)
    row, column = data["mask"].nonzero()[3].tolist()
    alg = pgloss.get("opd", kl_coef=0.1, rollout_correction=RolloutCorrection(upper=2.0))
    data["rollout_log_prob"] = data["old_log_prob"].clone()

    def call(d):
        return alg(
            d["log_prob"],
            d["old_log_prob"],
            d["advantages"],
            d["mask"],
            ref_log_prob=d["ref_log_prob"],
            rollout_log_prob=d["rollout_log_prob"],
            teacher_log_prob=d["teacher_log_prob"],
        )

    one = dict(data, **{key: data[key].clone()})
    one[key][row, column] = 0.25
    with pytest.raises(ValueError, match=rf"{key} must hold log-probabilities \(<= 0\), got 0.25 at a valid position"):
        call(one)  # CPU
    with (
        pytest.raises(
            RuntimeError,
            match=rf"{key} must hold log-probabilities \(<= 0\), got a positive value at a "
            r"valid position; were probabilities passed",
        ),
        no_host_sync(),
    ):
        call(one)  # an accelerator
    with (
        as_on_accelerator(),
        pgloss.detect_anomaly(),
        pytest.raises(
            ValueError,
            match=rf"got 0.25 at a valid position "
            rf"\({row}, {column}\)",
        ),
    ):
        call(one)
    masked = dict(data, **{key: data[key].clone()})
    masked[key][~data["mask"]] = 3.0  # at masked positions: never read, on any device
    with no_host_sync():
        loss = call(masked).loss
    assert torch.isfinite(loss)
    meta = {k: v.to("meta") for k, v in one.items()}  # no values: nothing to refuse, nothing read
    assert call(meta).loss.device.type == "meta"


def test_probabilities_are_refused_before_the_loss_on_an_accelerator_too():
    mask, old, rollout = rollout_step(seed=4)
    corr = RolloutCorrection(upper=2.0, rejection=(Rejection("token_k2", upper=0.1),))
    with pytest.raises(RuntimeError, match="rollout_log_probs must hold log-probabilities"), no_host_sync():
        corr.step_weight_mean(mask, old, rollout.exp())
    with pytest.raises(RuntimeError, match="prox_log_prob must hold log-probabilities"), no_host_sync():
        m2po_mask(rollout, old.exp(), mask, 1.0)


@pytest.mark.compile
def test_a_compiled_call_refuses_a_positive_log_prob():
    """Inside `torch.compile(fullgraph=True)` the check is the device assert (inductor lowers it; on
    CUDA a `tl.device_assert`), not a graph break."""
    data = make_batch(seed=11)
    alg = pgloss.get("grpo", kl_coef=0.0)
    torch._dynamo.reset()
    compiled = torch.compile(lambda lp, old: alg(lp, old, data["advantages"], data["mask"]).loss, fullgraph=True)
    assert torch.isfinite(compiled(data["log_prob"], data["old_log_prob"]))
    with pytest.raises(RuntimeError, match="old_log_prob must hold log-probabilities"):
        compiled(data["log_prob"], data["old_log_prob"].exp())


def test_probabilities_are_refused_wherever_log_probs_are_read_before_the_loss():
    mask, old, rollout = rollout_step(seed=4)
    corr = RolloutCorrection(upper=2.0, rejection=(Rejection("token_k2", upper=0.1),))
    with pytest.raises(ValueError, match="rollout_log_probs must hold log-probabilities"):
        corr.normalizer(mask, old, rollout.exp())
    with pytest.raises(ValueError, match="old_log_prob must hold log-probabilities"):
        corr.keep_mask(mask, old.exp(), rollout)
    with pytest.raises(ValueError, match="behave_log_prob must hold log-probabilities"):
        m2po_cutoff(rollout.exp(), old, mask, threshold=0.1)
    with pytest.raises(ValueError, match="prox_log_prob must hold log-probabilities"):
        m2po_mask(rollout, old.exp(), mask, 1.0)
    with pytest.raises(ValueError, match="old_log_prob must hold log-probabilities"):
        est.optimal_token_baseline_advantages(
            torch.rand(mask.shape, dtype=F64),
            mask,
            torch.arange(5) // 2,
            old.exp(),
            torch.full(mask.shape, 0.3, dtype=F64),
        )


def test_a_normalizer_counted_on_fewer_tokens_than_the_call_holds_is_refused():
    data = make_batch(batch=6, length=7, seed=12)
    mask = data["mask"]
    alg = pgloss.get("dapo")
    args = (data["log_prob"], data["old_log_prob"], data["advantages"], mask)
    truncated = mask & (torch.arange(7) < 3)  # counted on another mask than the call's
    with pytest.raises(
        ValueError,
        match=rf"the normalizer counted {int(truncated.sum())} tokens but this call holds "
        rf"{int(mask.sum())}",
    ):
        alg(*args, normalizer=pgloss.Normalizer.count(truncated))
    fewer_rows = pgloss.Normalizer(tokens=torch.tensor(1000.0, dtype=F64), sequences=torch.tensor(2.0, dtype=F64))
    with pytest.raises(
        ValueError, match=rf"the normalizer counted 2 sequences but this call holds {int(mask.any(-1).sum())}"
    ):
        alg(*args, normalizer=fewer_rows)
    ids = torch.arange(6) // 2
    groups = pgloss.Normalizer(
        tokens=torch.tensor(1000.0, dtype=F64),
        sequences=torch.tensor(100.0, dtype=F64),
        group_tokens=torch.tensor([1.0, 100.0, 100.0], dtype=F64),
    )
    with pytest.raises(ValueError, match="the normalizer counted 1 tokens in group 0 but this call holds more"):
        pgloss.get("real")(*args, group_ids=ids, normalizer=groups)
    # a micro-batch of the step, and a step counted on more tokens (kept in the denominator), are fine
    step = pgloss.Normalizer.count([mask, mask[:2]])
    assert torch.isfinite(alg(*args, normalizer=step).loss)
    assert torch.isfinite(
        alg(
            data["log_prob"],
            data["old_log_prob"],
            data["advantages"],
            truncated,
            normalizer=pgloss.Normalizer.count(mask),
        ).loss
    )


def test_value_checks_need_no_host_read_off_the_cpu():
    """On meta tensors (an accelerator's stand-in) the value checks do not run: a call reads no value."""
    mask = torch.empty(3, 4, dtype=torch.bool, device=META)
    token = torch.empty(3, 4, device=META)
    counted = pgloss.Normalizer.count(mask, group_ids=torch.empty(3, dtype=torch.long, device=META))
    assert counted.group_tokens.shape == (MAX_GROUPS,)  # the static bound: max id + 1 needs a host read
    out = pgloss.get("real")(
        token,
        token,
        torch.empty(3, device=META),
        mask,
        group_ids=torch.empty(3, dtype=torch.long, device=META),
        normalizer=counted,
    )
    assert out.loss.device == META
