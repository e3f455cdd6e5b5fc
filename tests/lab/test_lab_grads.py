"""pgloss grads: the numbers behind the figure against the closed forms, and the figure itself."""

import pytest
import torch

from pgloss.cli import main
from pgloss.lab.grads import examples, gradient_table, load_batch, plot, summary, synthetic_batch

NAMES = ("grpo", "bnpo", "dr_grpo", "sample_grpo", "gspo")


def test_ratio_one_numbers_are_the_closed_forms():
    """At ratio one, g·N per token: GRPO and GSPO -Â/|y|, BNPO -Â·N/N_tok, Dr.GRPO -Â/C, sample-level -Â."""
    batch = synthetic_batch(groups=4, group_size=4, max_length=32, seed=1)
    table = gradient_table(NAMES, batch)
    mask = batch["mask"]
    lengths = mask.sum(1).double()
    n, n_tok, c = mask.shape[0], float(lengths.sum()), float(mask.shape[1])
    a = batch["advantages"].double()
    per_token = {
        "grpo": -a / lengths,
        "gspo": -a / lengths,
        "bnpo": -a * n / n_tok,
        "dr_grpo": -a / c,
        "sample_grpo": -a,
    }
    for name, expected in per_token.items():
        grad = table[name]["grad"]
        torch.testing.assert_close(grad, torch.where(mask, expected[:, None].expand_as(grad), 0.0))
        torch.testing.assert_close(table[name]["total"], expected * lengths)
    # the sequence total: constant in length for GRPO, proportional to it for the others
    torch.testing.assert_close(table["grpo"]["total"], -a)
    torch.testing.assert_close(
        table["sample_grpo"]["total"] / table["grpo"]["total"].where(a != 0, 1.0), lengths.where(a != 0, 0.0)
    )


def test_off_policy_numbers_equal_the_inspector_closed_form():
    batch = synthetic_batch(groups=3, group_size=4, max_length=24, spread=0.3, seed=2)
    table = gradient_table(NAMES, batch)
    for name in NAMES:
        assert table[name]["closed_form"] is not None, table[name]["reason"]
        torch.testing.assert_close(table[name]["grad"], table[name]["closed_form"], rtol=1e-9, atol=1e-12)
    assert (table["sample_grpo"]["grad"][batch["mask"]] == 0).any()  # whole-sequence ratios leave the clip band


def test_examples_pick_the_shortest_and_longest_of_each_sign():
    lengths = torch.tensor([3, 9, 5, 7, 0])
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0])
    assert examples(lengths, advantages) == {"short, Â>0": 0, "long, Â>0": 1, "short, Â<0": 2, "long, Â<0": 3}


def test_plot_summary_and_saved_batch(tmp_path):
    batch = synthetic_batch(groups=2, group_size=4, max_length=16, seed=3)
    torch.save(batch, tmp_path / "batch.pt")
    loaded = load_batch(tmp_path / "batch.pt")
    table = gradient_table(("grpo", "sample_grpo"), loaded)
    lines = summary(table)
    assert len(lines) == 3 and lines[1].startswith("grpo")
    path = plot(table, tmp_path / "grads.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_command(tmp_path, capsys):
    out = tmp_path / "g.png"
    assert main(["grads", "--algorithms", "grpo,dr_grpo", "--max-length", "16", "--out", str(out)]) == 0
    assert out.exists() and "dr_grpo" in capsys.readouterr().out
    assert main(["grads", "--algorithms", "grpo,nope", "--out", str(out)]) == 2
    assert "unknown algorithm 'nope'" in capsys.readouterr().err
    torch.save({"mask": torch.ones(1, 1)}, tmp_path / "bad.pt")
    assert main(["grads", "--batch", str(tmp_path / "bad.pt"), "--out", str(out)]) == 2
    assert "must hold a dict with the keys" in capsys.readouterr().err


def test_bad_synthetic_arguments():
    with pytest.raises(ValueError, match="group_size"):
        synthetic_batch(group_size=1)
    with pytest.raises(ValueError, match="spread"):
        synthetic_batch(spread=-1.0)
