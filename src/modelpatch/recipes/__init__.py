"""Ready-made recipes: a patch mapping plus the conversion rules it needs, applied with one call or one block.

>>> from modelpatch.recipes import get_recipe, list_recipes
>>> with get_recipe("llama-fused-qkv").apply():
...     model = AutoModelForCausalLM.from_pretrained(path)   # q/k/v fused, weights converted
>>> model.save_pretrained(out)                                 # written in the original layout

``list_recipes()`` names them all; ``recipe_a + recipe_b`` applies both (the founding document's full example is
``get_recipe("qwen2_moe-full-example")``: fused QKV attention + per-expert linear experts + a ``Concatenate`` rule,
built-in expert fusion dropped). :mod:`.base` defines :class:`Recipe` and :class:`RuleSpec`; the recipes:

=========================  ===========================================================================
``<type>-fused-qkv``       llama, mistral, qwen2, qwen2_moe, qwen3 (:mod:`.attention`); bert (:mod:`.bert`)
``<type>-linear-experts``  qwen2_moe, qwen3_moe, mixtral, olmoe, deepseek_v3 (:mod:`.experts`); Hub layout
``...-from-fused``         the same for checkpoints saved in Transformers' fused experts layout
=========================  ===========================================================================

:mod:`.calibration` has :func:`~.calibration.calibrate_all_experts` (every expert of the per-expert recipes runs on
every token, for GPTQ/AWQ-style calibration observers).
"""

from __future__ import annotations

from ..errors import ModelpatchError
from .attention import FAMILIES as _ATTENTION_FAMILIES
from .attention import FUSED_QKV_CLASSES, FusedQKVAttention, fused_qkv_recipe
from .base import Recipe, RuleSpec
from .bert import BERT_FUSED_QKV, FusedQKVBertSelfAttention
from .experts import FAMILIES as _EXPERTS_FAMILIES
from .experts import LINEAR_EXPERTS_CLASSES, ExpertMLP, LinearExperts, linear_experts_recipe

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
    "FULL_EXAMPLE",
]


class UnknownRecipeError(ModelpatchError, KeyError):
    """No recipe of that name (the message lists the known ones)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _build() -> dict[str, Recipe]:
    recipes = [fused_qkv_recipe(f) for f in _ATTENTION_FAMILIES]
    recipes.append(BERT_FUSED_QKV)
    recipes += [linear_experts_recipe(f, from_fused=fused) for f in _EXPERTS_FAMILIES for fused in (False, True)]
    by_name = {r.name: r for r in recipes}
    full = by_name["qwen2_moe-fused-qkv"] + by_name["qwen2_moe-linear-experts"]
    by_name["qwen2_moe-full-example"] = Recipe(
        name="qwen2_moe-full-example",
        description="founding document's full example: per-expert experts + fused QKV + Concatenate rule (qwen2_moe)",
        patch_mapping=full.patch_mapping,
        conversion=full.conversion,
        model_types=full.model_types,
    )
    return by_name


_RECIPES = _build()
FULL_EXAMPLE = _RECIPES["qwen2_moe-full-example"]


def list_recipes() -> list[str]:
    """Names of every recipe, sorted."""
    return sorted(_RECIPES)


def get_recipe(name: str) -> Recipe:
    """The recipe called ``name``; ``"a+b"`` combines recipes.

    Raises:
        UnknownRecipeError: no such recipe (the message lists the known names).
    """
    parts = [p.strip() for p in name.split("+")]
    missing = [p for p in parts if p not in _RECIPES]
    if missing or not parts:
        raise UnknownRecipeError(
            f"unknown recipe {missing[0] if missing else name!r}; known: {', '.join(list_recipes())}"
        )
    recipe = _RECIPES[parts[0]]
    for part in parts[1:]:
        recipe = recipe + _RECIPES[part]
    return recipe
