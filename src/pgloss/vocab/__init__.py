"""Computations over the vocabulary, chunk by chunk: log-prob and entropy from logits, the loss from
hidden states without materialising the logits, and the exact full-vocabulary KL."""
