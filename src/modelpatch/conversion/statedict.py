"""``model.load_state_dict`` in both layouts, for every model that carries conversion rules.

A patched model's ``save_pretrained`` writes the original (checkpoint) layout, and every loader that reads such a
checkpoint back into a live model goes through ``nn.Module.load_state_dict``: the Trainer's
``resume_from_checkpoint`` and ``load_best_model_at_end`` (``load_state_dict(state_dict, False)`` and
``load_sharded_checkpoint``, one shard at a time), accelerate, hand-written resume code. Without help those loads
report the converted parameters missing (``qkv_proj``) and the sources unexpected (``q_proj``/``k_proj``/``v_proj``)
in a log line, and keep the old values: a silently wrong model.

So a model that carries conversion state (:mod:`.state`: loaded or built with rules, bound, or patched in place)
gets two hooks of ``torch.nn.Module``, registered on the instance (they follow it through ``copy.deepcopy``):

* a *pre-hook* converts the keys of the incoming state dict that are not keys of the model through the same rules,
  operations and reference shapes as :func:`~modelpatch.conversion.load_converted_state_dict` (the model's rules,
  then Transformers' built-in converters they leave in place, after Transformers' renamings). Keys already in the
  model's layout pass through untouched, so both layouts, and a mix, load; ``strict=True`` works as usual.
  A group whose sources arrive in different calls (``load_sharded_checkpoint`` loads one shard at a time) is kept
  on the instance until its last source arrives; meanwhile its missing sources are reported as missing keys (so
  ``strict=True`` raises naming them; torch gives hooks no ``strict`` flag).
* a *post-hook* reports missing keys in the layout the caller used: when the state dict was in the original layout,
  a missing ``qkv_proj.weight`` is reported as its ``q_proj``/``k_proj``/``v_proj`` sources.

``model.state_dict()`` is unchanged (the model's own layout: optimizers, FSDP and DDP depend on it).
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import ConversionError, ConversionShapeError
from .loading import model_key
from .manual import _resolve
from .plan import build_plan
from .reference import ReferenceShapes, state_shapes
from .state import ConversionState, add_state_listener, get_state

__all__ = ["install_state_dict_hooks", "remove_state_dict_hooks", "has_state_dict_hooks"]

_PENDING_ATTR = "_modelpatch_pending_sources"  # {group key: {checkpoint key: tensor}} of groups missing a source
_CALLER_LAYOUT_ATTR = "_modelpatch_loaded_prefixes"  # prefixes of the loads in progress that used original keys


def _convert_original_layout(
    module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
) -> None:
    """``load_state_dict`` pre-hook: replace original-layout keys of ``state_dict`` (under ``prefix``) by the model's
    converted keys, in place (``torch`` passes a copy of the caller's dict)."""
    state = get_state(module)
    if state is None:
        return
    own = {name: tensor for name, tensor in module.state_dict(keep_vars=True).items()}
    base = module.base_model_prefix
    foreign = [key for key in state_dict if key.startswith(prefix) and model_key(key[len(prefix) :], own, base) is None]
    pending: dict = module.__dict__.get(_PENDING_ATTR) or {}
    # a held group whose parameter now arrives in the model's own layout is superseded
    pending = {target: sources for target, sources in pending.items() if prefix + target not in state_dict}
    if not foreign and not pending:
        module.__dict__.pop(_PENDING_ATTR, None)
        return
    resolved, renamings = _resolve(module, None)
    items = [(key[len(prefix) :], state_dict[key]) for key in foreign]
    items += [(k, t) for sources in pending.values() for k, t in sources.items() if prefix + k not in state_dict]
    incomplete: list = []
    plan = build_plan(items, resolved.rules, key_renamings=renamings, incomplete=incomplete)
    shapes = state_shapes(((k, v.shape) for k, v in own.items()), base)
    references = shapes  # as from_pretrained: the model's own shapes (a fused parameter's size)
    dry = plan.dry_run(references)
    targets: dict = {}
    for name, (shape, _, group) in dry.items():
        key = model_key(name, own, base)
        if key is None:
            continue  # not a parameter of this model: its sources stay unexpected keys, as torch reports them
        if tuple(shape) != tuple(shapes[key]):
            raise ConversionShapeError(key, shape, shapes[key], repr(group.rule))
        targets.setdefault(id(group), (group, []))[1].append((name, key))
    groups = {id(g): g for g, _ in targets.values()}
    for _name, (_, _, group) in list(dry.items()):
        if id(group) not in groups and group.key in plan.groups:
            plan.unconvert(group, dry)
    with torch.no_grad():
        converted = plan.convert_all(references)
    for group, outputs in targets.values():
        for source in group.source_keys():
            state_dict.pop(prefix + source, None)
        for name, key in outputs:
            state_dict[prefix + key] = converted[name]
    for name, obj in plan.passthrough.items():  # keys only renamed (Transformers' legacy renamings, user renamings)
        key = model_key(name, own, base)
        original = [k for k, o in items if o is obj]
        if key is not None and original and prefix + original[0] in state_dict:
            state_dict[prefix + key] = state_dict.pop(prefix + original[0])
    remaining = {g.key: {k: t for items_ in g.sources.values() for k, t in items_} for g in incomplete}
    for sources in remaining.values():
        for key in sources:
            state_dict.pop(prefix + key, None)  # held until its group is complete, not an unexpected key
    if remaining:
        object.__setattr__(module, _PENDING_ATTR, remaining)
    else:
        module.__dict__.pop(_PENDING_ATTR, None)
    if targets or remaining:
        module.__dict__.setdefault(_CALLER_LAYOUT_ATTR, set()).add(prefix)


def _report_in_caller_layout(module, incompatible_keys) -> None:
    """``load_state_dict`` post-hook: name missing converted parameters by their original-layout sources when the
    caller's state dict was in the original layout."""
    prefixes = module.__dict__.get(_CALLER_LAYOUT_ATTR)
    if not prefixes:
        return
    state = get_state(module)
    for prefix in list(prefixes):
        prefixes.discard(prefix)
        missing = [k for k in incompatible_keys.missing_keys if k.startswith(prefix)]
        if not missing or state is None:
            continue
        names = original_names(module, state, [k[len(prefix) :] for k in missing])
        pending = {k for sources in (module.__dict__.get(_PENDING_ATTR) or {}).values() for k in sources}
        rewritten: list[str] = []
        for key in incompatible_keys.missing_keys:
            local = key[len(prefix) :] if key.startswith(prefix) else None
            if local is None or local not in names:
                rewritten.append(key)
                continue
            rewritten += [prefix + source for source in names[local] if source not in pending]
        incompatible_keys.missing_keys[:] = rewritten
    if not prefixes:
        module.__dict__.pop(_CALLER_LAYOUT_ATTR, None)


def original_names(model, state: ConversionState, keys: list[str]) -> dict[str, tuple[str, ...]]:
    """``{model key: original-layout keys}`` for those ``keys`` that the model's rules convert (names only: the
    reverse rules run on ``meta`` tensors). Keys of groups that cannot be reversed alone are left out."""
    resolved, _ = _resolve(model, None)
    reversed_rules = [rule.reverse_transform() for rule in resolved.rules]
    own = model.state_dict()
    meta = [(key, torch.empty(own[key].shape, dtype=own[key].dtype, device="meta")) for key in keys if key in own]
    incomplete: list = []
    try:
        plan = build_plan(meta, reversed_rules, reverse=True, incomplete=incomplete)
        dry = plan.dry_run(ReferenceShapes(state.recorded_shapes, model))
    except ConversionError:
        return {}
    result: dict[str, list[str]] = {}
    for name, (_, _, group) in dry.items():
        for source in group.source_keys():
            result.setdefault(source, []).append(name)
    return {key: tuple(names) for key, names in result.items()}


def _is_ours(hook: Any) -> bool:
    function = getattr(hook, "hook", hook)  # torch wraps a with_module hook in _WrappedHook(.hook)
    return function in (_convert_original_layout, _report_in_caller_layout)


def has_state_dict_hooks(model) -> bool:
    """Whether modelpatch's ``load_state_dict`` hooks are registered on ``model``."""
    return any(_is_ours(h) for h in model._load_state_dict_pre_hooks.values())


def install_state_dict_hooks(model) -> None:
    """Register the ``load_state_dict`` pre- and post-hook on ``model`` (once)."""
    if not isinstance(model, torch.nn.Module) or has_state_dict_hooks(model):
        return
    model.register_load_state_dict_pre_hook(_convert_original_layout)
    model.register_load_state_dict_post_hook(_report_in_caller_layout)


def remove_state_dict_hooks(model) -> None:
    """Remove modelpatch's ``load_state_dict`` hooks (and any sources held for an incomplete group) from ``model``."""
    for hooks in (model._load_state_dict_pre_hooks, model._load_state_dict_post_hooks):
        for handle_id in [i for i, h in hooks.items() if _is_ours(h)]:
            del hooks[handle_id]
    model.__dict__.pop(_PENDING_ATTR, None)
    model.__dict__.pop(_CALLER_LAYOUT_ATTR, None)


def _on_state_set(model, state: ConversionState | None) -> None:
    if state is None:
        remove_state_dict_hooks(model)
    else:
        install_state_dict_hooks(model)


add_state_listener(_on_state_set)
