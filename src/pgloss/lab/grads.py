"""``pgloss grads``: draw how much gradient each token and each sequence gets from chosen losses.

For one batch (synthetic, a saved one, or one sampled by a trained lab policy: ``--policy RUN``) and each algorithm, `gradient_table` computes with
`pgloss.diagnostics.inspect` the per-token gradient g_{i,t} = ∂L/∂log π(y_{i,t}) of the policy term, scaled by
the number of sequences N so that every aggregation is on one scale (at ratio one, g·N is -Â for
every token of Dr.GRPO-like sums with C = 1, -Â/|y_i| for GRPO, -Â·N/N_tok for token-mean). The
figure has one column per algorithm, sharing each row's scale:

- top: g·N against the token's position for the shortest and the longest response with Â > 0 and
  with Â < 0;
- bottom: the total gradient a sequence receives, Σ_t g·N, against its length.

At ratio one the closed forms give the picture: a per-sequence token mean (GRPO, GSPO) gives every
sequence the same total |Â| whatever its length, so a long response's tokens get less each; a token
mean (BNPO, DAPO) and a constant divisor (Dr.GRPO) give every token the same weight, so a sequence's
total grows with its length; the sample-level loss gives each token the weight of its whole
sequence, so its total grows with the square of the length relative to GRPO's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import Tensor

DEFAULT_ALGORITHMS = ("grpo", "bnpo", "dr_grpo", "sample_grpo", "gspo")
BATCH_KEYS = ("log_prob", "old_log_prob", "advantages", "mask")
EXTRA_KEYS = ("scores", "group_ids", "teacher_log_prob", "ref_log_prob")
"""What some losses also need (TOPR the raw rewards, REAL the groups, OPD a teacher, A*-PO the reference, whose
log-ratio its policy term fits); a batch may hold them."""


def synthetic_batch(
    *, groups: int = 8, group_size: int = 8, max_length: int = 128, spread: float = 0.0, seed: int = 0
) -> dict[str, Tensor]:
    """`groups` prompts × `group_size` responses of lengths spread over 1..max_length, 0/1 rewards
    (``scores``) with GRPO's group advantages and their ``group_ids``, log π = log π_old + spread·noise
    (spread 0: ratio one), a reference and a teacher near π_old and an entropy per token. float64. The
    one synthetic batch of the command line: ``pgloss grads`` and ``pgloss losses`` draw it."""
    from ..advantages.group import group_advantages

    for name, value in (("groups", groups), ("group_size", group_size), ("max_length", max_length)):
        if not isinstance(value, int) or value < (2 if name == "group_size" else 1):
            raise ValueError(f"{name}: need an int >= {2 if name == 'group_size' else 1}, got {value!r}")
    if not spread >= 0:
        raise ValueError(f"spread: need >= 0, got {spread}")
    gen = torch.Generator().manual_seed(seed)
    n = groups * group_size
    lengths = torch.randint(1, max_length + 1, (n,), generator=gen)
    mask = torch.arange(max_length)[None, :] < lengths[:, None]
    rewards = (torch.rand(n, generator=gen) < 0.5).double()
    old = -torch.rand(n, max_length, generator=gen, dtype=torch.float64) * 2
    log_prob = -(old + spread * torch.randn(n, max_length, generator=gen, dtype=torch.float64)).abs()  # <= 0
    group_ids = torch.arange(n) // group_size
    advantages = group_advantages(rewards, group_ids)
    ref = -(old + 0.05 * torch.randn(n, max_length, generator=gen, dtype=torch.float64)).abs()
    entropy = torch.rand(n, max_length, generator=gen, dtype=torch.float64)
    teacher = -(old + 0.3 * torch.randn(n, max_length, generator=gen, dtype=torch.float64)).abs()
    return {
        "log_prob": log_prob,
        "old_log_prob": old,
        "advantages": advantages,
        "mask": mask,
        "scores": rewards,
        "group_ids": group_ids,
        "ref_log_prob": ref,
        "entropy": entropy,
        "teacher_log_prob": teacher,
    }


def load_batch(path: str | Path) -> dict[str, Tensor]:
    """A batch saved with ``torch.save({"log_prob": ..., "old_log_prob": ..., "advantages": ..., "mask": ...})``
    (and, optionally, ``scores``, ``group_ids``, ``teacher_log_prob`` and ``ref_log_prob``), read without running code from it (`torch_files.load_tensors`)."""
    from .torch_files import load_tensors

    data = load_tensors(path, "--batch")
    if not isinstance(data, dict) or any(k not in data for k in BATCH_KEYS):
        raise ValueError(f"batch: {path} must hold a dict with the keys {', '.join(BATCH_KEYS)}")
    return {k: data[k] for k in (*BATCH_KEYS, *EXTRA_KEYS) if k in data}


def gradient_table(algorithms, batch: dict[str, Tensor], *, norm_constant: float | None = None) -> dict[str, dict]:
    """Per algorithm (a name or a spec of ``--algorithms``, ``dapo:clip_high=0.3``): ``grad`` g·N
    `[B, T]` (policy term, autograd), ``closed_form`` -Â·f·w·N (None where the family has none),
    ``total`` Σ_t g·N `[B]`, and the batch's ``lengths`` and ``advantages`` `[B]`. A sum-norm divisor
    (Dr.GRPO's) defaults to `norm_constant` or the padded width (the generation budget)."""
    from ..diagnostics.inspect import inspect
    from .spec import parse_spec

    mask = batch["mask"].bool()
    n = int(mask.any(dim=1).sum())
    lengths = mask.sum(dim=1)
    advantages = batch["advantages"].double()
    if advantages.ndim == 2:  # per-token advantages: the sequence's mean, for the sign and the picks
        advantages = (advantages * mask).sum(dim=1) / lengths.clamp(min=1)
    table = {}
    for name in algorithms:
        spec = parse_spec(name)
        # the policy term alone (inspect separates the KL term anyway; a reference reaches a family that needs it);
        # a fixed divisor is the padded width unless given
        algorithm = spec.build(norm_constant or mask.shape[1], kl_coef=0.0)
        extra = {k: batch[k] for k in algorithm.needs if k in EXTRA_KEYS and k in batch}
        result = inspect(
            algorithm, batch["log_prob"], batch["old_log_prob"], batch["advantages"], mask, normalizer=None, **extra
        )  # no normalizer: the batch is the whole step
        grad = result.policy_grad * n
        closed = None if result.closed_form is None else result.closed_form * n
        table[spec.label] = {
            "grad": grad,
            "closed_form": closed,
            "total": grad.sum(dim=1),
            "lengths": lengths,
            "advantages": advantages,
            "reason": result.reason,
        }
    return table


def examples(lengths: Tensor, advantages: Tensor) -> dict[str, int]:
    """Row indices of the shortest and the longest response with Â > 0 and with Â < 0 (those that exist)."""
    picks = {}
    for sign, label in ((1, "Â>0"), (-1, "Â<0")):
        rows = ((advantages * sign > 0) & (lengths > 0)).nonzero().squeeze(1)
        if len(rows):
            picks[f"short, {label}"] = int(rows[lengths[rows].argmin()])
            picks[f"long, {label}"] = int(rows[lengths[rows].argmax()])
    return picks


COLUMNS = 5
"""Algorithms per row of the figure: more wrap into further pairs of rows."""


def plot(table: dict[str, dict], path: Path) -> Path:
    """The two-row figure of the module docstring, one column per algorithm (at most `COLUMNS` side
    by side; more wrap into further pairs of rows, every plot of a kind on one scale); returns `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(table)
    cols = min(COLUMNS, len(names))
    blocks = -(-len(names) // cols)
    fig, axes = plt.subplots(2 * blocks, cols, figsize=(3.0 * cols + 0.6, 2.8 * 2 * blocks + 0.4), squeeze=False)
    styles = {
        "short, Â>0": ("tab:green", "-"),
        "long, Â>0": ("tab:green", "--"),
        "short, Â<0": ("tab:red", "-"),
        "long, Â<0": ("tab:red", "--"),
    }
    tops, bottoms = [], []
    for k, name in enumerate(names):
        entry = table[name]
        lengths, advantages = entry["lengths"], entry["advantages"]
        top, bottom = axes[2 * (k // cols)][k % cols], axes[2 * (k // cols) + 1][k % cols]
        tops.append(top)
        bottoms.append(bottom)
        for label, row in examples(lengths, advantages).items():
            length = int(lengths[row])
            color, style = styles[label]
            top.plot(
                range(1, length + 1),
                entry["grad"][row, :length].tolist(),
                style,
                color=color,
                lw=1.3,
                label=f"{label} (|y|={length})",
            )
        top.axhline(0, color="black", lw=0.5)
        top.set_title(name, fontsize=10)
        top.set_xlabel("token position")
        for sign, color in ((1, "tab:green"), (-1, "tab:red")):
            rows = advantages * sign > 0
            bottom.scatter(
                lengths[rows].tolist(),
                entry["total"][rows].tolist(),
                s=9,
                color=color,
                label="Â > 0" if sign > 0 else "Â < 0",
            )
        bottom.axhline(0, color="black", lw=0.5)
        bottom.set_xlabel("response length |y|")
        # one scale per kind of plot for every algorithm; symmetric-log, since the losses differ by decades
        top.set_yscale("symlog", linthresh=_linthresh(table, "grad"))
        bottom.set_yscale("symlog", linthresh=_linthresh(table, "total"))
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    for group in (tops, bottoms):
        low = min(ax.get_ylim()[0] for ax in group)
        high = max(ax.get_ylim()[1] for ax in group)
        for ax in group:
            ax.set_ylim(low, high)
            if ax.get_subplotspec().colspan.start:
                ax.tick_params(labelleft=False)
    for ax in list(axes.flat):
        if ax not in tops and ax not in bottoms:
            ax.set_visible(False)
    for block in range(blocks):
        axes[2 * block][0].set_ylabel("per-token gradient  N·∂L/∂log π")
        axes[2 * block + 1][0].set_ylabel("sequence total  Σ_t N·∂L/∂log π")
    axes[0][0].legend(fontsize=6, loc="center right")  # the band around 0 holds no line
    axes[1][0].legend(fontsize=7, loc="center right")
    height = fig.get_size_inches()[1]
    fig.suptitle("How much gradient each token and each sequence gets (negative: pushed up)", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / height))  # room for the title above the first row
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _linthresh(table: dict[str, dict], key: str) -> float:
    """The symlog's linear range: the smallest non-zero magnitude of `key` over all algorithms."""
    values = torch.cat([entry[key].abs().flatten() for entry in table.values()])
    values = values[values > 0]
    return float(values.min()) if len(values) else 1.0


def summary(table: dict[str, dict]) -> list[str]:
    """Lines of a text table: per algorithm, the mean |per-token weight| and |sequence total| of the
    shortest and the longest third of the responses."""
    lines = [f"{'algorithm':<12} {'|g·N| short':>12} {'|g·N| long':>11} {'|total| short':>14} {'|total| long':>13}"]
    for name, entry in table.items():
        lengths = entry["lengths"].double()
        valid = lengths > 0
        low, high = torch.quantile(lengths[valid], torch.tensor([1 / 3, 2 / 3], dtype=torch.float64))
        cells = []
        for rows in (valid & (lengths <= low), valid & (lengths >= high)):
            per_token = entry["total"][rows].abs() / lengths[rows]
            cells.append((float(per_token.mean()), float(entry["total"][rows].abs().mean())))
        lines.append(f"{name:<12} {cells[0][0]:>12.4f} {cells[1][0]:>11.4f} {cells[0][1]:>14.3f} {cells[1][1]:>13.3f}")
    return lines


def cmd_grads(args) -> int:
    """Draw the gradient figure and print its summary table."""
    from .outputs import claim_file
    from .runner import require_extras
    from .spec import parse_algorithms

    try:  # every argument is checked before any work
        require_extras()
        names = [spec.label for spec in parse_algorithms(args.algorithms)]
        if args.batch and args.policy:
            raise ValueError("--batch and --policy are two sources of the batch: give one of them")
        if args.policy:
            from .policy import batch as policy_batch

            batch = policy_batch(args.policy, prompts=args.prompts, seed=args.seed)
        else:
            batch = (
                load_batch(args.batch)
                if args.batch
                else synthetic_batch(spread=args.spread, seed=args.seed, max_length=args.max_length)
            )
        table = gradient_table(names, batch)
        out = claim_file(args.out, "runs/grads.png", args.overwrite)
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"pgloss grads: {err}", file=sys.stderr)
        return 2
    print("\n".join(summary(table)))
    print(f"wrote {plot(table, out)}")
    return 0


def add_grads_command(subparsers) -> None:
    """Add ``grads`` to the ``pgloss`` command's subparsers."""
    from .spec import add_algorithms_argument

    parser = subparsers.add_parser("grads", help="draw the per-token gradient of chosen losses on one batch")
    add_algorithms_argument(parser, DEFAULT_ALGORITHMS)
    parser.add_argument(
        "--batch",
        help="a saved batch (torch.save of a dict with log_prob, old_log_prob, "
        "advantages, mask); default: a synthetic batch",
    )
    parser.add_argument(
        "--policy",
        metavar="RUN",
        help="a batch sampled by a trained lab policy: a pgloss train folder (its policy.safetensors), "
        "or a policy file of a compare folder (policies/<algorithm>-seed<seed>.safetensors)",
    )
    parser.add_argument(
        "--prompts",
        type=int,
        default=8,
        help="--policy: prompts sampled, each the run's group size of times (default 8)",
    )
    parser.add_argument(
        "--spread",
        type=float,
        default=0.0,
        help="synthetic batch: std of log π - log π_old (default 0: ratio one, the on-policy step)",
    )
    parser.add_argument("--max-length", type=int, default=128, help="synthetic batch: longest response (default 128)")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the synthetic batch, or of --policy's prompts and sampling (default 0)",
    )
    parser.add_argument(
        "--out",
        help="the figure's path (default: runs/grads.png, or runs/grads-2.png, ... when "
        "taken); an --out that exists is refused",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write over the figure at --out, the earlier one kept as <name>.replaced.png",
    )
    parser.set_defaults(func=cmd_grads)
