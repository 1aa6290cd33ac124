"""Loading a checkpoint or state dict into an existing patched model outside ``from_pretrained``."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers import core_model_loading as _tcml

from ..errors import ModelpatchTypeError
from .compose import ResolvedRules, compose_builtins, has_target_layout, overlaps, resolve_model_rules
from .errors import ConversionError, ConversionShapeError
from .io import open_checkpoint
from .loading import model_key, prepare, transformers_renamings
from .plan import ConversionRow, LazyConverted, load_tensor, shape_of
from .rules import as_modelpatch_rule
from .state import get_state, set_state

__all__ = ["load_converted_state_dict", "resolve_transforms", "builtin_transforms"]


def resolve_transforms(model, rules) -> tuple[ResolvedRules, list]:
    """The rules to apply and Transformers' own key renamings for ``model`` (applied before the rules)."""
    if isinstance(rules, Mapping):
        raise ModelpatchTypeError(
            "load_converted_state_dict(rules=...) takes a list of rules; for {name: [rules]} open "
            "apply_conversion_rules({...}) around the call (or register them)"
        )
    if rules is not None:
        resolved = ResolvedRules()
        for rule in rules:
            rule = as_modelpatch_rule(rule)
            resolved.rules.append(rule)
            resolved.owner[id(rule)] = None
        return resolved, []
    state = get_state(model)
    if state is not None:
        resolved = ResolvedRules(list(state.rules), dict(state.owner))
    else:
        resolved = resolve_model_rules(model) or ResolvedRules()
    converters, renamings = builtin_transforms(model, resolved)
    for rule in converters:
        resolved.rules.append(rule)
        resolved.owner[id(rule)] = None
    return resolved, renamings


def builtin_transforms(model, user: ResolvedRules) -> tuple[list, list]:
    """Transformers' own transforms for ``model`` (what ``from_pretrained`` applies) that no user rule replaces:
    converters whose targets exist in the model (e.g. per-expert checkpoint tensors merged into a fused experts
    parameter), as modelpatch rules, and renamings (legacy layouts), as they are."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    names = list(model.state_dict())
    converters = []
    builtins = compose_builtins(model, get_model_conversion_mapping(model), user)
    renamings = transformers_renamings(builtins)
    for builtin in builtins:
        if isinstance(builtin, _tcml.WeightRenaming) or any(overlaps(builtin, rule) for rule in user.rules):
            continue
        if not has_target_layout(builtin, names):
            continue  # the model does not have the fused layout this built-in produces (e.g. per-expert experts)
        try:
            rule = as_modelpatch_rule(builtin)
        except TypeError:
            raise ConversionError(
                f"Transformers' built-in rule {builtin!r} for {type(model).__name__} cannot be applied outside "
                "from_pretrained; pass rules= explicitly"
            ) from None
        rule.scope_prefix = builtin.scope_prefix
        converters.append(rule)
    return converters, renamings


def _check_readable(plan, targets: dict) -> None:
    """Refuse data that cannot be read (meta tensors, e.g. the ``state_dict()`` of a disk-offloaded model) before
    anything is written."""
    sources = [(k, o) for g in plan.groups.values() for items in g.sources.values() for k, o in items]
    sources += [(k, o) for k, o in targets.items() if not isinstance(o, LazyConverted)]
    for key, obj in sources:
        if isinstance(obj, torch.Tensor) and obj.is_meta:
            raise ConversionError(f"'{key}' has no data (a meta tensor). The model was not modified.")


def load_converted_state_dict(model, state_dict_or_path, *, rules=None, strict: bool = True) -> list[ConversionRow]:
    """Convert a checkpoint or state dict with the model's conversion rules and copy it into ``model`` in place
    (Trainer resume, manual ``load_state_dict``), so no path silently skips conversion.

    Args:
        model: a (patched) ``PreTrainedModel`` with materialised parameters.
        state_dict_or_path: ``{key: Tensor}`` in checkpoint layout, a ``.safetensors`` file, or a folder with
            ``model.safetensors`` / ``model.safetensors.index.json`` (read lazily, tensor by tensor).
        rules: rules to apply; default: the rules the model was loaded with, else the rules registered for it,
            plus Transformers' built-in rules for the model that those do not replace (as ``from_pretrained``).
        strict: raise if a model parameter is not provided or a key is left over.

    Returns:
        The report rows (also available from :func:`conversion_report`).

    Raises:
        ConversionShapeError: a (converted) tensor does not fit its parameter.
        ConversionError: missing/unexpected keys (``strict``), a rule that cannot be applied, a meta tensor.
        TypeError: ``rules`` is a dict (it takes a list).
        Keys, shapes and readability are checked before the first parameter is written: on those errors the
        model is unchanged.
    """
    resolved, renamings = resolve_transforms(model, rules)
    base_prefix = model.base_model_prefix
    opened_here = not isinstance(state_dict_or_path, dict)
    with open_checkpoint(state_dict_or_path) as items:
        plan, dry, state = prepare(model, items.items(), resolved, renamings)
        converted = dict(plan.passthrough)
        converted.update(plan.lazy_outputs(dry, release_mapped_sources=opened_here))
        model_state = model.state_dict()
        targets, unexpected = {}, []
        for name, obj in converted.items():
            key = model_key(name, model_state, base_prefix)
            if key is None:
                unexpected.append(name)
                continue
            if tuple(shape_of(obj)) != tuple(model_state[key].shape):
                raise ConversionShapeError(key, shape_of(obj), model_state[key].shape, "no rule (unconverted key)")
            targets[key] = obj
        loaded_ptrs = {model_state[k].data_ptr() for k in targets}
        missing = [k for k in model_state if k not in targets and model_state[k].data_ptr() not in loaded_ptrs]
        _check_readable(plan, targets)
        if strict and (missing or unexpected):
            raise ConversionError(
                f"Cannot load into {type(model).__name__}: missing keys {missing[:10]}"
                f"{' ...' if len(missing) > 10 else ''}, unexpected keys {unexpected[:10]}"
                f"{' ...' if len(unexpected) > 10 else ''}. The model was not modified."
            )
        with torch.no_grad():
            for key, obj in targets.items():
                model_state[key].copy_(load_tensor(obj))
    previous = get_state(model)
    if previous is not None and rules is None:
        state.recorded_shapes = {**previous.recorded_shapes, **state.recorded_shapes}
    set_state(model, state)
    return list(state.load_rows)
