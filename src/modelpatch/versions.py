"""The Transformers releases modelpatch is tested with, and the optional dependencies of its integrations.

:data:`TESTED_TRANSFORMERS` is the range ``pyproject.toml`` declares, and CI runs the whole suite on each of its
releases (one venv per release, pinned by ``constraints/transformers-5.2N.txt``; ``tests/test_release_range.py``
keeps the three in agreement). Importing modelpatch with a Transformers release outside it emits one
:class:`UntestedTransformersWarning` naming the range (``pip`` allows it: ``--no-deps``, or an upgrade of
transformers after modelpatch); ``MODELPATCH_STRICT_VERSION=1`` makes it an :class:`UnsupportedTransformersError`.

:func:`require` imports an optional dependency of an integration, or raises a :class:`MissingDependencyError`
naming the ``modelpatch[extra]`` that installs it.
"""

from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from .errors import ModelpatchError

__all__ = [
    "TESTED_TRANSFORMERS",
    "UntestedTransformersWarning",
    "UnsupportedTransformersError",
    "MissingDependencyError",
    "check_transformers_release",
    "require",
    "missing_dependency",
]

TESTED_TRANSFORMERS = SpecifierSet(">=5.23,<5.26")
"""The Transformers releases CI tests whole (5.23, 5.24, 5.25); ``pyproject.toml`` declares the same range."""

_RANGE_TEXT = "5.23 to 5.25 (transformers>=5.23,<5.26)"


class UntestedTransformersWarning(ModelpatchError, UserWarning):
    """The imported Transformers release is outside :data:`TESTED_TRANSFORMERS` (a ``UserWarning``; also a
    :class:`~modelpatch.ModelpatchError`, as every exception class of the package, for ``-W error`` runs)."""


class UnsupportedTransformersError(ModelpatchError, ImportError):
    """The imported Transformers release is outside :data:`TESTED_TRANSFORMERS` and ``MODELPATCH_STRICT_VERSION=1``."""


class MissingDependencyError(ModelpatchError, ImportError):
    """An integration needs a package that is not installed; the message names the extra that installs it."""


def check_transformers_release(release: str, *, strict: bool | None = None) -> str | None:
    """Check a Transformers release string against :data:`TESTED_TRANSFORMERS` (``import modelpatch`` calls it
    with ``transformers.__version__``).

    Args:
        release: e.g. ``"5.24.0"``, ``"5.26.0.dev0"``.
        strict: raise instead of warning; default: ``MODELPATCH_STRICT_VERSION=1`` in the environment.

    Returns:
        ``None`` for a tested release, else the message, also emitted once as an :class:`UntestedTransformersWarning`.

    Raises:
        UnsupportedTransformersError: an untested release with ``strict``.
    """
    try:
        tested = TESTED_TRANSFORMERS.contains(Version(release), prereleases=True)
    except InvalidVersion:
        tested = False
    if tested:
        return None
    if strict is None:
        strict = os.environ.get("MODELPATCH_STRICT_VERSION") == "1"
    untested = f"modelpatch is tested with Transformers {_RANGE_TEXT}, not {release}"
    advice = "install a tested release: pip install 'transformers>=5.23,<5.26'"
    if strict:
        raise UnsupportedTransformersError(f"{untested} (MODELPATCH_STRICT_VERSION=1); {advice}")
    message = f"{untested}; {advice} (MODELPATCH_STRICT_VERSION=1 makes this an error)"
    warnings.warn(message, UntestedTransformersWarning, stacklevel=3)
    return message


def missing_dependency(exc: ModuleNotFoundError, package: str, extra: str, purpose: str) -> ImportError:
    """The error to raise for ``exc`` (caught importing ``package`` for ``purpose``): a
    :class:`MissingDependencyError` naming ``pip install 'modelpatch[extra]'`` when ``package`` itself is missing,
    else ``exc`` (the package is there, something it imports is not: not ours to rename)."""
    if exc.name is None or exc.name.split(".")[0] != package:
        return exc
    return MissingDependencyError(
        f"{purpose} needs the '{package}' package, which is not installed: pip install 'modelpatch[{extra}]'"
    )


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """Import ``module`` (an optional dependency) for ``purpose``.

    Raises:
        MissingDependencyError: ``module`` is not installed; the message names ``pip install 'modelpatch[extra]'``.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise missing_dependency(exc, module.split(".")[0], extra, purpose) from None
