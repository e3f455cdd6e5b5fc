"""The experiments' settings: the lab's fields are the lab's (documented once, passed on by name), and an
experiment.json written before a setting existed still loads and resumes."""

import dataclasses
import json

import pytest

from pgloss.experiments import distill, length
from pgloss.experiments.command import _saved_plan, claim_out
from pgloss.experiments.runs import lab_settings
from pgloss.lab.config import LabConfig, field_docs

LAB = {f.name: f for f in dataclasses.fields(LabConfig)}
# A valid value other than every experiment's default, for each lab field the experiments carry.
OTHER = dict(
    steps=7,
    task="ladder",
    prompts_per_step=6,
    group_size=3,
    max_new_tokens=40,
    warm_steps=5,
    warm_batch=6,
    scratchpad_prob=0.25,
    d_model=24,
    lr=1e-3,
    eval_prompts=6,
    entropy_coef=0.01,
    target_entropy=0.2,
)


@pytest.mark.parametrize("cls", [length.LengthExperiment, distill.DistillExperiment])
def test_the_lab_fields_are_documented_once_and_passed_on_by_name(cls):
    shared = [f.name for f in dataclasses.fields(cls) if f.name in LAB]
    assert len(shared) >= 8 and not set(field_docs(cls)) & set(LAB), "a lab setting documented twice"
    for f in dataclasses.fields(cls):
        if f.name in LAB:
            assert f.type == LAB[f.name].type, f.name
    experiment = cls(**{k: OTHER[k] for k in shared})
    assert lab_settings(experiment) == {k: OTHER[k] for k in shared}
    label = experiment.students[0] if cls is distill.DistillExperiment else experiment.algorithms[0]
    cfg = experiment.lab_config(label, 1)
    assert {k: getattr(cfg, k) for k in shared} == {k: OTHER[k] for k in shared}
    assert (cfg.seed, cfg.threads, cfg.samples) == (1, 1, 4)


def test_the_teacher_takes_its_own_steps_and_width():
    experiment = distill.DistillExperiment(d_model=24, teacher_d_model=48, steps=3, teacher_steps=5)
    teacher = experiment.lab_config(distill.TEACHER, 0)
    assert (teacher.steps, teacher.d_model, teacher.warm_lr) == (5, 48, LabConfig.warm_lr / 2)
    assert (experiment.lab_config("opd", 0).steps, experiment.lab_config("opd", 0).d_model) == (3, 24)


# experiment.json as earlier versions wrote them: the length experiment before --task, --entropy-coef and
# --target-entropy, the distill experiment before --teacher-d-model.
OLD_LENGTH = {
    "algorithms": ["grpo", "dapo"],
    "seeds": 2,
    "steps": 3,
    "prompts_per_step": 2,
    "group_size": 2,
    "max_new_tokens": 40,
    "warm_steps": 3,
    "warm_batch": 4,
    "scratchpad_prob": 0.5,
    "d_model": 16,
    "lr": 0.0005,
    "eval_prompts": 2,
    "workers": 1,
    "status": "interrupted",
    "command": "pgloss experiment length --seeds 2 --steps 3",
}
OLD_DISTILL = {
    "students": ["grpo", "opd"],
    "seeds": 2,
    "teacher_steps": 3,
    "steps": 2,
    "workers": 1,
    "task": "chain",
    "prompts_per_step": 2,
    "group_size": 2,
    "max_new_tokens": 24,
    "warm_steps": 3,
    "warm_batch": 4,
    "d_model": 16,
    "eval_prompts": 2,
    "status": "finished",
    "command": "pgloss experiment distill",
}


@pytest.mark.parametrize(
    "saved, cls", [(OLD_LENGTH, length.LengthExperiment), (OLD_DISTILL, distill.DistillExperiment)]
)
def test_an_older_experiment_json_still_loads_and_resumes(tmp_path, saved, cls):
    (tmp_path / "experiment.json").write_text(json.dumps(saved))
    plan, command = _saved_plan(tmp_path)
    settings = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k not in ("status", "command")}
    assert plan.experiment == cls(**settings) and command == saved["command"]
    assert claim_out(str(tmp_path), "unused", plan.experiment, overwrite=False) == tmp_path  # the same: resumed
    other = dataclasses.replace(plan.experiment, steps=9)
    with pytest.raises(ValueError, match=r"steps \d there, 9 here"):
        claim_out(str(tmp_path), "unused", other, overwrite=False)
