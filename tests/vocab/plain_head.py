"""The float64 reference the input tests hold both routes of the vocabulary loop to, written from the formulas
and apart from pgloss: an LM head's logits formed by hand, then log π(y), H, the exact KL and JSD(β) over them,
each token on its own. A banned token (a −inf logit) has π = 0 and adds nothing; `finite` stands a finite logit
for it that float64 gives the same π (exactly 0) and the same gradient elsewhere, for autograd to differentiate."""

import torch

ROUTES = ("torch", "kernel")
BANNED_STAND_IN = -1e4  # e^{-10⁴} is 0 in float64: a logit this far below the others is banned to every sum


def normal(seed: int, device):
    """(generator, r): r(*shape, scale=1.0) draws float32 normal values (drawn in float64) on `device`."""
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).float().to(device)

    return gen, r


def logits(hidden, weight, bias=None, logit_scale=1.0, softcap=None, temperature=1.0):
    """c·tanh(s·(x Wᵀ + b)/c)/τ (s·(x Wᵀ + b)/τ without a soft-cap), in float64."""
    z = hidden.double() @ weight.double().t()
    if bias is not None:
        z = z + bias.double()
    z = logit_scale * z
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


def finite(z):
    """`z` with each −inf replaced by a logit 10⁴ below the row's largest finite one."""
    top = z.masked_fill(z == -torch.inf, -torch.inf).amax(-1, keepdim=True)
    return torch.where(z == -torch.inf, top.detach() + BANNED_STAND_IN, z)


def log_prob_entropy(z, targets):
    """log π(y) and H = −Σ π log π per token of tempered float64 logits `z` [..., V] (no −inf)."""
    log_p = torch.log_softmax(z, -1)
    return log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def kl(z, z_other):
    """KL(softmax z ‖ softmax z_other) per token (no −inf)."""
    log_p, log_q = torch.log_softmax(z, -1), torch.log_softmax(z_other, -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def jsd(z_student, z_teacher, beta):
    """β KL(p_T‖m) + (1 − β) KL(p_S‖m), m = β p_T + (1 − β) p_S (no −inf)."""
    log_p, log_q = torch.log_softmax(z_student, -1), torch.log_softmax(z_teacher, -1)
    log_m = torch.logaddexp(log_q + torch.tensor(beta).log(), log_p + torch.tensor(1 - beta).log())
    return beta * (log_q.exp() * (log_q - log_m)).sum(-1) + (1 - beta) * (log_p.exp() * (log_p - log_m)).sum(-1)


def largest_error(got, expected):
    """max |got − expected| over a list of pairs of tensors (float64, on the CPU)."""
    return max(
        (a.detach().double().cpu() - b.detach().double().cpu()).abs().max().item()
        for a, b in zip(got, expected, strict=True)
    )


def scale_of(tensors):
    return max(t.detach().double().abs().max().item() for t in tensors)
