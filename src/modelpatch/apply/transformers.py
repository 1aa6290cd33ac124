"""Every wrapper modelpatch installs on Transformers, behind one :class:`~modelpatch.undo.UndoStack`.

Installed once when :mod:`modelpatch` is imported (idempotent) or, while ``transformers.modeling_utils`` is not
imported yet, right after it is (a :class:`~modelpatch.lazy_imports.PostImportHook`: importing it costs seconds and
imports torchao, bitsandbytes, ... when installed, which importing modelpatch must not do; no model can be built before
it is imported), these thin wrappers are the only process-wide change modelpatch makes, and they are inert while the
registry is empty and no block is open. :func:`uninstall` undoes them exactly (a wrapper someone else wrapped again
after ours stays, so that their chain still reaches the original).

On ``PreTrainedModel``:

* ``from_pretrained`` and ``_from_config`` (which every ``Auto*`` class, every concrete class and every composite model
  building sub-models from sub-configs goes through) open a registry :class:`~modelpatch.patching.scopes.PatchScope`
  around the whole build and load;
* ``__init__`` (which runs before a model builds its children) picks up modeling modules imported since the last look,
  so a module first imported inside a block is patched too, and remembers which scopes built the model, for
  :func:`~modelpatch.patch_report`;
* ``post_init`` fixes the output recorders of models built inside a block, binds the conversion rules in effect that
  fit them (so they save their original layout after the block) and swaps the tensor-parallel plan's entries of
  replaced modules for the replacements' own (:mod:`modelpatch.integrations.tensor_parallel`; ``from_pretrained(...,
  tp_plan=...)`` that cannot be exact is refused there);
* ``save_pretrained`` of a quantized model that carries conversion state (and only of such a model) computes the
  original layout first (:func:`~modelpatch.conversion.saving.quantized_original_layout`), so that a layout that
  cannot be written exactly is refused before anything is written, then lets Transformers write it as is;
* ``set_use_kernels`` (hub kernels, ``kernels.kernelize``) is followed by
  :func:`~modelpatch.integrations.kernels.settle_kernels`: a hub kernel never silently replaces a patched forward.

Three functions of ``transformers.modeling_utils``:

* ``convert_and_load_state_dict_in_model`` (called by ``from_pretrained`` with the lazily opened checkpoint): when
  user rules resolve for the model, the checkpoint dict is converted lazily by :mod:`modelpatch.conversion.loading`
  and the remaining built-in rules are passed on to the original function, which still does all reading, dtype casting
  and placement;
* ``_load_state_dict_into_zero3_model`` (called by ``from_pretrained`` instead of the first when DeepSpeed ZeRO-3 is
  on, see :mod:`modelpatch.conversion.zero3`): the checkpoint converted with the user rules before Transformers'
  ZeRO-3 loader reads it;
* ``revert_weight_conversion`` (called by ``save_pretrained`` unless ``save_original_format=False``): a model that
  carries modelpatch rules, or for which rules are in effect, is written back in the original layout by
  :mod:`modelpatch.conversion.saving`, the path :func:`~modelpatch.iter_original_state_dict` takes too: Transformers'
  own reverse run group by group exactly as the original runs it (:mod:`modelpatch.conversion.streaming`), then the
  reverse of the user rules. Any other model goes through the original function, untouched.

With no user rule in effect and a model that was not converted, the load wrapper calls the original with the same
arguments (except for a model modelpatch built that loads PEFT adapters through ``model.load_adapter``: the adapter
rules whose targets the model lacks are dropped, see :func:`~modelpatch.conversion.compose.transforms_in_force`), then
only checks that the parameters of replacement modules came from the checkpoint (:mod:`modelpatch.conversion.unloaded`).
A quantized load inside a patch scope or with user rules that leaves fused 3-D experts parameters in full precision
warns, naming them (:func:`~modelpatch.conversion.quantized.warn_fused_experts_left`).

:func:`install` also installs the adapters of :mod:`modelpatch.integrations` (PEFT, other libraries' checkpoint
loaders, the Trainer's optimizer checkpoint), each when the module it wraps is imported."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import threading
from contextvars import ContextVar
from types import ModuleType

import torch.nn as nn

from ..conversion import zero3
from ..conversion.buffers import restore_nonpersistent_buffers
from ..conversion.compose import built_by_modelpatch, resolve_model_rules, transforms_in_force
from ..conversion.loading import convert_and_load
from ..conversion.quantized import check_prequantized_layers, quantizer_label, warn_fused_experts_left
from ..conversion.registry import set_hooks_installed
from ..conversion.saving import (
    bind_conversion_rules,
    needs_quantized_original_layout,
    quantized_original_layout,
    revert_to_original_layout,
    serving_quantized_state_dict,
)
from ..conversion.state import get_state, set_state
from ..conversion.unloaded import check_replacements_loaded, restore_pending_initial_values
from ..errors import ModelpatchRuntimeError
from ..integrations import kernels as kernels_integration
from ..integrations import loaders as loaders_integration
from ..integrations import peft as peft_integration
from ..integrations import tensor_parallel as tensor_parallel_integration
from ..integrations import trainer as trainer_integration
from ..integrations.tensor_parallel import adapt_tensor_parallel_plan, requested_tensor_parallelism
from ..lazy_imports import PostImportHook
from ..outputs import install_registry_extension, patch_output_recorders
from ..patching.provenance import BuildRecord, build_record, set_build_record
from ..patching.registry import is_strict_patching, registered_patch_mapping
from ..patching.scopes import PatchScope, active_scopes, refresh_catalog
from ..patching.upstream import fusion_conflicts_checked, in_fusion_discovery
from ..undo import UndoStack, context_set

__all__ = ["install", "uninstall", "installed"]

_LOADING: ContextVar[bool] = ContextVar("modelpatch_loading", default=False)  # inside from_pretrained
# from_pretrained(tp_plan=... / distributed_config=...): what it asks for (tensor_parallel.requested_tensor_parallelism)
_TP_PLAN: ContextVar[dict | None] = ContextVar("modelpatch_tp_plan", default=None)


class _RegistryBuild:
    """Context for one ``from_pretrained``/``from_config`` call: the registry scope, if needed."""

    def __init__(self, label: str):
        self.label = label
        self.scope: PatchScope | None = None

    def __enter__(self):
        mapping = registered_patch_mapping()
        if mapping and not any(s.mapping is mapping for s in active_scopes()):
            self.scope = PatchScope(mapping, explicit=False, strict=is_strict_patching(), label=self.label)
            self.scope.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        if self.scope is not None:
            self.scope.__exit__(exc_type, exc, tb)


def _build_wrapper(name: str, original):
    label = name.lstrip("_")

    @functools.wraps(original)
    def build(cls, *args, **kwargs):
        loading = name == "from_pretrained"
        with (
            context_set(_LOADING, loading),
            context_set(_TP_PLAN, requested_tensor_parallelism(kwargs) if loading else None),
        ):
            with fusion_conflicts_checked(), _RegistryBuild(f"{cls.__name__}.{label}"):
                model = original(cls, *args, **kwargs)  # recorders and conversion rules: see post_init
            if isinstance(model, nn.Module):  # output_loading_info=True returns a tuple
                restore_pending_initial_values(model)
                if name == "from_pretrained":
                    restore_nonpersistent_buffers(model)
            elif isinstance(model, tuple) and model and isinstance(model[0], nn.Module):
                restore_pending_initial_values(model[0])
                if name == "from_pretrained":
                    restore_nonpersistent_buffers(model[0])
            return model

    return classmethod(build)


def _init_wrapper(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        # Transformers' fusion discovery builds the model class on meta to find fusable classes: not a build of the
        # scopes (they replace nothing there, see modelpatch.patching.upstream)
        scopes = active_scopes() if not in_fusion_discovery() else ()
        if scopes:
            refresh_catalog()
        original(self, *args, **kwargs)
        if scopes:
            keys = tuple(dict.fromkeys(k for scope in scopes for k in scope.mapping.keys))
            set_build_record(self, BuildRecord(keys=keys, scopes=scopes))
            for scope in scopes:
                scope.record_built_model(self)

    return __init__


def _post_init_wrapper(original):
    @functools.wraps(original)
    def post_init(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if build_record(self) is not None:  # built inside a block (from_config, from_pretrained or a constructor)
            # the tensor-parallel plan names the replacements' own modules; a plan that cannot be exact is refused
            adapt_tensor_parallel_plan(self, _TP_PLAN.get())
            patch_output_recorders(self)
            if not _LOADING.get():  # a load binds the rules itself, with the shapes it read
                bind_conversion_rules(self)  # saves its original layout after the block too
        return result

    return post_init


def _save_wrapper(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_pretrained(self, *args, **kwargs):
        refusal = peft_integration.adapter_save_refusal(self)
        if refusal is not None:  # before anything is written
            raise ModelpatchRuntimeError(refusal)
        if not needs_quantized_original_layout(self):
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        arguments = bound.arguments
        if not arguments.get("save_original_format", True) or arguments.get("state_dict") is not None:
            return original(self, *args, **kwargs)
        state_dict, metadata = quantized_original_layout(self)  # refuses before anything is written
        arguments["save_original_format"] = False  # already in the original layout
        with serving_quantized_state_dict(self, state_dict, metadata):
            return original(*bound.args, **bound.kwargs)

    return save_pretrained


# -- transformers.modeling_utils: checkpoint load (also under ZeRO-3) and save in the original layout --------------
def _load_wrapper(original):
    def _load(model, state_dict, load_config, disk_offload_index=None):
        if getattr(model, "_hf_peft_config_loaded", False) and built_by_modelpatch(model):
            # `model.load_adapter` (Transformers' PEFT integration, also `from_pretrained(adapter_dir)`) on a model
            # modelpatch built: the adapter is in the model's own layout, so user rules (written for base checkpoints)
            # do not apply, and of the adapter rules PEFT built from Transformers' table only those whose targets the
            # model has are kept (the built-in expert fusion would fuse per-expert LoRA weights into absent keys)
            mapping = transforms_in_force(load_config.weight_mapping or [], model.state_dict())
            # (the base weights were loaded before: the keys this load reports missing are not the adapter's to fill)
            return original(
                model, state_dict, dataclasses.replace(load_config, weight_mapping=mapping), disk_offload_index
            )
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

    return _load


def _load_zero3_wrapper(original):
    def _load_zero3(model, state_dict, load_config=None):
        """``_load_state_dict_into_zero3_model`` (``from_pretrained`` with DeepSpeed ZeRO-3 on, see :mod:`.zero3`): the
        checkpoint converted with the model's user rules first, then the same check of replacement modules as
        :func:`_load_wrapper`."""
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

    return _load_zero3


def _revert_wrapper(original):
    def _revert(model, state_dict):
        if get_state(model) is None and resolve_model_rules(model) is None:
            # no rule of modelpatch's applies: Transformers' own function, as if modelpatch were not installed
            return original(model, state_dict)
        return revert_to_original_layout(model, state_dict)

    return _revert


# name in ``transformers.modeling_utils`` -> factory of its wrapper (called with the original function)
_FUNCTION_WRAPPERS = {
    "convert_and_load_state_dict_in_model": _load_wrapper,
    "revert_weight_conversion": _revert_wrapper,
    "_load_state_dict_into_zero3_model": _load_zero3_wrapper,
}


TARGET_MODULE = "transformers.modeling_utils"

_installed = UndoStack()  # everything install() and the import hook changed, undone by uninstall()
_install_lock = threading.RLock()  # install() may be re-entered (an integration that installs another)
_state = {"installed": False, "wrapped": False}  # install() in effect; transformers.modeling_utils wrapped


def _wrap(module: ModuleType) -> None:
    """Wrap the methods of ``module.PreTrainedModel`` and the functions of ``module`` named in
    ``_FUNCTION_WRAPPERS`` (idempotent). A function not in this Transformers release (the ZeRO-3 loader is not in
    every 5.x) is skipped."""
    with _install_lock:
        if _state["wrapped"]:
            return
        pretrained = module.PreTrainedModel
        for name in ("from_pretrained", "_from_config"):
            _installed.wrap(
                pretrained, name, factory=functools.partial(_classmethod_wrapper, _build_wrapper, name), raw=True
            )
        _installed.wrap(pretrained, "__init__", factory=_init_wrapper, raw=True)
        _installed.wrap(pretrained, "post_init", factory=_post_init_wrapper, raw=True)
        _installed.wrap(pretrained, "save_pretrained", factory=_save_wrapper, raw=True)
        if "set_use_kernels" in vars(pretrained):  # hub kernels never silently replace a patched forward: .kernels
            _installed.wrap(
                pretrained, "set_use_kernels", factory=kernels_integration.set_use_kernels_wrapper, raw=True
            )
        for name, factory in _FUNCTION_WRAPPERS.items():
            if getattr(module, name, None) is not None:
                _installed.wrap(module, name, factory=factory)
        _state["wrapped"] = True
        _installed.callback(_state.__setitem__, "wrapped", False)


def _classmethod_wrapper(make, name: str, original: classmethod):
    """``make(name, function)`` for the function of the ``classmethod`` object ``original``."""
    return make(name, original.__func__)


_hook = PostImportHook(TARGET_MODULE, _wrap)


def install() -> None:
    """Install the wrappers on ``PreTrainedModel`` and ``transformers.modeling_utils``' load / save functions (now,
    or right after ``transformers.modeling_utils`` is imported), the output-recorder registry extension, the PEFT
    integration (:mod:`modelpatch.integrations.peft`), the checkpoint loaders of other libraries
    (:mod:`modelpatch.integrations.loaders`) and the Trainer's optimizer checkpoint
    (:mod:`modelpatch.integrations.trainer`) (idempotent; :mod:`modelpatch` calls it on import). Imports none of the
    libraries' modules it wraps: each is wrapped when it is imported."""
    with _install_lock:
        if not _state["installed"]:
            _state["installed"] = True
            _installed.callback(_state.__setitem__, "installed", False)
            set_hooks_installed(True)
            _installed.callback(set_hooks_installed, False)
            for adapter in (peft_integration, loaders_integration, trainer_integration, tensor_parallel_integration):
                _installed.callback(adapter.uninstall)
            _installed.callback(_hook.disarm)
        peft_integration.install()
        loaders_integration.install()
        trainer_integration.install()
        install_registry_extension(_installed)
        _hook.now_or_on_import()


def uninstall() -> None:
    """Remove everything :func:`install` put in place, exactly (``PreTrainedModel``'s class dictionary,
    ``transformers.modeling_utils``' functions and the recorder registry's class are as before import), the import
    hooks, the PEFT and Trainer integrations and the loaders. A wrapper that someone else wrapped again after ours
    stays in place (their wrapper still calls it). Models built while installed keep what they recorded; a later
    :func:`install` puts everything back."""
    with _install_lock:
        _hook.disarm()
        _installed.undo()


def installed() -> bool:
    """Whether :func:`install` is in effect (the wrappers in place, or the hook waiting for
    ``transformers.modeling_utils``)."""
    with _install_lock:
        if not _state["installed"]:
            return False
        if TARGET_MODULE not in sys.modules:
            return _hook.armed
        return _state["wrapped"]
