"""What the tests of LM-head options share: an option set's biases filled in (`with_biases`) and turned into the
records the calls take (`records`), a call compiled whole against its eager run (`assert_compiles_like_eager`),
and the refusals of a bad option (`head.Head.check`) and of the removed keywords (`head.refuses_head_keywords`),
asserted per caller and per head (`prefix`: "" for the trained model, "ref_" or "teacher_" for the other)."""

import math
import re

import pytest
import torch

import pgloss


def with_biases(opts: dict, x: dict, bias: torch.Tensor | None = None) -> dict:
    """`opts` with each `*bias=True` replaced by the tensor of that name in `x` (the trained model's by `bias`
    when given, a leaf to differentiate)."""
    out = {k: x[k] if v is True and k.endswith("bias") else v for k, v in opts.items()}
    if bias is not None and "bias" in out:
        out["bias"] = bias
    return out


OPTION_NAMES = ("bias", "logit_scale", "softcap")


def records(opts: dict) -> dict:
    """`opts` as the calls take them: the head options written flat (`bias`, `logit_scale`, `softcap` and their
    `ref_` / `teacher_` twins, as the tests' tables and the materialised logits read them) gathered into one
    `pgloss.HeadOptions` per model (`head=`, `ref_head=`, `teacher_head=`); other keywords pass through."""
    out, heads = {}, {}
    for key, value in opts.items():
        prefix = next((p for p in ("ref_", "teacher_") if key.startswith(p)), "")
        if key[len(prefix) :] in OPTION_NAMES:
            heads.setdefault(f"{prefix}head", {})[key[len(prefix) :]] = value
        else:
            out[key] = value
    return out | {name: pgloss.HeadOptions(**fields) for name, fields in heads.items()}


def assert_refuses_bad_head(call, bias: torch.Tensor, prefix: str = "") -> None:
    """`call(**options)` refuses each bad bias, logit scale and soft-cap of the record
    `{prefix}head=HeadOptions(...)`, naming it `{prefix}head.bias`, ...; and the keywords that once spelled the
    record out (`{prefix}bias=`, ...) with the fix. `bias` is a valid float64 bias on the CPU."""

    def bad(option: str, value: object):
        """`call` with one bad option, and that option's name in the error."""
        head = pgloss.HeadOptions(**{option: value})
        return lambda: call(**{f"{prefix}head": head}), f"{prefix}head.{option}"

    w = f"{prefix}weight"
    for value, error, message in (
        (bias[:-1], ValueError, rf"must have shape \[V\] = \[{bias.shape[0]}\] \(the rows of {w}\), got"),
        (bias.float(), TypeError, f"has dtype torch.float32 but {w} has torch.float64"),
        (bias.tolist(), TypeError, "must be a Tensor or None, got list"),
        (torch.empty_like(bias, device="meta"), ValueError, f"is on meta but {w} is on cpu"),
    ):
        run, name = bad("bias", value)
        with pytest.raises(error, match=f"^{re.escape(name)} {message}"):
            run()
    for value in (0.0, -1.0):
        run, name = bad("logit_scale", value)
        with pytest.raises(ValueError, match=f"^{re.escape(name)} must be a finite number > 0, got {value}"):
            run()
        run, name = bad("softcap", value)
        with pytest.raises(ValueError, match=f"^{re.escape(name)} must be a finite number > 0 or None, got {value}"):
            run()
    for value in (math.inf, math.nan):
        for option in ("logit_scale", "softcap"):
            run, name = bad(option, value)
            with pytest.raises(ValueError, match=f"^{re.escape(name)} must be finite"):
                run()
    for value in ("2", True, None):
        run, name = bad("logit_scale", value)
        with pytest.raises(TypeError, match=f"^{re.escape(name)} must be a real number"):
            run()
    run, name = bad("softcap", "30")
    with pytest.raises(TypeError, match=f"^{re.escape(name)} must be a real number or None"):
        run()
    with pytest.raises(TypeError, match=f"^{re.escape(prefix)}head must be a pgloss.HeadOptions or None, got dict"):
        call(**{f"{prefix}head": dict(softcap=2.0)})
    assert_refuses_removed_keywords(call, bias, prefix)


def assert_refuses_removed_keywords(call, bias: torch.Tensor, prefix: str = "") -> None:
    """`call` refuses the keywords `{prefix}bias=`, `{prefix}logit_scale=`, `{prefix}softcap=` (even at their old
    defaults), a TypeError that names them and the record that replaces them."""
    for given, fields in (
        (dict(bias=bias), "bias=..."),
        (dict(logit_scale=1.0), "logit_scale=..."),
        (dict(softcap=None), "softcap=..."),
        (dict(bias=bias, logit_scale=0.5, softcap=2.0), "bias=..., logit_scale=..., softcap=..."),
    ):
        keywords = ", ".join(f"{prefix}{name}=" for name in given)
        with pytest.raises(
            TypeError,
            match=re.escape(f"{keywords} are no longer keywords; pass {prefix}head=pgloss.HeadOptions({fields})"),
        ):
            call(**{f"{prefix}{name}": value for name, value in given.items()})


def assert_compiles_like_eager(call, inputs: list[torch.Tensor]) -> None:
    """`call(*leaves)` (a loss) under torch.compile(fullgraph=True) gives the eager value and gradients."""
    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=True, backend="inductor")
    ours, eager = [[t.detach().clone().requires_grad_() for t in inputs] for _ in range(2)]
    loss = compiled(*ours)
    loss.backward()
    expected = call(*eager)
    expected.backward()
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
    for a, b in zip(ours, eager, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
