"""A transformers model's LM head as pgloss's head record (`pgloss.HeadOptions`: bias, logit scale, soft-cap), for the
fused path.

pgloss's head (`pgloss.HeadOptions`) computes logits = c · tanh(s · (x Wᵀ + b) / c) (s · (x Wᵀ + b) without a
soft-cap c), then divides by τ. Read from each model's forward in transformers 5.10
(models/<name>/modeling_<name>.py, the lines after `self.lm_head(...)`): a bias lives in the head's Linear, before
anything else, and no model applies both a scale and a soft-cap, so each is exactly that order:

- Gemma2, Gemma3, Gemma3n, Gemma4, Gemma4Unified, VaultGemma, NanoChat ForCausalLM; Gemma3n, Gemma4, Gemma4Unified
  ForConditionalGeneration: c · tanh(z / c), c = `final_logit_softcapping` (z when None)  ->  softcap = c
- RecurrentGemmaForCausalLM: c · tanh(z / c), c = `logits_soft_cap`  ->  softcap = c
- Cohere, Cohere2, Cohere2Moe ForCausalLM: z · `logit_scale`  ->  logit_scale
- FalconH1ForCausalLM: z · `lm_head_multiplier`  ->  logit_scale
- Granite, GraniteMoe, GraniteMoeShared, GraniteMoeHybrid ForCausalLM; Granite4VisionForConditionalGeneration:
  z / `logits_scaling`  ->  logit_scale = 1 / logits_scaling
- HyperCLOVAXForCausalLM: z · `logits_scaling` (it multiplies)  ->  logit_scale = logits_scaling
- MptForCausalLM: z (its config's `logit_scale` is not used)  ->  none

with z = x Wᵀ + b the head's output; a subclass is read as its base class. The keys are read from the text config
(`config.get_text_config()`), as these forwards read them. Another class whose config sets one of the keys (`KEYS`)
is refused by name: how its forward applies it is not known here. TRL 1.16's own chunked head (`add_fused_lm_head`,
used by fused=False) reads the same keys by name for every class instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..vocab.chunks import HeadOptions

__all__ = ["KEYS", "head_options"]

KEYS = (
    "final_logit_softcapping",
    "logits_soft_cap",
    "logit_scale",
    "lm_head_multiplier",
    "logits_scaling",
    "output_multiplier",
)
"""Config keys that change a head's logits in some model; a class outside `_RULES` with one of them set is refused."""


def _sets(config: Any, key: str) -> bool:
    """Whether `config` sets `key` to a value that changes the logits: a soft-cap when given, a scale other than 1."""
    value = getattr(config, key, None)
    return value is not None and (key in ("final_logit_softcapping", "logits_soft_cap") or value != 1)


def _softcap(key: str) -> Callable[[Any], dict[str, Any]]:
    return lambda config: {"softcap": getattr(config, key)}


def _scale(key: str, divides: bool = False) -> Callable[[Any], dict[str, Any]]:
    return lambda config: {"logit_scale": 1.0 / getattr(config, key) if divides else getattr(config, key)}


_GEMMA_CAP = _softcap("final_logit_softcapping")
_RULES: dict[str, Callable[[Any], dict[str, Any]]] = {
    **dict.fromkeys(
        [
            "Gemma2ForCausalLM",
            "Gemma3ForCausalLM",
            "Gemma3nForCausalLM",
            "Gemma3nForConditionalGeneration",
            "Gemma4ForCausalLM",
            "Gemma4ForConditionalGeneration",
            "Gemma4UnifiedForCausalLM",
            "Gemma4UnifiedForConditionalGeneration",
            "VaultGemmaForCausalLM",
            "NanoChatForCausalLM",
        ],
        _GEMMA_CAP,
    ),
    "RecurrentGemmaForCausalLM": _softcap("logits_soft_cap"),
    **dict.fromkeys(["CohereForCausalLM", "Cohere2ForCausalLM", "Cohere2MoeForCausalLM"], _scale("logit_scale")),
    "FalconH1ForCausalLM": _scale("lm_head_multiplier"),
    **dict.fromkeys(
        [
            "GraniteForCausalLM",
            "GraniteMoeForCausalLM",
            "GraniteMoeSharedForCausalLM",
            "GraniteMoeHybridForCausalLM",
            "Granite4VisionForConditionalGeneration",
        ],
        _scale("logits_scaling", divides=True),
    ),
    "HyperCLOVAXForCausalLM": _scale("logits_scaling"),
    "MptForCausalLM": lambda config: {},
}
"""Each model class's head options from its text config (the module's table)."""


def head_options(model: Any) -> HeadOptions:
    """`model`'s LM head as a `pgloss.HeadOptions`, the `head=` of `Algorithm.from_hidden` and
    `log_prob_and_entropy_from_hidden` (`ref_head=`, `teacher_head=` for a reference or a teacher): the head's
    bias (`get_output_embeddings().bias`, or None) and the scale or soft-cap of its class's forward (the
    module's table, looked up along the class's bases).

    `model` is the transformers model whose forward computes the logits (PEFT's base model, not its wrapper).
    ValueError, naming the class and the key, for a class outside the table whose config sets one of `KEYS`."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    bias = getattr(model.get_output_embeddings(), "bias", None)
    rule = next((_RULES[c.__name__] for c in type(model).__mro__ if c.__name__ in _RULES), None)
    if rule is not None:
        return HeadOptions(bias, **rule(config))
    unknown = sorted({f"{key}={getattr(c, key)!r}" for c in (config, model.config) for key in KEYS if _sets(c, key)})
    if unknown:
        raise ValueError(
            f"fused=True does not know how {type(model).__name__} applies {', '.join(unknown)} to its "
            "logits (pgloss.integrations.lm_head lists the models it reads); use fused=False"
        )
    return HeadOptions(bias)
