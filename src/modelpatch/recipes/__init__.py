"""Ready-made recipes: a patch mapping plus the conversion rules it needs, applied with one call or one block.

>>> from modelpatch.recipes import get_recipe, list_recipes
>>> with get_recipe("llama-fused-qkv").apply():
...     model = AutoModelForCausalLM.from_pretrained(path)   # q/k/v fused, weights converted
>>> model.save_pretrained(out)                                 # written in the original layout

``list_recipes()`` names them all; ``recipe_a + recipe_b`` applies both (the full example, every kind of change
at once on one model, is ``get_recipe("qwen2_moe-full-example")``: fused QKV attention + per-expert linear experts + a ``Concatenate`` rule,
built-in expert fusion dropped). :mod:`.base` defines :class:`Recipe` and :class:`RuleSpec`; the recipes:

=========================  ===========================================================================
``<type>-fused-qkv``       llama, mistral, qwen2, qwen2_moe, qwen3 (:mod:`.fused_qkv.decoder`); bert (:mod:`.fused_qkv.bert`)
``<type>-linear-experts``  every model type with a ``@use_experts_implementation`` experts class
                           (:mod:`.linear_experts`, derived on first use); per-expert or fused checkpoints
``linear-experts``         all of those at once
``...-from-fused``         deprecated alias of ``<type>-linear-experts`` (FutureWarning)
=========================  ===========================================================================

:mod:`.support` ships the README's "Linear experts support" table per Transformers release: the model types
measured inexact there are not listed and :func:`get_recipe` refuses them (``UnsupportedExpertsError`` with the
measured reason); :func:`.linear_experts.linear_experts_recipe` still builds any of them, for measuring.

:mod:`.linear_experts.calibration` has :func:`~.linear_experts.calibrate_all_experts` (every expert of the per-expert recipes runs on
every token, for GPTQ/AWQ-style calibration observers).
"""

from __future__ import annotations

import difflib
import functools
import warnings

import transformers

from ..errors import ModelpatchError
from .base import Recipe, RuleSpec
from .fused_qkv.bert import BERT_FUSED_QKV, FusedQKVBertSelfAttention
from .fused_qkv.decoder import FAMILIES as _ATTENTION_FAMILIES
from .fused_qkv.decoder import FUSED_QKV_CLASSES, FusedQKVAttention, fused_qkv_recipe
from .linear_experts import (
    LINEAR_EXPERTS_CLASSES,
    ExpertMLP,
    LinearExperts,
    UnsupportedExpertsError,
    experts_family,
    experts_model_types,
    generic_linear_experts_recipe,
    linear_experts_recipe,
)
from .support import MEASURED_SUPPORTED, MEASURED_UNSUPPORTED

__all__ = [
    "Recipe",
    "RuleSpec",
    "UnknownRecipeError",
    "list_recipes",
    "get_recipe",
    "FusedQKVAttention",
    "FusedQKVBertSelfAttention",
    "LinearExperts",
    "ExpertMLP",
    "FUSED_QKV_CLASSES",
    "LINEAR_EXPERTS_CLASSES",
    "UnsupportedExpertsError",
    "measured_refusal",
    "FULL_EXAMPLE",
]


class UnknownRecipeError(ModelpatchError, KeyError):
    """No recipe of that name (the message lists the known ones)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _build() -> dict[str, Recipe]:
    recipes = [fused_qkv_recipe(f) for f in _ATTENTION_FAMILIES]
    recipes.append(BERT_FUSED_QKV)
    by_name = {r.name: r for r in recipes}
    # the full example (per-expert experts + fused QKV) reads both layouts Transformers writes for
    # qwen2_moe, as the linear-experts recipe does: the Hub's per-expert tensors and the fused experts tensors of
    # save_pretrained(..., save_original_format=False) (reading only the first left the experts at __init__ values)
    full = by_name["qwen2_moe-fused-qkv"] + linear_experts_recipe("qwen2_moe")
    by_name["qwen2_moe-full-example"] = Recipe(
        name="qwen2_moe-full-example",
        description="full example: per-expert experts + fused QKV + Concatenate rule (qwen2_moe)",
        patch_mapping=full.patch_mapping,
        conversion=full.conversion,
        model_types=full.model_types,
    )
    return by_name


_RECIPES = _build()
FULL_EXAMPLE = _RECIPES["qwen2_moe-full-example"]


_EXPERTS_SUFFIX = "-linear-experts"
_FROM_FUSED_SUFFIX = "-linear-experts-from-fused"


def measured_refusal(model_type: str) -> str | None:
    """Why the installed Transformers release's measurement (:mod:`.support`, the README's "Linear experts
    support" table) refuses ``<model_type>-linear-experts``; ``None`` when it does not.

    Refused: a "no" row of the release's column, and a model type without a row whose experts class is that of a
    "no" row (a vision tower or text model of a composite measured inexact). A release with no column was never
    measured: nothing is refused by measurement there.
    """
    release = transformers.__version__
    unsupported = MEASURED_UNSUPPORTED.get(release)
    if unsupported is None:
        return None
    if model_type in unsupported:
        return f"measured on Transformers {release}: {unsupported[model_type]}"
    if model_type in MEASURED_SUPPORTED.get(release, ()):
        return None
    refused = _refused_classes(release)
    for c in experts_family(model_type).classes:
        if (c.module, c.name) in refused:
            other = refused[c.module, c.name]
            return (
                f"not measured on Transformers {release}; its experts class is that of {other!r}, measured: "
                f"{unsupported[other]}"
            )
    return None


@functools.cache
def _refused_classes(release: str) -> dict[tuple[str, str], str]:
    """``{(module, class name): model type of the "no" row}`` of the experts classes of ``release``'s "no" rows."""
    types = set(experts_model_types())
    out: dict[tuple[str, str], str] = {}
    for other in MEASURED_UNSUPPORTED[release]:
        if other in types:
            for c in experts_family(other).classes:
                out.setdefault((c.module, c.name), other)
    return out


def _offered(model_type: str) -> bool:
    return not experts_family(model_type).unsupported and measured_refusal(model_type) is None


def _experts_recipe_names() -> list[str]:
    return [f"{mt}{_EXPERTS_SUFFIX}" for mt in experts_model_types() if _offered(mt)]


def _refuse_measured(model_type: str) -> None:
    why = measured_refusal(model_type)
    if why is not None:
        raise UnsupportedExpertsError(
            f"no linear-experts recipe for {model_type!r} on this Transformers release: {why} (the README's "
            f"linear-experts support table; modelpatch.recipes.linear_experts.linear_experts_recipe({model_type!r}) builds "
            "it anyway, unchecked)"
        )


def _generic_recipe() -> Recipe:
    """``linear-experts`` restricted to the model types offered on their own (:func:`_offered`)."""
    recipe = generic_linear_experts_recipe()
    kept = tuple(mt for mt in recipe.model_types if measured_refusal(mt) is None)
    classes = {c.name for mt in kept for c in experts_family(mt).classes}
    return Recipe(
        name=recipe.name,
        description=recipe.description,
        patch_mapping={k: v for k, v in recipe.patch_mapping.items() if k in classes},
        conversion={k: v for k, v in recipe.conversion.items() if k in kept},
        model_types=kept,
    )


_BUILT: dict[str, Recipe] = {}  # linear-experts recipes, built on first use


def list_recipes() -> list[str]:
    """Names of every recipe, sorted (the linear-experts ones are derived from the installed Transformers)."""
    return sorted({*_RECIPES, "linear-experts", *_experts_recipe_names()})


def _lookup(name: str) -> Recipe | None:
    """The recipe ``name``, building a linear-experts recipe on first use (``None``: no such recipe).

    Raises:
        UnsupportedExpertsError: ``<type>-linear-experts`` of a model type with decorated experts that cannot be
            supported, or that the installed release's measurement found inexact (the message says why).
    """
    if name in _RECIPES:
        return _RECIPES[name]
    if name in _BUILT:
        return _BUILT[name]
    if name == "linear-experts":
        recipe = _generic_recipe()
    elif name.endswith(_FROM_FUSED_SUFFIX) and name[: -len(_FROM_FUSED_SUFFIX)] in experts_model_types():
        replacement = name[: -len("-from-fused")]
        _refuse_measured(replacement.removesuffix(_EXPERTS_SUFFIX))
        warnings.warn(
            f"recipe {name!r} is deprecated: {replacement!r} loads fused and per-expert checkpoints alike (and saves "
            "the layout it loaded); use it instead",
            FutureWarning,
            stacklevel=3,
        )
        return _lookup(replacement)
    elif name.endswith(_EXPERTS_SUFFIX) and name[: -len(_EXPERTS_SUFFIX)] in experts_model_types():
        _refuse_measured(name[: -len(_EXPERTS_SUFFIX)])
        recipe = linear_experts_recipe(name[: -len(_EXPERTS_SUFFIX)])
    else:
        return None
    _BUILT[name] = recipe
    return recipe


def get_recipe(name: str) -> Recipe:
    """The recipe called ``name``; ``"a+b"`` combines recipes.

    ``"<type>-linear-experts-from-fused"`` (deprecated) returns ``"<type>-linear-experts"`` with a
    ``FutureWarning``.

    Raises:
        UnknownRecipeError: no such recipe (the message lists the known names).
        UnsupportedExpertsError: ``"<type>-linear-experts"`` of a model type whose experts cannot be supported, or
            whose recipe the installed release's measurement found inexact (:func:`measured_refusal`, e.g.
            ``laguna``: "logits differ by 1.45e-03"); the message names the measured reason.
    """
    parts = [p.strip() for p in name.split("+")]
    found: list[Recipe | None] = []
    for part in parts:  # a loop, not a comprehension: the FutureWarning of an alias points at the caller
        found.append(_lookup(part))
    missing = [p for p, r in zip(parts, found) if r is None]
    if missing or not parts:
        types = [n.removesuffix(_EXPERTS_SUFFIX) for n in _experts_recipe_names()]
        wrong = missing[0] if missing else name
        close = difflib.get_close_matches(wrong, [*_RECIPES, *_experts_recipe_names()], n=1, cutoff=0.8)
        raise UnknownRecipeError(
            f"unknown recipe {wrong!r}"
            + (f" (did you mean {close[0]!r}?)" if close else "")
            + f"; known: {', '.join(sorted(_RECIPES))}, linear-experts, and <model_type>-linear-experts for "
            f"{', '.join(types)}"
        )
    recipes = [r for r in found if r is not None]
    recipe = recipes[0]
    for other in recipes[1:]:
        recipe = recipe + other
    return recipe
