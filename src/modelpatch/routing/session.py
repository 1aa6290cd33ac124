"""Deprecated alias of :mod:`modelpatch.routing.record`, ``replay``, ``generate`` and ``driver`` for one release (see
:mod:`modelpatch.deprecation`)."""

from ..deprecation import alias

__getattr__ = alias(__name__)
