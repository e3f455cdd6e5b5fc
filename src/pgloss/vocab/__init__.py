"""Computations over the vocabulary, chunk by chunk: log-prob and entropy from logits (`entropy`), the
loss from hidden states without materialising the logits (`fused`), and the exact full-vocabulary KL
(`full_kl`) and a student's divergence from a teacher (`divergence`: forward KL, reverse KL, JSD_β). All run the one loop of `chunks.ChunkLoop`: a source gives a chunk's logits (given logits,
or hidden states times an LM head), a statistic turns them into per-token values and, in backward,
into the chunk's gradient."""
