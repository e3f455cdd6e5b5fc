"""Reading a loss rather than training with it: the per-token gradient (`inspect`) and the
gradient-statistics command (`grads`)."""
