"""The trainers' names for pgloss's hyperparameters and values: one table, read by the errors of
`pgloss.get` ("did you mean") and by the translations of a trainer's config (`pgloss.from_trl`,
`pgloss.from_verl`, the adapters), so that a name means one thing on every path.

Users arrive with TRL and verl configs: `pgloss.get("dapo", epsilon_high=0.28)` should say that
pgloss calls it `clip_high`, not only list pgloss's names.
"""

from __future__ import annotations

FIELDS: dict[str, tuple[str, str]] = {
    # their name: (pgloss's name, whose name it is)
    "epsilon": ("clip_low", "TRL's and ms-swift's (it also sets clip_high when epsilon_high is unset)"),
    "epsilon_high": ("clip_high", "TRL's and ms-swift's"),
    "epsilon_low": ("clip_low", "TRL's"),
    "eps_clip": ("clip_low", "OpenRLHF's (and clip_high)"),
    "eps_clip_low_high": ("clip_low", "OpenRLHF's (a pair: clip_low, clip_high)"),
    "clip_ratio": ("clip_low", "verl's (and clip_high)"),
    "clip_ratio_low": ("clip_low", "verl's"),
    "clip_ratio_high": ("clip_high", "verl's"),
    "clip_ratio_c": ("dual_clip", "verl's"),
    "dual_clip_ratio": ("dual_clip", "OpenRLHF's"),
    "beta": ("kl_coef", "TRL's and ms-swift's"),
    "kl_loss_coef": ("kl_coef", "verl's"),
    "init_kl_coef": ("kl_coef", "OpenRLHF's"),
    "kl_loss_type": ("kl_estimator", "verl's"),
    "kl_penalty": ("kl_estimator", "verl's"),
    "kl_estimator_type": ("kl_estimator", "OpenRLHF's"),
    "entropy_coeff": ("entropy_coef", "verl's"),
    "loss_scale_factor": ("norm_constant", "verl's"),
    "importance_sampling_level": ("ratio_level", "TRL's"),
    "sapo_temperature_pos": ("tau_pos", "TRL's"),
    "sapo_temperature_neg": ("tau_neg", "TRL's"),
    "loss_type": ("the algorithm's name", "TRL's: pgloss.get(loss_type)"),
    "policy_loss": ("the algorithm's name", "verl's: pgloss.get(name)"),
}
"""A trainer's hyperparameter name -> the pgloss name of the same meaning."""

VALUES: dict[str, dict[str, str]] = {
    "kl_estimator": {"kl": "k1", "mse": "k2", "low_var_kl": "k3", "kl+": "k1+", "mse+": "k2+", "low_var_kl+": "k3+"},
}
"""Per pgloss field: a trainer's value -> pgloss's value of the same meaning (verl's KL names)."""


def field_hint(name: str) -> str:
    """' (did you mean X? N is <trainer>'s name for it)' for a trainer's name, else ''."""
    if name not in FIELDS:
        return ""
    ours, whose = FIELDS[name]
    return f" (did you mean {ours}? {name!r} is {whose} name for it)"


def value_hint(field: str, value: object) -> str:
    """' (did you mean X? ...)' for a trainer's value of `field`, else ''."""
    ours = VALUES.get(field, {}).get(value) if isinstance(value, str) else None
    return "" if ours is None else f" (did you mean {ours!r}? {value!r} is verl's name for it)"


def translate_value(field: str, value: object) -> object:
    """pgloss's value for a trainer's `value` of `field` (unchanged when it is already pgloss's)."""
    return VALUES.get(field, {}).get(value, value) if isinstance(value, str) else value


def closest(name: object, valid) -> str:
    """' (did you mean X?)' for the name of `valid` closest to a misspelt `name` (difflib's ratio >= 0.6),
    else ''. Every "unknown name" error of pgloss asks here."""
    import difflib

    match = difflib.get_close_matches(str(name), list(valid), n=1) if isinstance(name, str) else []
    return f" (did you mean {match[0]!r}?)" if match else ""


def edits(a: str, b: str) -> int:
    """The Levenshtein distance: the fewest insertions, deletions and substitutions that make `a` into `b`."""
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        previous, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (x != y))
    return row[-1]


def misspelt(given, known) -> list[tuple[str, str]]:
    """(key, the name it misspells) for each key of `given` that is not in `known` but a typo away from one (one
    edit, two for a name of 10 characters or more): a trainer's config as a dict holds keys pgloss does not read
    (TRL's `vllm_importance_sampling_cap` beside `..._clip_max`), so an unknown key is refused only where it is a
    slip of one pgloss reads (`clip_ratio_hgh`), never silently ignored."""
    known = list(known)
    found = []
    for key in given:
        if isinstance(key, str) and key not in known and known:
            match = min(known, key=lambda name: edits(key, name))
            if edits(key, match) <= 1 + (len(match) >= 10):
                found.append((key, match))
    return found


def refuse_misspelt(given, known, where: str) -> None:
    """A ValueError naming every misspelt key of `given` (`misspelt`) and the name it misspells."""
    found = misspelt(given, known)
    if found:
        raise ValueError(
            f"{where}: " + "; ".join(f"{key!r} is not an option (did you mean {match!r}?)" for key, match in found)
        )
