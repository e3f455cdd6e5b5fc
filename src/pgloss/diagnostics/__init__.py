"""Reading a loss rather than training with it: the per-token gradient ∂L/∂log π and its closed form
(`inspect`). The lab's figures of it (`pgloss grads`) are `pgloss.lab.grads`."""
