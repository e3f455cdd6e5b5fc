"""Group sampling: G completions per prompt at a temperature, and their log-probabilities.

A rollout holds whole sequences: prompts left-padded to one width P, then the responses,
right-padded. ``mask`` marks the response tokens the loss sees (the end token included).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..vocab.entropy import log_prob_and_entropy
from .tokenizer import BOS, EOS, PAD


@dataclass(frozen=True)
class Rollout:
    """Sampled sequences of one step (N = prompts x group size)."""

    tokens: Tensor
    """[N, P + R] token ids: left-padded prompt, then response, then padding."""
    valid: Tensor
    """[N, P + R] bool, True on real (non-padding) tokens."""
    prompt_len: int
    """P, the padded prompt width; responses start at this column."""
    mask: Tensor
    """[N, R] bool, True on response tokens up to and including the end token."""
    finished: Tensor
    """[N] bool, True where the response ended with the end token within the limit."""
    group_ids: Tensor
    """[N] int, the index of each sequence's prompt."""

    @property
    def responses(self) -> Tensor:
        """[N, R] response token ids."""
        return self.tokens[:, self.prompt_len :]

    def select(self, index: Tensor) -> Rollout:
        """The rows `index` (a bool mask or ids) of this rollout."""
        return Rollout(
            self.tokens[index],
            self.valid[index],
            self.prompt_len,
            self.mask[index],
            self.finished[index],
            self.group_ids[index],
        )

    @staticmethod
    def cat(parts: list[Rollout]) -> Rollout:
        """The rows of `parts` in order, prompts re-padded on the left and responses on the right
        to the widest of them (``pad_responses`` does the same for ``[N, R]`` tensors)."""
        width = max(r.prompt_len for r in parts)
        length = max(r.mask.shape[1] for r in parts)

        def pad(r: Rollout, x: Tensor, value) -> Tensor:
            return torch.nn.functional.pad(x, (width - r.prompt_len, length - r.mask.shape[1]), value=value)

        return Rollout(
            torch.cat([pad(r, r.tokens, PAD) for r in parts]),
            torch.cat([pad(r, r.valid, False) for r in parts]),
            width,
            pad_responses([r.mask for r in parts], False),
            torch.cat([r.finished for r in parts]),
            torch.cat([r.group_ids for r in parts]),
        )


def pad_responses(parts: list[Tensor], value=0.0) -> Tensor:
    """``[N_i, R_i]`` tensors stacked into ``[sum N_i, max R_i]``, right-padded with `value`."""
    length = max(x.shape[1] for x in parts)
    return torch.cat([torch.nn.functional.pad(x, (0, length - x.shape[1]), value=value) for x in parts])


def left_pad(prompts: list[list[int]], device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """Prompts (with a begin token prepended) left-padded to one width: (tokens, valid)."""
    width = 1 + max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), PAD, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p) - 1 :] = torch.tensor([BOS, *p])
    tokens = tokens.to(device)
    return tokens, tokens != PAD


def teacher_forced(prompts: list[list[int]], responses: list[list[int]], device: torch.device | str = "cpu") -> Rollout:
    """A rollout holding given responses (an end token is appended to each): the warm
    start's demonstrations, or a fixed batch in tests. Row i is its own group."""
    prompt_tokens, prompt_valid = left_pad(prompts, device)
    width = max(len(r) for r in responses) + 1
    resp = torch.full((len(responses), width), PAD, dtype=torch.long)
    for i, r in enumerate(responses):
        resp[i, : len(r) + 1] = torch.tensor([*r, EOS])
    resp = resp.to(device)
    mask = resp != PAD
    n = len(prompts)
    return Rollout(
        torch.cat([prompt_tokens, resp], 1),
        torch.cat([prompt_valid, mask], 1),
        prompt_tokens.shape[1],
        mask,
        torch.ones(n, dtype=torch.bool, device=device),
        torch.arange(n, device=device),
    )


@torch.no_grad()
def sample(
    model,
    prompts: list[list[int]],
    *,
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator | None = None,
) -> Rollout:
    """Sample `group_size` completions of each prompt, at most `max_new_tokens` tokens each
    (temperature 0: greedy decoding).

    Row ``i * group_size + j`` is the j-th completion of prompt i. Keys and values of earlier
    tokens are cached; sampling stops early once every row has ended.
    """
    device = next(model.parameters()).device
    prompt_tokens, prompt_valid = left_pad(prompts, device)
    tokens = prompt_tokens.repeat_interleave(group_size, 0)
    valid = prompt_valid.repeat_interleave(group_size, 0)
    n, width = tokens.shape
    done = torch.zeros(n, dtype=torch.bool, device=device)
    logits, cache = model(tokens, valid, return_cache=True)
    logits = logits[:, -1].float()
    position = valid.sum(1) - 1
    for t in range(max_new_tokens):
        if temperature > 0:
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator).squeeze(1)
        else:
            nxt = logits.argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, PAD), nxt)
        tokens = torch.cat([tokens, nxt[:, None]], 1)
        valid = torch.cat([valid, ~done[:, None]], 1)
        done = done | (nxt == EOS)
        if bool(done.all()) or t == max_new_tokens - 1:
            break
        position = position + 1
        logits, cache = model.decode(nxt, position, valid, cache)  # keys and values of earlier tokens are reused
        logits = logits[:, -1].float()
    group_ids = torch.arange(len(prompts), device=device).repeat_interleave(group_size)
    return Rollout(tokens, valid, width, valid[:, width:], done, group_ids)


def response_log_probs(model, rollout: Rollout, *, temperature: float) -> tuple[Tensor, Tensor]:
    """Log-probabilities ``[N, R]`` of the response tokens under `model` and the entropies
    of its (tempered) next-token distributions there. Carries gradients if enabled."""
    logits = model(rollout.tokens[:, :-1], rollout.valid[:, :-1])[:, rollout.prompt_len - 1 :]
    return log_prob_and_entropy(logits, rollout.responses, temperature=temperature)
