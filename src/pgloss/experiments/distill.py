"""The distillation experiment: does on-policy distillation bring a student to its teacher faster than RL?

Published claims under test (docs/experiments.md states each with its prediction and verdict):

- "On-Policy Distillation" (Kevin Lu and Thinking Machines Lab, 2025; after GKD, Agarwal et al., arXiv
  2306.13649): a student that samples its own responses and is graded on every token by the teacher
  (the per-token reverse KL, log π_T - log π_student, as its advantage) learns the teacher's behaviour
  in far fewer steps than RL from the task's reward, which grades a whole response with one number.
- "On the Position Bias of On-Policy Distillation" (Xie et al., arXiv 2606.22600): weighting the tokens
  by how little discrepancy their prefix has accumulated (IW-OPD) converges faster than OPD's uniform
  token mean.

Design: the lab's ``chain`` task at the lab's default scale (width 96, 32 prompts x 8 responses per
step). Per seed, a warm start; a teacher trained from it by GRPO for ``teacher_steps`` (with
``teacher_d_model``, a wider teacher from a warm start of its own width); then students from the seed's
warm start, ``steps`` each, every
one sampling its own responses and seeing the same prompts (``STUDENTS``): ``grpo`` on the task's
reward (the teacher's own recipe, so its steps are the teacher's first ones), ``opd`` on the teacher's
advantage alone (``reward_coef`` 0: pure distillation), ``opd+reward`` on both summed
(tinker-cookbook's form), ``iw_opd`` on the teacher's advantage with IW-OPD's position weights. Each
step records the lab's diagnostics, among them the sampled reward and ``kl_teacher``, the reverse KL to
the teacher per token (k3) on the student's own samples.

Files in OUT: ``warm/`` (warm starts), ``teachers/teacher-seedS.pt`` (each teacher's final state),
``runs/LABEL-S.jsonl`` (the teacher's run is labelled ``teacher``). Complete runs are kept and skipped
when the experiment resumes; a teacher is trained again only if its state file is missing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from .runs import check_counts, execute, lab_settings, run_path, warm_state, write_run

OWN = ("runs", "warm", "teachers", "experiment.json", "seconds.json", "report.md", "distill.png")
"""The files and folders the experiment writes into its --out (what --overwrite sets aside)."""
TEACHER = "teacher"
"""The label of each seed's teacher run (GRPO from the warm start)."""
STUDENTS = {"grpo": ("grpo", 1.0), "opd": ("opd", 0.0), "opd+reward": ("opd", 1.0), "iw_opd": ("iw_opd", 0.0)}
"""Each student's label: (its lab algorithm, the weight of the task's group advantages, ``reward_coef``)."""


@dataclass(frozen=True)
class DistillExperiment:
    """The experiment's scale: students, seeds and steps, and the lab's settings every run shares.

    The fields named as `LabConfig`'s (``steps``, the students' RL steps, to ``eval_prompts``) are those
    settings, documented once there and passed on by name (`runs.lab_settings`); here they keep the lab's
    defaults. A teacher takes ``teacher_steps`` and ``teacher_d_model`` instead of ``steps`` and ``d_model``."""

    students: tuple[str, ...] = ("grpo", "opd", "opd+reward", "iw_opd")
    """Students trained from each seed's warm start against its teacher (names of ``STUDENTS``)."""
    seeds: int = 8
    """Seeds 0..seeds-1 (each its own warm start, teacher, prompts and sampling)."""
    teacher_steps: int = 60
    """GRPO steps that make each seed's teacher."""
    workers: int = 2
    """Runs trained at once, one process and one thread each."""
    steps: int = 30
    task: str = "chain"
    prompts_per_step: int = 32
    group_size: int = 8
    max_new_tokens: int = 24
    warm_steps: int = 1500
    warm_batch: int = 64
    d_model: int = 96
    eval_prompts: int = 64
    teacher_d_model: int | None = None
    """Width of each teacher, a larger model from its own warm start, whose learning rate is the lab's
    ``warm_lr`` times d_model / teacher_d_model (at 192 wide the lab's 3e-3 left the warm start at 0.21
    eval reward on seed 0, 1.5e-3 at 0.66, the students' 96-wide one at 0.39); None: the students' width and
    warm start."""

    def __post_init__(self) -> None:
        if not self.students:
            raise ValueError("students: need at least one student")
        unknown = [s for s in self.students if s not in STUDENTS]
        if unknown:
            raise ValueError(f"students: unknown {', '.join(map(repr, unknown))}; valid names: {', '.join(STUDENTS)}")
        check_counts(self, "seeds", "teacher_steps", "workers", *(["teacher_d_model"] if self.teacher_d_model else []))
        for label in (TEACHER, self.students[0]):  # the lab's settings, checked where the lab owns them
            self.lab_config(label, 0)

    def lab_config(self, label: str, seed: int):
        """The lab's configuration of one run: the teacher's or a student's."""
        from ..lab.config import LabConfig

        algorithm, reward_coef = ("grpo", 1.0) if label == TEACHER else STUDENTS[label]
        steps = self.teacher_steps if label == TEACHER else self.steps
        width = (self.teacher_d_model or self.d_model) if label == TEACHER else self.d_model
        warm_lr = LabConfig.warm_lr / (width / self.d_model)  # a wider model warms up at a lower rate
        return LabConfig(
            **{**lab_settings(self), "steps": steps, "d_model": width},
            algorithm=algorithm,
            reward_coef=reward_coef,
            seed=seed,
            warm_lr=warm_lr,
            samples=min(4, self.eval_prompts),
            threads=1,
        )

    def warm_configs(self, seed: int) -> list:
        """The configurations whose warm starts a seed needs: the teacher's, and the students' when wider."""
        configs = [self.lab_config(TEACHER, seed), self.lab_config(self.students[0], seed)]
        return configs[:1] if configs[0].d_model == configs[1].d_model else configs


DESIGN = DistillExperiment()
"""The experiment ``pgloss experiment distill`` runs (its options override these settings)."""


def quick(experiment: DistillExperiment) -> DistillExperiment:
    """``--quick``: two seeds, a 12-step teacher and 8-step students (a check that it all runs, not a result)."""
    return dataclasses.replace(experiment, seeds=2, teacher_steps=12, steps=8)


def teacher_path(out: Path, seed: int) -> Path:
    """Where the teacher of `seed` is kept (its state dict)."""
    return out / "teachers" / f"{TEACHER}-seed{seed}.pt"


def _warm(experiment: DistillExperiment, seed: int, cache: str) -> None:
    for cfg in experiment.warm_configs(seed):
        warm_state(cfg, cache)


def _teacher(experiment: DistillExperiment, seed: int, folder: str) -> None:
    """Train the teacher of `seed` in the experiment's `folder` (its run into runs/, its state into teachers/)."""
    import torch

    out = Path(folder)
    result = write_run(
        experiment.lab_config(TEACHER, seed), str(run_path(out, TEACHER, seed)), str(out / "warm"), label=TEACHER
    )
    path = teacher_path(out, seed)
    torch.save(result["state"], path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)  # a complete file or none


def _student(experiment: DistillExperiment, label: str, seed: int, folder: str) -> None:
    """Train the student `label` of `seed` in the experiment's `folder` from that seed's teacher."""
    from ..lab.torch_files import load_tensors

    out = Path(folder)
    write_run(
        experiment.lab_config(label, seed),
        str(run_path(out, label, seed)),
        str(out / "warm"),
        label=label,
        teacher_state=load_tensors(teacher_path(out, seed), "distillation teacher"),
        teacher_cfg=experiment.lab_config(TEACHER, seed),
    )


def check(experiment: DistillExperiment) -> None:
    """Fail before any training on a student the lab cannot build (ValueError/TypeError)."""
    from ..lab.trainer import make_algorithm

    for label in (TEACHER, *experiment.students):
        make_algorithm(experiment.lab_config(label, 0))


def run(experiment: DistillExperiment, out: Path, progress: bool = True) -> float:
    """Warm-start, then train every teacher and then every student not yet complete in `out`,
    ``experiment.workers`` at a time, with one progress bar on stderr; returns the seconds taken. A
    KeyboardInterrupt (Ctrl-C, SIGTERM) stops the workers and propagates: complete runs and teachers
    stay, the next call resumes."""
    from ..lab import warm

    check(experiment)
    for folder in ("warm", "runs", "teachers"):
        (out / folder).mkdir(parents=True, exist_ok=True)
    seeds = range(experiment.seeds)
    teachers = [s for s in seeds if not teacher_path(out, s).exists()]
    students = [(label, s) for s in seeds for label in experiment.students if not run_path(out, label, s).exists()]
    needed = sorted(set(teachers) | {s for _, s in students})
    cold = [cfg for s in needed for cfg in experiment.warm_configs(s) if not warm.cached(cfg, out / "warm")]
    stages = [
        (_warm, [(experiment, s, str(out / "warm")) for s in needed]),
        (_teacher, [(experiment, s, str(out)) for s in teachers]),
        (_student, [(experiment, label, s, str(out)) for label, s in students]),
    ]
    rl_steps = len(teachers) * (experiment.teacher_steps + 1) + len(students) * (experiment.steps + 1)
    return execute(
        "distill",
        stages,
        workers=min(experiment.workers, max(1, len(teachers) + len(students))),
        warm_starts=len(cold),
        warm_steps=experiment.warm_steps,
        rl_steps=rl_steps,
        progress=progress,
    )
