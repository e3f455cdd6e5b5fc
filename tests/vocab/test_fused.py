"""pgloss.from_hidden: the loss from hidden states equals the loss on materialised logits."""

import pytest
import torch
from properties.micro_batches import cut, micro_batches

import pgloss
import pgloss.vocab.entropy
from pgloss.from_hidden import loss_from_hidden
from pgloss.vocab.fused import log_prob_and_entropy_from_hidden

B, T, H, V = 3, 5, 8, 37  # N = 15 tokens; chunk_size 4 divides neither N nor V
LENGTHS = [5, 3, 1]


def algorithm(name, **hyper):
    if name == "dr_grpo":
        hyper.setdefault("norm_constant", float(T))
    return pgloss.get(name, **hyper)


def make(dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype)

    mask = torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]
    targets = torch.randint(0, V, (B, T), generator=gen).masked_fill(~mask, -100)  # padding ids at masked slots
    hidden, weight = randn(B, T, H), randn(V, H, scale=0.7)
    with torch.no_grad():  # old / ref / rollout log-probs near the current ones, so that ratios vary around 1
        current = (
            torch.log_softmax(hidden.double() @ weight.double().t(), -1)
            .gather(-1, targets.clamp(min=0).unsqueeze(-1))
            .squeeze(-1)
        )
    old = (current + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)).to(dtype)
    ref = (current + 0.2 * torch.randn(B, T, generator=gen, dtype=torch.float64)).to(dtype)
    rollout = (current + 0.2 * torch.randn(B, T, generator=gen, dtype=torch.float64)).to(dtype)
    teacher = (current + 0.4 * torch.randn(B, T, generator=gen, dtype=torch.float64)).to(dtype)
    old = old.masked_fill(~mask, float("nan"))
    old[2, 4] = float("inf")
    ref = ref.masked_fill(~mask, -float("inf"))
    return dict(
        hidden=hidden,
        weight=weight,
        targets=targets,
        mask=mask,
        old_log_prob=old,
        ref_log_prob=ref,
        rollout_log_prob=rollout,
        teacher_log_prob=teacher,
        advantages=randn(B),
    )


def unfused(alg, inputs, *, temperature=1.0, **kw):
    """The plain path: logits materialised, log_softmax + gather, entropy, then the algorithm."""
    logits = inputs["hidden"] @ inputs["weight"].t()
    log_pi = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, -1)
    log_prob = log_pi.gather(-1, inputs["targets"].clamp(min=0).unsqueeze(-1)).squeeze(-1)
    entropy = -(log_pi.exp() * log_pi).sum(-1)
    return alg(
        log_prob=log_prob,
        old_log_prob=inputs["old_log_prob"],
        advantages=inputs["advantages"],
        mask=inputs["mask"],
        ref_log_prob=inputs["ref_log_prob"],
        entropy=entropy,
        **kw,
    )


def fused(alg, inputs, **kw):
    return loss_from_hidden(
        alg,
        inputs["hidden"],
        inputs["weight"],
        inputs["targets"],
        old_log_prob=inputs["old_log_prob"],
        advantages=inputs["advantages"],
        mask=inputs["mask"],
        ref_log_prob=inputs["ref_log_prob"],
        **kw,
    )


def run(path, alg, inputs, **kw):
    """Loss output and the gradients of hidden and weight (None where not required)."""
    inputs = dict(inputs)
    for key in ("hidden", "weight"):
        inputs[key] = inputs[key].detach().clone().requires_grad_(inputs[key].requires_grad)
    out = path(alg, inputs, **kw)
    out.loss.backward()
    return out, inputs["hidden"].grad, inputs["weight"].grad


def leaves(inputs, hidden=True, weight=True):
    inputs = dict(inputs)
    inputs["hidden"] = inputs["hidden"].requires_grad_(hidden)
    inputs["weight"] = inputs["weight"].requires_grad_(weight)
    return inputs


@pytest.fixture
def small_blocks(monkeypatch):
    """Cache blocks of 3 rows, so that each 4-token chunk spans two blocks, the last one short."""
    monkeypatch.setattr(pgloss.vocab.entropy, "_BLOCK_ELEMENTS", 3 * V)


# chunk_size 4 < T: token chunks, logits recomputed in backward; 11: two whole sequences per chunk,
# gradients formed in the forward pass (the last chunk holds one sequence).
PATHS = {"recompute": 4, "one_pass": 11}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("name", pgloss.names())
def test_every_algorithm_matches_unfused_float64(name, temperature, path, small_blocks):
    alg = algorithm(name, kl_coef=0.05, entropy_coef=0.01)
    inputs = leaves(make())
    # The row inputs and the teacher for the names that need them (REAL, TOPR, OPD); the others ignore them.
    extra = dict(
        group_ids=torch.tensor([0, 0, 1]),
        scores=torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64),
        teacher_log_prob=inputs["teacher_log_prob"],
    )
    torch.manual_seed(0)  # Clip-Cov draws from the global generator: the same draw on both paths
    out, gh, gw = run(fused, alg, inputs, temperature=temperature, chunk_size=PATHS[path], **extra)
    torch.manual_seed(0)
    ref, gh_ref, gw_ref = run(unfused, alg, inputs, temperature=temperature, **extra)
    torch.testing.assert_close(out.loss, ref.loss, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.per_token, ref.per_token, rtol=0, atol=1e-12)
    assert out.metrics.keys() == ref.metrics.keys() and "entropy" in out.metrics
    for key in out.metrics:
        torch.testing.assert_close(out.metrics[key], ref.metrics[key], rtol=0, atol=1e-12, msg=key)
    assert gh.abs().sum() > 0 and gw.abs().sum() > 0
    torch.testing.assert_close(gh, gh_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(gw, gw_ref, rtol=0, atol=1e-12)
    assert (gh[~inputs["mask"]] == 0).all()  # masked tokens (NaN/inf old log-probs, -100 ids) give no gradient


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", ["grpo", "gspo", "cispo"])
def test_defaults_and_rollout_correction(name, path):
    # Paper defaults (entropy_coef 0: the entropy feeds the metric only) and a rollout log-prob.
    alg = algorithm(name)
    inputs = leaves(make(seed=3))
    kw = dict(rollout_log_prob=inputs["rollout_log_prob"])
    out, gh, gw = run(fused, alg, inputs, chunk_size=PATHS[path], **kw)
    ref, gh_ref, gw_ref = run(unfused, alg, inputs, **kw)
    torch.testing.assert_close(out.loss, ref.loss, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.metrics["entropy"], ref.metrics["entropy"], rtol=0, atol=1e-12)
    torch.testing.assert_close(gh, gh_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(gw, gw_ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("path", PATHS)
def test_from_hidden_method_and_normalizer_micro_batches(path):
    # Two micro-batches with the step's Normalizer sum to the whole batch, in value and gradient.
    alg = algorithm("grpo", loss_agg_mode="group-mean-token-mean", entropy_coef=0.02)
    inputs = leaves(make(seed=4))
    group_ids = torch.tensor([0, 0, 1])
    whole, gh, gw = run(fused, alg, inputs, group_ids=group_ids, chunk_size=PATHS[path])
    parts = [slice(0, 1), slice(1, 3)]
    normalizer = pgloss.Normalizer.count(cut(inputs["mask"], parts), group_ids=cut(group_ids, parts))
    hidden, weight = (
        inputs["hidden"].detach().clone().requires_grad_(),
        inputs["weight"].detach().clone().requires_grad_(),
    )
    total = micro_batches(
        lambda p: alg.from_hidden(
            hidden[p],
            weight,
            inputs["targets"][p],
            old_log_prob=inputs["old_log_prob"][p],
            advantages=inputs["advantages"][p],
            mask=inputs["mask"][p],
            ref_log_prob=inputs["ref_log_prob"][p],
            normalizer=normalizer,
            group_ids=group_ids[p],
            temperature=1.0,
            chunk_size=PATHS[path],
        ),
        parts,
    )
    torch.testing.assert_close(total, whole.loss.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(hidden.grad, gh, rtol=0, atol=1e-12)
    torch.testing.assert_close(weight.grad, gw, rtol=0, atol=1e-12)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", ["dapo", "gspo"])
def test_float32_agrees_with_float64(name, path):
    alg = algorithm(name, entropy_coef=0.01)
    inputs32 = leaves(make(dtype=torch.float32, seed=5))
    inputs64 = leaves({k: v.double() if v.is_floating_point() else v for k, v in inputs32.items()})
    out, gh, gw = run(fused, alg, inputs32, temperature=0.7, chunk_size=PATHS[path])
    ref, gh_ref, gw_ref = run(unfused, alg, inputs64, temperature=0.7)
    assert out.loss.dtype == gh.dtype == gw.dtype == torch.float32
    torch.testing.assert_close(out.loss, ref.loss.float(), rtol=1e-5, atol=1e-6)
    scale = max(gh_ref.abs().max(), gw_ref.abs().max())
    torch.testing.assert_close(gh, gh_ref.float(), rtol=1e-4, atol=1e-5 * scale)
    torch.testing.assert_close(gw, gw_ref.float(), rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("path", PATHS)
def test_bfloat16_parameters(path):
    alg = algorithm("dapo", entropy_coef=0.01)
    inputs = leaves(make(dtype=torch.bfloat16, seed=6))
    inputs32 = leaves({k: v.float() if v.is_floating_point() else v for k, v in inputs.items()})
    out, gh, gw = run(fused, alg, inputs, chunk_size=PATHS[path])
    ref, gh_ref, gw_ref = run(unfused, alg, inputs32)  # the same bf16 values in float32
    assert gh.dtype == gw.dtype == torch.bfloat16
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(gw.float(), gw_ref, rtol=2e-2, atol=2e-2 * gw_ref.abs().max())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("hidden, weight", [(True, False), (False, True)])
def test_frozen_inputs_get_no_gradient(hidden, weight, path):
    alg = algorithm("ppo", entropy_coef=0.01)
    inputs = leaves(make(seed=7), hidden=hidden, weight=weight)
    out, gh, gw = run(fused, alg, inputs, chunk_size=PATHS[path])
    ref, gh_ref, gw_ref = run(unfused, alg, inputs)
    assert (gh is None) == (not hidden) and (gw is None) == (not weight)
    for got, expected in ((gh, gh_ref), (gw, gw_ref)):
        if got is not None:
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("path", PATHS)
def test_scaled_loss_no_grad_and_single_backward(path):
    # A caller's scale reaches the gradients; under no_grad nothing is built; the value is the same.
    alg = algorithm("gspo_token", entropy_coef=0.01)
    inputs = leaves(make(seed=9))
    ref, gh_ref, gw_ref = run(unfused, alg, inputs)
    hidden, weight = (
        inputs["hidden"].detach().clone().requires_grad_(),
        inputs["weight"].detach().clone().requires_grad_(),
    )
    out = fused(alg, {**inputs, "hidden": hidden, "weight": weight}, chunk_size=PATHS[path])
    (-2.5 * out.loss).backward()
    torch.testing.assert_close(hidden.grad, -2.5 * gh_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(weight.grad, -2.5 * gw_ref, rtol=0, atol=1e-12)
    with pytest.raises(RuntimeError):
        out.loss.backward()
    with torch.no_grad():
        quiet = fused(alg, inputs, chunk_size=PATHS[path])
    assert not quiet.loss.requires_grad
    torch.testing.assert_close(quiet.loss, ref.loss, rtol=0, atol=1e-12)
    for key in ref.metrics:
        torch.testing.assert_close(quiet.metrics[key], ref.metrics[key], rtol=0, atol=1e-12, msg=key)


def test_gradcheck():
    inputs = make(seed=8)
    hidden = inputs["hidden"][:1, :3].clone().requires_grad_()
    weight = inputs["weight"][:11].clone().requires_grad_()
    targets = inputs["targets"][:1, :3].clamp(min=0) % 11

    def both(h, w):
        return log_prob_and_entropy_from_hidden(h, w, targets, temperature=0.7, chunk_size=4)

    assert torch.autograd.gradcheck(both, (hidden, weight))
    assert torch.autograd.gradcheck(lambda h, w: both(h, w)[1], (hidden, weight))


def test_saves_no_logits():
    # Nothing of N × V elements is kept for backward: only hidden, weight and [N] vectors.
    inputs = leaves(make())
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        log_prob_and_entropy_from_hidden(inputs["hidden"], inputs["weight"], inputs["targets"].clamp(min=0))
    sizes = sorted(t.numel() for t in saved)
    assert sizes[-1] == V * H and sizes[-2] == B * T * H
    assert all(n <= B * T for n in sizes[:-2])


def test_bad_inputs_raise():
    inputs = make()
    alg = algorithm("grpo")
    h, w, y = inputs["hidden"], inputs["weight"], inputs["targets"]
    kw = dict(
        old_log_prob=inputs["old_log_prob"],
        advantages=inputs["advantages"],
        mask=inputs["mask"],
        ref_log_prob=inputs["ref_log_prob"],
    )
    cases = [
        (dict(hidden=h[0]), ValueError, "hidden must have 3 dimensions"),
        (dict(hidden=h.long()), TypeError, "hidden must be a floating tensor"),
        (dict(weight=w[:, :4]), ValueError, r"weight must have shape \[V, 8\]"),
        (dict(weight=w.float()), TypeError, "weight has dtype torch.float32 but hidden has torch.float64"),
        (dict(weight=None), TypeError, "weight must be a Tensor"),
        (dict(targets=y.double()), TypeError, "targets must hold integer"),
        (dict(targets=y[:, :4]), ValueError, r"targets must have shape \(3, 5\)"),
        (dict(temperature=0.0), ValueError, "temperature must be a finite number > 0, got 0.0"),
        (dict(chunk_size=0), ValueError, "chunk_size must be >= 1, got 0"),
        (dict(mask=inputs["mask"][:, :4]), ValueError, "mask must have shape"),
    ]
    for change, error, match in cases:
        args = dict(hidden=h, weight=w, targets=y, **kw)
        args.update(change)
        with pytest.raises(error, match=match):
            loss_from_hidden(alg, args.pop("hidden"), args.pop("weight"), args.pop("targets"), **args)
    # An id outside [0, V) at a valid position is refused by name; at a masked position it is ignored.
    for bad in (V, -1):
        with pytest.raises(ValueError, match=rf"targets must be token ids in \[0, {V}\) at valid positions, got {bad}"):
            loss_from_hidden(alg, h, w, y.masked_fill(inputs["mask"], bad), **kw)
    padded = loss_from_hidden(alg, h, w, y.masked_fill(~inputs["mask"], -100), **kw)
    assert torch.equal(padded.loss, loss_from_hidden(alg, h, w, y, **kw).loss)
    with pytest.raises(ValueError, match="targets must be token ids"):
        pgloss.log_prob_and_entropy_from_hidden(h, w, y.masked_fill(inputs["mask"], V))
    with pytest.raises(ValueError, match="targets must be token ids"):
        pgloss.log_prob_and_entropy(torch.randn(3, V), torch.tensor([0, 1, V]))
