"""The one base class of every error modelpatch raises.

Each error also keeps the built-in base it always had (``ValueError``, ``TypeError``, ``KeyError``,
``RuntimeError``) as a second parent, so ``except ValueError`` written against earlier releases keeps
working, and ``except ModelpatchError`` catches everything modelpatch raises on purpose.
"""

from __future__ import annotations

__all__ = ["ModelpatchError"]


class ModelpatchError(Exception):
    """Base class of every exception modelpatch raises on purpose (bad input, failed checks)."""
