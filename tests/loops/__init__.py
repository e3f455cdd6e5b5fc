"""Plain float64 loops written from the papers, one module per concept; the package holds every name."""

from .advantages import *  # noqa: F403
from .aggregate import *  # noqa: F403
from .correction import *  # noqa: F403
from .distillation import *  # noqa: F403
from .divergence import *  # noqa: F403
from .divergences import *  # noqa: F403
from .kl import *  # noqa: F403
from .losses import *  # noqa: F403
from .terms import *  # noqa: F403
from .topk import *  # noqa: F403
