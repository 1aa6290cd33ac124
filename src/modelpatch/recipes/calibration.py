"""Deprecated alias of :mod:`modelpatch.recipes.linear_experts.calibration` for one release (see :mod:`modelpatch.deprecation`)."""

from ..deprecation import alias

__getattr__, __dir__ = alias(__name__)  # __all__ too, on first use: the names of the new modules
del alias
