"""`opd` against tinker-cookbook 0.6.1's on-policy distillation (tinker_cookbook/distillation/
train_on_policy.py `incorporate_kl_penalty`, cut from the source by path, its tinker objects stood in for).

tinker-cookbook adds −λ·(log p_sample − log p_T)·mask to each token's advantage (λ = `kl_penalty_coef`,
1 by default), optionally summed over the future tokens with a discount γ (`kl_discount_factor`, 0 by
default), and trains with Tinker's `importance_sampling` loss, which runs on Tinker's servers and is
documented as −Σ_t (π_θ/π_sample)·A_t: pgloss's `opd` per-token term −r_t·A_t with π_sample the old
policy. Measured (float64 inputs, 4 seeds, λ ∈ {1, 0.5}, the environment's advantages zero and not):
the advantages agree within 1.1e-7 and the per-token terms within 1.3e-7, float32 rounding: tinker
turns the teacher's log-probs into a float32 tensor (`torch.tensor` of a list). γ = 0.9 (`opd_discount`, the
discounted sum of the future tokens' reverse KL, which moves the advantages by up to 0.53 on these rows):
within 1.7e-7 (its datums hold one turn; over a multi-turn mask pgloss discounts by valid tokens, tinker by
positions). Tinker's loss is a sum over tokens: `opd` with loss_agg_mode="seq-mean-token-sum" times the
batch size.

Source: PGLOSS_TINKER_SRC, the root of the unpacked tinker-cookbook 0.6.1 wheel (`make test` unpacks it).
"""

import asyncio
import types

import pytest
import torch
from advantages.trainer_sources import load, source_file
from conftest import make_batch

import pgloss

ON_POLICY = "tinker_cookbook/distillation/train_on_policy.py"
METRICS = "tinker_cookbook/rl/metrics.py"


class _Data:
    def __init__(self, tensor):
        self.tensor = tensor

    def to_torch(self):
        return self.tensor.clone()

    @staticmethod
    def from_torch(tensor):
        return _Data(tensor)


def tinker_advantages(data, coef, discount):
    """tinker-cookbook's advantages after `incorporate_kl_penalty`, row by row (its datums are rows)."""
    namespace = dict(
        asyncio=asyncio,
        torch=torch,
        cast=lambda _, x: x,
        safezip=zip,
        tinker=types.SimpleNamespace(TensorData=_Data, Datum=object, SamplingClient=object),
    )
    load(source_file("PGLOSS_TINKER_SRC", METRICS), ("discounted_future_sum_vectorized",), namespace)
    load(source_file("PGLOSS_TINKER_SRC", ON_POLICY), ("incorporate_kl_penalty",), namespace)
    rows, lengths = [], data["mask"].sum(-1).tolist()
    for i, n in enumerate(lengths):
        teacher = [0.0] + data["teacher_log_prob"][i, :n].tolist()  # its logprobs of the whole sequence: [1:]
        client = types.SimpleNamespace(
            compute_logprobs=lambda _, t=teacher: types.SimpleNamespace(coroutine=lambda: asyncio.sleep(0, t))
        )
        datum = types.SimpleNamespace(
            model_input=types.SimpleNamespace(append_int=lambda token: None),
            loss_fn_inputs=dict(
                target_tokens=types.SimpleNamespace(data=[0]),
                logprobs=_Data(data["old_log_prob"][i, :n]),
                mask=_Data(torch.ones(n, dtype=torch.float64)),
                advantages=_Data(data["advantages"][i, :n]),
            ),
        )
        rows.append((datum, client))
    asyncio.run(
        namespace["incorporate_kl_penalty"]([d for d, _ in rows], [c for _, c in rows], [0] * len(rows), coef, discount)
    )
    out = torch.zeros_like(data["old_log_prob"])
    for i, (datum, _) in enumerate(rows):
        out[i, : lengths[i]] = datum.loss_fn_inputs["advantages"].to_torch()
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("coef", [1.0, 0.5])
@pytest.mark.parametrize("task_advantages", [False, True])
@pytest.mark.parametrize("discount", [0.0, 0.9])
def test_tinker_cookbook_advantage_and_importance_sampling_term(seed, coef, task_advantages, discount):
    data = make_batch(batch=6, length=7, seed=seed, per_token_adv=True)
    data["mask"] = torch.arange(7)[None, :] < data["mask"].sum(-1, keepdim=True)  # left-aligned, as tinker's datums
    data["mask"][data["mask"].sum(-1) == 0, 0] = True  # every datum holds a token
    if not task_advantages:
        data["advantages"] = torch.zeros_like(data["advantages"])
    theirs = tinker_advantages(data, coef, discount=discount)
    alg = pgloss.get("opd", opd_coef=coef, opd_discount=discount)
    ours, _, _ = alg.advantages(
        pgloss.core.batch.TokenBatch.prepare(
            data["log_prob"],
            data["old_log_prob"],
            data["advantages"],
            data["mask"],
            teacher_log_prob=data["teacher_log_prob"],
        )
    )
    mask = data["mask"]
    torch.testing.assert_close(ours[mask], theirs[mask], rtol=0, atol=2e-7)  # its teacher log-probs: float32
    out = alg(
        data["log_prob"], data["old_log_prob"], data["advantages"], mask, teacher_log_prob=data["teacher_log_prob"]
    )
    ratio = (data["log_prob"] - data["old_log_prob"]).exp()
    torch.testing.assert_close(out.per_token[mask], (-ratio * theirs)[mask], rtol=0, atol=2e-7)


def test_tinker_cookbooks_discount_moves_the_advantages():
    """The discount is a real difference (so its parity above is not the undiscounted case twice)."""
    data = make_batch(batch=6, length=7, seed=9, per_token_adv=True)
    data["mask"] = torch.arange(7)[None, :] < data["mask"].sum(-1, keepdim=True).clamp(min=1)
    data["advantages"] = torch.zeros_like(data["advantages"])
    undiscounted, discounted = (tinker_advantages(data, 1.0, discount=g) for g in (0.0, 0.9))
    gap = (discounted - undiscounted)[data["mask"]].abs().max()
    assert gap.item() == pytest.approx(0.5251, abs=1e-4)
