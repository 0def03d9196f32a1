"""Fleet models, one submodule per seam; every model is re-exported here, so callers import
``from fleet.models import Node`` and Django finds each model through this package."""

from .nodes import *  # noqa: F403
from .nodes import DEFAULT_DEGRADED_CONDITIONS, DEFAULT_UNHEALTHY_CONDITIONS  # noqa: F401
