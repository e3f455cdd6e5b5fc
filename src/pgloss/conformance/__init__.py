"""`pgloss conformance`: pgloss against every installed trainer's own loss functions, case by case.

`case.py`: the record of one case and the shared batch; `run.py`: the runner and the command;
`sources.py`: a trainer's loss code run from its files; one module per trainer (`trl.py`, `verl.py`,
`ms_swift.py`, `liger.py`, `openrlhf.py`) with `TRAINER`, `available()` and `cases()`.
"""

from .case import AGREE, DIFFERS, DOCUMENTED, Case

__all__ = ["AGREE", "DIFFERS", "DOCUMENTED", "Case"]
