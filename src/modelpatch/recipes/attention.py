"""Deprecated alias of :mod:`modelpatch.recipes.fused_qkv.decoder` for one release (see :mod:`modelpatch.deprecation`)."""

from ..deprecation import alias

__getattr__ = alias(__name__)
