"""Saving in the original layout: reverse the built-in rules (Transformers), then the user rules (modelpatch).

``save_pretrained`` (through the wrapper of ``revert_weight_conversion`` in :mod:`.hooks`) and
:func:`iter_original_state_dict` (weight sync to an inference engine) take the same path: :func:`original_layout`
picks the rules of both stages for the model and :func:`.streaming.iter_reverted` converts group by group;
``save_pretrained`` collects every group in one dict, :func:`iter_original_state_dict` hands them out one by one.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel
from transformers import conversion_mapping as _tcm
from transformers import core_model_loading as _tcml
from transformers.utils import logging

from ..errors import ModelpatchTypeError
from .compose import compose_builtins, resolve_model_rules, rules_fitting_model
from .errors import ConversionError
from .state import ConversionState, get_state
from .streaming import OriginalLayoutIterator, iter_reverted, transformers_conversions
from .wrappers import unwrapped_names, unwrapped_state_dict, wrapper_bases

logger = logging.get_logger("modelpatch.conversion")

__all__ = ["revert_to_original_layout", "original_layout", "iter_original_state_dict", "bind_conversion_rules"]


def original_layout(model, state_dict: dict) -> OriginalLayoutIterator:
    """``(name, tensor)`` of ``state_dict`` (keys of ``model``'s layout, tied duplicates already removed) in the
    original layout, one conversion group at a time: what ``revert_weight_conversion`` returns for ``save_pretrained``.

    Stage A reverses Transformers' own rules as Transformers picks them (:func:`.streaming.transformers_conversions`;
    for a model with user rules not loaded by ``from_pretrained``, those the user rules leave in place), stage B the
    user rules: those the model was loaded or built with, else those registered for it whose target layout it has.
    A model that modelpatch reverses and that still holds wrapper modules of a library with a registered view
    (PEFT's LoRA layers, see :mod:`.wrappers`) is reversed without them: the base weights under their own names,
    adapter weights left out (a warning says how many), so the result is the original base layout.

    Raises:
        ConversionError: see :func:`.streaming.iter_reverted` (on names: before anything is converted).
    """
    state = get_state(model)
    conversions = None
    bases: dict[str, str] = {}
    if state is None:
        resolved = resolve_model_rules(model)
        if resolved is not None:
            bases = wrapper_bases(model)
            names = unwrapped_names(model.state_dict(), bases)
            resolved = rules_fitting_model(model, resolved, names)
        if resolved is None:
            return iter_reverted(model, state_dict, transformers_conversions(model), None)
        state = ConversionState(resolved.rules, resolved.owner)
        conversions = getattr(model, "_weight_conversions", None)
        if conversions is None:
            builtins = _tcm.get_model_conversion_mapping(model, add_legacy=False)
            builtins = [b for b in builtins if not isinstance(b, _tcml.PrefixChange)]
            conversions = compose_builtins(model, builtins, resolved)
    else:
        bases = wrapper_bases(model)
        conversions = transformers_conversions(model)
    if bases:
        state_dict, dropped = unwrapped_state_dict(state_dict, bases)
        if dropped:
            logger.warning(
                f"{type(model).__name__} in the original layout (save_pretrained, iter_original_state_dict): "
                f"{len(bases)} module(s) are wrapped (e.g. by PEFT); saving their base weights in the original layout without the {len(dropped)} adapter tensor(s) (e.g. "
                f"'{dropped[0]}'). Merge the adapters first (merge_and_unload()) to save merged weights, or save "
                "the adapter itself."
            )
    return iter_reverted(model, state_dict, conversions, state)


def revert_to_original_layout(model, state_dict: dict) -> dict:
    """Wrapper body of ``revert_weight_conversion`` (see :mod:`.hooks`): every group of :func:`original_layout`."""
    return dict(original_layout(model, state_dict))


def iter_original_state_dict(model, state_dict: dict | None = None) -> OriginalLayoutIterator:
    """Yield ``(name, tensor)`` of ``model`` in the original checkpoint layout, one conversion group at a time: the
    weights an inference engine loads, for pushing trained weights to it after each step of an RL loop.

    The union of what it yields is what ``model.save_pretrained(dir)`` writes, bit for bit (same names, equal
    tensors): it takes the state dict as ``save_pretrained`` does (``hf_quantizer.get_state_dict_and_metadata``
    for a quantized model, ``_keys_to_ignore_on_save`` dropped, tied duplicates removed with Transformers'
    ``remove_tied_weights_from_state_dict``) and goes through the same conversion (:func:`original_layout`, which
    ``save_pretrained`` reaches through the wrapper of ``revert_weight_conversion``): Transformers' built-in reverse
    (e.g. fused experts split per expert), then the model's own rules (e.g. a fused ``qkv_proj`` split back). A
    tensor no rule touches is yielded as the state dict's own (detached, no copy; it shares memory with the
    parameter, so copy it before the next optimizer step if it must not change); a converted one is a new tensor,
    contiguous. The generator keeps no tensor it has yielded: the extra memory at any moment is the outputs of one
    group (one layer's fused QKV, one experts tensor), whatever the model's size. Each tensor has its parameter's
    device and dtype.

    Names and groups are planned when this function is called (errors in the rules surface then); a group is
    converted when its first tensor is requested, so a parameter changed after the call but before its group's
    turn is yielded as changed. Do not change the model's structure while iterating. The report rows of the user
    rules are those of :func:`~modelpatch.conversion_report` after the iterator is exhausted.

    Idea from miles' ``WeightBridge``, which streams each fused parameter through Transformers'
    ``revert_weight_conversion``; here the conversion groups are those of ``save_pretrained`` itself.

    Args:
        model: a ``PreTrainedModel`` (unwrap DDP/FSDP wrappers first: ``model.module``).
        state_dict: the model-layout state dict to convert instead of ``model.state_dict()`` (e.g. full tensors
            gathered from a sharded model); ``_keys_to_ignore_on_save`` and tied duplicates are removed from it as
            ``save_pretrained`` removes them.

    Returns:
        An iterator of ``(name, tensor)`` (original-layout key and tensor, each name once) whose ``groups`` and
        ``converted`` attributes count the conversion groups planned and converted so far.

    Raises:
        ModelpatchTypeError: ``model`` is not a ``PreTrainedModel``, or it has PEFT adapters loaded through
            Transformers (``model.load_adapter``), for which ``save_pretrained`` writes the adapter only.
        ConversionError: a meta tensor (an offloaded parameter) in the state dict; a conversion rule cannot be
            reversed (when called); an operation fails (while iterating).
    """
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    if not isinstance(model, PreTrainedModel):
        raise ModelpatchTypeError(
            f"iter_original_state_dict takes a transformers PreTrainedModel, got {type(model).__name__} (for a "
            "DDP/FSDP or PEFT wrapper pass the model it wraps: model.module, peft_model.get_base_model())"
        )
    if getattr(model, "_hf_peft_config_loaded", False):
        raise ModelpatchTypeError(
            f"{type(model).__name__} has PEFT adapters loaded through Transformers (model.load_adapter), for which "
            "save_pretrained writes the adapter only; merge them first, or push the adapter itself"
        )
    if state_dict is None:
        quantizer = getattr(model, "hf_quantizer", None)
        state_dict = quantizer.get_state_dict_and_metadata(model)[0] if quantizer is not None else None
        state_dict = dict(model.state_dict() if state_dict is None else state_dict)
    else:
        state_dict = dict(state_dict)
    for key in model._keys_to_ignore_on_save or ():
        state_dict.pop(key, None)
    for key, tensor in state_dict.items():
        if isinstance(tensor, torch.Tensor) and tensor.is_meta:
            raise ConversionError(
                f"'{key}' has no data (a meta tensor, e.g. an offloaded parameter); pass state_dict= with its data"
            )
    state_dict = remove_tied_weights_from_state_dict(state_dict, model)
    return original_layout(model, state_dict)


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
