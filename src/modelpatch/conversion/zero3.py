"""DeepSpeed ZeRO-3: loading a patched model that ``from_pretrained`` builds under ``deepspeed.zero.Init``.

With ZeRO-3 switched on before the load (``TrainingArguments(deepspeed=...)``, or ``HfDeepSpeedConfig``),
``from_pretrained`` builds the model under ``deepspeed.zero.Init`` (every parameter partitioned as soon as its module
is built: ``param.shape`` is ``(0,)``, the real shape is ``param.ds_shape``) and loads it with Transformers' own
ZeRO-3 loader, ``_load_state_dict_into_zero3_model``, instead of ``convert_and_load_state_dict_in_model``: only rank
0 reads the checkpoint values (the other ranks get ``meta`` tensors of the same shapes), and each module's
parameters are gathered, filled on rank 0 and partitioned again. That loader silently drops checkpoint keys the
model does not have and re-initialises the parameters it did not fill.

:func:`convert_checkpoint` converts the checkpoint with the model's user rules before that loader runs (on rank 0
on the real tensors, on the other ranks on the meta tensors, so every rank has the same keys and shapes), leaving the
built-in transforms the user rules do not replace to the loader, and returns the keys the loader will not read, so
that :func:`~.unloaded.check_replacements_loaded` refuses a replacement left with ``__init__`` values exactly as after
a plain load. :func:`tensor_shape` reads the full shape of a partitioned parameter (reference modules that recipes
build on the ``meta`` device to read shapes are partitioned too).
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import core_model_loading as _tcml

from .compose import ResolvedRules, compose_builtins, transforms_in_force
from .errors import ConversionError
from .loading import model_key, prepare, transformers_renamings
from .state import ConversionState  # noqa: F401 - named in docstrings

__all__ = ["tensor_shape", "zero3_state_shapes", "convert_checkpoint", "unread_keys", "ZeroLoadInfo", "check_gathered"]


def tensor_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The full shape of ``tensor``: ``ds_shape`` for a ZeRO-3 partitioned parameter, else ``tensor.shape``."""
    shape = getattr(tensor, "ds_shape", None)
    return tuple(tensor.shape if shape is None else shape)


def zero3_state_shapes(model) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` as ``meta`` tensors of the full shapes (``ds_shape`` of partitioned parameters)."""
    return {
        k: torch.empty(tensor_shape(v), dtype=v.dtype, device="meta")
        for k, v in model.state_dict(keep_vars=True).items()
    }


@dataclasses.dataclass
class ZeroLoadInfo:
    """What the ZeRO-3 loader did not fill (``missing_keys``) or read (``unexpected_keys``), in the shape of
    Transformers' ``LoadStateDictInfo`` that :func:`~.unloaded.check_replacements_loaded` reads."""

    missing_keys: set
    unexpected_keys: set
    mismatched_keys: set = dataclasses.field(default_factory=set)


def unread_keys(model, keys, transforms: list, model_state: dict) -> set[str]:
    """The keys of ``keys`` that Transformers' ZeRO-3 loader drops: after the renamings and converters of
    ``transforms`` (as ``_apply_weight_conversions_to_state_dict`` applies them), not a key of the model, with or
    without its ``base_model_prefix``."""
    renamings = [t for t in transforms if isinstance(t, _tcml.WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, _tcml.WeightConverter)]
    prefix = model.base_model_prefix
    # renaming records on the transforms what it saw (`_was_used`, read on save; a group renaming's `_active`):
    # this look-ahead must leave them as the loader will find them
    saved = [(t, {a: getattr(t, a) for a in ("_was_used", "_active") if hasattr(t, a)}) for t in transforms]
    unread = set()
    try:
        for key in keys:
            renamed, _ = _tcml.rename_source_key(
                key, renamings, converters, base_model_prefix=prefix, meta_state_dict=model_state
            )
            if model_key(renamed, model_state, prefix) is None:
                unread.add(key)
    finally:
        for transform, attributes in saved:
            for name, value in attributes.items():
                setattr(transform, name, value)
    return unread


def convert_checkpoint(model, state_dict: dict, load_config, resolved: ResolvedRules):
    """Convert ``state_dict`` (the checkpoint as Transformers' ZeRO-3 path read it: real tensors on rank 0, ``meta``
    tensors elsewhere) to ``model``'s layout with the user rules ``resolved``, validated first on meta tensors
    against the full (``ds_shape``) parameter shapes.

    Returns ``(converted, load_config, state)``: the state dict to hand to ``_load_state_dict_into_zero3_model``
    (converted keys eagerly converted, group by group, their sources released; other keys unchanged), the load
    config with only the built-in transforms the user rules leave in place and whose target layout the model has
    (that loader sends every key a converter matches to the converter's target: a built-in expert fusion would
    take the per-expert keys of per-expert Linears away from them), and the :class:`ConversionState` to
    bind to the model once loaded.

    Raises:
        ConversionError, ConversionShapeError: as :func:`.loading.prepare` (nothing loaded).
    """
    mapping = list(getattr(load_config, "weight_mapping", None) or []) if load_config is not None else []
    model_state = zero3_state_shapes(model)
    builtins = transforms_in_force(compose_builtins(model, mapping, resolved), model_state)
    plan, dry, state = prepare(
        model, state_dict.items(), resolved, transformers_renamings(builtins), True, model_state=model_state
    )
    converted = dict(plan.passthrough)
    for group in list(plan.groups.values()):
        converted.update(plan.convert_group(group, plan.references))
        group.sources.clear()  # the checkpoint tensors of this group are no longer needed
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        converted = _WithMetadata(converted)
        converted._metadata = metadata
    if load_config is not None:
        load_config = dataclasses.replace(load_config, weight_mapping=builtins)
    return converted, load_config, state


class _WithMetadata(dict):
    """A dict that can carry ``_metadata`` (``torch.load``'s per-module versions) like the one it replaces."""

    _metadata: dict


def check_gathered(model, state_dict: dict) -> None:
    """Refuse a state dict that holds ZeRO-3 partitions of ``model``'s parameters (``param.shape`` ``(0,)`` or a
    slice, outside ``deepspeed.zero.GatheredParameters``) instead of the full tensors: converted to the original
    layout they would be empty or wrong.

    Raises:
        ConversionError: naming the parameters (up to 4) whose tensor is not of their full ``ds_shape``.
    """
    full = {k: tensor_shape(p) for k, p in model.named_parameters() if getattr(p, "ds_shape", None) is not None}
    if not full:
        return
    partial = [
        k for k, v in state_dict.items() if k in full and isinstance(v, torch.Tensor) and tuple(v.shape) != full[k]
    ]
    if partial:
        raise ConversionError(
            f"{len(partial)} tensor(s) of the state dict are DeepSpeed ZeRO-3 partitions, not full parameters: "
            f"{', '.join(partial[:4])}{' ...' if len(partial) > 4 else ''} (e.g. '{partial[0]}' has shape "
            f"{tuple(state_dict[partial[0]].shape)}, its parameter {full[partial[0]]}). Gather them first: "
            "`with deepspeed.zero.GatheredParameters(list(model.parameters())):`, or pass the consolidated state "
            "dict (the Trainer does with stage3_gather_16bit_weights_on_model_save)."
        )
