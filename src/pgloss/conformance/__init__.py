"""`pgloss conformance`: pgloss against every installed trainer's own loss functions, case by case."""

from .case import AGREE, DIFFERS, DOCUMENTED, Case

__all__ = ["AGREE", "DIFFERS", "DOCUMENTED", "Case"]
