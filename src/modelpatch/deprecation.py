"""Module paths that moved, kept working for one release as deprecated aliases.

Each old path is a small module whose attributes are looked up, on first use, in the module(s) it moved to, with a
:class:`DeprecationWarning` naming the new path; the object is the same (``modelpatch.instances.patch_model is
modelpatch.apply.model_patch.patch_model``). The aliases import their targets by name when an attribute is asked for,
so they are not part of the layering (``tests/test_layout.py`` skips them).
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["MOVED", "alias"]

# old module -> the modules its names live in now (looked up in this order)
MOVED: dict[str, tuple[str, ...]] = {
    "modelpatch.blocks": ("modelpatch.apply.blocks",),
    "modelpatch.instances": ("modelpatch.apply.model_patch", "modelpatch.apply.swap"),
    "modelpatch.integrations.transformers": ("modelpatch.apply.transformers",),
    "modelpatch.conversion.hooks": ("modelpatch.apply.transformers",),
    "modelpatch.recipes.attention": ("modelpatch.recipes.fused_qkv.decoder",),
    "modelpatch.recipes.bert": ("modelpatch.recipes.fused_qkv.bert",),
    "modelpatch.recipes.experts": (
        "modelpatch.recipes.linear_experts.layer",
        "modelpatch.recipes.linear_experts.discovery",
        "modelpatch.recipes.linear_experts.recipe",
    ),
    "modelpatch.recipes.calibration": ("modelpatch.recipes.linear_experts.calibration",),
    "modelpatch.routing.session": (
        "modelpatch.routing.record",
        "modelpatch.routing.replay",
        "modelpatch.routing.generate",
        "modelpatch.routing.driver",
    ),
}


def alias(old: str) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` (PEP 562) of the deprecated module ``old``.

    ``__getattr__`` looks each attribute up in the modules ``old`` moved to (:data:`MOVED`), with a
    :class:`DeprecationWarning` that names where it lives now: the target whose ``__all__`` lists it, else the
    target the object is defined in (its ``__module__``), else the first target that has it. ``__all__`` is the union
    of the targets' ``__all__`` (in :data:`MOVED` order), computed on first use, so importing ``old`` imports none of
    its targets and ``from old import *`` gives every name, each with its warning. ``__dir__`` lists the same names
    (and the module's own dunder attributes).

    Raises:
        AttributeError: (from ``__getattr__``) none of those modules has the attribute.
    """
    targets = MOVED[old]

    def public_names() -> list[str]:
        module = sys.modules[old]
        names = vars(module).get("__all__")
        if names is None:
            names = list(dict.fromkeys(name for target in targets for name in _target_all(target)))
            module.__all__ = names  # type: ignore[attr-defined]  # cached: later lookups do not reach __getattr__
        return list(names)

    def __getattr__(name: str) -> Any:
        if name == "__all__":
            return public_names()
        if name.startswith("__"):  # module protocol lookups (__path__, __file__, ...) are not forwarded
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        home, value = _home(old, targets, name)
        warnings.warn(
            f"{old} is deprecated and will be removed in the next release; import {name} from {home}",
            DeprecationWarning,
            stacklevel=2,
        )
        return value

    def __dir__() -> list[str]:
        names = public_names()
        return sorted({*names, *(name for name in vars(sys.modules[old]) if name.startswith("__"))})

    return __getattr__, __dir__


def _target_all(target: str) -> list[str]:
    module = importlib.import_module(target)
    names = getattr(module, "__all__", None)
    if names is None:  # a bug of modelpatch, not bad input (deprecation imports nothing of modelpatch: a plain error)
        raise RuntimeError(f"{target} (a target of a deprecated alias in modelpatch.deprecation.MOVED) has no __all__")
    return list(names)


def _home(old: str, targets: tuple[str, ...], name: str) -> tuple[str, Any]:
    """The module ``name`` lives in now, and its value: the target listing it in ``__all__``, else the target its
    ``__module__`` names, else the first target that has it."""
    found: list[tuple[str, Any]] = []
    for target in targets:
        module = importlib.import_module(target)
        if name in getattr(module, "__all__", ()):
            return target, getattr(module, name)
        value = getattr(module, name, _MISSING)
        if value is not _MISSING:
            found.append((target, value))
    if not found:
        raise AttributeError(f"module {old!r} has no attribute {name!r}")
    defined_in = getattr(found[0][1], "__module__", None)
    return next(((target, value) for target, value in found if target == defined_in), found[0])


_MISSING = object()
