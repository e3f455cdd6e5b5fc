"""`pgloss conformance`: pgloss against every installed trainer's own loss functions, case by case.

`case.py`: the record of one case; `run.py`: the runner and the command; one module per trainer
(`trl.py`, `verl.py`, ...) with `TRAINER`, `available()` and `cases()`.
"""

from .case import AGREE, DIFFERS, DOCUMENTED, Case

__all__ = ["AGREE", "DIFFERS", "DOCUMENTED", "Case"]
