"""``model.load_state_dict`` in both layouts, for every model that carries conversion rules.

A patched model's ``save_pretrained`` writes the original (checkpoint) layout, and every loader that reads such a
checkpoint back into a live model goes through ``nn.Module.load_state_dict``: the Trainer's
``resume_from_checkpoint`` and ``load_best_model_at_end`` (``load_state_dict(state_dict, False)`` and
``load_sharded_checkpoint``, one shard at a time), accelerate, hand-written resume code. Without help those loads
report the converted parameters missing (``qkv_proj``) and the sources unexpected (``q_proj``/``k_proj``/``v_proj``)
in a log line, and keep the old values: a silently wrong model.

So a model that carries conversion state (:mod:`.state`: loaded or built with rules, bound, or patched in place)
gets two hooks of ``torch.nn.Module``, registered on the instance (they follow it through ``copy.deepcopy``):

* a *pre-hook* checks the incoming state dict and converts its keys that are not keys of the model through the
  same rules, operations and reference shapes as :func:`~modelpatch.conversion.load_converted_state_dict` (the
  model's rules, then Transformers' built-in converters they leave in place, after Transformers' renamings, then
  the rules of the alternative layouts the model was not loaded from). The analysis is
  :func:`.loaders.analyse_state_dict`. Keys already in the model's layout pass through untouched, so both layouts,
  and a mix of different parameters, load; ``strict=True`` works as usual.
  A group given only in part (``load_sharded_checkpoint`` loads one shard at a time, and a fused group may span
  two shards; or a partial dict with ``strict=False``) is written straight into its rows of the fused parameter
  (q/k/v rows of ``qkv_proj``, one expert's slice of a stacked tensor), as vLLM's ``weight_loader`` does, and its
  absent sources are reported as missing keys; a rule whose rows cannot be told (other operations) raises.
  Everything that would fail is refused before any parameter is written, with
  :class:`~.errors.StateDictLayoutError` (``torch`` itself copies what it can, then raises): the same rows named in
  both layouts (``qkv_proj`` beside ``q_proj``, in either order, a whole group or a part, even with equal values),
  a shape that fits no layout, and, when the caller passed ``strict=True`` (read from the ``load_state_dict``
  frame: ``torch`` hands its hooks ``strict=True`` whatever the caller gave), keys in neither layout and missing
  keys (named in the caller's layout).
* a *post-hook* reports missing keys in the layout the caller used: when the state dict was in the original layout,
  a missing ``qkv_proj.weight`` is reported as its ``q_proj``/``k_proj``/``v_proj`` sources.

``model.state_dict()`` is unchanged (the model's own layout: optimizers, FSDP and DDP depend on it).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from .loaders import analyse_state_dict, original_names
from .state import ConversionState, add_state_listener, get_state

__all__ = ["install_state_dict_hooks", "remove_state_dict_hooks", "has_state_dict_hooks", "original_names"]

_CALLER_LAYOUT_ATTR = "_modelpatch_loaded_prefixes"  # a load in progress with original keys: {prefix: keys written}
_LOAD_STATE_DICT_CODE = torch.nn.Module.load_state_dict.__code__


def _caller_strict() -> bool | None:
    """The ``strict`` argument of the ``nn.Module.load_state_dict`` call in progress (``torch`` passes ``True`` to
    every hook whatever the caller gave, and checks the keys only after copying them), found on the call stack:
    the nearest frame of that function (the outermost module's, when a wrapper such as PEFT's model loads into the
    hooked model). ``None`` where there is none (``_load_from_state_dict`` called some other way)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _LOAD_STATE_DICT_CODE:
            return bool(frame.f_locals.get("strict", True))
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _convert_original_layout(
    module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
) -> None:
    """``load_state_dict`` pre-hook: check the keys of ``state_dict`` under ``prefix`` (:func:`.loaders.
    analyse_state_dict`: raises before anything is written) and replace its original-layout keys by the model's
    converted keys, in place (``torch`` passes a copy of the caller's dict)."""
    state = get_state(module)
    if state is None:
        return
    own = module.state_dict(keep_vars=True)
    items = [(key[len(prefix) :], value) for key, value in state_dict.items() if key.startswith(prefix)]
    analysis = analyse_state_dict(module, items, own)
    if _caller_strict():
        error = analysis.strict_error(type(module).__name__)
        if error is not None:
            raise error
    if not analysis.foreign:
        return
    converted = analysis.convert()
    for key in analysis.source_keys() - set(analysis.renamed):
        state_dict.pop(prefix + key, None)
    for key, tensor in converted.items():
        state_dict[prefix + key] = tensor  # replaces the model's own tensor object where one was filled in
    for source, key in analysis.renamed.items():  # keys only renamed (Transformers' legacy renamings)
        state_dict[prefix + key] = state_dict.pop(prefix + source)
    written = analysis.write_partial()  # placed into its rows of the fused parameter, as vLLM's weight_loader
    loaded = module.__dict__.setdefault(_CALLER_LAYOUT_ATTR, {})
    loaded.setdefault(prefix, set()).update(written)


def _report_in_caller_layout(module, incompatible_keys) -> None:
    """``load_state_dict`` post-hook: name missing converted parameters by their original-layout sources when the
    caller's state dict was in the original layout."""
    prefixes = module.__dict__.pop(_CALLER_LAYOUT_ATTR, None)
    if not prefixes:
        return
    state = get_state(module)
    for prefix, written in prefixes.items():
        missing = [k[len(prefix) :] for k in incompatible_keys.missing_keys if k.startswith(prefix)]
        if not missing or state is None:
            continue
        names = original_names(module, state, missing)
        rewritten: list[str] = []
        for key in incompatible_keys.missing_keys:
            local = key[len(prefix) :] if key.startswith(prefix) else None
            if local is None or local not in names:
                rewritten.append(key)
                continue
            rewritten += [prefix + source for source in names[local] if source not in written]
        incompatible_keys.missing_keys[:] = rewritten


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
