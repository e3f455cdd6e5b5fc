"""The tiny model and the group sampler."""

import torch

from pgloss.lab.model import ModelConfig, TinyGPT
from pgloss.lab.sampling import response_log_probs, sample, teacher_forced
from pgloss.lab.tokenizer import EOS, PAD, Tokenizer

TOK = Tokenizer()


def model(seed=0):
    torch.manual_seed(seed)
    return TinyGPT(ModelConfig(TOK.vocab_size, block_size=32, d_model=32, n_layer=1, n_head=2))


def test_model_is_causal_and_ignores_left_padding():
    m = model()
    x = torch.tensor([TOK.encode("1+2=|3")])
    valid = torch.ones_like(x, dtype=torch.bool)
    a = m(x, valid)
    x2 = x.clone()
    x2[0, -1] = TOK.stoi["9"]
    assert torch.allclose(m(x2, valid)[0, :-1], a[0, :-1], atol=1e-6)  # the future does not leak
    padded = torch.cat([torch.full((1, 3), PAD), x], 1)
    b = m(padded, padded != PAD)
    assert torch.allclose(b[0, 3:], a[0], atol=1e-5)  # left padding changes nothing


def test_sample_groups_masks_and_determinism():
    m = model()
    prompts = [TOK.encode("1+2="), TOK.encode("3+4+5=")]
    kw = dict(group_size=3, max_new_tokens=6, temperature=1.0)
    r = sample(m, prompts, generator=torch.Generator().manual_seed(0), **kw)
    assert r.tokens.shape[0] == 6 and r.group_ids.tolist() == [0, 0, 0, 1, 1, 1]
    assert r.prompt_len == 1 + 6 and r.mask.shape[1] <= 6
    for row, mask, done in zip(r.responses, r.mask, r.finished, strict=True):
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any()  # response tokens are a prefix
        assert (row[n:] == PAD).all()
        assert bool(done) == (n > 0 and row[n - 1] == EOS)
        assert (row[: n - 1] != EOS).all()
    again = sample(m, prompts, generator=torch.Generator().manual_seed(0), **kw)
    assert torch.equal(r.tokens, again.tokens)


def test_greedy_sampling_picks_the_most_likely_token_and_log_probs_agree():
    m = model(1)
    r = sample(m, [TOK.encode("7*3=")], group_size=1, max_new_tokens=5, temperature=0.0)
    log_prob, entropy = response_log_probs(m, r, temperature=1.0)
    logits = m(r.tokens[:, :-1], r.valid[:, :-1])[:, r.prompt_len - 1 :]
    best = logits.log_softmax(-1).max(-1).values
    assert torch.allclose(log_prob[r.mask], best[r.mask], atol=1e-5)
    assert (entropy[r.mask] > 0).all()


def test_teacher_forced_rollout_holds_the_responses():
    r = teacher_forced([TOK.encode("1+2="), TOK.encode("4+4+1=")], [TOK.encode("|3"), TOK.encode("8,9|9")])
    assert TOK.decode(r.responses[0]) == "|3" and TOK.decode(r.responses[1]) == "8,9|9"
    assert r.mask.sum(1).tolist() == [3, 6]  # the end token counts


def test_cached_decoding_matches_the_full_forward_pass():
    m = model(2)
    r = sample(
        m,
        [TOK.encode("1+2="), TOK.encode("3+4+5+6=")],
        group_size=2,
        max_new_tokens=8,
        temperature=1.0,
        generator=torch.Generator().manual_seed(3),
    )
    full = m(r.tokens, r.valid)
    logits, cache = m(r.tokens[:, : r.prompt_len], r.valid[:, : r.prompt_len], return_cache=True)
    position = r.valid[:, : r.prompt_len].sum(1) - 1
    for t in range(r.prompt_len, r.tokens.shape[1]):
        position = position + 1
        step, cache = m.decode(r.tokens[:, t], position, r.valid[:, : t + 1], cache)
        keep = r.valid[:, t]
        torch.testing.assert_close(step[keep, 0], full[keep, t], rtol=1e-4, atol=1e-5)
