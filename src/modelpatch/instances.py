"""Deprecated alias of :mod:`modelpatch.apply.model_patch` for one release (see :mod:`modelpatch.deprecation`)."""

from .deprecation import alias

__getattr__ = alias(__name__)
