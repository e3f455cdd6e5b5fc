"""Adapters that put pgloss's losses inside the trainers people already run.

- `pgloss.integrations.trl`: `PGLossGRPOTrainer` and `PGLossMixin` for TRL's GRPOTrainer
  (extra `trl`: `pip install -e '.[trl]'`).
- `pgloss.integrations.verl`: registers `pgloss_<name>` into verl's policy-loss registry
  (extra `verl`, then verl with `--no-deps`; loaded by a bare `import verl` through the `verl.plugins` entry point).

- `pgloss.integrations.lm_head`: a transformers model's LM head as the fused path's options.

Neither adapter is imported by `import pgloss`; the trainers' option translators they share with
`pgloss.from_trl` / `from_verl` are `pgloss.trainer_options` (a floor below, importing no trainer). An adapter maps a trainer's names, options and counts onto
a `pgloss.Step` (one optimizer step: counted once, its calls of `Algorithm.__call__` / `from_hidden`, their
metrics), and adds no loss math and no counting of its own. See docs/integrations.md.
"""
