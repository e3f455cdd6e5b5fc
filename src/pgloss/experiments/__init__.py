"""Experiments that test published claims about the losses with the lab, with intervals over seeds.

``length``: do sample-level and token-mean losses lengthen responses (and repeat tokens) where
GRPO's per-sequence token mean keeps them short, and does GRPO's 1/|y| lengthen wrong answers?
Run it with ``pgloss experiment length``; docs/experiments.md holds the result.
"""
