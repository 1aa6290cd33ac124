"""Per-expert linear experts: every expert a set of ``nn.Linear`` (what weight quantisers need), for every family
whose experts class carries Transformers' ``@use_experts_implementation``; nothing is written per family.

``discovery``    which ``@use_experts_implementation`` classes a model type has, their flags and the per-expert
                 names of its checkpoints (:func:`experts_family`), read from Transformers' sources
``layer``        the replacement layer :class:`LinearExperts` (``Linear<X>`` for the experts class ``<X>``) and
                 :class:`ExpertMLP`, one expert
``recipe``       the conversion rules of both checkpoint layouts and the recipes (:func:`linear_experts_recipe`)
``calibration``  :func:`calibrate_all_experts`: every expert runs on every token, for calibration observers

May import: errors, undo, patching, conversion, integrations, apply, and :mod:`modelpatch.recipes.base`. May not
import: cli, or :mod:`modelpatch` itself.
"""

from typing import Any

from . import discovery, layer
from .calibration import calibrate_all_experts
from .discovery import ExpertsClass, ExpertsFamily, UnsupportedExpertsError, experts_family, experts_model_types
from .layer import COMPILED_DISPATCHES, LINEAR_EXPERTS_CLASSES, ExpertMLP, LinearExperts, linear_experts_class
from .recipe import generic_linear_experts_recipe, linear_experts_recipe

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
    if name == "FAMILIES":
        return discovery.FAMILIES
    if name.startswith("Linear") and name.endswith("Experts"):
        return getattr(layer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
