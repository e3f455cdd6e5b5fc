"""Time of the loss part of a TRL optimizer step: TRL's own loss against pgloss's, plain and fused.

One optimizer step of GRPOTrainer = generation (identical for every variant, not timed) + for each
of the gradient_accumulation_steps micro-batches a forward and backward of the loss + the optimizer
step (identical, not timed). This script times the middle part, `trainer.compute_loss(...)` and
`backward()` over the micro-batches of one window, on the same trainer, model and inputs:

  trl      GRPOTrainer._compute_loss with loss_type="dapo" (TRL 1.16: its chunked log-prob head)
  pgloss   PGLossGRPOTrainer(algorithm="dapo"): TRL's chunked head for log π, then pgloss's loss
  fused    PGLossGRPOTrainer(algorithm="dapo", fused=True): the backbone, then algorithm.from_hidden
           on the hidden states and the LM head (on-policy, log π_old is the detached log π of that pass)

The window is synthetic (random prompts and completions of uneven lengths), off-policy
(old = log π + noise), so no generation runs. The model is a random Qwen2 saved to a temporary
directory; nothing is downloaded.

    python benchmarks/trl_step.py --hidden 256 --layers 2 --vocab 32768 --batch 8 --prompt 32 --completion 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from device import add_device_argument, describe, resolve_device, timed


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=8, help="rows per micro-batch")
    parser.add_argument("--accumulation", type=int, default=2, help="gradient_accumulation_steps")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--completion", type=int, default=256, help="max_completion_length")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--on-policy", action="store_true", help="no old log-probs (TRL's default schedule)")
    parser.add_argument("--json", default=None, help="write the results here")
    add_device_argument(parser)
    return parser.parse_args(argv)


def word_tokenizer(vocab: int):
    """A word-level tokenizer over `vocab` ids: <pad> = 0, <eos> = 1, <unk> = 2, then the words w0, w1, ...
    (id 3 + i), split on whitespace; built here, nothing is downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(vocab - 3)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def make_model(path: str, hidden: int, layers: int, vocab: int) -> str:
    """A random Qwen2 with a word-level tokenizer over `vocab` synthetic words."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    word_tokenizer(vocab).save_pretrained(path)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def make_window(options, vocab: int, seed: int = 0) -> list[dict]:
    """`accumulation` micro-batches: left-padded prompts, right-padded completions of uneven length."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    window = []
    for _ in range(options.accumulation):
        rows, width = options.batch, options.completion
        prompt_len = torch.randint(options.prompt // 2, options.prompt + 1, (rows,), generator=gen)
        completion_len = torch.randint(1, width + 1, (rows,), generator=gen)
        window.append(
            dict(
                prompt_ids=torch.randint(3, vocab, (rows, options.prompt), generator=gen),
                prompt_mask=(torch.arange(options.prompt)[None] >= options.prompt - prompt_len[:, None]).long(),
                completion_ids=torch.randint(3, vocab, (rows, width), generator=gen),
                completion_mask=(torch.arange(width)[None] < completion_len[:, None]).long(),
                advantages=torch.randn(rows, generator=gen),
            )
        )
    return window


def main(argv=None) -> dict:
    options = parse_args(argv)
    import torch

    if options.threads:
        torch.set_num_threads(options.threads)
    device = resolve_device(options.device)
    print(describe(device))
    import trl_tiny
    from trl import GRPOTrainer

    from pgloss.integrations.trl import PGLossGRPOTrainer

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(os.path.join(tmp, "model"), options.hidden, options.layers, options.vocab)
        config = trl_tiny.config(
            os.path.join(tmp, "out"),
            per_device_train_batch_size=options.batch,
            gradient_accumulation_steps=options.accumulation,
            num_generations=options.batch,
            max_completion_length=options.completion,
            max_steps=1,
            epsilon_high=0.28,
            use_cpu=device.type == "cpu",
        )
        trainers = {
            "trl": GRPOTrainer(
                model=model_dir, reward_funcs=trl_tiny.digits, train_dataset=trl_tiny.make_dataset(), args=config
            ),
            "pgloss": PGLossGRPOTrainer(
                model=model_dir,
                reward_funcs=trl_tiny.digits,
                train_dataset=trl_tiny.make_dataset(),
                args=config,
                algorithm="dapo",
            ),
            "fused": PGLossGRPOTrainer(
                model=model_dir,
                reward_funcs=trl_tiny.digits,
                train_dataset=trl_tiny.make_dataset(),
                args=config,
                algorithm="dapo",
                fused=True,
            ),
        }
        window = [{k: v.to(device) for k, v in batch.items()} for batch in make_window(options, options.vocab)]
        total_tokens = sum(int(b["completion_mask"].sum()) for b in window)
        for batch in window:  # TRL's dapo divides by the generation batch's count, here the window's
            batch["num_items_in_batch"] = torch.tensor(float(total_tokens))
        if not options.on_policy:
            trainer = trainers["trl"]
            gen = torch.Generator().manual_seed(1)
            for batch in window:
                ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
                attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
                with torch.no_grad():
                    log_prob, _, _ = trainer._get_per_token_logps_and_entropies(
                        trainer.model, ids, attention, options.completion
                    )
                noise = 0.05 * torch.randn(log_prob.shape, generator=gen).to(device)
                batch["old_per_token_logps"] = (log_prob + noise).clamp(max=0.0)

        def step(name):
            trainer = trainers[name]
            trainer.model.train()
            trainer.model.zero_grad(set_to_none=True)
            trainer._buffered_inputs = window
            trainer.current_gradient_accumulation_steps = options.accumulation
            trainer.state.global_step += 1
            losses = []

            def window_step():
                for j, batch in enumerate(window):
                    trainer._step = j
                    loss = trainer._compute_loss(trainer.model, batch)
                    loss.backward()
                    losses.append(loss.detach())

            elapsed, _ = timed(window_step, device)
            grad = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
            return elapsed, float(sum(losses)), grad

        results, grads = {}, {}
        for name in trainers:  # one warm-up each
            step(name)
        times = {name: [] for name in trainers}
        for _ in range(options.repeats):  # interleaved, so that machine noise hits every variant alike
            for name in trainers:
                elapsed, loss, grads[name] = step(name)
                times[name].append(elapsed)
                results[name] = {"loss": loss}
        for name in trainers:
            results[name]["median_s"] = statistics.median(times[name])
            results[name]["min_s"] = min(times[name])
            results[name]["grad_rel_diff_vs_trl"] = float((grads[name] - grads["trl"]).norm() / grads["trl"].norm())
        summary = {
            "setup": {**vars(options), "tokens": total_tokens, "torch_threads": torch.get_num_threads()},
            "results": results,
            "ratio_pgloss_vs_trl": results["pgloss"]["median_s"] / results["trl"]["median_s"],
            "ratio_fused_vs_trl": results["fused"]["median_s"] / results["trl"]["median_s"],
        }
    print(json.dumps(summary, indent=2))
    if options.json:
        with open(options.json, "w") as handle:
            json.dump(summary, handle, indent=2)
    return summary


if __name__ == "__main__":
    main()
