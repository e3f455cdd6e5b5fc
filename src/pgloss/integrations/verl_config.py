"""The former home of `pgloss.trainer_options.verl` (verl's options as an Algorithm): this name is that
module, so code that imports `pgloss.integrations.verl_config` (or patches its attributes) keeps working."""

import sys

from ..trainer_options import verl as _moved

sys.modules[__name__] = _moved
