"""Statistics over the vocabulary, chunk by chunk, and the backends that run them: log-prob and entropy from logits
or hidden states (`entropy`, `fused`), the exact full-vocabulary KL (`full_kl`) and the student-teacher divergences
of distillation (`divergence`: forward KL, reverse KL, JSD(β)). All run the one loop of `chunks.ChunkLoop`: a source
gives a chunk's logits (given logits, or hidden states times an LM head), a statistic (`statistic.Statistic`) turns
them into per-token values and, in backward, into the chunk's gradient, on the backend the call's plan chose
(`backends.py`, `plan.py`: torch tiles, Triton tiles, Triton head). The loss of an algorithm from hidden states,
which drives this loop, is a floor up: `pgloss.from_hidden`."""
