"""The one place where modelpatch wraps Transformers functions.

Three module-level names of ``transformers.modeling_utils`` are replaced by thin wrappers:

* ``convert_and_load_state_dict_in_model`` (called by ``from_pretrained`` with the lazily opened checkpoint): when
  user rules resolve for the model, the checkpoint dict is converted lazily by :mod:`.loading` and the remaining
  built-in rules are passed on to the original function, which still does all reading, dtype casting and placement;
* ``_load_state_dict_into_zero3_model`` (called by ``from_pretrained`` instead of the first when DeepSpeed ZeRO-3 is
  on, see :mod:`.zero3`): the checkpoint converted with the user rules before Transformers' ZeRO-3 loader reads it;
* ``revert_weight_conversion`` (called by ``save_pretrained`` unless ``save_original_format=False``): a model that
  carries modelpatch rules, or for which rules are in effect, is written back in the original layout by
  :mod:`.saving`, the path :func:`~modelpatch.iter_original_state_dict` takes too: Transformers' own reverse run
  group by group exactly as the original runs it (:mod:`.streaming`), then the reverse of the user rules. Any other
  model goes through the original function, untouched.

With no user rule in effect and a model that was not converted, the load wrapper calls the original with the same
arguments (except for a model modelpatch built that loads PEFT adapters through ``model.load_adapter``: the adapter
rules whose targets the model lacks are dropped, see :func:`.compose.transforms_in_force`), then only checks that the
parameters of replacement modules came from the checkpoint (:mod:`.unloaded`). A quantized load inside a patch
scope or with user rules that leaves fused 3-D experts parameters in full precision warns, naming them
(:func:`.quantized.warn_fused_experts_left`). The wrappers are installed when
:mod:`modelpatch` is imported, or, if ``transformers.modeling_utils`` is not imported yet (it imports torchao,
bitsandbytes, ... when installed: seconds and log lines that importing modelpatch must not cost), right after it is
(:class:`~modelpatch.lazy_imports.PostImportHook`). :func:`uninstall` restores the originals.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from types import ModuleType

from ..lazy_imports import PostImportHook
from ..patching.scopes import active_scopes
from . import zero3
from .compose import built_by_modelpatch, resolve_model_rules, transforms_in_force
from .loading import convert_and_load
from .quantized import check_prequantized_layers, quantizer_label, warn_fused_experts_left
from .registry import set_hooks_installed
from .saving import revert_to_original_layout
from .state import get_state, set_state
from .unloaded import check_replacements_loaded

__all__ = ["install", "uninstall", "installed"]

TARGET_MODULE = "transformers.modeling_utils"

_lock = threading.RLock()  # the import hook may fire while install() holds it (install imports nothing, though)
_originals: dict = {}


def _load(model, state_dict, load_config, disk_offload_index=None):
    original = _originals["convert_and_load_state_dict_in_model"]
    if getattr(model, "_hf_peft_config_loaded", False) and built_by_modelpatch(model):
        # `model.load_adapter` (Transformers' PEFT integration, also `from_pretrained(adapter_dir)`) on a model
        # modelpatch built: the adapter is in the model's own layout, so user rules (written for base checkpoints)
        # do not apply, and of the adapter rules PEFT built from Transformers' table only those whose targets the
        # model has are kept (the built-in expert fusion would fuse per-expert LoRA weights into absent keys)
        mapping = transforms_in_force(load_config.weight_mapping or [], model.state_dict())
        # (the base weights were loaded before: the keys this load reports missing are not the adapter's to fill)
        return original(model, state_dict, dataclasses.replace(load_config, weight_mapping=mapping), disk_offload_index)
    resolved = resolve_model_rules(model)
    if resolved is None:
        result = original(model, state_dict, load_config, disk_offload_index)
    else:
        result = convert_and_load(model, state_dict, load_config, disk_offload_index, resolved, original)
    check_replacements_loaded(model, result[0])
    quantizer = load_config.hf_quantizer
    if quantizer is not None and not quantizer.pre_quantized and (resolved is not None or active_scopes()):
        warn_fused_experts_left(model, quantizer_label(quantizer))  # a recipe was meant to make them quantizable
    if quantizer is not None and quantizer.pre_quantized and (resolved is not None or active_scopes()):
        check_prequantized_layers(model, quantizer_label(quantizer))
    return result


def _load_zero3(model, state_dict, load_config=None):
    """``_load_state_dict_into_zero3_model`` (``from_pretrained`` with DeepSpeed ZeRO-3 on, see :mod:`.zero3`): the
    checkpoint converted with the model's user rules first, then the same check of replacement modules as
    :func:`_load`."""
    original = _originals["_load_state_dict_into_zero3_model"]
    if getattr(model, "_hf_peft_config_loaded", False) and built_by_modelpatch(model):
        return original(model, state_dict, load_config)  # an adapter in the model's own layout (see _load)
    resolved = resolve_model_rules(model)
    state = None
    if resolved is not None:
        state_dict, load_config, state = zero3.convert_checkpoint(model, state_dict, load_config, resolved)
    elif load_config is not None and load_config.weight_mapping and built_by_modelpatch(model):
        # built-in converters whose target layout a replacement removed (see zero3.convert_checkpoint)
        mapping = transforms_in_force(load_config.weight_mapping, model.state_dict(keep_vars=True))
        load_config = dataclasses.replace(load_config, weight_mapping=mapping)
    model_state = zero3.zero3_state_shapes(model)
    mapping = list(getattr(load_config, "weight_mapping", None) or []) if load_config is not None else []
    unexpected = zero3.unread_keys(model, list(state_dict), mapping, model_state)
    # leaf modules (linear experts): one broadcast per module, not a gather and broadcast per sub-module (zero3)
    state_dict, loaded = zero3.load_leaf_modules(model, state_dict, mapping)
    error_msgs, missing_keys = original(model, state_dict, load_config)
    if loaded:
        missing_keys = set(missing_keys) - loaded
    if state is not None:
        set_state(model, state)
    check_replacements_loaded(model, zero3.ZeroLoadInfo(set(missing_keys), unexpected))
    return error_msgs, missing_keys


def _revert(model, state_dict):
    if get_state(model) is None and resolve_model_rules(model) is None:
        # no rule of modelpatch's applies: Transformers' own function, as if modelpatch were not installed
        return _originals["revert_weight_conversion"](model, state_dict)
    return revert_to_original_layout(model, state_dict)


_WRAPPERS = {
    "convert_and_load_state_dict_in_model": _load,
    "revert_weight_conversion": _revert,
    "_load_state_dict_into_zero3_model": _load_zero3,
}


def _wrap(module: ModuleType) -> None:
    """Wrap the functions of ``transformers.modeling_utils`` named in ``_WRAPPERS`` (idempotent).

    A name that someone else (a profiler, another library) wrapped again after modelpatch is left alone: that wrapper
    calls ours, and taking it as our "original" would make ours call itself without end.
    """
    with _lock:
        for name, wrapper in _WRAPPERS.items():
            current = getattr(module, name, None)
            if current is None:  # not in this Transformers release (the ZeRO-3 loader is not in every 5.x)
                continue
            if current is wrapper or (name in _originals and current is not _originals[name]):
                continue
            _originals[name] = current
            setattr(module, name, wrapper)


_hook = PostImportHook(TARGET_MODULE, _wrap)


def install() -> None:
    """Install the wrappers now, or right after ``transformers.modeling_utils`` is imported (idempotent,
    thread-safe)."""
    with _lock:
        _hook.now_or_on_import()
        set_hooks_installed(True)


def uninstall() -> None:
    """Restore Transformers' functions (only those still wrapped by us) and remove the import hook."""
    with _lock:
        _hook.disarm()
        module = sys.modules.get(TARGET_MODULE)
        if module is not None:
            for name, wrapper in _WRAPPERS.items():
                if getattr(module, name, None) is wrapper and name in _originals:
                    setattr(module, name, _originals.pop(name))
        set_hooks_installed(False)


def installed() -> bool:
    """Whether :func:`install` is in effect (the functions wrapped, or the hook waiting for the import)."""
    with _lock:
        module = sys.modules.get(TARGET_MODULE)
        if module is None:
            return _hook.armed
        return all(getattr(module, name) is wrapper for name, wrapper in _WRAPPERS.items() if hasattr(module, name))
