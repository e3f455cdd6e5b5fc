"""pgloss.integrations.lm_head: each model class's head options reproduce that model's own logits (transformers
5.10, tiny random models in float64), and a class it does not know is refused when its config sets a key."""

import pytest
import torch

import pgloss
from pgloss.integrations.lm_head import head_options

transformers = pytest.importorskip("transformers")

V, WIDTH = 40, 32
COMMON = dict(
    vocab_size=V,
    hidden_size=WIDTH,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=None,
    tie_word_embeddings=False,
)
# Each table row that builds small on a CPU, with an option that moves the logits (|logits| ≲ 1.5 here).
# FalconH1 (lm_head_multiplier) is left out: its CPU mamba path takes about a minute.
MODELS = {
    "Gemma2": (dict(final_logit_softcapping=0.5, head_dim=8), dict(softcap=0.5)),
    "Gemma3": (dict(final_logit_softcapping=0.5, head_dim=8), dict(softcap=0.5)),
    "VaultGemma": (dict(final_logit_softcapping=0.5, head_dim=8), dict(softcap=0.5)),
    "NanoChat": (dict(final_logit_softcapping=0.5), dict(softcap=0.5)),
    "RecurrentGemma": (
        dict(logits_soft_cap=0.5, lru_width=WIDTH, attention_window_size=16, block_types=("recurrent", "attention")),
        dict(softcap=0.5),
    ),
    "Cohere": (dict(logit_scale=3.0), dict(logit_scale=3.0)),
    "Cohere2": (dict(logit_scale=3.0), dict(logit_scale=3.0)),
    "Granite": (dict(logits_scaling=0.25), dict(logit_scale=4.0)),
    "GraniteMoe": (dict(logits_scaling=0.25, num_local_experts=2, num_experts_per_tok=1), dict(logit_scale=4.0)),
    "HyperCLOVAX": (dict(logits_scaling=4.0), dict(logit_scale=4.0)),
    "Phi": ({}, dict(bias=True)),
    "Qwen2": ({}, {}),
}


def build(family, options):
    config_class = getattr(transformers, "Gemma3TextConfig" if family == "Gemma3" else f"{family}Config")
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config_class(**COMMON, **options)).double().eval()
    if model.get_output_embeddings().bias is not None:  # initialised to 0: a random one, that a dropped bias shows
        torch.nn.init.normal_(model.get_output_embeddings().bias, std=0.5)
    return model


def own_and_fused(model, head, temperature=0.7):
    """log π(y) from the model's own logits, and from its last hidden states through pgloss's head `head`."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(2, V, (2, 7), generator=gen)
    targets = torch.randint(0, V, (2, 7), generator=gen)
    with torch.no_grad():
        logits = model(input_ids=ids).logits / temperature
        hidden = model.base_model(input_ids=ids).last_hidden_state
        own = logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
        fused, _ = pgloss.log_prob_and_entropy_from_hidden(
            hidden, model.get_output_embeddings().weight, targets, temperature=temperature, head=head
        )
    return own, fused


@pytest.mark.parametrize("family", MODELS)
def test_the_options_give_the_models_own_logits(family):
    config, expected = MODELS[family]
    model = build(family, config)
    options = head_options(model)
    bias = model.get_output_embeddings().bias
    assert isinstance(options, pgloss.HeadOptions)
    assert vars(options) == dict(
        bias=bias, logit_scale=expected.get("logit_scale", 1.0), softcap=expected.get("softcap")
    )
    assert (bias is not None) == ("bias" in expected)
    own, fused = own_and_fused(model, options)
    # measured: 0 for every model (the same float64 operations in the same order)
    torch.testing.assert_close(fused, own, rtol=0, atol=1e-13)
    if expected:  # the option matters: the plain head is off by 9.8e-3 (VaultGemma) to 1.2 (HyperCLOVAX)
        _, plain = own_and_fused(model, pgloss.HeadOptions())
        assert (plain - own).abs().max() > 5e-3


def test_a_subclass_is_read_as_its_base_and_mpt_ignores_its_logit_scale():
    class MyGemma(transformers.Gemma2ForCausalLM):
        pass

    torch.manual_seed(0)
    model = MyGemma(transformers.Gemma2Config(**COMMON, final_logit_softcapping=0.5, head_dim=8))
    assert head_options(model).softcap == 0.5
    mpt = (
        transformers.MptForCausalLM(
            transformers.MptConfig(vocab_size=V, d_model=WIDTH, n_heads=4, n_layers=2, max_seq_len=64, logit_scale=3.0)
        )
        .double()
        .eval()
    )
    assert vars(head_options(mpt)) == dict(bias=None, logit_scale=1.0, softcap=None)
    own, fused = own_and_fused(mpt, head_options(mpt))
    torch.testing.assert_close(fused, own, rtol=0, atol=1e-13)


def test_an_unknown_class_with_a_head_key_is_refused():
    torch.manual_seed(0)
    for key, value in (("logit_scale", 2.0), ("final_logit_softcapping", 1.0), ("logits_scaling", "4")):
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON, **{key: value}))
        with pytest.raises(
            ValueError, match=f"fused=True does not know how Qwen2ForCausalLM applies {key}={value!r} to its logits"
        ):
            head_options(model)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON, logit_scale=1.0))  # no change: read
    assert vars(head_options(model)) == dict(bias=None, logit_scale=1.0, softcap=None)
