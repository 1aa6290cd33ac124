"""Deprecated alias of :mod:`modelpatch.recipes.linear_experts.calibration` for one release (see :mod:`modelpatch.deprecation`)."""

from ..deprecation import alias

__getattr__ = alias(__name__)
