"""The exceptions of :mod:`modelpatch.routing`, in one module that every other routing module may import.

Each derives from :class:`modelpatch.errors.ModelpatchError` and keeps its built-in base (``ValueError`` or
``RuntimeError``), so ``except ModelpatchError`` and ``except ValueError`` / ``except RuntimeError`` both
catch them.
"""

from __future__ import annotations

from ..errors import ModelpatchError

__all__ = ["RoutingTraceError", "RoutingReplayError", "RoutingDiscoveryError", "RouterContractError"]


class RoutingTraceError(ModelpatchError, ValueError):
    """A routing trace, or an engine array, does not fit the model or is malformed."""


class RoutingReplayError(ModelpatchError, RuntimeError):
    """A replay block consumed more or fewer routes than its trace holds, or a forward does not fit it."""


class RoutingDiscoveryError(ModelpatchError, RuntimeError):
    """The model has no router that `modelpatch.routing` can drive, or its routers are ambiguous."""


class RouterContractError(ModelpatchError, RuntimeError):
    """A router did not behave as its kind expects (e.g. no, or several, routing top-k calls in one call)."""
