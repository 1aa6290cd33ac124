"""Per-expert linear experts: every expert a set of ``nn.Linear`` (what weight quantisers need), for every family
whose experts class carries Transformers' ``@use_experts_implementation``; nothing is written per family.

``layer``        the replacement layer :class:`LinearExperts` (``Linear<X>`` for the experts class ``<X>``) and
                 :class:`ExpertMLP`, one expert
``calibration``  :func:`calibrate_all_experts`: every expert runs on every token, for calibration observers

May import: errors, undo, patching, conversion, integrations, apply, and :mod:`modelpatch.recipes.base`. May not
import: cli, or :mod:`modelpatch` itself.
"""

from typing import Any

from . import layer
from .calibration import calibrate_all_experts
from .layer import (
    COMPILED_DISPATCHES,
    LINEAR_EXPERTS_CLASSES,
    ExpertMLP,
    ExpertsClass,
    ExpertsFamily,
    LinearExperts,
    UnsupportedExpertsError,
    experts_family,
    experts_model_types,
    generic_linear_experts_recipe,
    linear_experts_class,
    linear_experts_recipe,
)

__all__ = [
    "COMPILED_DISPATCHES",
    "LINEAR_EXPERTS_CLASSES",
    "ExpertMLP",
    "ExpertsClass",
    "ExpertsFamily",
    "LinearExperts",
    "UnsupportedExpertsError",
    "calibrate_all_experts",
    "experts_family",
    "experts_model_types",
    "generic_linear_experts_recipe",
    "linear_experts_class",
    "linear_experts_recipe",
]


def __getattr__(name: str) -> Any:
    """``FAMILIES`` (every model type with decorated experts) and the per-family classes (``LinearMixtralExperts``,
    ...), derived by :mod:`.layer` when asked for."""
    if name == "FAMILIES" or (name.startswith("Linear") and name.endswith("Experts")):
        return getattr(layer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
