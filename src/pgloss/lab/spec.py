"""Algorithm specs of the command line: a pgloss name with optional loss hyperparameters.

A spec is ``NAME`` or ``NAME:KEY=VALUE,KEY=VALUE``, e.g. ``dapo:clip_high=0.3``. Its canonical
text is the run's label (in ``metrics.jsonl``, the report and the plots), so two settings of one
loss are two distinct runs: ``--algorithms dapo dapo:clip_high=0.3``. Values are numbers,
``true``/``false``, ``none`` or words (``loss_agg_mode=token-mean``); every key and value is
checked against ``pgloss.get`` before any training, so a typo fails at once and names the valid
hyperparameters.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Spec:
    """One algorithm of a run: its pgloss name and the hyperparameters set on the command line."""

    name: str
    args: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        """The canonical text: ``name`` or ``name:key=value,...`` (keys in the order given)."""
        if not self.args:
            return self.name
        return self.name + ":" + ",".join(f"{k}={_show(v)}" for k, v in self.args)

    def with_args(self, args: dict[str, Any]) -> Spec:
        """This spec with `args` added; its own settings win over `args`."""
        own = dict(self.args)
        merged = {**{k: v for k, v in args.items() if k not in own}, **own}
        return Spec(self.name, tuple(merged.items()))

    def build(self, max_new_tokens: float, rollout_correction=None, **fixed):
        """The pgloss algorithm, with `rollout_correction` (a ``RolloutCorrection`` or None) and the
        hyperparameters `fixed` over the spec's own (``pgloss grads`` fixes ``kl_coef=0``). A sum-norm
        aggregation (Dr.GRPO) without a given ``norm_constant`` divides by the response budget,
        `max_new_tokens` (``pgloss grads`` passes its ``--norm-constant`` there, any positive number). Raises ValueError/TypeError like ``pgloss.get``."""
        import pgloss

        kwargs = {**dict(self.args), **fixed}  # checked by the family's own check_fields, named with the label
        if rollout_correction is not None:
            kwargs["rollout_correction"] = rollout_correction
        try:
            algorithm = pgloss.get(self.name, generation_budget=float(max_new_tokens), **kwargs)
        except (TypeError, ValueError) as err:
            raise type(err)(f"{self.label}: {err}") from None
        if algorithm.uses_full_kl:  # it needs the reference's logits at every position, which the lab does not keep
            raise ValueError(
                f"{self.label}: the lab computes the KL term from sampled tokens; kl_estimator='full' "
                f"is not available here (use k1, k2, k3 or a '+' form)"
            )
        return algorithm


def _show(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _value(text: str) -> Any:
    """``none`` -> None, ``true``/``false`` -> bool, a number -> int/float, anything else: the text."""
    low = text.lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else text


def parse_setting(text: str, where: str) -> tuple[str, Any]:
    """``key=value`` -> (key, value); `where` names the argument in the error."""
    key, sep, value = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key or not value.strip():
        raise ValueError(f"{where}: expected KEY=VALUE, got {text!r}")
    return key, _value(value.strip())


def parse_spec(text: str) -> Spec:
    """``name`` or ``name:key=value,key=value`` (``:`` also separates settings)."""
    name, _, rest = text.strip().partition(":")
    if not name:
        raise ValueError(f"algorithm spec {text!r}: no algorithm name before ':'")
    pieces = [p for p in rest.replace(":", ",").split(",") if p.strip()]
    args = dict(parse_setting(p, f"algorithm spec {text!r}") for p in pieces)
    return Spec(name.strip(), tuple(args.items()))


def parse_algorithms(items: list[str], every: list[str] | None = None, loss_args: Sequence[str] = ()) -> list[Spec]:
    """The specs of ``--algorithms`` (space- or comma-separated; ``all`` is every name in `every`),
    each with the ``--loss-arg`` settings added. A comma-separated ``key=value`` continues the
    previous spec's settings: ``dapo:clip_high=0.3,clip_low=0.1``. Duplicate labels are refused.
    `every` defaults to ``pgloss.names()``."""
    if every is None:
        import pgloss

        every = pgloss.names()
    texts: list[str] = []
    for piece in (p.strip() for item in items for p in item.split(",")):
        if not piece:
            continue
        if "=" in piece and ":" not in piece:
            if not texts:
                raise ValueError(f"--algorithms: setting {piece!r} comes before any algorithm name")
            texts[-1] += "," + piece
        elif piece == "all":
            texts += every
        else:
            texts.append(piece)
    if not texts:
        raise ValueError("--algorithms: no algorithm given")
    shared = dict(parse_setting(a, "--loss-arg") for a in loss_args)
    specs = [parse_spec(t).with_args(shared) for t in texts]
    seen: set[str] = set()
    for spec in specs:
        if spec.label in seen:
            raise ValueError(f"--algorithms: {spec.label} is listed twice (two runs need distinct settings)")
        seen.add(spec.label)
    return specs


GRAMMAR = (
    "pgloss algorithm names, space- or comma-separated, 'all' for every name; NAME:KEY=VALUE[,KEY=VALUE] "
    "sets that algorithm's loss hyperparameters, so 'dapo dapo:clip_high=0.3' compares two settings of one loss"
)


def add_algorithms_argument(parser, default: tuple[str, ...], *flags: str, one: bool = False) -> None:
    """``--algorithms`` (and `flags`), the one grammar of every command that takes algorithms
    (`parse_algorithms` reads it); `one`: the command takes exactly one."""
    what = (
        "one algorithm, NAME or NAME:KEY=VALUE[,KEY=VALUE] (the grammar of --algorithms elsewhere)" if one else GRAMMAR
    )
    parser.add_argument(
        "--algorithms",
        *flags,
        dest="algorithms",
        nargs="+",
        default=list(default),
        metavar="SPEC",
        help=f"{what} (default: {' '.join(default)})",
    )


CORRECTION_KEYS = {
    "mode": "weight_mode",
    "lower": "lower",
    "upper": "upper",
    "off_policy_mask": "off_policy_mask",
    "bypass": "bypass",
    "batch_normalize": "batch_normalize",
    "weight_kl": "weight_kl",
    "max_log_ratio": "max_log_ratio",
}


def parse_rollout_correction(text: str):
    """``--rollout-correction``: ``default`` -> None (the loss's own truncated IS when given rollout
    log-probs); ``none`` -> no weight (the mismatch metrics only); ``LEVEL[:KEY=VALUE,...]`` with LEVEL
    token, sequence_product or sequence_geometric and keys mode (truncate/mask), lower, upper,
    off_policy_mask, bypass, batch_normalize, weight_kl, max_log_ratio, or a rejection rule
    ``<level>_<k>=BOUND`` (e.g. ``seq_mean_k3=0.01``; for k1 the bound is the ratio's upper one).
    ``none:KEY=VALUE`` keeps the masks without a weight. ValueError/TypeError naming the option."""
    from ..correction.rejection import REJECTION_OPTIONS, Rejection
    from ..correction.rollout import WEIGHT_LEVELS, RolloutCorrection

    where = f"--rollout-correction {text!r}"
    if not isinstance(text, str):
        raise TypeError(f"--rollout-correction takes a string, got {text!r}")
    level, _, rest = text.strip().partition(":")
    if level == "default" and not rest:
        return None
    if level not in (*WEIGHT_LEVELS, "none"):
        raise ValueError(
            f"{where}: the level must be default, none or one of {', '.join(WEIGHT_LEVELS)}, got {level!r}"
        )
    kwargs: dict[str, Any] = {"weight_level": None if level == "none" else level}
    rejection = []
    for piece in (p for p in rest.replace(":", ",").split(",") if p.strip()):
        key, value = parse_setting(piece, where)
        if key in REJECTION_OPTIONS:
            rejection.append((key, value))
        elif key in CORRECTION_KEYS:
            kwargs[CORRECTION_KEYS[key]] = value
        else:
            raise ValueError(
                f"{where}: unknown key {key!r}; valid keys: {', '.join(CORRECTION_KEYS)} or a rejection "
                f"rule <level>_<k> ({', '.join(REJECTION_OPTIONS)})"
            )
    try:
        kwargs["rejection"] = tuple(Rejection(option, upper=bound) for option, bound in rejection)
        return RolloutCorrection(**kwargs)
    except (TypeError, ValueError) as err:
        raise type(err)(f"{where}: {err}") from None
