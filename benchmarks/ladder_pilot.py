"""One pilot of ``pgloss experiment length --task ladder``: does the length grow under GRPO?

Trains one seed's warm start and one run of one algorithm at the experiment's settings
(``pgloss.experiments.length.EXPERIMENTS["ladder"]``, one torch thread) and prints one row of the pilot
table of docs/experiments.md ("Where length keeps growing"): the warm start's time, the probability it
gives the right running value at each step of a whole scratchpad (teacher-forced, 512 chains), the
means over 20 steps of the sampled response length, reward and entropy at the start, the middle and
the end of the run, and the run's time. The growth asked for: the last 20 steps' mean length at least
three times the first 20 steps', and the last means still rising.

    python benchmarks/ladder_pilot.py                      # seed 0, grpo, 200 steps
    python benchmarks/ladder_pilot.py --seed 1                  # another seed
    python benchmarks/ladder_pilot.py --lr 2e-5                 # a pilot of the table at another rate
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from device import add_device_argument, resolve_device


def step_accuracy(model, task, tokenizer, chains: int = 512, seed: int = 123) -> list[float]:
    """P(argmax = the right running value) at each step j = 1..max_terms-1 of whole scratchpads
    (teacher-forced), over the chains whose own work reaches step j (the padding's steps left out)."""
    from pgloss.lab.sampling import teacher_forced

    rng = random.Random(seed)
    problems = [task.sample(rng) for _ in range(chains)]
    work = [task.max_terms - 1 - p.prompt.count("+0") for p in problems]  # the chain's own steps
    running = [_running(task, p.prompt) for p in problems]
    texts = [",".join(map(str, r)) + "|" + p.answer for r, p in zip(running, problems, strict=True)]
    batch = teacher_forced([tokenizer.encode(p.prompt) for p in problems], [tokenizer.encode(t) for t in texts])
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(batch.tokens[:, :-1].to(device), batch.valid[:, :-1].to(device))[:, batch.prompt_len - 1 :]
    right = (logits.argmax(-1) == batch.responses.to(device)).cpu()
    return [
        float(right[[i for i, w in enumerate(work) if w > j], 2 * j].float().mean()) for j in range(task.max_terms - 1)
    ]


def _running(task, prompt: str) -> list[int]:
    value, out = int(prompt[0]), []
    for k in range(1, len(prompt) - 1, 2):
        value = task.step(value, prompt[k : k + 2])
        out.append(value)
    return out


def means(values: list[float], width: int = 20) -> list[float]:
    return [round(sum(values[i : i + width]) / len(values[i : i + width]), 2) for i in range(0, len(values), width)]


def main() -> None:
    from pgloss.experiments.length import EXPERIMENTS
    from pgloss.lab import trainer, warm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", default="grpo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, help="RL steps (default: the experiment's)")
    parser.add_argument("--lr", type=float, help="RL learning rate (default: the experiment's)")
    parser.add_argument("--warm-steps", type=int, help="warm-start steps (default: the experiment's)")
    parser.add_argument(
        "--target-entropy", type=float, help="entropy target, nats per token (default: the experiment's)"
    )
    add_device_argument(parser)
    args = parser.parse_args()
    device = resolve_device(args.device)
    experiment = EXPERIMENTS["ladder"]
    changes = {
        k: v
        for k, v in (
            ("steps", args.steps),
            ("lr", args.lr),
            ("warm_steps", args.warm_steps),
            ("target_entropy", args.target_entropy),
        )
        if v is not None
    }
    changes["device"] = str(device)
    cfg = dataclasses.replace(experiment.lab_config(args.algorithm, args.seed), **changes)
    torch.set_num_threads(cfg.threads)

    start = time.perf_counter()
    state = warm.state(cfg, None)
    warm_seconds = time.perf_counter() - start
    tokenizer, task, model = trainer.build(cfg)
    model.load_state_dict(state)  # on cfg.device
    accuracy = step_accuracy(model, task, tokenizer)

    start = time.perf_counter()
    records = trainer.train(cfg, state)["metrics"][: cfg.steps]  # the last record measures the final policy only
    rl_seconds = time.perf_counter() - start
    length, rewards, entropy = ([r[k] for r in records] for k in ("length", "reward", "entropy"))
    print(
        json.dumps(
            {
                "algorithm": cfg.algorithm,
                "seed": cfg.seed,
                "lr": cfg.lr,
                "warm_steps": cfg.warm_steps,
                "target_entropy": cfg.target_entropy,
                "warm_s": round(warm_seconds),
                "step_accuracy": [round(a, 2) for a in accuracy],
                "length_20": means(length),
                "reward_20": means(rewards),
                "entropy_20": means(entropy),
                "growth": round(means(length)[-1] / means(length)[0], 2),
                "rl_s": round(rl_seconds),
                "torch": torch.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
