"""Saving in the original layout: reverse the built-in rules (Transformers), then the user rules (modelpatch).

``save_pretrained`` (through the wrapper of ``revert_weight_conversion`` in :mod:`modelpatch.apply.transformers`) and
:func:`iter_original_state_dict` (weight sync to an inference engine) take the same path: :func:`original_layout`
picks the rules of both stages for the model and :func:`.streaming.iter_reverted` converts group by group;
``save_pretrained`` collects every group in one dict, :func:`iter_original_state_dict` hands them out one by one.

A quantized model that carries conversion state takes :func:`quantized_original_layout` instead (the quantizer's
saved components split by rows where that is exact, else :class:`~.quantized.QuantizedSaveError`), computed by the
``save_pretrained`` wrapper of :mod:`modelpatch.apply.transformers` before anything is written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator

import torch
from transformers import conversion_mapping as _tcm
from transformers import core_model_loading as _tcml
from transformers.utils import logging

from ..errors import ModelpatchTypeError
from ..lazy_imports import pretrained_model_class
from ..undo import UndoStack
from .compose import compose_builtins, resolve_model_rules, rules_fitting_model
from .errors import ConversionError
from .plan import build_plan
from .quantized import QuantizedSaveError, check_reverse_groups, quantized_params, quantizer_label
from .reference import ReferenceShapes
from .state import ConversionState, get_state, set_state
from .streaming import OriginalLayoutIterator, iter_reverted, reversed_user_rules, transformers_conversions
from .wrappers import unmerged_wrappers, unwrapped_names, unwrapped_state_dict, wrapper_bases, wrapper_of
from .zero3 import check_gathered

logger = logging.get_logger("modelpatch.conversion")

__all__ = [
    "revert_to_original_layout",
    "original_layout",
    "iter_original_state_dict",
    "bind_conversion_rules",
    "needs_quantized_original_layout",
    "quantized_original_layout",
    "serving_quantized_state_dict",
]


def original_layout(model, state_dict: dict, *, state: ConversionState | None = None) -> OriginalLayoutIterator:
    """``(name, tensor)`` of ``state_dict`` (keys of ``model``'s layout, tied duplicates already removed) in the
    original layout, one conversion group at a time: what ``revert_weight_conversion`` returns for ``save_pretrained``.

    Stage A reverses Transformers' own rules as Transformers picks them (:func:`.streaming.transformers_conversions`;
    for a model with user rules not loaded by ``from_pretrained``, those the user rules leave in place), stage B the
    user rules: those the model was loaded or built with, else those registered for it whose target layout it has.
    A model that modelpatch reverses and that still holds wrapper modules of a library with a registered view
    (PEFT's LoRA layers, see :mod:`.wrappers`) is reversed without them: the base weights under their own names,
    adapter weights left out, so the result is the original base layout: a warning names the wrappers whose adapters
    are not merged (their adapter tensors are missing from it), an info line says when every wrapper's adapters are
    merged (PEFT's ``merge_adapter()``: the base weights include them).

    ``state``: the conversion state to reverse instead of the model's own (:func:`quantized_original_layout` passes
    one whose recorded shapes also size the quantized components).

    Raises:
        ConversionError: see :func:`.streaming.iter_reverted` (on names: before anything is converted).
    """
    state = get_state(model) if state is None else state
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
        _report_wrappers(model, bases, dropped)
    return iter_reverted(model, state_dict, conversions, state)


def _report_wrappers(model, bases: dict[str, str], dropped: list[str]) -> None:
    """Say what the original layout of a model holding wrappers (PEFT) contains: a warning naming the wrappers whose
    adapters are not merged into their base weights (their adapter tensors are left out), an info line when every
    wrapper's adapters are merged (the base weights include them)."""
    if not dropped:
        return
    where = f"{type(model).__name__} in the original layout (save_pretrained, iter_original_state_dict): "
    unmerged = unmerged_wrappers(model, bases)
    merged = len(bases) - len(unmerged)
    if not unmerged:
        logger.info(
            f"{where}the adapters of the {merged} wrapped module(s) (e.g. by PEFT) are merged: the base weights "
            f"saved in the original layout include them ({len(dropped)} adapter tensor(s) left out, e.g. "
            f"'{dropped[0]}')."
        )
        return
    unmerged_set = set(unmerged)
    left_out = [key for key in dropped if wrapper_of(key, bases) in unmerged_set]
    example = f" (e.g. '{left_out[0]}')" if left_out else ""
    mixed = (
        f" The adapters of the other {merged} wrapped module(s) are merged: their saved base weights include them."
        if merged
        else ""
    )
    logger.warning(
        f"{where}{len(unmerged)} wrapped module(s) (e.g. by PEFT) hold adapters that are not merged (e.g. "
        f"'{unmerged[0]}'); saving their base weights in the original layout without the {len(left_out)} adapter "
        f"tensor(s){example}. Merge the adapters first (merge_adapter() or merge_and_unload()) to save merged "
        f"weights, or save the adapter itself.{mixed}"
    )


def revert_to_original_layout(model, state_dict: dict) -> dict:
    """Wrapper body of ``revert_weight_conversion`` (see :mod:`modelpatch.apply.transformers`): every group of :func:`original_layout`.

    Raises:
        ConversionError: see :func:`original_layout`; ``state_dict`` holds ZeRO-3 partitions
            (:func:`.zero3.check_gathered`)."""
    check_gathered(model, state_dict)
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
        ConversionError: a meta tensor (an offloaded parameter) in the state dict; a ZeRO-3 partition (a
            DeepSpeed ZeRO-3 model outside ``deepspeed.zero.GatheredParameters``); a conversion rule cannot be
            reversed (when called); an operation fails (while iterating).
    """
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    if not isinstance(model, pretrained_model_class()):
        raise ModelpatchTypeError(
            f"iter_original_state_dict takes a transformers PreTrainedModel, got {type(model).__name__} (for a "
            "DDP/FSDP or PEFT wrapper pass the model it wraps: model.module, peft_model.get_base_model())"
        )
    if getattr(model, "_hf_peft_config_loaded", False):
        raise ModelpatchTypeError(
            f"{type(model).__name__} has PEFT adapters loaded through Transformers (model.load_adapter), for which "
            "save_pretrained writes the adapter only; merge them first, or push the adapter itself"
        )
    if state_dict is None and needs_quantized_original_layout(model):
        converted = quantized_original_layout(model)[0]
        return OriginalLayoutIterator(0).feed(iter(list(converted.items())))
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
    check_gathered(model, state_dict)
    state_dict = remove_tied_weights_from_state_dict(state_dict, model)
    return original_layout(model, state_dict)


def bind_conversion_rules(model) -> bool:
    """Attach the user rules in effect now to ``model`` (e.g. one built inside a scoped block), so that
    ``save_pretrained`` writes the original layout even after the block has exited. Only converters whose target
    layout the model has are bound. Models built or loaded inside a block are bound automatically. Returns whether
    any rule was bound."""
    if get_state(model) is not None:
        return True
    resolved = rules_fitting_model(model, resolve_model_rules(model))
    if resolved is None:
        return False
    set_state(model, ConversionState(resolved.rules, resolved.owner))
    return True


# --- quantized models ------------------------------------------------------------------------------------------


def needs_quantized_original_layout(model) -> bool:
    """Whether saving ``model`` in its original layout goes through :func:`quantized_original_layout`: a quantized
    model (``hf_quantizer``, serializable) that carries modelpatch conversion state, without PEFT adapters loaded."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None or get_state(model) is None or getattr(model, "_hf_peft_config_loaded", False):
        return False
    try:
        return bool(quantizer.is_serializable())
    except TypeError:  # older signatures took arguments; let Transformers decide
        return False


def _metadata_for(output: str, source: str, params_by_key: dict, metadata: dict) -> tuple[str, str]:
    param = params_by_key.get(source)
    if param is None:
        entry = metadata.get(source, json.dumps({"_type": "Tensor"}))
        return output, entry
    suffix = param.suffix(source)
    if not output.endswith(suffix):
        raise ConversionError(
            f"'{output}' (from the quantized component '{source}') does not end in '{suffix}': its torchao metadata "
            "cannot be carried over"
        )
    return output[: -len(suffix)] + "." + param.name.rsplit(".", 1)[1], param.metadata or ""


def quantized_original_layout(model) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(state_dict, metadata)`` of a quantized ``model`` in its original checkpoint layout: what
    ``save_pretrained`` writes for it (the modelpatch wrapper of ``save_pretrained`` computes it first, so that a
    refusal leaves the target folder untouched).

    The state dict is the quantizer's (``hf_quantizer.get_state_dict_and_metadata``, else ``model.state_dict()``),
    the saved components of each quantized weight under its module's prefix (torchao ``_weight_qdata``/
    ``_weight_scale``/``_weight_zero_point``, bitsandbytes 8-bit ``weight``/``SCB``/``weight_format``). It goes
    through :func:`original_layout` like a full-precision state dict; a rule that splits a quantized weight's rows
    (the fused ``qkv_proj``) splits each row component with the weight's recorded row counts (exact: one scale per
    output row), and copies bitsandbytes' ``weight_format`` to every piece. torchao's metadata (one entry per
    weight) follows the weights to their original names.

    Raises:
        QuantizedSaveError: a conversion rule takes a quantized weight that cannot be converted exactly (a
            bitsandbytes 4-bit weight, a torchao format other than int8 per row, a rule that stacks or merges
            rather than splits rows); names the parameter, the quantizer and ``save_original_format=False``.
        ConversionError: as :func:`original_layout`.
    """
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    quantizer = model.hf_quantizer
    state = get_state(model)
    if state is None:
        raise ConversionError(f"{type(model).__name__} carries no modelpatch conversion state")
    state_dict, metadata = quantizer.get_state_dict_and_metadata(model)
    metadata = dict(metadata or {})
    state_dict = dict(model.state_dict() if state_dict is None else state_dict)
    for key in model._keys_to_ignore_on_save or ():
        state_dict.pop(key, None)
    state_dict = remove_tied_weights_from_state_dict(state_dict, model)
    params = quantized_params(model, state_dict, metadata)
    label = quantizer_label(quantizer)
    params_by_key = {key: p for p in params.values() for key in p.rows + p.copied}
    copied_keys = {key for p in params.values() for key in p.copied}

    # row counts of every component from the recorded shape of its weight (a split sizes each piece by them)
    recorded = dict(state.recorded_shapes)
    tails = {p.suffix(k): tuple(state_dict[k].shape[1:]) for p in params.values() if p.row_exact for k in p.rows}
    for key, shape in state.recorded_shapes.items():
        if key.endswith(".weight") and len(shape) == 2:
            module = key[: -len(".weight")]
            for suffix, tail in tails.items():
                recorded.setdefault(module + suffix, (shape[0], *tail))
    references = ReferenceShapes(recorded, model)

    # plan over names (meta tensors) to refuse before converting anything, and to map outputs to their sources
    rules, _ = reversed_user_rules(state)
    metas = {
        k: torch.empty(tuple(v.shape), dtype=v.dtype, device="meta")
        for k, v in state_dict.items()
        if k not in copied_keys and isinstance(v, torch.Tensor)
    }
    plan = build_plan(metas.items(), rules, reverse=True)
    names = {k for k in model.state_dict() if k not in metas} | set(metas)
    named = [(k, torch.empty(0, device="meta")) for k in sorted(names)]
    check_reverse_groups(plan, build_plan(named, rules, reverse=True, incomplete=[]), params, label)
    dry = plan.dry_run(references)
    source_of = {id(obj): key for key, obj in metas.items()}
    origin = {name: source_of.get(id(obj), name) for name, obj in plan.passthrough.items()}
    origin.update({name: group.source_keys()[0] for name, (_, _, group) in dry.items()})

    touched = {params_by_key[k].name for g in plan.groups.values() for k in g.source_keys() if k in params_by_key}
    set_aside = {k: state_dict.pop(k) for name in touched for k in params[name].copied}
    augmented = dataclasses.replace(state, recorded_shapes=recorded, save_rows=[])
    result = dict(original_layout(model, state_dict, state=augmented))
    state.save_rows = augmented.save_rows

    for name, (_, _, group) in dry.items():  # bitsandbytes' weight_format, copied to every piece of a split
        param = params_by_key.get(group.source_keys()[0])
        if param is None or not param.copied or name not in result:
            continue
        prefix = name[: -len(param.suffix(group.source_keys()[0]))]
        for key in param.copied:
            result[prefix + param.suffix(key)] = set_aside[key].clone()

    if "tensor_names" in metadata:  # torchao: one metadata entry per weight, under its saved name
        new_metadata: dict[str, str] = {}
        for output in result:
            source = origin.get(output)
            if source is None:
                if output in state_dict or output not in params_by_key:
                    source = output
                else:
                    raise ConversionError(
                        f"'{output}' has no known source: its torchao metadata cannot be carried over"
                    )
            name, entry = _metadata_for(output, source, params_by_key, metadata)
            new_metadata[name] = entry
        new_metadata["tensor_names"] = json.dumps(list(new_metadata))
        metadata = new_metadata
    return result, metadata


@contextlib.contextmanager
def serving_quantized_state_dict(model, state_dict: dict, metadata: dict) -> Iterator[None]:
    """While open, ``model.hf_quantizer.get_state_dict_and_metadata(model)`` returns ``(state_dict, metadata)`` (an
    attribute of that quantizer instance only, removed on exit): how ``save_pretrained`` writes what
    :func:`quantized_original_layout` computed. Raises :class:`QuantizedSaveError` if the model has no quantizer."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        raise QuantizedSaveError("<model>", "none", f"{type(model).__name__} is not quantized")

    def serve(_model):
        return state_dict, dict(metadata)

    with UndoStack() as undo:
        undo.setattr(quantizer, "get_state_dict_and_metadata", serve)  # undo deletes it (the class's method again)
        yield
