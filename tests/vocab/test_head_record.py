"""An LM head's options as one record, `pgloss.HeadOptions` (`head=`, `ref_head=`, `teacher_head=`), the one
spelling every call from hidden states takes: the record reaches the call's values and gradients, the keywords
that once spelled it out (`bias=`, `logit_scale=`, `softcap=`, `ref_...`, `teacher_...`) are refused with the
fix, and every such call turns its records into heads at one place (`head.as_head`)."""

import dataclasses
import inspect

import pytest
import torch
from vocab.head_checks import assert_refuses_removed_keywords

import pgloss
from pgloss import from_hidden
from pgloss.vocab import divergence, full_kl, fused, head, topk_divergence

B, T, H, H_OTHER, V = 3, 5, 8, 6, 37
TAU = 0.7
MASK = torch.arange(T)[None, :] < torch.tensor([5, 3, 1])[:, None]
STUDENT = dict(logit_scale=0.8, softcap=3.0)  # plus its bias
OTHER = dict(logit_scale=1.25, softcap=2.0)  # the reference's or the teacher's, plus its bias


def make(seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: scale * torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    return dict(
        hidden=r(B, T, H),
        weight=r(V, H, scale=0.7),
        bias=r(V, scale=0.5),
        other_hidden=r(B, T, H_OTHER),
        other_weight=r(V, H_OTHER, scale=0.7),
        other_bias=r(V, scale=0.5),
        noise=r(B, T),
        targets=torch.randint(0, V, (B, T), generator=gen),
        advantages=r(B),
    )


TOP_LOG_PROBS, TOP_IDS = torch.log_softmax(
    torch.randn(B, T, V, dtype=torch.float64, generator=torch.Generator().manual_seed(1)), -1
).topk(4, dim=-1)


def grpo_inputs(x):
    """grpo with the exact KL to the reference head and an entropy bonus; old log-probs near the current ones."""
    with torch.no_grad():
        current, _ = pgloss.log_prob_and_entropy_from_hidden(
            x["hidden"], x["weight"], x["targets"], temperature=TAU, head=pgloss.HeadOptions(x["bias"], **STUDENT)
        )
    old = (current + 0.3 * x["noise"]).masked_fill(~MASK, float("nan"))
    return dict(old_log_prob=old, advantages=x["advantages"], mask=MASK)


# Each public call from hidden states: (its keyword prefix for the other model, or None without one; a function of
# the data, the policy's three leaves and the head keyword arguments that returns a scalar to differentiate).
CALLS = {
    "log_prob_and_entropy_from_hidden": (
        None,
        lambda x, h, w, kw: sum(
            t.sum()
            for t in (pgloss.log_prob_and_entropy_from_hidden(h, w, x["targets"], temperature=TAU, chunk_size=4, **kw))
        ),
    ),
    "loss_from_hidden": (
        "ref_",
        lambda x, h, w, kw: (
            pgloss.get("grpo", kl_estimator="full", kl_coef=0.3, entropy_coef=0.01)
            .from_hidden(
                h,
                w,
                x["targets"],
                **grpo_inputs(x),
                ref_hidden=x["other_hidden"],
                ref_weight=x["other_weight"],
                temperature=TAU,
                chunk_size=4,
                **kw,
            )
            .loss
        ),
    ),
    "loss_from_hidden one pass": (
        None,
        lambda x, h, w, kw: (
            pgloss.get("grpo", entropy_coef=0.01)
            .from_hidden(
                h,
                w,
                x["targets"],
                **grpo_inputs(x),
                ref_log_prob=grpo_inputs(x)["old_log_prob"] - 0.1,
                temperature=TAU,
                chunk_size=11,
                **kw,
            )
            .loss
        ),
    ),
    "full_kl_from_hidden": (
        "ref_",
        lambda x, h, w, kw: pgloss.full_kl_from_hidden(
            h, w, x["other_hidden"], x["other_weight"], temperature=TAU, chunk_size=4, vocab_block=10, **kw
        ).sum(),
    ),
    "divergence_from_hidden": (
        "teacher_",
        lambda x, h, w, kw: (
            pgloss.divergence_from_hidden(
                h, w, x["other_hidden"], x["other_weight"], MASK, beta=0.4, temperature=TAU, chunk_size=4, **kw
            ).loss
        ),
    ),
    "topk_divergence_from_hidden": (
        None,
        lambda x, h, w, kw: (
            pgloss.topk_divergence_from_hidden(
                h, w, TOP_IDS, TOP_LOG_PROBS, MASK, beta=0.0, temperature=TAU, chunk_size=4, vocab_block=10, **kw
            ).loss
        ),
    ),
    "student_topk_divergence_from_hidden": (
        "teacher_",
        lambda x, h, w, kw: (
            pgloss.student_topk_divergence_from_hidden(
                h, w, x["other_hidden"], x["other_weight"], MASK, k=4, beta=0.5, temperature=TAU, chunk_size=4, **kw
            ).loss
        ),
    ),
}


def heads(x, bias, other):
    """The call's head records: the trained model's with `bias`, and the other model's (prefix `other`)."""
    records = dict(head=pgloss.HeadOptions(bias, **STUDENT))
    if other is not None:
        records[f"{other}head"] = pgloss.HeadOptions(x["other_bias"], **OTHER)
    return records


@pytest.mark.parametrize("name", CALLS)
def test_the_record_reaches_the_values_and_the_bias_its_gradient(name):
    other, call = CALLS[name]
    x = make()
    h, w, b = (x[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    value = call(x, h, w, heads(x, b, other))
    value.backward()
    assert b.grad.abs().sum() > 0  # the bias took part
    # the options matter: the plain heads give another value
    assert not torch.equal(call(x, x["hidden"], x["weight"], {}), value.detach())


@pytest.mark.parametrize("name", CALLS)
def test_the_removed_keywords_are_refused_with_the_record_that_replaces_them(name):
    other, call = CALLS[name]
    x = make()
    h, w = x["hidden"], x["weight"]
    for prefix in ("",) + ((other,) if other else ()):
        assert_refuses_removed_keywords(lambda **kw: call(x, h, w, kw), x["bias"], prefix)
        with pytest.raises(TypeError, match=f"^{prefix}head must be a pgloss.HeadOptions or None, got dict"):
            call(x, h, w, {f"{prefix}head": dict(softcap=2.0)})


PUBLIC = {  # each public call from hidden states: the prefixes of the heads it takes
    fused.log_prob_and_entropy_from_hidden: ("",),
    from_hidden.loss_from_hidden: ("", "ref_"),
    full_kl.full_kl_from_hidden: ("", "ref_"),
    divergence.divergence_from_hidden: ("", "teacher_"),
    topk_divergence.topk_divergence_from_hidden: ("",),
    topk_divergence.student_topk_divergence_from_hidden: ("", "teacher_"),
}


def test_every_call_from_hidden_takes_the_record_alone_and_converts_at_one_place():
    from_hidden = {getattr(pgloss, name) for name in pgloss.__all__ if name.endswith("_from_hidden")}
    assert from_hidden == set(PUBLIC)  # a new call from hidden states is listed here, and so checked
    assert "return loss_from_hidden(self, hidden, weight, targets, **kwargs)" in inspect.getsource(
        pgloss.Algorithm.from_hidden
    )  # Algorithm.from_hidden is loss_from_hidden
    options = [f.name for f in dataclasses.fields(pgloss.HeadOptions)]
    assert options == list(head.REMOVED_KEYWORDS) == ["bias", "logit_scale", "softcap"]
    for function, prefixes in PUBLIC.items():
        parameters = inspect.signature(function).parameters
        source = inspect.getsource(function)
        assert f"@refuses_head_keywords({', '.join(repr(p) for p in prefixes)})" in source.replace('"', "'")
        for prefix in prefixes:
            assert parameters[f"{prefix}head"].default is None  # the record alone
            assert not any(f"{prefix}{option}" in parameters for option in options)
            assert f"as_head({prefix}head" in source  # the record becomes one Head at the entry
    # no other module of the package reads a head's options one by one
    for module in (fused, full_kl, divergence, topk_divergence):
        source = inspect.getsource(module)
        assert "check_head(" not in source and "other_softcap" not in source
