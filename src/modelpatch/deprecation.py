"""Module paths that moved, kept working for one release as deprecated aliases.

Each old path is a small module whose attributes are looked up, on first use, in the module(s) it moved to, with a
:class:`DeprecationWarning` naming the new path; the object is the same (``modelpatch.instances.patch_model is
modelpatch.apply.model_patch.patch_model``). The aliases import their targets by name when an attribute is asked for,
so they are not part of the layering (``tests/test_layout.py`` skips them).
"""

from __future__ import annotations

import importlib
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


def alias(old: str) -> Callable[[str], Any]:
    """The module ``__getattr__`` (PEP 562) of the deprecated module ``old``: each attribute is looked up in the
    modules ``old`` moved to (:data:`MOVED`), with a :class:`DeprecationWarning` that names where it is now.

    Raises:
        AttributeError: none of those modules has the attribute.
    """
    targets = MOVED[old]

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):  # module protocol lookups (__path__, __file__, ...) are not forwarded
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        for target in targets:
            module = importlib.import_module(target)
            try:
                value = getattr(module, name)
            except AttributeError:
                continue
            warnings.warn(
                f"{old} is deprecated and will be removed in the next release; import {name} from {target}",
                DeprecationWarning,
                stacklevel=2,
            )
            return value
        raise AttributeError(f"module {old!r} has no attribute {name!r}")

    return __getattr__
