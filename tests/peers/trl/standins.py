"""What TRL's GRPO tests take from the Hub, built in code, and the trainer under test.

- `GRPOTrainer`: TRL's own when PGLOSS_PEER_TRAINER=trl (the "before" run), else pgloss's
  `PGLossGRPOTrainer` with `algorithm=None`: `pgloss.from_trl(args)`, the loss of each test's
  `loss_type` and options.
- `load_dataset("trl-internal-testing/zen", ...)`: small in-memory prompt datasets of the same
  formats (standard and conversational prompt-only; train and test splits; streaming).
- `build_models(root)`: tiny models and a byte-level tokenizer with a chat template, saved under
  `root/trl-internal-testing/<name>`; the tests run with `root` as the working directory, so the Hub
  ids they name are these local directories (transformers reads an existing directory first).
"""

from __future__ import annotations

import os

from datasets import Dataset, DatasetDict

if os.environ.get("PGLOSS_PEER_TRAINER", "pgloss") == "trl":
    from trl import GRPOTrainer
else:
    from pgloss.integrations.trl import PGLossGRPOTrainer as GRPOTrainer

__all__ = ["GRPOTrainer", "MODELS", "build_models", "load_dataset"]

_PROMPTS = [  # the beginnings of the Zen of Python's lines, as the zen dataset's prompts
    "Beautiful is better than",
    "Explicit is",
    "Simple is better",
    "Complex",
    "Flat is better than",
    "Sparse is better",
    "Readability",
    "Special cases aren't special",
    "Although practicality beats",
    "Errors should never",
    "Unless explicitly",
    "In the face of ambiguity, refuse",
    "There should be one-- and preferably",
    "Although that way may not be",
    "Now is better than",
    "Although never is often better than",
    "If the implementation is hard to explain,",
    "If the implementation is easy to explain,",
    "Namespaces are one honking great idea",
]
_SPLITS = {"train": _PROMPTS[:17], "test": _PROMPTS[17:]}


def load_dataset(path: str, name: str | None = None, *, split: str | None = None, streaming: bool = False):
    """The zen prompt-only datasets TRL's GRPO tests load (17 train and 2 test prompts: the Zen of Python)."""
    if path != "trl-internal-testing/zen" or name not in ("standard_prompt_only", "conversational_prompt_only"):
        raise ValueError(f"no stand-in for {path} {name}")

    def make(prompts: list[str]) -> Dataset:
        if name == "conversational_prompt_only":
            return Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts]})
        return Dataset.from_dict({"prompt": prompts})

    if split is None:
        splits = DatasetDict({key: make(prompts) for key, prompts in _SPLITS.items()})
        return splits if not streaming else {key: d.to_iterable_dataset() for key, d in splits.items()}
    dataset = make(_SPLITS[split])
    return dataset.to_iterable_dataset() if streaming else dataset


_CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

MODELS = {  # Hub id -> (transformers class, extra config)
    "tiny-Qwen2ForCausalLM-2.5": ("Qwen2ForCausalLM", {}),
    "tiny-Qwen2ForSequenceClassification-2.5": ("Qwen2ForSequenceClassification", {"num_labels": 1}),
    "tiny-Qwen3ForCausalLM": ("Qwen3ForCausalLM", {}),
    "tiny-Qwen3ForSequenceClassification": ("Qwen3ForSequenceClassification", {"num_labels": 1}),
    "tiny-LlamaForCausalLM-3.2": ("LlamaForCausalLM", {}),
    "tiny-LlamaForSequenceClassification-3.2": ("LlamaForSequenceClassification", {"num_labels": 1}),
    "tiny-MistralForCausalLM-0.2": ("MistralForCausalLM", {}),
}


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {char: i for i, char in enumerate(sorted(ByteLevel.alphabet()))}
    vocab |= {token: len(vocab) + i for i, token in enumerate(specials)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>", additional_special_tokens=specials[1:]
    )
    tokenizer.chat_template = _CHAT
    return tokenizer


def build_models(root: str) -> str:
    """Save every model of MODELS (2 layers, hidden 16, seed 0) with the tokenizer under root."""
    import torch
    import transformers

    tokenizer = _tokenizer()
    for name, (cls_name, extra) in MODELS.items():
        path = os.path.join(root, "trl-internal-testing", name)
        if os.path.exists(os.path.join(path, "config.json")):
            continue
        cls = getattr(transformers, cls_name)
        config = cls.config_class(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=4,
            max_position_embeddings=256,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=None,
            tie_word_embeddings=False,
            **extra,
        )
        torch.manual_seed(0)
        model = cls(config)
        if hasattr(model, "generation_config") and model.can_generate():
            model.generation_config.pad_token_id = tokenizer.pad_token_id
            model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return root
