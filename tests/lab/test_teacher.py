"""The lab trains with a teacher of its own (on-policy distillation): `train(..., teacher_state=...)`
gives the loss that model's log-probs of the sampled tokens and records the reverse KL to it."""

import copy
import dataclasses

import pytest
import torch

from pgloss.lab import trainer
from pgloss.lab.batch import Batch, collect, refill, score
from pgloss.lab.config import LabConfig
from pgloss.lab.trainer import build, make_algorithm, train, warm_start


def tiny(**overrides):
    return LabConfig(
        **{
            **dict(
                algorithm="opd",
                steps=2,
                prompts_per_step=4,
                group_size=2,
                warm_steps=30,
                warm_batch=16,
                d_model=32,
                n_layer=1,
                eval_prompts=4,
                samples=1,
                max_new_tokens=12,
                epochs=1,
                minibatches=1,
            ),
            **overrides,
        }
    )


def models(cfg):
    tokenizer, task, policy = build(cfg)
    warm_start(policy, task, tokenizer, cfg)
    teacher = copy.deepcopy(policy)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return tokenizer, task, policy, teacher


def test_the_teachers_log_probs_reach_the_loss_and_the_reference_is_the_default():
    cfg = tiny()
    tokenizer, task, policy, teacher = models(cfg)
    algorithm = make_algorithm(cfg)
    problems = [task.sample(__import__("random").Random(1)) for _ in range(4)]

    def batch(with_teacher):
        generator = torch.Generator().manual_seed(0)
        return collect(
            policy, policy, algorithm, problems, tokenizer, cfg, generator, teacher=teacher if with_teacher else None
        )

    own, own_stats, _ = batch(True)
    default, default_stats, _ = batch(False)
    assert default.teacher_log_prob is None and torch.equal(
        default.inputs(algorithm)["teacher_log_prob"], default.ref_log_prob
    )
    assert not torch.equal(own.inputs(algorithm)["teacher_log_prob"], own.ref_log_prob)
    assert float(own_stats["kl_teacher"]) > 0 and float(default_stats["kl_teacher"]) == pytest.approx(0.0, abs=1e-6)

    def loss(b):
        return algorithm(
            log_prob=b.old_log_prob,
            old_log_prob=b.old_log_prob,
            advantages=b.advantages,
            mask=b.rollout.mask,
            **b.inputs(algorithm),
        ).loss

    assert float(loss(own)) != pytest.approx(float(loss(default)))
    rows = torch.tensor([1, 0])
    picked = own.select(rows)
    assert torch.equal(picked.teacher_log_prob, own.teacher_log_prob[rows])
    joined = Batch.cat([own.select(torch.tensor([0])), own.select(torch.tensor([1]))])
    width = joined.teacher_log_prob.shape[1]
    assert torch.equal(joined.teacher_log_prob[:, :width], own.teacher_log_prob[:2, :width])


def test_a_run_with_a_teacher_records_the_kl_to_it_and_a_misfit_teacher_is_refused():
    cfg = tiny()
    _, _, policy, teacher = models(cfg)
    out = train(cfg, warm_state=policy.state_dict(), teacher_state=teacher.state_dict())
    assert len(out["metrics"]) == cfg.steps + 1 and out["metrics"][0]["kl_teacher"] > 0
    with pytest.raises(
        ValueError,
        match=r"teacher_state does not fit the teacher's model \(48 wide, 1 layers; "
        r"pass teacher_cfg for another shape\)",
    ):
        train(tiny(d_model=48), warm_state=None, teacher_state=teacher.state_dict())


def test_a_wider_deeper_teacher_is_built_from_its_own_config_without_moving_the_runs_random_numbers():
    cfg, wide = tiny(), tiny(d_model=48, n_layer=2)
    student, big = models(cfg)[2], models(wide)[2]
    own = trainer.teacher_model(cfg, wide, big.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(own.state_dict().values(), big.state_dict().values(), strict=True))
    assert not any(p.requires_grad for p in own.parameters())
    distilled = train(cfg, warm_state=student.state_dict(), teacher_state=big.state_dict(), teacher_cfg=wide)
    assert all(r["kl_teacher"] > 0 for r in distilled["metrics"])
    # a GRPO run reads no teacher: with one built beside it, its samples and metrics are the same
    grpo = dataclasses.replace(cfg, algorithm="grpo")
    plain = train(grpo, warm_state=student.state_dict())
    beside = train(grpo, warm_state=student.state_dict(), teacher_state=big.state_dict(), teacher_cfg=wide)
    without_kl = lambda run: [{k: v for k, v in r.items() if k != "kl_teacher"} for r in run["metrics"]]  # noqa: E731
    assert without_kl(plain) == without_kl(beside)
    assert [r["kl_teacher"] for r in plain["metrics"]] != [r["kl_teacher"] for r in beside["metrics"]]


def test_dapos_refill_keeps_the_teachers_log_probs():
    cfg = tiny()
    tokenizer, task, policy, teacher = models(cfg)
    algorithm = make_algorithm(cfg)
    problems = [task.sample(__import__("random").Random(2)) for _ in range(4)]
    own, _, _ = collect(
        policy, policy, algorithm, problems, tokenizer, cfg, torch.Generator().manual_seed(0), teacher=teacher
    )
    own = dataclasses.replace(own, scores=torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0]))  # group 1 all right
    kept, _ = refill(own, lambda round_: own, 4, max_rounds=0)
    rows = torch.tensor([0, 1, 4, 5, 6, 7])
    assert kept.teacher_log_prob is not None
    assert torch.equal(kept.teacher_log_prob[kept.rollout.mask], own.teacher_log_prob[rows][own.rollout.mask[rows]])


def test_reward_coef_weighs_the_task_advantages_and_a_run_returns_its_final_policy(monkeypatch):
    cfg = tiny()
    monkeypatch.setattr(  # rewards that differ within each group (this small a policy gets none right)
        "pgloss.lab.batch.score",
        lambda rollout, *args: (torch.arange(len(rollout.tokens)).remainder(3).float(), score(rollout, *args)[1]),
    )
    tokenizer, task, policy, teacher = models(cfg)
    problems = [task.sample(__import__("random").Random(3)) for _ in range(4)]

    def advantages(**overrides):
        run = tiny(**overrides)
        return collect(
            policy,
            policy,
            make_algorithm(run),
            problems,
            tokenizer,
            run,
            torch.Generator().manual_seed(0),
            teacher=teacher,
        )[0].advantages

    full, half, none = advantages(), advantages(reward_coef=0.5), advantages(reward_coef=0.0)
    assert full.abs().max() > 0 and torch.allclose(half, 0.5 * full) and torch.equal(none, torch.zeros_like(full))
    with pytest.raises(ValueError, match="--reward-coef must be a finite number >= 0"):
        tiny(reward_coef=-1.0)
    out = train(tiny(reward_coef=0.0), warm_state=policy.state_dict(), teacher_state=teacher.state_dict())
    moved = [k for k, v in out["state"].items() if not torch.equal(v, policy.state_dict()[k])]
    assert moved  # pure distillation trains the policy from the teacher's advantage alone
    fresh = build(cfg)[2]
    fresh.load_state_dict(out["state"])  # the state is a whole lab policy: a teacher for another run
