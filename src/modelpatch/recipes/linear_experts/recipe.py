"""The recipes of the linear experts: the conversion rules of both checkpoint layouts and the ``Recipe`` objects.

One recipe ``<model_type>-linear-experts`` loads both checkpoint layouts, and saves the one it loaded (the rules
carry alternative :class:`~modelpatch.conversion.Layout` s of one group, see :mod:`modelpatch.conversion.rules`):

* per-expert (``"per-expert"``, the default: the Hub layout, Transformers' default ``save_pretrained``): the
  tensors load directly into the expert linears; the family's built-in renamings (Mixtral's ``block_sparse_moe``
  -> ``mlp``) are kept, the built-in fusion is dropped (``overwrite=True``);
* fused (``"fused"``, ``save_pretrained(..., save_original_format=False)``): ``experts.gate_up_proj`` is transposed
  back if the class stores it transposed (:class:`~modelpatch.conversion.SwapDims`), split into gate and up
  (``Chunk(dim=1)``, or :class:`~modelpatch.conversion.Deinterleave` for alternating columns) and per expert
  (``SplitModulelist(dim=0)``); ``down_proj`` and the biases likewise. On save the rules run backwards.

A model built from a config (nothing loaded) saves the per-expert layout.
"""

from __future__ import annotations

import functools

from ...conversion import (
    Chunk,
    Deinterleave,
    Layout,
    LayoutWeightConverter,
    LayoutWeightRenaming,
    SplitModulelist,
    SwapDims,
)
from ...conversion.rules import as_modelpatch_rule, original_patterns
from ..base import Recipe, RuleSpec
from .discovery import ExpertsFamily, UnsupportedExpertsError, experts_family, experts_model_types, split_builtins
from .layer import LinearExperts, linear_experts_class

__all__ = ["generic_linear_experts_recipe", "linear_experts_recipe"]


def _conversion_rules(family: ExpertsFamily) -> list:
    """The rules of ``family``: Transformers' other rules (renamings of the per-expert layout), then the fused
    layout's converters (see the module docstring)."""
    from transformers import core_model_loading as _tcml

    group = f"{family.model_type}-experts"
    # the default layout (saved by a model built from a config, or loaded from neither layout) is the one
    # Transformers' own save_pretrained writes for the type, so plain Transformers loads it
    hub = family.per_expert_checkpoints
    per_expert, fused = Layout(group, "per-expert", default=hub), Layout(group, "fused", default=not hub)
    _, others, _ = split_builtins(family.model_type)
    rules: list = []
    for rule in others:
        if isinstance(rule, _tcml.PrefixChange):
            continue  # a change of the base-model prefix, which Transformers applies itself
        if type(rule) is _tcml.WeightRenaming:
            sources, targets = original_patterns(rule)
            rules.append(LayoutWeightRenaming(sources, targets, layout=per_expert))
        else:
            rules.append(as_modelpatch_rule(rule))
    flags = family.flags
    swap = [SwapDims(1, 2)] if flags["is_transposed"] else []
    split = Chunk(dim=1) if flags["is_concatenated"] else Deinterleave(dim=1)
    suffixes = ["weight"] + (["bias"] if flags["has_bias"] else [])
    if flags["has_gate"]:
        gate, up, down = family.names
        first, inputs, split_ops = "gate_up_proj", [gate, up], [split]
    else:
        up, down = family.names[-2:]
        first, inputs, split_ops = "up_proj", [up], []
    for suffix in suffixes:
        fused_name = "" if suffix == "weight" else "_bias"
        ops = (swap if suffix == "weight" else []) + split_ops + [SplitModulelist(dim=0)]
        targets = [f"experts.*.{name}.{suffix}" for name in inputs]
        rules.append(LayoutWeightConverter(f"experts.{first}{fused_name}", targets, ops, layout=fused))
        down_ops = (swap if suffix == "weight" else []) + [SplitModulelist(dim=0)]
        rules.append(
            LayoutWeightConverter(
                f"experts.down_proj{fused_name}", f"experts.*.{down}.{suffix}", down_ops, layout=fused
            )
        )
    return rules


def _check_supported(family: ExpertsFamily) -> None:
    if family.unsupported:
        raise UnsupportedExpertsError(f"no linear-experts recipe for {family.model_type!r}: {family.unsupported}")


def linear_experts_recipe(family: ExpertsFamily | str, *, from_fused: bool = False) -> Recipe:
    """The per-expert recipe ``<model_type>-linear-experts`` of ``family`` (an :class:`ExpertsFamily` or a
    ``model_type``): loads per-expert and fused checkpoints alike, saves the layout loaded.

    ``from_fused`` is accepted for old code and changes nothing (the recipe loads both layouts).

    Raises:
        UnsupportedExpertsError: the model type has no decorated experts class, or it cannot be supported (the
            message says why).
    """
    family = experts_family(family) if isinstance(family, str) else family
    _check_supported(family)
    mapping = {c.name: linear_experts_class(family, c) for c in family.classes}
    names = "/".join(family.names)
    return Recipe(
        name=f"{family.model_type}-linear-experts",
        description=f"{', '.join(mapping)} -> ModuleList of per-expert nn.Linear ({names}); per-expert or fused "
        "checkpoints, saved in the layout loaded",
        patch_mapping=mapping,
        conversion={family.model_type: RuleSpec(functools.partial(_conversion_rules, family), overwrite=True)},
        model_types=(family.model_type,),
    )


def generic_linear_experts_recipe() -> Recipe:
    """``linear-experts``: the recipes of every supported model type at once (a model of any of them gets its
    experts replaced and its rules). Derived from source text when called (no modeling module imported)."""
    mapping: dict[str, type[LinearExperts]] = {}
    conversion: dict[str, RuleSpec] = {}
    types = []
    for model_type in experts_model_types():
        family = experts_family(model_type)
        if family.unsupported:
            continue
        if any(c.name in mapping and mapping[c.name].family.names != family.names for c in family.classes):
            continue  # its class is replaced by name for another type that names the linears otherwise: own recipe
        for c in family.classes:
            mapping.setdefault(c.name, linear_experts_class(family, c))
        conversion[model_type] = RuleSpec(functools.partial(_conversion_rules, family), overwrite=True)
        types.append(model_type)
    return Recipe(
        name="linear-experts",
        description="every @use_experts_implementation experts class -> ModuleList of per-expert nn.Linear",
        patch_mapping=mapping,
        conversion=conversion,
        model_types=tuple(types),
    )
