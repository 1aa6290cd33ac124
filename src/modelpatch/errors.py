"""The one base class of every error modelpatch raises.

Each error also keeps the built-in base it always had (``ValueError``, ``TypeError``, ``KeyError``,
``RuntimeError``) as a second parent, so ``except ValueError`` written against earlier releases keeps
working, and ``except ModelpatchError`` catches everything modelpatch raises on purpose.
"""

from __future__ import annotations

__all__ = [
    "ModelpatchError",
    "ModelpatchValueError",
    "ModelpatchTypeError",
    "ModelpatchKeyError",
    "ModelpatchRuntimeError",
]


class ModelpatchError(Exception):
    """Base class of every exception modelpatch raises on purpose (bad input, failed checks)."""


class ModelpatchValueError(ModelpatchError, ValueError):
    """A bad value: an invalid pattern, a key already registered, a tensor of the wrong shape."""


class ModelpatchTypeError(ModelpatchError, TypeError):
    """An argument of the wrong kind: a replacement that is not an ``nn.Module`` class, a rule class instead of an
    instance, a list where a dict is expected."""


class ModelpatchKeyError(ModelpatchError, KeyError):
    """A name that is not registered (a conversion mapping, a recipe, an output recorder)."""

    def __str__(self) -> str:  # KeyError's str() is the repr of its argument: keep messages readable
        return str(self.args[0]) if self.args else ""


class ModelpatchRuntimeError(ModelpatchError, RuntimeError):
    """An operation used in the wrong state (a scope stopped twice, an integration that is uninstalled)."""
