"""Deprecated alias of :mod:`modelpatch.apply.model_patch` and :mod:`modelpatch.apply.swap` for one release (see :mod:`modelpatch.deprecation`)."""

from .deprecation import alias

__getattr__, __dir__ = alias(__name__)  # __all__ too, on first use: the names of the new modules
del alias
