"""FSDP2 with real ranks: two and three gloo processes, parameters sharded by `fully_shard` over a
CPU device mesh (DTensors), uneven tokens per rank and one all-masked micro-batch.

Each rank counts the step with `algorithm.step_normalizer` (all-reduced) over its micro-batches and
backpropagates each micro-batch's loss; FSDP2 reduce-scatters (averages) the gradients onto the
shards. The shard every rank holds must equal the matching rows of one call on the whole batch in
one process, for every name of `pgloss.names()`, through the plain call on materialised logits and
through `from_hidden`, with the LM head in the root's shard group (the unsharded parameter during the
step) or sharded on its own (a DTensor, gathered once per call by `pgloss.vocab.fused.full_head`).

Clip-Cov and KL-Cov select their tokens within each call, so no split of the batch gives one call's
loss: their reference is the same per-call selections in one process, summed under the step's counts.
"""

import functools

import pytest
import torch
from conftest import run_ranks
from properties.micro_batches import micro_batches

import pgloss

ROWS, WIDTH, HIDDEN, VOCAB = 16, 6, 5, 11
# rank -> its micro-batches, each of whole groups (group_ids = row // 2: REAL contrasts a group's rows).
# FSDP2, like DDP, needs as many forwards and backwards on every rank; the rows and tokens per rank
# differ. Rows 2-3 are all masked: an empty micro-batch on rank 0 (two ranks) and on rank 1 (three).
LAYOUT = {
    2: {0: [slice(0, 2), slice(2, 4)], 1: [slice(4, 10), slice(10, 16)]},
    3: {0: [slice(0, 2), slice(4, 8)], 1: [slice(2, 4), slice(8, 10)], 2: [slice(10, 12), slice(12, 16)]},
}
ROOT_HEAD, OWN_HEAD = "head in the root group", "head sharded on its own"
# The plain path calls the head as a module (FSDP2's own hooks, wherever the head is sharded); the
# fused path takes the head's weight, unsharded (root group) or a DTensor (sharded on its own).
RUNS = [(ROOT_HEAD, "plain"), (ROOT_HEAD, "from_hidden"), (OWN_HEAD, "from_hidden")]


class Tiny(torch.nn.Module):
    """Embedding, one tanh layer, LM head without bias: hidden = tanh(W₁ e(x) + b), logits = hidden Wᵀ."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.block = torch.nn.Linear(HIDDEN, HIDDEN)
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids):
        return torch.tanh(self.block(self.embed(ids)))


def tiny() -> Tiny:
    torch.manual_seed(0)
    return Tiny().double()


def build(name):
    return pgloss.get(name, generation_budget=WIDTH)


def selects_per_call(algorithm) -> bool:
    return algorithm.name in ("clip_cov", "kl_cov")


def data():
    """One float64 step: the log-probs around the tiny model's own, uneven lengths, rows 2-3 empty."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (ROWS, WIDTH), generator=g)
    targets = torch.randint(0, VOCAB, (ROWS, WIDTH), generator=g)
    lengths = torch.randint(1, WIDTH + 1, (ROWS,), generator=g)
    lengths[2:4] = 0
    mask = torch.arange(WIDTH)[None, :] < lengths[:, None]
    with torch.no_grad():
        model = tiny()
        log_prob = model.lm_head(model(ids)).log_softmax(-1).gather(-1, targets[..., None])[..., 0]
    noise = lambda scale: scale * torch.randn(ROWS, WIDTH, generator=g, dtype=torch.float64)  # noqa: E731
    old = (log_prob + noise(0.1)).clamp(max=-1e-3)
    inputs = dict(
        old_log_prob=old,
        advantages=torch.randn(ROWS, generator=g, dtype=torch.float64),
        mask=mask,
        ref_log_prob=(old + noise(0.2)).clamp(max=-1e-3),
        rollout_log_prob=(old + noise(0.2)).clamp(max=-1e-3),
        group_ids=torch.arange(ROWS) // 2,
        scores=torch.randn(ROWS, generator=g, dtype=torch.float64),
        teacher_log_prob=(old + noise(0.3)).clamp(max=-1e-3),
    )
    return ids, targets, inputs


def micro_loss(algorithm, model, path, ids, targets, inputs, part, normalizer):
    """One micro-batch's loss, the model's forward included."""
    batch = {k: v[part] for k, v in inputs.items()}
    hidden = model(ids[part])
    torch.manual_seed(0)  # Clip-Cov draws from the global generator: the same draw on every path
    if path == "from_hidden":
        return algorithm.from_hidden(hidden, model.lm_head.weight, targets[part], normalizer=normalizer, **batch).loss
    logp = model.lm_head(hidden).log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1) if "entropy" in algorithm.needs else None
    log_prob = logp.gather(-1, targets[part][..., None])[..., 0]
    return algorithm(log_prob, **batch, entropy=entropy, normalizer=normalizer).loss


def step_normalizer(algorithm, inputs, parts):
    return algorithm.step_normalizer(
        [inputs["mask"][p] for p in parts],
        old_log_probs=[inputs["old_log_prob"][p] for p in parts],
        rollout_log_probs=[inputs["rollout_log_prob"][p] for p in parts],
        group_ids=[inputs["group_ids"][p] for p in parts],
    )


def worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world,))
    ids, targets, inputs = data()
    parts = LAYOUT[world][rank]
    out = {}
    for head in (ROOT_HEAD, OWN_HEAD):
        model = tiny()
        fully_shard(model.block, mesh=mesh)
        if head == OWN_HEAD:
            fully_shard(model.lm_head, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        for path in [path for h, path in RUNS if h == head]:
            for name in pgloss.names():
                algorithm = build(name)
                model.zero_grad(set_to_none=True)
                normalizer = step_normalizer(algorithm, inputs, parts)
                micro_batches(
                    functools.partial(micro_loss, algorithm, model, path, ids, targets, inputs, normalizer=normalizer),
                    parts,
                )
                out[(head, path, name)] = {k: p.grad.to_local().clone() for k, p in model.named_parameters()}
    return out


@pytest.fixture(scope="module", params=sorted(LAYOUT), ids=lambda world: f"{world} ranks")
def ranks(request):
    world = request.param
    return world, run_ranks(worker, world)


def reference(name, world):
    """The step's gradient in one process: one call on the whole batch from materialised logits (the
    per-call selections of Clip-Cov and KL-Cov: one call per micro-batch, counted for the step)."""
    algorithm = build(name)
    ids, targets, inputs = data()
    model = tiny()
    if selects_per_call(algorithm):
        parts = [p for rank in range(world) for p in LAYOUT[world][rank]]
        normalizer = step_normalizer(algorithm, inputs, parts)
        micro_batches(lambda p: micro_loss(algorithm, model, "plain", ids, targets, inputs, p, normalizer), parts)
    else:
        micro_loss(algorithm, model, "plain", ids, targets, inputs, slice(None), None).backward()
    return {k: p.grad for k, p in model.named_parameters()}


@pytest.mark.parametrize("name", pgloss.names())
def test_every_shard_gets_the_gradient_of_one_call(ranks, name):
    world, results = ranks
    want = reference(name, world)
    assert sum(g.abs().sum() for g in want.values()) > 0, "a step with no gradient would make the test vacuous"
    for head, path in RUNS:
        for rank in range(world):
            got = results[rank][(head, path, name)]
            for key, full in want.items():
                shards = torch.chunk(full, world, dim=0)  # FSDP2's Shard(0): torch.chunk's rows
                shard = shards[rank] if rank < len(shards) else full[:0]
                torch.testing.assert_close(
                    got[key],
                    shard,
                    rtol=1e-9,
                    atol=1e-12,
                    msg=lambda m, where=f"{name}, {path}, {head}, rank {rank}/{world}, {key}": f"{where}: {m}",
                )
