"""One (shape, variant) of benchmarks/grpo_step.py, in its own process: the model of the shape's architecture,
the fixed rollout, the variant's trainer, and the ladder of completion lengths, each length a row printed to
stdout as one JSON line after ROW (the parent process reads them as they come).

A row is `trainer.train()` for `--warmup + --steps` optimizer steps on a fresh model (seeded: the same weights
in every variant), at one completion length; a length that runs out of memory or fails is the ladder's last
row, with the error and its traceback's tail.
"""

from __future__ import annotations

import gc
import itertools
import json
import random
import statistics
import tempfile
import time
import traceback

from device import Memory, timed

VARIANTS = ("trl", "pgloss", "fused", "liger")
COMMON = dict(
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=131072,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=None,
)
SHAPES = {  # the architectures' published configurations (sizes only; the weights are random)
    "qwen2-0.5b": (
        "qwen2",
        dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            **COMMON,
        ),
    ),
    "qwen2-1.5b": (
        "qwen2",
        dict(
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            **COMMON,
        ),
    ),
    "qwen3-0.6b": (
        "qwen3",
        dict(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            **COMMON,
        ),
    ),
    "qwen3-1.7b": (
        "qwen3",
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            **COMMON,
        ),
    ),
    "tiny": (
        "qwen2",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            **{**COMMON, "vocab_size": 512},
        ),
    ),
}
ROW = "ROW\t"
"""The prefix of a row's JSON line on stdout (transformers prints its logs there too)."""


def ladder(args) -> list[int]:
    """The completion lengths: --start doubling up to --max-completion."""
    return list(itertools.takewhile(lambda n: n <= args.max_completion, (args.start << k for k in itertools.count())))


def completion_lengths(length: int, generations: int) -> list[int]:
    """The lengths within a group: L, L - L/2G, L - 2·L/2G, ... (uneven, so that a length reward varies)."""
    return [max(1, length - j * (length // (2 * generations))) for j in range(generations)]


def emit(row: dict) -> None:
    print(ROW + json.dumps(row), flush=True)


def build_model(shape: str, device):
    """The shape's architecture with random bfloat16 weights, seeded, built on `device`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, sizes = SHAPES[shape]
    config = AutoConfig.for_model(model_type, **sizes)
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def fixed_rollout(length: int, vocab: int, generations: int):
    """TRL's `rollout_func`: each prompt's ids and a fixed random completion per row (rows of a group are
    consecutive), drawn from a generator seeded by the call's index: the same completions in every variant."""
    import torch

    lengths = completion_lengths(length, generations)
    calls = itertools.count()

    def rollout(prompts: list, trainer) -> dict:
        draw = torch.Generator().manual_seed(next(calls))
        completions = [
            torch.randint(3, vocab, (lengths[i % generations],), generator=draw).tolist() for i in range(len(prompts))
        ]
        return {
            "prompt_ids": trainer.processing_class(prompts)["input_ids"],
            "completion_ids": completions,
            "logprobs": None,
        }

    return rollout


def length_reward(completions: list[str], **_) -> list[float]:
    """The completion's length in words (one word a token): group advantages that are not zero."""
    return [float(len(text.split())) for text in completions]


def step_timer(device):
    """A TrainerCallback timing each optimizer step, from on_step_begin to on_step_end (device synchronised)."""
    import torch
    from transformers import TrainerCallback

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []

        def on_step_begin(self, *_, **__):
            sync()
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            sync()
            self.times.append(time.perf_counter() - self.start)

    return StepTimer()


def trainer_for(variant: str, args, shape: str, length: int, device, tokenizer, output_dir: str):
    """The variant's trainer on a fresh model, with the step timer among its callbacks."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    vocab = SHAPES[shape][1]["vocab_size"]
    draw = random.Random(0)
    steps = args.warmup + args.steps
    words = (" ".join(f"w{draw.randrange(vocab - 3)}" for _ in range(args.prompt)) for _ in range(args.prompts * steps))
    config = GRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=args.prompts * args.generations,
        num_generations=args.generations,
        gradient_accumulation_steps=1,
        max_completion_length=length,
        max_steps=steps,
        learning_rate=1e-6,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        bf16=True,
        use_cpu=device.type == "cpu",
        gradient_checkpointing=args.gradient_checkpointing,
        optim="adamw_torch_fused" if args.optimizer == "adamw" else "sgd",
        use_liger_kernel=variant == "liger",
    )
    timer = step_timer(device)
    common = dict(
        model=build_model(shape, device),
        reward_funcs=[length_reward],
        args=config,
        train_dataset=Dataset.from_dict({"prompt": list(words)}),
        processing_class=tokenizer,
        rollout_func=fixed_rollout(length, vocab, args.generations),
        callbacks=[timer],
    )
    if variant in ("pgloss", "fused"):
        from pgloss.integrations.trl import PGLossGRPOTrainer

        return PGLossGRPOTrainer(**common, fused=variant == "fused"), timer
    return GRPOTrainer(**common), timer


def measure(variant: str, args, shape: str, length: int, device, tokenizer) -> dict:
    """One row: `args.warmup + args.steps` optimizer steps of trainer.train() at completion length `length`."""
    memory = Memory(device)
    memory.set_baseline()
    with tempfile.TemporaryDirectory() as output_dir:
        trainer, timer = trainer_for(variant, args, shape, length, device, tokenizer, output_dir)
        train_s, _ = timed(trainer.train, device)
        peak = memory.baseline + memory.peak_above_baseline()
        logs = [entry for entry in trainer.state.log_history if "grad_norm" in entry]
        norm = type(getattr(getattr(trainer.model, "model", None), "norm", None)).__name__  # LigerRMSNorm: Liger's
    timed_steps = timer.times[args.warmup :]
    step_s = statistics.median(timed_steps)
    tokens = args.prompts * sum(completion_lengths(length, args.generations))
    return {
        "status": "measured",
        "step_s": step_s,
        "steps_s": timer.times,
        "train_s": train_s,
        "tokens": tokens,
        "tokens_per_s": tokens / step_s,
        "start_gib": memory.baseline / 1024,
        "peak_gib": peak / 1024,
        "loss": logs[0]["loss"],
        "grad_norm": float(logs[0]["grad_norm"]),
        "norm": norm,
    }


def is_out_of_memory(error: BaseException) -> bool:
    import torch

    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def free(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def next_cost(row: dict, elapsed: float) -> float:
    """Seconds the next length (twice as long) should take, from this row's `elapsed`: its setup (the model,
    the trainer) again and its steps three times over (the linear parts double, attention's quadruple), the
    warm-up step counted as a timed one (it compiles the kernels and allocates the optimizer's state once).
    Without step times: twice the row."""
    steps = row.get("steps_s")
    if not steps:
        return 2 * elapsed
    return max(elapsed - sum(steps), 0.0) + 3 * len(steps) * row["step_s"]


def run_ladder(lengths: list[int], measure_one, deadline: float, release=lambda: None, now=time.time) -> list[dict]:
    """Each length's row from `measure_one(length)` (emitted as it is measured), until one runs out of memory
    or fails (its row says so; longer ones would too) or the next would end past `deadline` (a `now()`, as
    `next_cost` foresees it): a `skipped` row, and the ladder ends. `release()` runs after each row (the child
    frees the device's memory there)."""
    rows, need = [], 0.0
    for length in lengths:
        left = deadline - now()
        if left < max(need, 5.0):
            rows.append(
                {
                    "completion": length,
                    "status": "skipped",
                    "note": f"--budget: {max(left, 0):.0f} s of this process's share left, this length "
                    f"would take about {need:.0f} s",
                }
            )
            emit(rows[-1])
            break
        emit({"event": "start", "completion": length})
        began = now()
        try:
            row = {"completion": length, **measure_one(length)}
        except Exception as error:
            row = failure(error, length)
        release()
        need = next_cost(row, now() - began)
        rows.append(row)
        emit(row)
        if row["status"] != "measured":
            break
    return rows


def failure(error: Exception, length: int) -> dict:
    """The row of a length that raised `error` (inside its `except`): out of memory or failed, the error's first
    line, and the traceback's last 4,000 characters."""
    lines = str(error).strip().splitlines() or [""]
    oom = is_out_of_memory(error)
    return {
        "completion": length,
        "status": "out of memory" if oom else "failed",
        "note": (lines[0] if oom else f"{type(error).__name__}: {lines[0]}")[:200],
        "error": traceback.format_exc()[-4000:],
    }


def child(args, device) -> None:
    """The ladder of `args.child` ("shape:variant") until `args.deadline` (time.time(); None: no limit)."""
    shape, variant = args.child.split(":")
    try:
        from trl_step import word_tokenizer

        tokenizer = word_tokenizer(SHAPES[shape][1]["vocab_size"])
    except Exception as error:
        emit(failure(error, args.start))
        return
    run_ladder(
        ladder(args),
        lambda length: measure(variant, args, shape, length, device, tokenizer),
        float("inf") if args.deadline is None else args.deadline,
        release=lambda: free(device),
    )
