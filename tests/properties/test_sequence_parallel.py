"""Sequence (Ulysses) and context parallelism with real torch.distributed processes (gloo on CPU).

Each sequence of the step is cut over a sequence group (`pgloss.SequenceParallel`): contiguous slices and
the load-balanced layout (rank r holds chunks r and 2W-1-r of 2W), on 2 ranks (one sequence group) and on 4
(a 2 x 2 mesh: two data-parallel ranks of two sequence ranks each, with micro-batches; and one group of 4).
The rows have uneven lengths, padding at the end, an empty row, a row shorter than a slice and a row with a
hole in its mask. Every rank computes its tokens' log-probs from its slice of the hidden states and a
replicated LM head, calls the loss with the step's Normalizer counted over the sequence group and
back-propagates; averaging the head's and the hidden states' gradients over all ranks (as FSDP does over the
dp x sp mesh) and summing the losses / world must give one process's loss and gradients on whole sequences,
in float64. One sequence group of 2, contiguous: every registered name x rollout correction, every name x
aggregation mode, the exact KL, IW-OPD with its discount, `from_hidden` on both of its routes for every name.
Load-balanced on 2 and on 4 ranks: every name with the chained rejection (its sequence rules). The 2 x 2
mesh: every name with the two corrections whose step statistics also go over the data-parallel group (the
kept tokens' counts, the step's mean weight). Beside them (2 ranks): the collectives a call makes, the
refusal by name, KL-Cov's step selection, no host sync, and the layouts against torch's context-parallel
sharding. Each world size is one spawn that runs every case.
"""

import collections
import contextlib
import dataclasses

import pytest
import torch
import torch.distributed as dist
from conftest import run_ranks
from steps import CORRECTIONS

import pgloss
from pgloss import SequenceParallel

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
    inputs = dict(
        old_log_prob=old,
        advantages=torch.randn(ROWS, generator=g, dtype=torch.float64),
        mask=mask,
        ref_log_prob=(old + noise(0.2)).clamp(max=-1e-3),
        rollout_log_prob=(old + noise(0.2)).clamp(max=-1e-3),
        teacher_log_prob=(old + noise(0.3)).clamp(max=-1e-3),
        group_ids=torch.arange(ROWS) // 2,
        scores=torch.randn(ROWS, generator=g, dtype=torch.float64),
        expert=torch.arange(ROWS) % 4 == 3,
    )
    ref_weight = weight + 0.3 * torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    return hidden, weight, ref_weight, targets, inputs


def build(name, kind="none", mode=FIXED, **extra):
    """`name` with a KL term, an entropy bonus and the positive NLL, so that every optional input is in play."""
    fields = dict(
        generation_budget=WIDTH, kl_coef=0.05, entropy_coef=0.01, rollout_correction=CORRECTIONS[kind], **extra
    )
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
    if "expert" in algorithm.reads:
        wanted.add("expert")
    return {k: v for k, v in inputs.items() if k in wanted}


def loss_and_grads(
    algorithm,
    kind,
    hidden,
    weight,
    ref_weight,
    targets,
    inputs,
    *,
    split=None,
    rows=None,
    parts=None,
    process_group=None,
    exact_kl=False,
    fused=None,
):
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
            [c["mask"] for c in local],
            old_log_probs=[c["old_log_prob"] for c in local],
            rollout_log_probs=[c["rollout_log_prob"] for c in local] if "rollout_log_prob" in given else None,
            group_ids=[c["group_ids"] for c in local] if "group_ids" in given else None,
            scores=[c["scores"] for c in local] if "scores" in given else None,
            expert=[c["expert"] for c in local] if "expert" in given else None,
            process_group=process_group,
            sequence_parallel=split,
        )
    total = torch.zeros((), dtype=torch.float64)
    whole = algorithm
    for part, call in zip(parts, local, strict=True):
        h, y = cut(hidden[rows][part]), cut(targets[rows][part])
        if getattr(whole, "selection", None) is not None:  # Clip-Cov's, KL-Cov's: the step's, cut like a token
            algorithm = dataclasses.replace(whole, selection=cut(whole.selection[rows][part]))
        if exact_kl:
            call["full_kl"] = pgloss.full_kl_from_hidden(h, weight, h.detach(), ref_weight)
        if fused is not None:
            out = algorithm.from_hidden(
                h,
                weight,
                y,
                normalizer=normalizer,
                chunk_size=fused,
                **{k: v for k, v in call.items() if k != "full_kl"},
                **(dict(ref_hidden=h.detach(), ref_weight=ref_weight) if exact_kl else {}),
            )
        else:
            lp, ent = log_probs_and_entropy(h, weight, y)
            out = algorithm(lp, entropy=ent, normalizer=normalizer, **call)
        out.loss.backward()
        total = total + out.loss.detach()
    return torch.cat([total.reshape(1), hidden.grad.reshape(-1), weight.grad.reshape(-1)])


EXTRA = ("exact KL", "IW-OPD, discounted")


def extra_cases():
    """(label, name, kind, fields, options): the exact KL, and from_hidden on its one-pass and recompute routes."""
    out = [
        ("exact KL", "grpo", "none", dict(kl_estimator="full"), dict(exact_kl=True)),
        ("IW-OPD, discounted", "iw_opd", "none", dict(opd_position_gamma=0.5, opd_discount=0.9), {}),
    ]
    for name in pgloss.names():
        kind = "chained rejection" if accepts(name, "chained rejection", FIXED) else "none"
        for route, chunk in (("one pass", None), ("recompute", 4)):
            out.append((f"from_hidden {route} {name}", name, kind, {}, dict(fused=chunk)))
    return out


def all_cases():
    return [(f"{n} {k} {m}", n, k, dict(mode=m), {}) for n, k, m in cases()] + extra_cases()


def corrections_cases():
    """Every name with every rollout correction it takes, at its own mode, and the exact KL."""
    return [case for case in all_cases() if case[3].get("mode") == FIXED or case[0] in EXTRA]


def sequence_rules_cases():
    """Every name with the chained rejection (its sequence rules) where it takes it, and the extra losses."""
    return [
        case
        for case in corrections_cases()
        if case[2] == "chained rejection"
        or case[0] in EXTRA
        or (case[2] == "none" and not accepts(case[1], "chained rejection", FIXED))
    ]


def run_all(cases, split, rows, parts, process_group):
    """`cases` on this rank: {label: the loss and gradients summed over the world / world}."""
    hidden, weight, ref_weight, targets, inputs = data()
    world = dist.get_world_size()
    out = {}
    for label, name, kind, fields, options in cases:
        fields = dict(fields)
        algorithm = build(name, kind, fields.pop("mode", FIXED), **fields)
        try:
            pack = loss_and_grads(
                algorithm,
                kind,
                hidden,
                weight,
                ref_weight,
                targets,
                inputs,
                split=split,
                rows=rows,
                parts=parts,
                process_group=process_group,
                **options,
            )
        except Exception as error:
            raise AssertionError(f"{label} ({split.layout}) failed") from error
        dist.all_reduce(pack)
        out[label] = pack / world
    return out


def two_ranks(rank, world):
    """One sequence group of 2 (pure sequence parallelism), micro-batches of whole groups; and what a call
    reduces over the group (`collectives`), the refusal by name, KL-Cov's step selection."""
    parts = [slice(0, 2), slice(2, 8)]
    return {
        "sp2 contiguous": run_all(all_cases(), SequenceParallel(), slice(None), parts, None),
        "sp2 load_balanced": run_all(
            sequence_rules_cases(), SequenceParallel(layout="load_balanced"), slice(None), parts, None
        ),
    }, side_checks(SequenceParallel(layout="load_balanced"))


def side_checks(split):
    hidden, weight, ref_weight, targets, inputs = data()
    lp, ent = log_probs_and_entropy(split.shard(hidden), weight, split.shard(targets))
    call = {k: split.shard(v) if k in TOKEN_INPUTS else v for k, v in inputs.items()}
    out = {"collectives": {}}
    for name in ("dapo", "grpo", "gspo", "fipo"):
        algorithm = pgloss.get(name)
        normalizer = algorithm.step_normalizer(call["mask"], sequence_parallel=split)
        leaf = lp.detach().requires_grad_(True)
        with counted() as forward:
            loss = algorithm(
                leaf,
                **{k: call[k] for k in ("old_log_prob", "advantages", "mask", "ref_log_prob")},
                normalizer=normalizer,
            ).loss
        with counted() as backward:
            loss.backward()
        out["collectives"][name] = (dict(forward), dict(backward))
    try:
        pgloss.get("clip_cov")(
            lp,
            **{k: call[k] for k in ("old_log_prob", "advantages", "mask")},
            normalizer=pgloss.get("clip_cov").step_normalizer(call["mask"], sequence_parallel=split),
        )
    except ValueError as error:
        out["refusal"] = str(error)
    out["host syncs"] = host_syncs(split)
    out["layouts"] = torch_layouts()
    kl_cov = pgloss.get("kl_cov", kl_cov_ratio=0.2)
    (selection,) = kl_cov.step_selection(lp.detach(), call["advantages"], call["mask"])  # over every rank's tokens
    out["kl_cov selection"] = split.whole(selection.to(torch.int64))
    return out


def host_syncs(split):
    """{label: the host sync a sharded call makes, forward or backward}: for every name with the chained
    rejection (its sequence rules), or none where it takes no correction (the step's count may sync)."""
    from host_sync import HostSync, no_host_sync

    hidden, weight, _, targets, inputs = data()
    found = {}
    for label, name, kind, fields, options in sequence_rules_cases():
        if options:
            continue
        algorithm = build(name, kind, fields.get("mode", FIXED))
        given = {k: split.shard(v) if k in TOKEN_INPUTS else v for k, v in call_inputs(algorithm, inputs, kind).items()}
        if getattr(algorithm, "selection", None) is not None:
            algorithm = dataclasses.replace(algorithm, selection=split.shard(algorithm.selection))
        normalizer = algorithm.step_normalizer(
            given["mask"],
            old_log_probs=given["old_log_prob"],
            rollout_log_probs=given.get("rollout_log_prob"),
            group_ids=given.get("group_ids"),
            scores=given.get("scores"),
            expert=given.get("expert"),
            sequence_parallel=split,
        )
        lp, ent = log_probs_and_entropy(split.shard(hidden), weight.clone().requires_grad_(True), split.shard(targets))
        try:
            with no_host_sync():
                algorithm(lp, entropy=ent, normalizer=normalizer, **given).loss.backward()
        except HostSync as sync:
            found[label] = str(sync)
    return found


def torch_layouts():
    """{layout: whether SequenceParallel(layout=).shard cuts positions as torch's context-parallel sharding does}:
    plain Shard(seq_dim), and the head-tail load balancer that torch's `context_parallel` (accelerate's cp_size)
    applies to causal attention by default. None where torch has no such sharding to compare with (torch 2.9's
    context parallelism has no `_context_parallel_shard`)."""
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.tensor.experimental._attention import _context_parallel_shard, _HeadTailLoadBalancer
    except ImportError:
        return None

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    positions = torch.arange(ROWS * WIDTH, dtype=torch.float64).view(ROWS, WIDTH)
    balancer = _HeadTailLoadBalancer(WIDTH, dist.get_world_size(), "cpu")
    return {
        layout: torch.equal(
            SequenceParallel(layout=layout).shard(positions),
            _context_parallel_shard(mesh, [positions], [1], load_balancer=balancer)[0],
        )
        for layout, balancer in (("contiguous", None), ("load_balanced", balancer))
    }


@contextlib.contextmanager
def counted():
    """{collective: calls} of torch.distributed made inside the block."""
    calls = collections.Counter()
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather")}

    def counting(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in originals:
        setattr(dist, name, counting(name))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def four_ranks(rank, world):
    """A 2 x 2 mesh (data-parallel ranks of 4 rows, each in two micro-batches, over sequence groups of 2) and
    one sequence group of 4 ranks, load-balanced (each rank holds 2 of 8 chunks): every name."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    dp = mesh.get_local_rank("dp")
    mesh_split = SequenceParallel(group=mesh.get_group("sp"))
    # the corrections whose step statistics are reduced over the data-parallel group too: the kept tokens' counts
    # (a sequence rule after a token rule) and the step's mean weight
    stepwise = [
        case
        for case in corrections_cases()
        if case[2] in ("chained rejection", "batch-normalised")
        or case[0] in EXTRA
        or (case[2] == "none" and not accepts(case[1], "chained rejection", FIXED))
    ]
    return {
        "dp2 x sp2 contiguous": run_all(
            stepwise, mesh_split, slice(4 * dp, 4 * dp + 4), [slice(0, 2), slice(2, 4)], mesh.get_group("dp")
        ),
        "sp4 load_balanced": run_all(
            sequence_rules_cases(), SequenceParallel(layout="load_balanced"), slice(None), [slice(0, 8)], None
        ),
    }


@pytest.fixture(scope="module")
def expected():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hidden, weight, ref_weight, targets, inputs = data()
        out = {}
        for label, name, kind, fields, options in all_cases():
            fields = dict(fields)
            algorithm = build(name, kind, fields.pop("mode", FIXED), **fields)
            out[label] = loss_and_grads(algorithm, kind, hidden, weight, ref_weight, targets, inputs, **options)
        return out
    finally:
        torch.set_num_threads(threads)


def check(results, expected):
    for rank, by_config in results.items():
        for config, got in by_config.items():
            assert got, config
            for label, value in got.items():
                torch.testing.assert_close(
                    value,
                    expected[label],
                    rtol=1e-9,
                    atol=1e-12,
                    msg=lambda m, where=f"{label}, {config}, rank {rank}": f"{where}: {m}",
                )


def test_two_ranks_of_one_sequence_group_give_one_process_loss_and_gradients(expected):
    results = run_ranks(two_ranks, 2)
    check({rank: cases for rank, (cases, _) in results.items()}, expected)
    assert len(results[0][0]["sp2 contiguous"]) == len(expected)  # every name x mode x correction, KL, from_hidden
    side = results[0][1]
    # a call reduces only what its configuration reads: DAPO (token ratio, token-mean) nothing; GRPO its
    # sequence lengths (seq-mean-token-mean); GSPO its sequence log-ratio and lengths (one all-reduce), the
    # lengths, and the log-ratio's gradient in backward; FIPO gathers its Future-KL's input once
    assert side["collectives"] == {
        "dapo": ({}, {}),
        "grpo": ({"all_reduce": 1}, {}),
        "gspo": ({"all_reduce": 2}, {"all_reduce": 1}),
        "fipo": ({"all_gather": 1}, {}),
    }
    assert "clip_cov cannot be computed over sequences split across ranks" in side["refusal"]
    if side["layouts"] is not None or tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 13):
        assert side["layouts"] == {"contiguous": True, "load_balanced": True}  # compared from make test's torch on
    assert side["host syncs"] == {}
    hidden, weight, _, targets, inputs = data()
    lp, _ = log_probs_and_entropy(hidden, weight, targets)
    (whole,) = pgloss.get("kl_cov", kl_cov_ratio=0.2).step_selection(lp, inputs["advantages"], inputs["mask"])
    assert torch.equal(side["kl_cov selection"], whole.to(torch.int64)) and whole.sum() > 1


def test_four_ranks_of_a_mesh_and_of_one_group_give_one_process_loss_and_gradients(expected):
    check(run_ranks(four_ranks, 4), expected)
