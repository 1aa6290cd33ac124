"""Deprecated alias of :mod:`modelpatch.apply.blocks` for one release (see :mod:`modelpatch.deprecation`)."""

from .deprecation import alias

__getattr__ = alias(__name__)
