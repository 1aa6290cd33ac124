"""Loading with user rules: plan, validate (before anything is loaded), then hand a lazily converted checkpoint to
Transformers' own loader (``from_pretrained``), or copy it into an existing model (:func:`load_converted_state_dict`).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from transformers import core_model_loading as _tcml
from transformers.utils import logging

from .compose import (
    ResolvedRules,
    compose_builtins,
    has_target_layout,
    layout_settled,
    rules_fitting_model,
    settle_layouts,
)
from .errors import ConversionError, ConversionShapeError
from .plan import Plan, build_plan, shape_of
from .quantized import fix_prequantized_metadata, prepare_prequantized_items, prequantized_companion
from .reference import state_shapes
from .rules import rule_layout
from .state import ConversionState, set_state

__all__ = ["prepare", "convert_and_load", "transformers_renamings"]

logger = logging.get_logger("modelpatch.conversion")


def model_key(name: str, model_keys, base_model_prefix: str) -> str | None:
    """``name`` as a key of the model, adding or removing ``base_model_prefix`` like Transformers does."""
    if name in model_keys:
        return name
    prefix = f"{base_model_prefix}." if base_model_prefix else None
    if prefix and name.startswith(prefix) and name[len(prefix) :] in model_keys:
        return name[len(prefix) :]
    if prefix and prefix + name in model_keys:
        return prefix + name
    return None


def _check_unmatched(plan: Plan, resolved: ResolvedRules, keys) -> None:
    """Warn (strict: raise) for rules that matched no checkpoint key, unless the checkpoint already has the
    layout they convert to (e.g. written by ``modelpatch convert``): such a rule has nothing to do on load and is
    still reversed on save."""
    for rule in resolved.rules:
        if id(rule) in plan.fired or layout_settled(rule, resolved.rules, plan.fired):
            continue  # fired, or the checkpoint is in another of the rule's alternative layouts
        if has_target_layout(rule, keys):
            logger.info(f"Conversion rule {rule!r}: the checkpoint is already in its target layout")
            continue
        name = resolved.owner.get(id(rule))
        scope = f" under '{rule.scope_prefix}'" if rule.scope_prefix else ""
        message = f"Conversion rule {rule!r} (registered as '{name}'){scope} matched no checkpoint key"
        if resolved.strict:
            raise ConversionError(message + " (strict)")
        logger.warning(message)


def _leave_absent_modules_unconverted(plan: Plan, dry: dict, model_shapes: dict, prefix: str) -> None:
    """Groups whose outputs all name parameters the model does not have, while the same rule filled parameters the
    model has (e.g. a checkpoint with more layers than ``num_hidden_layers``), are not converted: their checkpoint
    keys stay unexpected keys, as in a vanilla load. A rule that fills no parameter at all stays an error."""
    outputs = defaultdict(list)
    for name, (_, _, group) in dry.items():
        outputs[id(group)].append((model_key(name, model_shapes, prefix) is not None, group))
    useful_rules = {id(group.rule) for entries in outputs.values() for present, group in entries if present}
    for entries in outputs.values():
        group = entries[0][1]
        if not any(present for present, _ in entries) and id(group.rule) in useful_rules:
            plan.unconvert(group, dry)


def prepare(
    model,
    items,
    resolved: ResolvedRules,
    key_renamings=(),
    keep_unconverted_keys: bool = False,
    quantizer=None,
    model_state=None,
):
    """Plan the conversion of ``items`` (``(key, tensor_like)``) for ``model`` and validate it on meta tensors.

    ``key_renamings`` and ``keep_unconverted_keys`` are passed to :func:`~.engine.build_plan`. ``quantizer``: the
    ``hf_quantizer`` of a pre-quantized load, whose saved components (``<m>._weight_qdata``, ``<m>.SCB``) are
    converted like the weight they belong to (:mod:`.quantized`). ``model_state`` is ``model.state_dict()`` when
    the caller has it. Returns ``(plan, dry, state)`` where ``dry`` maps each converted key to
    ``(shape, dtype, group)``.

    Raises:
        ConversionShapeError: a converted tensor does not fit its parameter (key and both shapes named).
        ConversionError: a rule's converted keys name no parameter of the model, a strict rule matched nothing, or
            an operation cannot be applied. Nothing has been loaded when these are raised.
    """
    model_state = model.state_dict() if model_state is None else model_state
    model_shapes = {k: tuple(v.shape) for k, v in model_state.items()}
    prefix = model.base_model_prefix
    items = list(items)
    if quantizer is not None:
        items = prepare_prequantized_items(items, resolved.rules, quantizer)
    plan = build_plan(items, resolved.rules, key_renamings=key_renamings, keep_unconverted_keys=keep_unconverted_keys)
    _check_unmatched(plan, resolved, [key for key, _ in items])
    references = state_shapes(model_shapes.items(), prefix)
    dry = plan.dry_run(references)
    companions = {}
    if quantizer is not None:  # components of a saved quantized weight: checked against the weight's rows
        for name in dry:
            if model_key(name, model_shapes, prefix) is None:
                param = prequantized_companion(name, quantizer, model_shapes)
                param = param or prequantized_companion(
                    name, quantizer, {k.removeprefix(f"{prefix}.") for k in model_shapes}
                )
                if param is not None:
                    companions[name] = model_key(param, model_shapes, prefix)
    _leave_absent_modules_unconverted(plan, dry, {**model_shapes, **dict.fromkeys(companions)}, prefix)
    for name, (shape, _, group) in dry.items():
        if name in companions:
            rows = model_shapes[companions[name]][0]
            if not shape or shape[0] != rows:
                raise ConversionError(
                    f"{group.rule!r} produced '{name}' of shape {tuple(shape)}, a saved component of "
                    f"'{companions[name]}', which has {rows} rows. Nothing was loaded."
                )
            continue
        key = model_key(name, model_shapes, prefix)
        if key is None:
            raise ConversionError(
                f"{group.rule!r} produced '{name}' (from {list(group.source_keys())}), which is not a parameter of "
                f"{type(model).__name__}. Nothing was loaded."
            )
        if tuple(shape) != model_shapes[key]:
            raise ConversionShapeError(key, shape, model_shapes[key], repr(group.rule))
    recorded = {k: shape_of(o) for g in plan.groups.values() for items_ in g.sources.values() for k, o in items_}
    # also under the name each rule matched (renamed first, e.g. Ling's `.attention.` -> `.self_attn.`): on save the
    # rule runs backwards before the renamings are undone and sizes its pieces by those names
    for group in plan.groups.values():
        for key, name in group.matched_names.items():
            recorded.setdefault(name, recorded[key])
    # reversed on save: the rules that fired, and those whose layout the model has although the checkpoint was
    # already in it (e.g. written by `modelpatch convert`): the model still saves the original layout
    fitting = rules_fitting_model(model, resolved, model_shapes)
    kept = plan.fired | {id(rule) for rule in (fitting.rules if fitting else ())}
    settled = settle_layouts(resolved.rules, kept, plan.fired)  # alternative layouts: the checkpoint's own is saved
    fired = [rule for rule in resolved.rules if id(rule) in settled]
    # the other layouts' rules, which load_state_dict still takes (a fused experts tensor into per-expert Linears)
    others = [r for r in resolved.rules if id(r) not in settled and rule_layout(r) is not None]
    state = ConversionState(fired, resolved.owner, recorded, plan.rows("load", resolved.owner, dry), also_loads=others)
    return plan, dry, state


def transformers_renamings(weight_mapping) -> list:
    """The renamings among the transforms Transformers computed for a load (legacy layouts, ``key_mapping=``)."""
    return [t for t in weight_mapping or [] if isinstance(t, _tcml.WeightRenaming)]


def load_dtypes(dry: dict, model_state: dict, prefix: str, load_config) -> dict:
    """``{converted key: dtype}``: the dtype ``convert_and_load_state_dict_in_model`` casts each converted tensor to,
    where that is its parameter's dtype (no quantizer: a quantizer receives the tensor as Transformers casts it for
    any tensor; no entry of the model's ``dtype_plan``, e.g. ``_keep_in_fp32_modules``, matching it)."""
    if load_config.hf_quantizer is not None:
        return {}
    dtype_plan = load_config.dtype_plan or {}
    special = _tcml.build_glob_alternation(list(dtype_plan))[0] if dtype_plan else None
    dtypes = {}
    for name in dry:
        key = model_key(name, model_state, prefix)
        if key is not None and (special is None or special.search(key) is None):
            dtypes[name] = model_state[key].dtype
    return dtypes


def convert_and_load(model, state_dict, load_config, disk_offload_index, resolved: ResolvedRules, original):
    """``convert_and_load_state_dict_in_model`` with user rules (see :mod:`modelpatch.apply.transformers`): ``state_dict`` holds the lazily
    opened checkpoint (safetensors slices or tensors); converted keys are replaced by :class:`LazyConverted`
    placeholders and ``original`` does the loading, with the built-in rules the user rules do not replace.

    With a quantizer, converted tensors go through it exactly like unconverted ones: on-the-fly quantization runs
    on the converted tensor (Transformers' ``needs_quantization`` on the converted key); a pre-quantized checkpoint's
    components are converted per component (row concatenation only, see :mod:`.quantized`) and then deserialized
    by the quantizer under the converted name."""
    builtins = compose_builtins(model, list(load_config.weight_mapping or []), resolved)
    quantizer = load_config.hf_quantizer
    quantizer = quantizer if quantizer is not None and quantizer.pre_quantized else None
    model_state = model.state_dict()
    plan, dry, state = prepare(
        model,
        state_dict.items(),
        resolved,
        transformers_renamings(builtins),
        True,
        quantizer=quantizer,
        model_state=model_state,
    )
    if quantizer is not None:
        fix_prequantized_metadata(quantizer, dry, plan.renamed)
    converted = dict(plan.passthrough)
    # the loader's own file handles; fused outputs are read straight into their parameter's dtype
    cast = load_dtypes(dry, model_state, model.base_model_prefix, load_config)
    converted.update(plan.lazy_outputs(dry, release_mapped_sources=True, cast=cast))
    result = original(model, converted, dataclasses.replace(load_config, weight_mapping=builtins), disk_offload_index)
    set_state(model, state)
    return result
