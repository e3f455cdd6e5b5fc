"""Shared by the TRL tests and their two-process worker: a recording trainer and the one-call reference.

`RecordingTrainer` runs the real PGLossGRPOTrainer and keeps, for the last optimizer step, every
micro-batch's inputs, the parameters before the optimizer step and the gradient it was about to
apply (after DDP's average). `window_gradient` recomputes that gradient with one plain
`algorithm(...)` call on all the micro-batches concatenated (over processes too), from full
logits: the invariant the adapter promises.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import trl_tiny
from transformers import TrainerCallback

from pgloss.integrations.trl import PGLossGRPOTrainer

KEYS = (
    "prompt_ids",
    "prompt_mask",
    "completion_ids",
    "completion_mask",
    "advantages",
    "old_per_token_logps",
    "ref_per_token_logps",
    "group_ids",
    "scores",
)


class _Snapshot(TrainerCallback):
    def __init__(self, trainer):
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        model = self.trainer.accelerator.unwrap_model(self.trainer.model_wrapped)
        self.trainer.snapshot = {
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "grads": {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None},
            "inputs": list(self.trainer.window_inputs),
        }
        self.trainer.window_inputs = []


class RecordingTrainer(PGLossGRPOTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.window_inputs, self.snapshot = [], None
        self.add_callback(_Snapshot(self))

    def _compute_loss(self, model, inputs):
        if self.model.training:
            self.window_inputs.append({k: inputs[k].detach().clone() for k in KEYS if inputs.get(k) is not None})
        return super()._compute_loss(model, inputs)


def run_two_ranks(worker: str, tmp_path: Path, cases, model_dir: str) -> dict[str, list[dict]]:
    """Run `worker` (a file beside this one) on two gloo ranks with torchrun, one folder per case of
    `cases` holding the tiny model; the ranks' records (`rank{r}.pt`) per case."""
    import socket
    import subprocess

    for case in cases:
        (tmp_path / case).mkdir()
        os.symlink(model_dir, tmp_path / case / "model")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    here = Path(__file__).parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
            str(here / worker),
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return {case: [torch.load(tmp_path / case / f"rank{r}.pt") for r in (0, 1)] for case in cases}


def train(tmp: str, algorithm, *, fused=False, **overrides) -> RecordingTrainer:
    """Two optimizer steps of GA = 2 with num_iterations = 2: the second step reuses the first step's
    completions, with the old log-probs TRL computed before the first update (off-policy)."""
    model = os.path.join(tmp, "model")
    if not os.path.exists(os.path.join(model, "config.json")):
        trl_tiny.make_tiny_model(model)
    values = dict(
        per_device_train_batch_size=4,
        max_steps=2,
        num_iterations=2,
        learning_rate=2e-2,
        max_grad_norm=0.0,
        logging_steps=1,
    )
    values.update(overrides)
    trainer = RecordingTrainer(
        model=model,
        reward_funcs=trl_tiny.digits,
        train_dataset=trl_tiny.make_dataset(),
        args=trl_tiny.config(os.path.join(tmp, "out"), **values),
        algorithm=algorithm,
        fused=fused,
    )
    trainer.train()
    return trainer


def off_policy_window(model_dir: str, out: str, log_prob, *, config: dict | None = None, **options):
    """A real GA = 2 window from TRL's generation, made off-policy: old = log π + 0.3·N(0, 1), Â ~ N(0, 1), so that
    clipping, weights and signs all occur. `log_prob(trainer, batch)` gives a micro-batch's log π; `config` holds
    options of `trl_tiny.config`, `options` those of PGLossGRPOTrainer."""
    trainer = PGLossGRPOTrainer(
        model=model_dir,
        reward_funcs=trl_tiny.digits,
        train_dataset=trl_tiny.make_dataset(),
        args=trl_tiny.config(out, max_steps=1, **(config or {})),
        algorithm="dapo",
        **options,
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2  # what Trainer sets for each optimizer step
    trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    generator = torch.Generator().manual_seed(0)
    for batch in trainer._buffered_inputs:
        with torch.no_grad():
            old = log_prob(trainer, batch)
        batch["old_per_token_logps"] = old + 0.3 * torch.randn(old.shape, generator=generator)
        batch["advantages"] = torch.randn(old.shape[0], generator=generator)  # a group of equal rewards has none
    return trainer


def _pad(tensors, value=0):
    width = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value) for t in tensors])


def window_gradient(model_dir: str, snapshot_inputs: list[dict], params: dict, algorithm, temperature=1.0):
    """The gradient of one `algorithm(...)` call on every recorded micro-batch, from full logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(params)
    log_probs, entropies = [], []
    for batch in snapshot_inputs:
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        length = batch["completion_ids"].shape[1]
        logits = model(input_ids=ids, attention_mask=attention).logits[:, -length - 1 : -1] / temperature
        logp = logits.log_softmax(-1)
        log_probs.append(logp.gather(-1, batch["completion_ids"][..., None]).squeeze(-1))
        entropies.append(-(logp.exp() * logp).sum(-1))
    log_prob, entropy = _pad(log_probs), _pad(entropies)
    cat = {k: _pad([b[k] for b in snapshot_inputs]) for k in ("completion_mask", "old_per_token_logps")}
    extra = {}
    if algorithm.uses_reference:
        extra["ref_log_prob"] = _pad([b["ref_per_token_logps"] for b in snapshot_inputs])
    for key in algorithm.needs & {"group_ids", "scores"}:
        extra[key] = torch.cat([b[key] for b in snapshot_inputs])
    if "sampling_per_token_logps" in snapshot_inputs[0]:
        extra["rollout_log_prob"] = _pad([b["sampling_per_token_logps"] for b in snapshot_inputs])
    mask = _pad([b.get("loss_mask", b["completion_mask"]) for b in snapshot_inputs])
    out = algorithm(
        log_prob=log_prob,
        old_log_prob=cat["old_per_token_logps"],
        advantages=torch.cat([b["advantages"] for b in snapshot_inputs]),
        mask=mask,
        entropy=entropy,
        **extra,
    )
    out.loss.backward()
    return {k: p.grad for k, p in model.named_parameters() if p.grad is not None}, out


def relative_error(grads: dict, reference: dict) -> float:
    keys = sorted(reference)
    diff = torch.cat([(grads[k] - reference[k]).flatten() for k in keys]).norm()
    return float(diff / torch.cat([reference[k].flatten() for k in keys]).norm())
