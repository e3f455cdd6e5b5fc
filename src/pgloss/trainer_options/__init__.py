"""The trainers' options as a pgloss `Algorithm`: the one translation of each trainer's loss options,
read by `pgloss.from_trl` / `pgloss.from_verl` and by the adapters in `pgloss.integrations`.

- `trl.py`: TRL's `GRPOConfig` (loss_type, epsilon, beta, vLLM importance sampling, adaptive entropy, ...);
- `verl.py`: verl's actor config (policy_loss.loss_mode, clip ratios, loss_agg_mode, loss_scale_factor,
  rollout_correction, ...).

They read the attributes (or keys) of the config they are given and import no trainer, so `import
pgloss` stays free of trl and verl; the adapters, which import the trainers, sit a floor above.
"""
