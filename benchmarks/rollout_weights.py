"""Rollout weights against response length: the effective sample size of each weight level.

The trainer's and the engine's log-probs differ per token by a small noise (here Gaussian, std
`--sigma`, the size of a bf16-versus-fp32 mismatch); the product of the token ratios then spreads
with the length, the geometric mean does not. Prints, per length, the effective sample size
(Σw)²/(nΣw²) of the untruncated weights and the share of sequences TIS at cap 2 truncates.

    python benchmarks/rollout_weights.py [--sigma 0.05] [--rows 512]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from pgloss.correction.rollout import RolloutCorrection

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from device import add_device_argument, describe, resolve_device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sigma", type=float, default=0.05, help="std of log π_old - log π_rollout per token")
    parser.add_argument("--rows", type=int, default=512, help="sequences per length")
    add_device_argument(parser)
    args = parser.parse_args()
    device = resolve_device(args.device)
    gen = torch.Generator().manual_seed(0)
    print(describe(device))
    print(f"sigma={args.sigma}, {args.rows} sequences per length; ESS of the raw weight / share truncated at 2")
    print(f"{'length':>7} | {'token':>15} | {'sequence_product':>17} | {'sequence_geometric':>18}")
    for length in (16, 64, 256, 1024, 4096, 16384):
        rollout = torch.zeros(args.rows, length, dtype=torch.float64, device=device)
        old = (args.sigma * torch.randn(args.rows, length, generator=gen, dtype=torch.float64)).to(device)
        mask = torch.ones(args.rows, length, dtype=torch.bool, device=device)
        cells = []
        for level in ("token", "sequence_product", "sequence_geometric"):
            kw = dict(log_prob=old, old_log_prob=old, rollout_log_prob=rollout, mask=mask)
            raw = RolloutCorrection(weight_level=level, upper=None).apply(**kw).metrics
            tis = RolloutCorrection(weight_level=level, upper=2.0).apply(**kw).metrics
            cells.append(f"{float(raw['rollout_is_ess']):.3f} / {float(tis['rollout_is_bounded_frac']):.3f}")
        print(f"{length:>7} | {cells[0]:>15} | {cells[1]:>17} | {cells[2]:>18}")


if __name__ == "__main__":
    main()
