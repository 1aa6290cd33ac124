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
  A group given only in part (``load_sharded_checkpoint`` loads one shard at a time, and a fused group may span
  two shards; or a partial dict with ``strict=False``) is written straight into its rows of the fused parameter
  (q/k/v rows of ``qkv_proj``, one expert's slice of a stacked tensor), as vLLM's ``weight_loader`` does, and its
  absent sources are reported as missing keys; a rule whose rows cannot be told (other operations) raises.
  A parameter given in both layouts in one call raises.
* a *post-hook* reports missing keys in the layout the caller used: when the state dict was in the original layout,
  a missing ``qkv_proj.weight`` is reported as its ``q_proj``/``k_proj``/``v_proj`` sources.

``model.state_dict()`` is unchanged (the model's own layout: optimizers, FSDP and DDP depend on it).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from .errors import ConversionError, ConversionShapeError
from .loading import model_key
from .manual import _resolve
from .plan import build_plan
from .reference import ReferenceShapes, state_shapes
from .state import ConversionState, add_state_listener, get_state

__all__ = ["install_state_dict_hooks", "remove_state_dict_hooks", "has_state_dict_hooks"]

_CALLER_LAYOUT_ATTR = "_modelpatch_loaded_prefixes"  # a load in progress with original keys: {prefix: keys written}


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
    if not foreign:
        return
    resolved, renamings = _resolve(module, None)
    items = [(key[len(prefix) :], state_dict[key]) for key in foreign]
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
            if prefix + key in state_dict:
                raise ConversionError(
                    f"'{prefix + key}' is given twice: in the model's layout and from {list(group.source_keys())} in "
                    "the original layout; give one of them. Nothing was loaded."
                )
            state_dict[prefix + key] = converted[name]
    for name, obj in plan.passthrough.items():  # keys only renamed (Transformers' legacy renamings, user renamings)
        key = model_key(name, own, base)
        original = [k for k, o in items if o is obj]
        if key is not None and original and prefix + original[0] in state_dict:
            state_dict[prefix + key] = state_dict.pop(prefix + original[0])
    partial = _load_partial_groups(module, incomplete, own, base, state)
    for key in partial:
        state_dict.pop(prefix + key, None)  # written into its rows of the fused parameter already
    if targets or partial:
        loaded = module.__dict__.setdefault(_CALLER_LAYOUT_ATTR, {})
        loaded.setdefault(prefix, set()).update(partial)


def _source_index(pattern: str, key: str) -> int | None:
    """The module-list index ``*`` stands for in ``pattern`` within ``key`` (``experts.*.w1`` in ``...experts.3.w1``)."""
    if "*" not in pattern:
        return None
    found = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key)
    return int(found.group(1)) if found else None


def _load_partial_groups(module, incomplete: list, own: dict, base: str, state: ConversionState) -> set[str]:
    """Write the sources of groups that arrived incomplete straight into their rows of the fused parameter (as
    vLLM's ``weight_loader`` does), for the layouts whose rows are known: ``Concatenate(dim)`` (q/k/v),
    ``MergeModulelist(dim)`` (experts) and ``MergeModulelist`` then ``Concatenate`` (per-expert gate/up). The rest
    of the parameter keeps its values, as a plain ``load_state_dict`` of a partial dict does. Returns the keys
    written.

    Raises:
        ConversionError: any other rule given only part of its sources (it cannot be placed exactly); or the rows a
            source would take do not fit.
    """
    written: set[str] = set()
    writes: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    references = ReferenceShapes(state.recorded_shapes, module)
    for group in incomplete:
        ops = [type(op).__name__ for op in group.rule.operations]
        targets = group.rule.target_patterns
        key = model_key(group.prefix + targets[0] + group.suffix, own, base) if len(targets) == 1 else None
        if key is None or ops not in (["Concatenate"], ["MergeModulelist"], ["MergeModulelist", "Concatenate"]):
            raise ConversionError(
                f"{group.rule!r}: only {list(group.source_keys())} of the sources of '{group.key}' were given; this "
                "rule's layout cannot be loaded in parts. Give all its sources in one load_state_dict call. Nothing "
                "was loaded."
            )
        param = own[key]
        concat = group.rule.operations[-1].dim if ops[-1] == "Concatenate" else None
        stack = group.rule.operations[0].dim if ops[0] == "MergeModulelist" else None
        patterns = list(group.rule.source_patterns)
        offsets, start = {}, 0
        for pattern in patterns:
            offsets[pattern] = start
            if concat is None:
                continue
            given = group.sources.get(pattern)
            if given:
                size = given[0][1].shape[concat - (1 if stack is not None and stack <= concat else 0)]
            else:
                name = group.prefix + pattern + group.suffix
                shape = None if "*" in pattern else references.get(name)
                rest = [p for p in patterns if p != pattern and not group.sources.get(p)]
                if shape is None and not rest:
                    others = sum(
                        group.sources[p][0][1].shape[concat - (1 if stack is not None and stack <= concat else 0)]
                        for p in patterns
                        if p != pattern
                    )
                    size = param.shape[concat] - others
                elif shape is None:
                    raise ConversionError(
                        f"{group.rule!r}: the rows of {pattern!r} in '{key}' are unknown (its size is not recorded); "
                        "give all the sources of the group in one call. Nothing was loaded."
                    )
                else:
                    size = shape[concat]
            start += int(size)
        for pattern, pairs in group.sources.items():
            for source_key, tensor in pairs:
                target = param.data
                if stack is not None:
                    index = _source_index(pattern, source_key)
                    if index is None or index >= target.shape[stack]:
                        raise ConversionError(f"'{source_key}': no row of '{key}' for it. Nothing was loaded.")
                    target = target.select(stack, index)
                if concat is not None:
                    dim = concat - (1 if stack is not None and stack <= concat else 0)
                    if offsets[pattern] + tensor.shape[dim] > target.shape[dim]:
                        raise ConversionShapeError(key, tuple(tensor.shape), tuple(target.shape), repr(group.rule))
                    target = target.narrow(dim, offsets[pattern], tensor.shape[dim])
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ConversionShapeError(key, tuple(tensor.shape), tuple(target.shape), repr(group.rule))
                writes.append((source_key, target, tensor))
    with torch.no_grad():  # every placement checked first: an error above leaves the model as it was
        for source_key, target, tensor in writes:
            target.copy_(tensor)
            written.add(source_key)
    return written


def _report_in_caller_layout(module, incompatible_keys) -> None:
    """``load_state_dict`` post-hook: name missing converted parameters by their original-layout sources when the
    caller's state dict was in the original layout."""
    prefixes = module.__dict__.pop(_CALLER_LAYOUT_ATTR, None)
    if not prefixes:
        return
    state = get_state(module)
    for prefix, written in prefixes.items():
        missing = [k for k in incompatible_keys.missing_keys if k.startswith(prefix)]
        if not missing or state is None:
            continue
        names = original_names(module, state, [k[len(prefix) :] for k in missing])
        rewritten: list[str] = []
        for key in incompatible_keys.missing_keys:
            local = key[len(prefix) :] if key.startswith(prefix) else None
            if local is None or local not in names:
                rewritten.append(key)
                continue
            rewritten += [prefix + source for source in names[local] if source not in written]
        incompatible_keys.missing_keys[:] = rewritten


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
    model.__dict__.pop(_CALLER_LAYOUT_ATTR, None)


def _on_state_set(model, state: ConversionState | None) -> None:
    if state is None:
        remove_state_dict_hooks(model)
    else:
        install_state_dict_hooks(model)


add_state_listener(_on_state_set)
