"""What every command shares, as a user meets it: a run never deletes another, the warm start is
cached, one progress bar with an honest ETA, one --algorithms grammar, missing extras caught first."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from lab_helpers import CLI_TINY, PGLOSS, warm_cache  # noqa: F401 (autouse: a warm-start cache of each test's own)

import pgloss
from pgloss import cli
from pgloss.lab import trainer, warm
from pgloss.lab.config import LabConfig
from pgloss.lab.progress import Progress, clock

COMPARE = ["compare", "--algorithms", "grpo", "--steps", "1", "--seeds", "1", "--workers", "1", *CLI_TINY]


def _contents(folder: Path) -> dict:
    """Every file under `folder` (its checkpoints and policies too) by its path there, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_an_out_that_holds_a_run_is_refused_and_nothing_is_deleted(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main([*COMPARE, "--out", str(out)]) == 0
    before = _contents(out)
    start = time.time()
    assert cli.main([*COMPARE, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--out {out} already holds " in err and "a run never replaces another" in err and "--overwrite" in err
    assert time.time() - start < 10 and _contents(out) == before
    (out / "notes.txt").write_text("mine")  # --overwrite replaces the lab's files and keeps the others
    assert cli.main([*COMPARE, "--steps", "2", "--out", str(out), "--overwrite"]) == 0
    assert json.loads((out / "config.json").read_text())["base"]["steps"] == 2 and (out / "notes.txt").exists()
    assert _contents(out / "replaced") == before  # the earlier run is kept
    assert f"kept in {out / 'replaced'}" in capsys.readouterr().err


def test_the_default_out_when_taken_is_written_beside(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "compare").mkdir(parents=True)
    (tmp_path / "runs" / "compare" / "report.md").write_text("the make demo report")
    assert cli.main(COMPARE) == 0
    assert (tmp_path / "runs" / "compare" / "report.md").read_text() == "the make demo report"
    assert "report: runs/compare-2/report.md" in capsys.readouterr().out


def test_grads_refuses_an_existing_figure_and_takes_the_same_grammar(tmp_path, capsys):
    out = tmp_path / "g.png"
    args = ["grads", "--algorithms", "grpo", "dr_grpo,dapo:clip_high=0.3", "--max-length", "8", "--out", str(out)]
    assert cli.main(args) == 0
    assert "dapo:clip_high=0.3" in capsys.readouterr().out
    figure = out.read_bytes()
    assert cli.main(args) == 2 and out.read_bytes() == figure
    assert "already exists: a run never replaces another" in capsys.readouterr().err
    assert cli.main([*args, "--overwrite"]) == 0
    assert (tmp_path / "g.replaced.png").read_bytes() == figure  # the earlier figure is kept beside
    assert f"kept as {tmp_path / 'g.replaced.png'}" in capsys.readouterr().err
    assert cli.main(["grads", "--algorithms", "all", "--max-length", "8", "--out", str(tmp_path / "all.png")]) == 0
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:-1]]
    assert rows == pgloss.names()  # every loss, those that need scores (TOPR) or groups (REAL) included


@pytest.mark.parametrize(
    "argv",
    [
        ["compare", "--algorithms", "grpo", "dapo:clip_hihg=0.3"],
        ["train", "--algorithms", "dapo:clip_hihg=0.3"],
        ["grads", "--algorithms", "grpo", "dapo:clip_hihg=0.3"],
        ["experiment", "length", "--algorithms", "grpo", "dapo:clip_hihg=0.3"],
    ],
)
def test_one_grammar_one_message_for_every_command(argv, tmp_path, capsys):
    assert cli.main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "dapo:clip_hihg=0.3: dapo has no hyperparameter 'clip_hihg'" in err, err
    assert not (tmp_path / "out").exists()


def test_train_takes_one_spec_of_the_grammar(tmp_path):
    out = tmp_path / "run"
    assert cli.main(["train", "--algorithms", "dapo:clip_high=0.3", "--steps", "1", *CLI_TINY, "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {r["algorithm"] for r in records} == {"dapo:clip_high=0.3"}
    assert (out / "report.md").read_text().startswith("# pgloss lab: training run")


def test_the_warm_start_is_cached_by_its_settings(tmp_path, monkeypatch):
    assert cli.main([*COMPARE, "--seeds", "2", "--out", str(tmp_path / "a")]) == 0
    assert len(list(warm.default_cache().glob("chain-seed*.pt"))) == 2  # the test's own cache (lab_helpers)

    def untrained(*args, **kwargs):
        raise AssertionError("the warm start was trained again")

    monkeypatch.setattr(trainer, "warm_start", untrained)
    assert cli.main([*COMPARE, "--seeds", "2", "--algorithms", "dapo", "--out", str(tmp_path / "b")]) == 0
    first = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    second = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["accuracy"] for r in first if r["step"] == 0] == [r["accuracy"] for r in second if r["step"] == 0]
    # another warm-start setting is another warm start
    assert cli.main([*COMPARE, "--warm-lr", "1e-3", "--out", str(tmp_path / "c")]) == 1
    assert "AssertionError: the warm start was trained again" in (tmp_path / "c" / "errors.log").read_text()


def test_the_cache_key_follows_what_the_warm_start_reads():
    base = LabConfig()
    same = [LabConfig(algorithm="dapo"), LabConfig(steps=3, lr=1e-3, temperature=0.7)]
    other = [
        LabConfig(seed=1),
        LabConfig(warm_steps=10),
        LabConfig(d_model=64),
        LabConfig(max_new_tokens=30),
        LabConfig(task="sum"),
    ]
    assert all(warm.key(c) == warm.key(base) for c in same)
    assert len({warm.key(c) for c in [base, *other]}) == 1 + len(other)


def test_progress_eta_is_per_phase_and_names_what_is_not_timed(tmp_path):
    with open(tmp_path / "bar.txt", "w") as file:
        bar = Progress("compare", {"warm start": (100, 2), "RL": (20, 2)}, file=file)
        assert bar.eta() == "warm start, ETA from its first step"
        bar.advance("warm start", 10, seconds=1.0)  # 0.1 s a step, two at once: 90 steps in 4.5 s
        assert bar.remaining() == (pytest.approx(4.5), ["RL"])
        assert bar.eta() == "warm start, ETA 0:04 + RL (timed from its first step)"
        bar.advance("warm start", 90, seconds=9.0)
        bar.advance("RL", 1, seconds=30.0)  # an RL step costs 300 warm-start steps: 19 x 30 / 2
        assert bar.remaining() == (pytest.approx(285.0), [])
        assert bar.eta() == "RL, ETA 4:45"
        assert bar.postfix() == "warm start 100/100, RL 1/20; RL, ETA 4:45" and bar.fraction() == pytest.approx(
            (100 * 0.05 + 15) / (100 * 0.05 + 20 * 15)
        )  # each phase's steps weighed by their seconds
        bar.close()
    assert clock(3725) == "1:02:05"


def test_the_bar_at_the_end_of_the_warm_start_shows_its_share_of_the_time(tmp_path):
    """A tiny run, timed as the bar goes: a warm-start step costs about a sixth of an RL step here, so the
    count of steps (30 of 34 at the end of the warm start) overstates the share of the time by far."""
    from pgloss.lab.commands import progress
    from pgloss.lab.runner import RL, WARM, timed_steps

    cfg = LabConfig(
        warm_steps=30,
        steps=3,
        d_model=16,
        n_layer=1,
        n_head=2,
        prompts_per_step=4,
        group_size=4,
        eval_prompts=4,
        samples=2,
    )
    seconds = {WARM: 0.0, RL: 0.0}
    warm.state(LabConfig(**{**cfg.__dict__, "warm_steps": 2}), None)  # torch's one-off start-up, paid before timing

    def advance(phase, steps, took):
        seconds[phase] += took
        bar.advance(phase, steps, took)

    with open(tmp_path / "bar.txt", "w") as file:
        bar = progress("train", 1, cfg, 1, 1)
        bar.bar.fp = file
        state = warm.state(cfg, None, on_steps=lambda steps, took: advance(WARM, steps, took))
        at_warm_end = bar.fraction()
        trainer.train(cfg, state, on_step=timed_steps(lambda item: advance(RL, 1, item["seconds"])))
        assert bar.fraction() == 1.0
        bar.close()
    share = seconds[WARM] / (seconds[WARM] + seconds[RL])
    assert abs(at_warm_end - share) < 0.25, (at_warm_end, share)  # loose: the CPU is shared and the prior rough
    assert abs(30 / 34 - share) > abs(at_warm_end - share)  # the count of steps was further off


def _without(package: str, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    """The CLI in a Python where `package` cannot be imported."""
    code = (
        f"import sys; sys.modules[{package!r}] = None; sys.argv = ['pgloss', *{list(argv)!r}]; "
        "from pgloss.cli import main; sys.exit(main())"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=120)


@pytest.mark.parametrize("argv", [["compare"], ["train"], ["experiment", "length", "--quick"], ["grads"]])
def test_a_missing_extra_stops_every_command_before_any_work(argv, tmp_path):
    start = time.time()
    done = _without("matplotlib", *argv, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "pip install -e '.[lab]'" in done.stderr and "Traceback" not in done.stderr
    assert time.time() - start < 60 and not (tmp_path / "runs").exists()


def test_version_and_the_command_table():
    done = subprocess.run([PGLOSS, "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == f"pgloss {pgloss.__version__}"
    commands = cli.build_parser()._subparsers._group_actions[0].choices
    assert {"list", "losses", "train", "compare", "experiment", "grads"} <= set(commands)


def test_losses_explains_its_columns_and_shows_no_kl_for_a_loss_without_one():
    out = subprocess.run(
        [PGLOSS, "losses", "--batch", "4", "--length", "6"], capture_output=True, text=True, check=True
    ).stdout
    header = next(line for line in out.splitlines() if line.startswith("algorithm"))
    for column in header.split()[1:]:
        assert any(line.split()[:1] == [column] for line in out.splitlines() if line.startswith("  ")), column
    kl = header.split().index("kl")
    rows = {
        line.split()[0]: line.split()
        for line in out.splitlines()
        if line.split()[:1] and line.split()[0] in pgloss.names()
    }
    assert rows["grpo"][kl] != "-" and float(rows["grpo"][kl]) > 0  # kl_coef 0.04: a term of its loss
    assert rows["dapo"][kl] == "-" and rows["gspo"][kl] == "-"  # no KL term
    assert "\ncolumns ('-': the loss has no such quantity):" in out
