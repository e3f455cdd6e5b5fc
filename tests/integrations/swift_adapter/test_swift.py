"""pgloss's losses inside ms-swift 4.6.0's own GRPOTrainer (on its TRL 0.29): a tiny Qwen2 built in code, CPU.

These tests run in the ms-swift environment (`make test` builds it beside the TRL 1.16 one and runs them from
tests/integrations/test_swift_env.py); elsewhere they skip."""

import pytest

pytest.importorskip("swift.rlhf_trainers")

import copy
import json
import math
import types
from pathlib import Path

import swift_window as sw
import torch

import pgloss
from pgloss.integrations.swift import PGLossSwiftGRPOTrainer


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """ms-swift's pipeline built once (loss_type names a pgloss loss: the plugin's route), with a reference model
    (beta = 0.04, ms-swift's GRPO default), and one off-policy generation with rollout log-probs."""
    root = tmp_path_factory.mktemp("swift")
    args = sw.arguments(root, beta=0.04, loss_type="pgloss:dapo")
    trainer = sw.build_trainer(args, PGLossSwiftGRPOTrainer)
    initial = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    batches = sw.off_policy(trainer, rollout=True)
    return trainer, initial, batches


FUSED = ("grpo", "gspo", "clip_cov", "vespo", "real")
"""The fused path on a spread of families (every name through it costs about a minute on the CPU; every name's
fused loss is pgloss's own tests' concern, the adapter's wiring is this one)."""


def names(fused: bool) -> list[str]:
    return list(FUSED) if fused else pgloss.names()


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_step_gradient_is_one_call_for_every_name(built, fused):
    """For every name: one optimizer step (GA = 2) of ms-swift's trainer, through its own training_step, applies
    the gradient of one plain pgloss call on the step's micro-batches (off-policy, with a KL term and rollout
    log-probs); the logged metrics are that call's. Names that need an input ms-swift has not are refused."""
    trainer, initial, batches = built
    trainer.fused = fused
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    checked, refused = [], []
    for number, name in enumerate(names(fused)):
        model.load_state_dict(initial)
        try:
            algorithm = sw.named_algorithm(trainer.args, name)
        except ValueError as error:
            refused.append((name, str(error)))
            continue
        if algorithm.needs - {"ref_log_prob", "entropy", "rollout_log_prob", "group_ids", "scores", "teacher_log_prob"}:
            config = copy.copy(trainer.args)
            config.loss_type = "grpo"
            with pytest.raises(ValueError, match=f"cannot honour: {name}, which needs"):
                PGLossSwiftGRPOTrainer(args=config, algorithm=algorithm)
            refused.append((name, "needs"))
            continue
        grads, logged = sw.drive_step(trainer, algorithm, batches, number + 1)
        reference, metrics = sw.window_gradient(model, sw.records(trainer, batches), algorithm, trainer.temperature)
        error = sw.relative_error(grads, reference)
        assert sum(float(g.norm()) for g in reference.values()) > 0, name
        assert error < 2e-5, (name, error)
        for key, value in metrics.items():
            assert logged[f"pgloss/{key}"] == pytest.approx(value, rel=1e-4, abs=1e-6, nan_ok=True), (name, key)
        checked.append(f"{name} {error:.1e}")
    print(f"fused={fused}: {len(checked)} names checked; refused: {refused}")
    assert len(checked) >= len(names(fused)) - 2, refused


def _theirs_and_ours(trainer, initial, batches, options, number, scale=1.0, losses=None):
    """The step's gradient under ms-swift's own `GRPOTrainer._compute_loss_and_metrics` and through the adapter
    (`from_swift`: the algorithm of ms-swift's loss_type and options), both through ms-swift's training_step."""
    from swift.rlhf_trainers.grpo_trainer import GRPOTrainer

    from pgloss.trainer_options.swift import counts_rejected, from_swift

    config = copy.copy(trainer.args)
    for key, value in options.items():
        setattr(config, key, value)
    saved = trainer.args
    trainer.args = config
    trainer._prepare_algorithm_params()  # ms-swift's own attributes from its arguments
    trainer.beta = config.beta
    trainer.compute_entropy = config.log_entropy or config.top_entropy_quantile < 1  # as its _prepare_metrics
    # Without vLLM ms-swift switches its rollout importance sampling off (it is for vLLM >= 0.10.2's log-probs,
    # which the recorded rollout log-probs stand for): on, as with vLLM.
    trainer.disable_rollout_importance_sampling = False
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    grads = []
    try:
        for side in ("ms-swift", "pgloss"):
            model.load_state_dict(initial)
            if side == "ms-swift":
                trainer._compute_loss_and_metrics = types.MethodType(GRPOTrainer._compute_loss_and_metrics, trainer)
                # ms-swift 4.6.0 sets _has_teacher without a teacher (its dynamic self-distillation capability), and
                # its loss then refuses fipo, real and off_policy_sequence_mask_delta: run it as without that flag
                trainer._has_teacher = False
            else:
                del trainer._compute_loss_and_metrics
                trainer._pgloss_count_rejected = counts_rejected(config)
            step_grads, logged = sw.drive_step(trainer, from_swift(config), batches, number)
            grads.append(step_grads)
            if losses is not None:
                losses.append(logged["step_loss"])
        assert sum(float(g.norm()) for g in grads[0].values()) > 0, options
    finally:
        trainer.__dict__.pop("_compute_loss_and_metrics", None)
        trainer.args = saved
        trainer._prepare_algorithm_params()
        trainer._pgloss_count_rejected = False
        trainer._has_teacher = True
    return sw.relative_error(grads[1], {key: scale * value for key, value in grads[0].items()})


SHARED = [
    dict(loss_type="grpo"),  # ms-swift's defaults: beta = 0.04
    dict(loss_type="dr_grpo"),
    dict(loss_type="dapo", epsilon_high=0.28),
    dict(loss_type="cispo", epsilon_high=5.0),
    dict(loss_type="sapo", tau_pos=2.0, tau_neg=0.5),
    dict(loss_type="fipo", beta=0.0),
    dict(loss_type="real", beta=0.0),
    dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4),
    dict(loss_type="grpo", importance_sampling_level="sequence_token", epsilon=3e-4, epsilon_high=4e-4),
    dict(loss_type="grpo", delta=1.5, beta=0.0),
    dict(
        loss_type="dapo", rollout_importance_sampling_mode="token_truncate", rollout_importance_sampling_threshold=1.2
    ),
    dict(loss_type="dapo", rollout_importance_sampling_mode="sequence_mask", rollout_importance_sampling_threshold=1.2),
    dict(loss_type="grpo", rollout_importance_sampling_mode="sequence_truncate"),
    dict(loss_type="grpo", off_policy_sequence_mask_delta=0.02, beta=0.0),
]


def test_ms_swifts_loss_types_give_its_own_step_gradient(built):
    """Each ms-swift loss_type pgloss also has: the optimizer step (GA = 2, off-policy, rollout log-probs) through
    the adapter applies ms-swift's own gradient (`GRPOTrainer._compute_loss_and_metrics` in the same trainer)."""
    trainer, initial, batches = built
    errors = {str(o): _theirs_and_ours(trainer, initial, batches, o, 100 + i) for i, o in enumerate(SHARED)}
    print(errors)
    assert all(error < 2e-5 for error in errors.values()), errors


def test_ms_swift_refuses_its_own_fipo_without_a_teacher(built):
    """Documented (docs/integrations.md, ms-swift): in ms-swift 4.6.0 plain GRPO sets `_has_teacher` (the dynamic
    self-distillation capability), so its own loss raises for fipo, real and off_policy_sequence_mask_delta; the
    adapter computes them."""
    trainer, _, _ = built
    assert trainer._has_teacher and not trainer._has_teacher_explicit()


def test_overlong_filter_and_entropy_mask_as_ms_swift_applies_them(built):
    """`top_entropy_quantile` keeps the tokens of top entropy (dr_grpo on one micro-batch, where ms-swift's
    per-micro-batch quantile is the step's): ms-swift's gradient. `overlong_filter` drops the truncated rows from the
    mask; documented difference (docs/integrations.md): ms-swift still counts them as rows (dr_grpo divides by every
    row), pgloss counts the rows its mask keeps, so pgloss's gradient is ms-swift's times rows / rows kept."""
    trainer, initial, batches = built
    entropy = dict(loss_type="dr_grpo", beta=0.0, top_entropy_quantile=0.5)
    assert _theirs_and_ours(trainer, initial, batches[:1], entropy, 300) < 2e-5
    truncated = batches[0]["grpo_batch"].truncated_mask.bool()
    assert 0 < int(truncated.sum()) < len(truncated)  # some rows to drop, some kept
    scale = len(truncated) / int((~truncated).sum())
    overlong = dict(loss_type="dr_grpo", beta=0.0, overlong_filter=True)
    assert _theirs_and_ours(trainer, initial, batches[:1], overlong, 301, scale=scale) < 2e-5


def test_bnpo_is_ms_swifts_per_micro_batch_and_pgloss_the_steps(built):
    """Documented difference (docs/integrations.md, ms-swift): ms-swift's bnpo divides each micro-batch by its own
    tokens (then by GA), pgloss's by the step's tokens. One micro-batch: the same; two of unequal token counts:
    not."""
    trainer, initial, batches = built
    assert _theirs_and_ours(trainer, initial, batches[:1], dict(loss_type="bnpo"), 200) < 2e-5
    tokens = [float(b["grpo_batch"].completion_mask.sum()) for b in batches]
    assert tokens[0] != tokens[1]
    assert _theirs_and_ours(trainer, initial, batches, dict(loss_type="bnpo"), 201) > 1e-3


def test_two_steps_from_the_command_lines_plugin_with_a_loss_ms_swift_lacks(tmp_path):
    """ms-swift's entry point (`rlhf_main`, what `swift rlhf` runs) with the plugin file `pgloss swift-plugin`
    prints and `--loss_type pgloss:clip_cov,...`: two optimizer steps, each logging pgloss's metrics."""
    import subprocess
    import sys

    from swift import rlhf_main

    plugin = subprocess.run(
        [sys.executable, "-m", "pgloss.cli", "swift-plugin"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert Path(plugin).name == "swift_plugin.py"
    args = sw.arguments(tmp_path, plugins=(plugin,), loss_type="pgloss:clip_cov,clip_cov_ratio=0.01", num_iterations=2)
    rlhf_main(args)
    (log,) = Path(args.output_dir).glob("**/logging.jsonl")
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [row for row in rows if "pgloss/pg_loss" in row]
    assert len(steps) == 2 and all(math.isfinite(float(row["pgloss/pg_loss"])) for row in steps)
    assert "pgloss/clip_cov_fraction" in steps[-1] and float(steps[-1]["pgloss/ppo_kl"]) != 0  # off-policy 2nd step


def test_two_gloo_ranks_step_gradient_is_one_call(tmp_path):
    """Two processes (torchrun, gloo): each rank's step through ms-swift's training_step on the DDP-wrapped model
    applies the gradient of one plain call on both ranks' micro-batches (the count is over processes; group ids
    global), for a spread of names with ms-swift's rollout importance sampling."""
    import os
    import socket
    import subprocess
    import sys

    from swift_ddp_worker import NAMES, ROLLOUT

    from pgloss.trainer_options.swift import swift_algorithm

    sw.workspace(tmp_path / "work")  # made once here: the two ranks would write the same files at once
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
    env["OMP_NUM_THREADS"] = "1"
    for _attempt in range(2):  # a free port found here may be taken by another process before torchrun binds it
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr"]
        command += ["127.0.0.1", "--master_port", str(port), str(here / "swift_ddp_worker.py"), str(tmp_path)]
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        if run.returncode == 0 or "address already in use" not in run.stderr.lower():
            break
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    model = sw.tiny_model(str(tmp_path / "work" / "model"))
    options = dict(loss_type="grpo", beta=0.04, max_completion_length=8, **ROLLOUT)
    for name in NAMES:
        algorithm = swift_algorithm(options, name)
        model.load_state_dict(ranks[0]["initial"])
        recorded = [record for rank in ranks for record in rank["results"][name]["records"]]
        reference, metrics = sw.window_gradient(model, recorded, algorithm, ranks[0]["temperature"])
        for rank in ranks:  # DDP's average: every rank holds the step's gradient
            assert sw.relative_error(rank["results"][name]["grads"], reference) < 2e-5, name
        logged = ranks[0]["results"][name]["logged"]
        for key in ("pg_loss", "ppo_kl"):
            if key in metrics:
                assert logged[f"pgloss/{key}"] == pytest.approx(metrics[key], rel=1e-4, abs=1e-6), (name, key)


def _teacher_generation(trainer, initial, options, seed):
    """One generation by ms-swift with a local OPD-RL teacher (`teacher_model`): a tiny Qwen2 made as the policy is,
    its weights moved by 0.05·N(0, 1). ms-swift computes the teacher's log-probs of the sampled tokens and, with
    `options` set (`advantage_reweight`, `teacher_kl_coef`, `sdar_loss_coef`), its per-token advantages in
    `_postprocess_batch` from per-row base advantages N(0, 1) (the tiny model's rewards are mostly 0); the old
    log-probs are then moved by 0.3·N so that clipping occurs."""
    generator = torch.Generator().manual_seed(seed)
    teacher = sw.tiny_model(trainer.accelerator.unwrap_model(trainer.model).config.name_or_path)
    with torch.no_grad():
        for parameter in teacher.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    trainer.accelerator.unwrap_model(trainer.model).load_state_dict(initial)
    torch.manual_seed(seed)  # the sampling: the same completions whichever tests ran before
    saved = trainer.args
    trainer.args = copy.copy(saved)
    for key, value in options.items():
        setattr(trainer.args, key, value)
    trainer._prepare_algorithm_params()
    trainer.teacher_kl_coef = trainer.args.teacher_kl_coef
    trainer._teacher_model = trainer.teacher_model = teacher.eval()
    trainer._compute_advantages = lambda samples, *_: torch.randn(len(samples), generator=generator)
    try:
        trainer.model.train()
        batches = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    finally:
        del trainer._compute_advantages
        trainer._teacher_model = trainer.teacher_model = None
        trainer.args = saved
        trainer._prepare_algorithm_params()
    for micro in batches:
        batch = micro["grpo_batch"]
        assert batch.teacher_per_token_logps is not None and batch.advantages.dim() == 2
        batch.old_per_token_logps = batch.old_per_token_logps + 0.3 * torch.randn(
            batch.old_per_token_logps.shape, generator=generator
        )
    return batches


def test_sdar_is_ms_swifts_on_one_micro_batch_and_one_call_on_two(built):
    """`sdar_loss_coef` > 0 (SDAR's term, `sdar_coef`), ms-swift's teacher log-probs as `teacher_log_prob`: one
    micro-batch gives ms-swift's own step gradient; two give one plain pgloss call's (SDAR's token mean over the
    step). Documented difference: ms-swift's SDAR mean is per micro-batch, so on two of unequal token counts its
    gradient differs."""
    from pgloss.trainer_options.swift import from_swift

    trainer, initial, _ = built
    trainer.fused = False  # the unfused path first (the every-name test leaves it as its last case set it)
    options = dict(loss_type="grpo", sdar_loss_coef=0.5, sdar_gate_beta=3.0)
    batches = _teacher_generation(trainer, initial, options, 400)
    one = _theirs_and_ours(trainer, initial, batches[:1], options, 400)
    algorithm = from_swift(dict(vars(trainer.args)) | options)
    assert (algorithm.sdar_coef, algorithm.sdar_gate_beta) == (0.5, 3.0)
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    model.load_state_dict(initial)
    grads, logged = sw.drive_step(trainer, algorithm, batches, 401)
    reference, metrics = sw.window_gradient(model, sw.records(trainer, batches), algorithm, trainer.temperature)
    without, _ = sw.window_gradient(
        model,
        sw.records(trainer, batches),
        from_swift(dict(vars(trainer.args)) | options | dict(sdar_loss_coef=0.0)),
        trainer.temperature,
    )
    two = sw.relative_error(grads, reference)
    trainer.fused = True  # the teacher's log-probs through the fused path too
    try:
        model.load_state_dict(initial)
        fused = sw.relative_error(sw.drive_step(trainer, algorithm, batches, 403)[0], reference)
    finally:
        trainer.fused = False
    tokens = [float(b["grpo_batch"].completion_mask.sum()) for b in batches]
    apart = _theirs_and_ours(trainer, initial, batches, options, 402) if tokens[0] != tokens[1] else None
    print(
        {
            "one micro-batch vs ms-swift": one,
            "two vs one call": two,
            "SDAR's share": sw.relative_error(without, reference),
            "two vs ms-swift": apart,
            "fused two vs one call": fused,
        }
    )
    assert one < 2e-5 and two < 2e-5 and fused < 2e-5
    assert sw.relative_error(without, reference) > 1e-3  # the term moves the gradient
    assert logged["pgloss/sdar_loss"] == pytest.approx(metrics["sdar_loss"], rel=1e-4)
    assert apart is None or apart > 1e-4


@pytest.mark.parametrize(
    "options",
    [
        dict(loss_type="grpo", advantage_reweight="rlsd", rlsd_lambda=0.8, rlsd_reweight_clip_range=0.3),
        dict(loss_type="dapo", teacher_kl_coef=0.7),
    ],
    ids=["rlsd", "opd-rl"],
)
def test_rlsd_and_opd_rl_advantages_give_ms_swifts_step(built, options):
    """RLSD's reweighting and OPD-RL's teacher term are in ms-swift's per-token advantages, which the adapter
    passes as they are: the step (GA = 2) applies ms-swift's own gradient."""
    trainer, initial, _ = built
    batches = _teacher_generation(trainer, initial, options, 500)
    for micro in batches:  # per-token advantages that vary along each row: the teacher's evidence is in them
        batch = micro["grpo_batch"]
        mask = batch.completion_mask.bool()
        spread = (batch.advantages - batch.advantages[:, :1]).abs().masked_fill(~mask, 0)
        assert float(spread.max()) > 1e-3
    losses = []
    error = _theirs_and_ours(trainer, initial, batches, options, 500, losses=losses)
    print(options, error, losses)
    assert error < 2e-5
    assert losses[1] == pytest.approx(losses[0], rel=1e-5, abs=1e-7)


def test_a_term_that_reads_the_teacher_without_its_log_probs_is_refused_by_name(built):
    """ms-swift skips SDAR on a batch without teacher log-probs (no teacher, no teacher_prompt); the adapter says
    so instead of training without the configured term."""
    from pgloss.trainer_options.swift import from_swift

    trainer, _, batches = built
    batch = copy.copy(batches[0]["grpo_batch"])
    batch.teacher_per_token_logps = None
    saved = trainer.algorithm
    trainer.algorithm = from_swift(dict(sdar_loss_coef=0.1))
    try:
        with pytest.raises(ValueError, match=r"needs teacher_log_prob \(sdar_coef=0.1\)"):
            trainer._pgloss_inputs(batch, trainer._pgloss_mask(batch))
    finally:
        trainer.algorithm = saved
