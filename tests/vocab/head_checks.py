"""What the tests of LM-head options share: an option set's biases filled in (`with_biases`), a call compiled whole
against its eager run (`assert_compiles_like_eager`), and the refusals of
a bad option (`chunks.check_head`), asserted per caller and per head (`prefix`: "" for the trained model, "ref_"
or "teacher_" for the other)."""

import math

import pytest
import torch


def with_biases(opts: dict, x: dict, bias: torch.Tensor | None = None) -> dict:
    """`opts` with each `*bias=True` replaced by the tensor of that name in `x` (the trained model's by `bias`
    when given, a leaf to differentiate)."""
    out = {k: x[k] if v is True and k.endswith("bias") else v for k, v in opts.items()}
    if bias is not None and "bias" in out:
        out["bias"] = bias
    return out


def assert_refuses_bad_head(call, bias: torch.Tensor, prefix: str = "") -> None:
    """`call(**options)` refuses each bad `{prefix}bias`, `{prefix}logit_scale` and `{prefix}softcap`, naming it.
    `bias` is a valid float64 bias on the CPU."""
    b, w = f"{prefix}bias", f"{prefix}weight"
    with pytest.raises(ValueError, match=rf"^{b} must have shape \[V\] = \[{bias.shape[0]}\] \(the rows of {w}\), got"):
        call(**{b: bias[:-1]})
    with pytest.raises(TypeError, match=f"^{b} has dtype torch.float32 but {w} has torch.float64"):
        call(**{b: bias.float()})
    with pytest.raises(TypeError, match=f"^{b} must be a Tensor or None, got list"):
        call(**{b: bias.tolist()})
    with pytest.raises(ValueError, match=f"^{b} is on meta but {w} is on cpu"):
        call(**{b: torch.empty_like(bias, device="meta")})
    for value in (0.0, -1.0):
        with pytest.raises(ValueError, match=f"^{prefix}logit_scale must be a finite number > 0, got {value}"):
            call(**{f"{prefix}logit_scale": value})
        with pytest.raises(ValueError, match=f"^{prefix}softcap must be a finite number > 0 or None, got {value}"):
            call(**{f"{prefix}softcap": value})
    for value in (math.inf, math.nan):
        with pytest.raises(ValueError, match=f"^{prefix}logit_scale must be finite"):
            call(**{f"{prefix}logit_scale": value})
        with pytest.raises(ValueError, match=f"^{prefix}softcap must be finite"):
            call(**{f"{prefix}softcap": value})
    for value in ("2", True, None):
        with pytest.raises(TypeError, match=f"^{prefix}logit_scale must be a real number"):
            call(**{f"{prefix}logit_scale": value})
    with pytest.raises(TypeError, match=f"^{prefix}softcap must be a real number or None"):
        call(**{f"{prefix}softcap": "30"})


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
    for a, b in zip(ours, eager):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
