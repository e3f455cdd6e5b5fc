"""Train a tiny causal LM with TRL's GRPOTrainer and a pgloss loss, on a CPU, in about a minute.

    pip install -e '.[trl]'                                 # in a clone: pgloss is not on the package index
    python examples/trl_tiny.py --algorithm dapo            # any name of pgloss.names()
    python examples/trl_tiny.py --algorithm gspo --fused    # the loss from hidden states

Nothing is downloaded: the model (a 2-layer Qwen2, 77k parameters) and its word-level tokenizer
are built here and saved to a temporary directory, which is passed to TRL as a path (with a KL
term TRL loads its reference model from that path). The task: answer in digits (the reward is the fraction of words that are digits).
The only lines that differ from a plain TRL script are the import and `algorithm=`.
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

WORDS = [
    "<pad>",
    "<eos>",
    "<unk>",
    "yes",
    "no",
    "maybe",
    "say",
    "the",
    "word",
    "please",
    "now",
    "a",
    "b",
    "c",
    "0",
    "1",
    "2",
    "3",
    "4",
    "5",
    "6",
    "7",
]
PROMPTS = [
    "say the word",
    "say the word now",
    "please say the word",
    "say a word",
    "the word please",
    "say 1",
    "say 2 now",
    "please say 3",
    "now say the word",
    "say the word a",
    "say b",
    "say c please",
]


def make_tiny_model(path: str, *, hidden: int = 64, layers: int = 2, seed: int = 0) -> str:
    """Save a random 2-layer Qwen2 and a WordLevel tokenizer over WORDS to `path`; returns `path`."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {word: i for i, word in enumerate(WORDS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tokenizer.save_pretrained(path)
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(WORDS),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    model.save_pretrained(path)
    return path


def make_dataset(repeat: int = 4):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": PROMPTS * repeat})


def digits(completions: list[str], **_: object) -> list[float]:
    """The fraction of the completion's words that are digits (0 for an empty completion)."""
    return [sum(word.isdigit() for word in text.split()) / max(len(text.split()), 1) for text in completions]


def config(output_dir: str, **overrides: object):
    from trl import GRPOConfig

    values = dict(
        output_dir=output_dir,
        per_device_train_batch_size=8,
        num_generations=4,
        gradient_accumulation_steps=2,
        max_completion_length=8,
        learning_rate=1e-2,
        max_steps=20,
        logging_steps=5,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
        disable_tqdm=True,
    )
    values.update(overrides)
    return GRPOConfig(**values)


def main(argv: list[str] | None = None) -> dict[str, float]:
    import pgloss
    from pgloss.integrations.trl import PGLossGRPOTrainer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", default="dapo", choices=pgloss.names())
    parser.add_argument("--fused", action="store_true", help="the loss from hidden states (algorithm.from_hidden)")
    parser.add_argument("--steps", type=int, default=20)
    options = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(os.path.join(tmp, "model"))
        trainer = PGLossGRPOTrainer(
            model=model,
            reward_funcs=digits,
            train_dataset=make_dataset(),
            args=config(os.path.join(tmp, "out"), max_steps=options.steps, logging_steps=max(1, options.steps // 4)),
            algorithm=options.algorithm,
            fused=options.fused,
        )
        trainer.train()
    history = [row for row in trainer.state.log_history if "reward" in row]
    for row in history:
        print(
            f"step {row['step']:3d}  reward {row['reward']:.3f}  pg_loss {row['pgloss/pg_loss']:+.4f}  "
            f"clipfrac {row.get('pgloss/pg_clipfrac', float('nan')):.3f}"
        )
    return {"first_reward": history[0]["reward"], "last_reward": history[-1]["reward"]}


if __name__ == "__main__":
    main()
