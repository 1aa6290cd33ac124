"""Saving in the original layout: reverse the built-in rules (Transformers), then the user rules (modelpatch)."""

from __future__ import annotations

from transformers import conversion_mapping as _tcm
from transformers import core_model_loading as _tcml
from transformers.utils import logging

from .compose import compose_builtins, resolve_model_rules, rules_fitting_model
from .plan import build_plan
from .reference import ReferenceShapes
from .state import ConversionState, get_state
from .wrappers import unwrapped_names, unwrapped_state_dict, wrapper_bases

logger = logging.get_logger("modelpatch.conversion")

__all__ = ["revert_to_original_layout", "reverse_state_dict"]


def reverse_state_dict(model, state_dict: dict, state: ConversionState) -> dict:
    """Apply the inverse of ``state.rules`` to a ``{model key: tensor}`` dict; returns the checkpoint-layout dict.

    Split sizes come from the shapes recorded at load, else from the vanilla model (see :mod:`.reference`).

    Raises:
        ConversionError: a fused tensor cannot be split back unambiguously, or a group is incomplete.
    """
    # Converters keep their load priority (the rule that won a key at load wins it back); renamings undo in reverse.
    converters = [r for r in state.rules if isinstance(r, _tcml.WeightConverter)]
    renamings = [r for r in state.rules if not isinstance(r, _tcml.WeightConverter)]
    reversed_rules, owner = [], {}
    for rule in converters + renamings[::-1]:
        reverse = rule.reverse_transform()
        reversed_rules.append(reverse)
        owner[id(reverse)] = state.owner.get(id(rule))
    plan = build_plan(state_dict.items(), reversed_rules, reverse=True)
    result = plan.convert_all(ReferenceShapes(state.recorded_shapes, model))
    state.save_rows = plan.rows("save", owner, plan.produced)
    return result


def revert_to_original_layout(model, state_dict: dict, original) -> dict:
    """Wrapper body of ``revert_weight_conversion`` (see :mod:`.hooks`).

    A model that modelpatch reverses and that still holds wrapper modules of a library with a registered view
    (PEFT's LoRA layers, see :mod:`.wrappers`) is saved without them: the base weights under their own names,
    adapter weights left out (a warning says how many), so the checkpoint is the original base layout.
    """
    state = get_state(model)
    restore = False
    bases: dict[str, str] = {}
    if state is None:
        resolved = resolve_model_rules(model)
        if resolved is not None:
            bases = wrapper_bases(model)
            names = unwrapped_names(model.state_dict(), bases)
            resolved = rules_fitting_model(model, resolved, names)
        if resolved is None:
            return original(model, state_dict)
        state = ConversionState(resolved.rules, resolved.owner)
        if getattr(model, "_weight_conversions", None) is None:
            builtins = _tcm.get_model_conversion_mapping(model, add_legacy=False)
            builtins = [b for b in builtins if not isinstance(b, _tcml.PrefixChange)]
            model._weight_conversions = compose_builtins(model, builtins, resolved)
            restore = True
    else:
        bases = wrapper_bases(model)
    if bases:
        state_dict, dropped = unwrapped_state_dict(state_dict, bases)
        if dropped:
            logger.warning(
                f"{type(model).__name__}.save_pretrained: {len(bases)} module(s) are wrapped (e.g. by PEFT); saving "
                f"their base weights in the original layout without the {len(dropped)} adapter tensor(s) (e.g. "
                f"'{dropped[0]}'). Merge the adapters first (merge_and_unload()) to save merged weights, or save "
                "the adapter itself."
            )
    try:
        state_dict = original(model, state_dict)
    finally:
        if restore:
            model._weight_conversions = None
    return reverse_state_dict(model, state_dict, state)


def bind_conversion_rules(model) -> bool:
    """Attach the user rules in effect now to ``model`` (e.g. one built inside a scoped block), so that
    ``save_pretrained`` writes the original layout even after the block has exited. Only converters whose target
    layout the model has are bound. Models built or loaded inside a block are bound automatically. Returns whether
    any rule was bound."""
    from .state import set_state

    if get_state(model) is not None:
        return True
    resolved = rules_fitting_model(model, resolve_model_rules(model))
    if resolved is None:
        return False
    set_state(model, ConversionState(resolved.rules, resolved.owner))
    return True
