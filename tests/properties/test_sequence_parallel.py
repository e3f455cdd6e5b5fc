"""Sequence (Ulysses) and context parallelism with real torch.distributed processes (gloo on CPU).

Each sequence of the step is cut over a sequence group (`pgloss.SequenceParallel`): contiguous slices and
the load-balanced layout (rank r holds chunks r and 2W-1-r of 2W), on 2 ranks (one sequence group) and on 4
(a 2 x 2 mesh: two data-parallel ranks of two sequence ranks each, with micro-batches; and one group of 4).
The rows have uneven lengths, padding at the end, an empty row, a row shorter than a slice and a row with a
hole in its mask. Every rank computes its tokens' log-probs from its slice of the hidden states and a
replicated LM head, calls the loss with the step's Normalizer counted over the sequence group and
back-propagates; averaging the head's and the hidden states' gradients over all ranks (as FSDP does over the
dp x sp mesh) and summing the losses / world must give one process's loss and gradients on whole sequences,
in float64, for every registered name x rollout correction, every name x aggregation mode, the exact KL, and
`from_hidden` on both of its routes. Each world size is one spawn that runs every case.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist

import pgloss
from pgloss.core.sequence_parallel import SequenceParallel
from conftest import run_ranks
from steps import CORRECTIONS

ROWS, WIDTH, HIDDEN, VOCAB = 8, 8, 4, 7
FIXED = "fixed"  # the family's own mode (a family that fixes it, or the default)
TOKEN_INPUTS = ("old_log_prob", "mask", "ref_log_prob", "rollout_log_prob", "teacher_log_prob")
ROW_INPUTS = ("advantages", "group_ids", "scores", "expert")


def data(seed=0):
    """A float64 step of whole sequences: hidden states, a head, targets and every input a loss reads."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, WIDTH, HIDDEN, generator=g, dtype=torch.float64)
    weight = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    targets = torch.randint(0, VOCAB, (ROWS, WIDTH), generator=g)
    lengths = torch.tensor([8, 1, 5, 0, 7, 3, 8, 6])  # an empty row; rows shorter than a slice of 2 and of 4
    mask = torch.arange(WIDTH)[None, :] < lengths[:, None]
    mask[6, 2] = mask[6, 5] = False  # a hole (a tool's tokens) inside a row
    lp = torch.log_softmax(hidden @ weight.T, dim=-1).gather(-1, targets[..., None])[..., 0]
    noise = lambda scale: scale * torch.randn(ROWS, WIDTH, generator=g, dtype=torch.float64)  # noqa: E731
    old = (lp + noise(0.1)).clamp(max=-1e-3)
    inputs = dict(old_log_prob=old, advantages=torch.randn(ROWS, generator=g, dtype=torch.float64), mask=mask,
                  ref_log_prob=(old + noise(0.2)).clamp(max=-1e-3),
                  rollout_log_prob=(old + noise(0.2)).clamp(max=-1e-3),
                  teacher_log_prob=(old + noise(0.3)).clamp(max=-1e-3),
                  group_ids=torch.arange(ROWS) // 2, scores=torch.randn(ROWS, generator=g, dtype=torch.float64),
                  expert=torch.arange(ROWS) % 4 == 3)
    ref_weight = weight + 0.3 * torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    return hidden, weight, ref_weight, targets, inputs


def build(name, kind="none", mode=FIXED, **extra):
    """`name` with a KL term, an entropy bonus and the positive NLL, so that every optional input is in play."""
    fields = dict(generation_budget=WIDTH, kl_coef=0.05, entropy_coef=0.01, rollout_correction=CORRECTIONS[kind],
                  **extra)
    if mode != FIXED:
        fields["loss_agg_mode"] = mode
    algorithm = pgloss.get(name, **fields)
    if algorithm.couples_rows and "selection" in {f.name for f in dataclasses.fields(algorithm)}:
        selection = torch.rand(ROWS, WIDTH, generator=torch.Generator().manual_seed(7)) < 0.2
        algorithm = dataclasses.replace(algorithm, selection=selection)  # the step's selection, cut like a token
    return algorithm


def accepts(name, kind, mode):
    try:
        build(name, kind, mode)
    except (ValueError, TypeError):
        return False
    return True


def cases():
    out = []
    for name in pgloss.names():
        for kind in CORRECTIONS:
            if accepts(name, kind, FIXED):
                out.append((name, kind, FIXED))
        for mode in pgloss.AGG_MODES:
            if mode != build(name).loss_agg_mode and accepts(name, "none", mode):
                out.append((name, "none", mode))
    return out


def log_probs_and_entropy(hidden, weight, targets):
    logp = torch.log_softmax(hidden @ weight.T, dim=-1)
    return logp.gather(-1, targets[..., None])[..., 0], -(logp.exp() * logp).sum(-1)


def call_inputs(algorithm, inputs, kind):
    """The call's inputs: the required ones and the optional ones the algorithm reads."""
    wanted = set(algorithm.needs) | {"old_log_prob", "advantages", "mask"}
    if kind != "none":
        wanted.add("rollout_log_prob")
    if algorithm.takes_expert:
        wanted.add("expert")
    return {k: v for k, v in inputs.items() if k in wanted}


def loss_and_grads(algorithm, kind, hidden, weight, ref_weight, targets, inputs, *, split=None, rows=None,
                   parts=None, process_group=None, exact_kl=False, fused=None):
    """The step's loss (this process's share) and the gradients of `hidden` (whole) and `weight`. Without
    `split`: one process, one call. With it: this rank's rows (`rows`), cut into micro-batches (`parts` of
    those rows), each micro-batch's tokens this rank's slice (`split.shard`)."""
    hidden = hidden.clone().requires_grad_(True)
    weight = weight.clone().requires_grad_(True)
    rows = slice(None) if rows is None else rows
    parts = [slice(None)] if parts is None else parts
    cut = (lambda v: v) if split is None else (lambda v: split.shard(v, dim=1))
    given = call_inputs(algorithm, inputs, kind)
    local = [{k: (cut(v[rows][p]) if k in TOKEN_INPUTS else v[rows][p]) for k, v in given.items()} for p in parts]
    normalizer = None
    if split is not None:
        normalizer = algorithm.step_normalizer(
            [c["mask"] for c in local], old_log_probs=[c["old_log_prob"] for c in local],
            rollout_log_probs=[c["rollout_log_prob"] for c in local] if "rollout_log_prob" in given else None,
            group_ids=[c["group_ids"] for c in local] if "group_ids" in given else None,
            scores=[c["scores"] for c in local] if "scores" in given else None,
            expert=[c["expert"] for c in local] if "expert" in given else None,
            process_group=process_group, sequence_parallel=split)
    total = torch.zeros((), dtype=torch.float64)
    whole = algorithm
    for part, call in zip(parts, local):
        h, y = cut(hidden[rows][part]), cut(targets[rows][part])
        if getattr(whole, "selection", None) is not None:  # Clip-Cov's, KL-Cov's: the step's, cut like a token
            algorithm = dataclasses.replace(whole, selection=cut(whole.selection[rows][part]))
        if exact_kl:
            call["full_kl"] = pgloss.full_kl_from_hidden(h, weight, h.detach(), ref_weight)
        if fused is not None:
            out = algorithm.from_hidden(h, weight, y, normalizer=normalizer, chunk_size=fused,
                                        **{k: v for k, v in call.items() if k != "full_kl"},
                                        **(dict(ref_hidden=h.detach(), ref_weight=ref_weight) if exact_kl else {}))
        else:
            lp, ent = log_probs_and_entropy(h, weight, y)
            out = algorithm(lp, entropy=ent, normalizer=normalizer, **call)
        out.loss.backward()
        total = total + out.loss.detach()
    return torch.cat([total.reshape(1), hidden.grad.reshape(-1), weight.grad.reshape(-1)])


def extra_cases():
    """(label, name, kind, options): the exact KL and from_hidden on its one-pass and recompute routes."""
    out = [("exact KL", "grpo", "none", dict(kl_estimator="full"), dict(exact_kl=True))]
    for name in pgloss.names():
        for route, chunk in (("one pass", None), ("recompute", 4)):
            kind = "chained rejection" if accepts(name, "chained rejection", FIXED) else "none"
            out.append((f"from_hidden {route} {name}", name, kind, {}, dict(fused=chunk)))
    return out


def all_cases():
    return [(f"{n} {k} {m}", n, k, {"mode": m}, {}) for n, k, m in cases()] + extra_cases()


def run_all(split, rows, parts, process_group):
    """Every case on this rank: {label: the loss and gradients summed over the world / world}."""
    hidden, weight, ref_weight, targets, inputs = data()
    world = dist.get_world_size()
    out = {}
    for label, name, kind, fields, options in all_cases():
        fields = dict(fields)
        algorithm = build(name, kind, fields.pop("mode", FIXED), **fields)
        try:
            pack = loss_and_grads(algorithm, kind, hidden, weight, ref_weight, targets, inputs, split=split,
                                  rows=rows, parts=parts, process_group=process_group, **options)
        except Exception as error:
            raise AssertionError(f"{label} ({split.layout}) failed") from error
        dist.all_reduce(pack)
        out[label] = pack / world
    return out


def two_ranks(rank, world):
    torch.set_num_threads(1)  # tiny tensors: a second intra-op thread per rank only contends for the cores
    results = {}
    for layout in ("contiguous", "load_balanced"):
        split = SequenceParallel(layout=layout)
        results[layout] = run_all(split, slice(None), [slice(0, 3), slice(3, 8)], None)
    return results


def reference():
    hidden, weight, ref_weight, targets, inputs = data()
    out = {}
    for label, name, kind, fields, options in all_cases():
        fields = dict(fields)
        algorithm = build(name, kind, fields.pop("mode", FIXED), **fields)
        out[label] = loss_and_grads(algorithm, kind, hidden, weight, ref_weight, targets, inputs, **options)
    return out


def check(results, expected):
    for label, want in expected.items():
        for rank, by_layout in results.items():
            for layout, got in by_layout.items():
                torch.testing.assert_close(got[label], want, rtol=1e-9, atol=1e-12,
                                           msg=lambda m: f"{label}, {layout}, rank {rank}: {m}")


@pytest.fixture(scope="module")
def expected():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return reference()
    finally:
        torch.set_num_threads(threads)


def test_two_ranks_of_one_sequence_group_give_one_process_loss_and_gradients(expected):
    check(run_ranks(two_ranks, 2), expected)
