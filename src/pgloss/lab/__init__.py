"""The lab: train a tiny causal transformer with each pgloss algorithm and compare them.

One concept per module: ``tokenizer`` and ``model`` (built in code, nothing downloaded),
``tasks`` (verifiable rewards, length that varies and matters), ``sampling`` (group
sampling), ``trainer`` (warm start and the RL loop), ``distributed`` (data parallel),
``plots`` and ``report`` (the comparison's files), ``config``, ``spec`` (an algorithm with its
loss hyperparameters, as the command line gives it: the one ``--algorithms`` grammar), ``warm``
(the warm start, cached by its settings), ``outputs`` (where a run writes, never over another),
``progress`` (the one progress bar), ``runner`` (jobs in worker processes, Ctrl-C and SIGTERM),
``commands`` (the ``pgloss train`` and ``pgloss compare`` commands) and ``grads`` (``pgloss grads``:
the per-token gradient of chosen losses, by `pgloss.diagnostics.inspect`, drawn on a batch). Importing ``pgloss``
does not import the lab.
"""
