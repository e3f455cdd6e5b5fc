"""The ground floor: the token batch and its checks, ratios, the aggregation and its step counts,
metrics, the gradient slope and the trainer-name table. Imports nothing else of pgloss."""
