"""The `pgloss` command. `COMMANDS` below is the table of its subcommands (list, losses, train, compare,
experiment, report, grads, conformance), each added by the module that owns it; `DESCRIPTION` is what
`pgloss --help` says of them. SIGTERM ends any of them as Ctrl-C does."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys

from . import algorithms

# Hyperparameters shared by every algorithm; `list` shows them once per row only when they differ
# from the base default, so each row reads as "what makes this algorithm itself".
_BASE = {f.name: f.default for f in dataclasses.fields(algorithms.Algorithm)}


def _defaults(algorithm: algorithms.Algorithm, skip: tuple[str, ...] = ()) -> str:
    shown = []
    for f in dataclasses.fields(algorithm):
        value = getattr(algorithm, f.name)
        if f.name in ("name", "loss_agg_mode", *skip) or value is None or (f.name in _BASE and _BASE[f.name] == value):
            continue
        shown.append(f"{f.name}={value}")
    return ", ".join(shown)


def _row(name: str) -> tuple[str, str]:
    """(loss_agg_mode, defaults) of a name; a value the caller must give (Dr.GRPO's divisor) is marked."""
    if not algorithms.divides_by_budget(name):
        return (algorithm := algorithms.get(name)).loss_agg_mode, _defaults(algorithm)
    algorithm = algorithms.get(name, generation_budget=1.0)  # the placeholder budget is not shown
    return algorithm.loss_agg_mode + " (norm_constant required)", _defaults(algorithm, skip=("norm_constant",))


def cmd_list(args: argparse.Namespace) -> int:
    """Print the named algorithms grouped by family, each with its aggregation, defaults and source."""
    rows = {name: _row(name) for name in algorithms.names()}
    width = max(len(n) for n in rows)
    agg_width = max(len(agg) for agg, _ in rows.values())
    for family, members in algorithms.families().items():
        module = algorithms.NAMED[members[0]][0].__module__.removeprefix("pgloss.").replace(".", "/")
        print(f"[{family}] {module}.py")
        for name in members:
            agg, defaults = rows[name]
            print(f"{name:<{width}}  {agg:<{agg_width}}  {defaults}")
            print(f"{'':<{width}}  source: {algorithms.SOURCES[name]}")
    return 0


# What each column of `pgloss losses` is (printed under the table).
LOSS_COLUMNS = {
    "loss": "the value minimised: policy term + kl_coef * KL - entropy_coef * entropy, aggregated",
    "pg_loss": "the policy term alone",
    "kl": "the KL estimate to the reference (the algorithm's kl_estimator); '-' for a loss without a KL term "
    "(kl_coef 0)",
    "pg_clipfrac": "share of valid tokens where the clip (or the loss's own bound) is active",
    "ppo_kl": "mean of log pi_old - log pi over valid tokens (how far the update moved)",
    "ratio_mean": "mean importance ratio pi / pi_old (at the loss's ratio level)",
    "ratio_max": "largest importance ratio",
    "entropy": "mean entropy given to the loss (the synthetic batch's, the same for every row)",
    "grad_norm": "L2 norm of d loss / d log_prob over the batch",
}


def cmd_losses(args: argparse.Namespace) -> int:
    """Compute every algorithm's loss on one synthetic batch and print the loss with its metrics."""
    import torch

    from .lab.grads import synthetic_batch

    if args.batch < 2 or args.batch % 2:
        print(
            f"pgloss losses: --batch must be an even number >= 2 (groups of 2 or 4), got {args.batch}", file=sys.stderr
        )
        return 2
    if args.length < 1:
        print(f"pgloss losses: --length must be >= 1 (tokens per response), got {args.length}", file=sys.stderr)
        return 2
    group_size = 4 if args.batch % 4 == 0 else 2
    data = synthetic_batch(
        groups=args.batch // group_size, group_size=group_size, max_length=args.length, spread=0.15, seed=args.seed
    )
    keys = ["loss", "pg_loss", "kl", "pg_clipfrac", "ppo_kl", "ratio_mean", "ratio_max", "entropy"]
    print(
        f"synthetic batch: B={args.batch} in groups of {group_size}, T={args.length}, seed={args.seed}, "
        f"{int(data['mask'].sum())} valid tokens"
    )
    print(f"{'algorithm':<14}" + "".join(f"{k:>12}" for k in keys) + "   grad_norm")
    for name in algorithms.names():
        algorithm = algorithms.get(name, generation_budget=args.length)
        log_prob = data["log_prob"].clone().requires_grad_(True)
        out = algorithm(
            log_prob,
            data["old_log_prob"],
            data["advantages"],
            data["mask"],
            ref_log_prob=data["ref_log_prob"],
            entropy=data["entropy"],
            group_ids=data["group_ids"],
            scores=data["scores"],
            teacher_log_prob=data["teacher_log_prob"],
        )
        (grad,) = torch.autograd.grad(out.loss, log_prob)
        values = {"loss": out.loss.detach(), **out.metrics}
        if not algorithm.uses_reference:  # measured, but no term of this loss
            values.pop("kl", None)
        cells = "".join(f"{float(values[k]):>12.4f}" if k in values else f"{'-':>12}" for k in keys)
        print(f"{name:<14}{cells}   {float(grad.norm()):.4f}")
    print("\ncolumns ('-': the loss has no such quantity):")
    width = max(map(len, LOSS_COLUMNS))
    for key, text in LOSS_COLUMNS.items():
        print(f"  {key:<{width}}  {text}")
    if args.length:
        print(f"dr_grpo's norm_constant is --length ({args.length}).")
    return 0


def add_basic_commands(sub) -> None:
    """``list`` and ``losses``: what needs torch only."""
    sub.add_parser("list", help="the named algorithms and their defaults").set_defaults(func=cmd_list)
    losses = sub.add_parser("losses", help="every loss and its metrics on one synthetic batch")
    losses.add_argument("--batch", type=int, default=8, help="sequences in the batch")
    losses.add_argument("--length", type=int, default=24, help="padded length; also Dr.GRPO's norm_constant")
    losses.add_argument("--seed", type=int, default=0, help="seed of the synthetic batch")
    losses.set_defaults(func=cmd_losses)


def cmd_swift_plugin(args: argparse.Namespace) -> int:
    """Print the path of the ms-swift plugin file (for `swift rlhf --external_plugins`), without importing swift."""
    import importlib.util

    spec = importlib.util.find_spec("pgloss.integrations.swift_plugin")
    assert spec is not None and spec.origin is not None  # a file of this package
    print(spec.origin)
    return 0


def add_swift_plugin_command(sub) -> None:
    """``swift-plugin``: the plugin file that puts pgloss's losses into ms-swift's GRPO trainer."""
    sub.add_parser(
        "swift-plugin", help="print the path of the plugin file for `swift rlhf --external_plugins`"
    ).set_defaults(func=cmd_swift_plugin)


# The command table: each entry is (module, function) and the function adds its subcommands to the
# parser. A new command is one line here; its module is imported only when the parser is built.
COMMANDS = (
    ("pgloss.cli", "add_basic_commands"),  # list, losses
    ("pgloss.lab.commands", "add_commands"),  # train, compare
    ("pgloss.experiments.command", "add_experiment_command"),  # experiment length, distill
    ("pgloss.experiments.command", "add_report_command"),  # report RUN_DIR
    ("pgloss.lab.grads", "add_grads_command"),  # grads
    ("pgloss.conformance.run", "register"),  # conformance
    ("pgloss.cli", "add_swift_plugin_command"),  # swift-plugin
)


DESCRIPTION = (
    "Policy-gradient losses for reinforcement learning of language models: list them (list), run each on "
    "one batch (losses), train a tiny policy with one (train) or compare several over seeds (compare), test "
    "a published claim (experiment), write a run's report again (report), draw the per-token gradient "
    "(grads), check pgloss against the trainers' own losses (conformance), and print the path of the plugin file "
    "that puts pgloss's losses into ms-swift's GRPO trainer (swift-plugin). `pgloss COMMAND --help` "
    "gives a command's options; Ctrl-C or SIGTERM stops any of them."
)


def build_parser() -> argparse.ArgumentParser:
    import importlib

    import pgloss

    parser = argparse.ArgumentParser(prog="pgloss", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"pgloss {pgloss.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for module, function in COMMANDS:
        getattr(importlib.import_module(module), function)(sub)
    return parser


def _initials(option: str) -> str:
    """`--learning-rate` -> `--lr`: how a long option is shortened (an option of one word is itself)."""
    words = option.lstrip("-").split("-")
    return "--" + "".join(word[:1] for word in words) if len(words) > 1 else option


def closest_option(name: str, options: list[str]) -> str | None:
    """The option of `options` that `name` most likely means: a near spelling (difflib), else the one whose
    initials `name` is or that `name`'s initials are (`--learning-rate` and `--lr`, `--max-grad-norm` and
    `--mgn`); None when nothing is close."""
    close = difflib.get_close_matches(name, options, n=1)
    if close:
        return close[0]
    long = [option for option in options if option.startswith("--")]
    return next((o for o in long if o == _initials(name)), None) or next(
        (o for o in long if _initials(o) == name and o != name), None
    )


def _refuse_unknown(parser: argparse.ArgumentParser, command: str, unknown: list[str]) -> None:
    """Exit 2 naming the options `command` does not take, the closest one it does, and the other commands that
    take the option as spelt (train's --seed, compare's --seeds), under a one-line usage of `command` (its
    --help lists the options)."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    chosen = commands[command]
    hints = []
    for name in dict.fromkeys(arg.split("=", 1)[0] for arg in unknown if arg.startswith("--")):
        close = [option] if (option := closest_option(name, list(chosen._option_string_actions))) else []
        elsewhere = [
            f"pgloss {other}" for other, p in commands.items() if other != command and name in p._option_string_actions
        ]
        hint = ([f"did you mean {close[0]}?"] if close else []) + (
            [f"{name} is an option of {' and '.join(elsewhere)}"] if elsewhere else []
        )
        hints += [" ".join(hint)] if hint else []
    message = f"unrecognized arguments: {' '.join(unknown)}" + (f" ({'; '.join(hints)})" if hints else "")
    chosen.exit(
        2, f"usage: {chosen.prog} [options] ({chosen.prog} --help lists them)\n{chosen.prog}: error: {message}\n"
    )


def main(argv: list[str] | None = None) -> int:
    from .lab.runner import interruptible  # SIGTERM ends a command as Ctrl-C does

    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _refuse_unknown(parser, args.command, unknown)
    with interruptible():
        return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
