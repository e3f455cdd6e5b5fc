"""A tiny causal transformer (nanoGPT-style), built in code.

Pre-norm blocks of causal self-attention and an MLP, learned positions, a final norm and an
output layer tied to the token embedding. Sequences may be left-padded: positions count
from each sequence's first real token and padding is never attended to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the transformer."""

    vocab_size: int
    """Number of token ids."""
    block_size: int = 64
    """Longest sequence (prompt plus response) the positions cover."""
    d_model: int = 64
    """Width of the residual stream."""
    n_layer: int = 2
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block."""


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model)
        )

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor, past=None):
        """New residual stream and this block's keys and values (appended to `past`, if given)."""
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x)), (k, v)


class TinyGPT(nn.Module):
    """Causal language model: ``forward(tokens, valid) -> logits [B, T, V]``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor, *, return_cache: bool = False):
        """Logits ``[B, T, V]`` for every position. `valid` is the bool ``[B, T]`` mask of
        non-padding tokens. With `return_cache`, also each block's keys and values, for `decode`."""
        T = tokens.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"tokens: length {T} exceeds block_size {self.cfg.block_size}")
        positions = (valid.long().cumsum(1) - 1).clamp(min=0)
        causal = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril()
        # Attend to earlier real tokens; a padding row attends to itself so that no row is empty.
        attn = (causal & valid[:, None, :]) | torch.eye(T, dtype=torch.bool, device=tokens.device)
        logits, cache = self._run(tokens, positions, attn[:, None], [None] * len(self.blocks))
        return (logits, cache) if return_cache else logits

    def decode(self, token: torch.Tensor, position: torch.Tensor, valid: torch.Tensor, cache: list):
        """Logits ``[B, 1, V]`` of one new token per row at `position` ``[B]``, given the keys and
        values of the earlier tokens (`cache`) and the ``[B, T + 1]`` validity of all of them."""
        if valid.shape[1] > self.cfg.block_size:
            raise ValueError(f"tokens: length {valid.shape[1]} exceeds block_size {self.cfg.block_size}")
        attn = valid.clone()
        attn[:, -1] = True
        return self._run(token[:, None], position[:, None], attn[:, None, None, :], cache)

    def _run(self, tokens, positions, attn, cache):
        x = self.tok(tokens) + self.pos(positions)
        new_cache = []
        for block, past in zip(self.blocks, cache, strict=True):
            x, kv = block(x, attn, past)
            new_cache.append(kv)
        return self.head(self.ln_f(x)), new_cache
