"""Automatic application: the registry is in force while Transformers builds a model.

Installed once when :mod:`modelpatch` is imported (idempotent) or, while ``transformers.modeling_utils`` is not
imported yet, right after it is (a :class:`~modelpatch.lazy_imports.PostImportHook`: importing it costs seconds and imports
torchao, bitsandbytes, ... when installed, which importing modelpatch must not do; no model can be built before
it is imported), these thin wrappers are the only process-wide change modelpatch makes, and they are inert while the registry is empty and no block is
open:

* ``PreTrainedModel.from_pretrained`` and ``PreTrainedModel._from_config`` (which every ``Auto*`` class,
  every concrete class and every composite model building sub-models from sub-configs goes through)
  open a registry :class:`~modelpatch.scope.PatchScope` around the whole build and load;
* ``PreTrainedModel.__init__`` (which runs before a model builds its children) picks up modeling
  modules imported since the last look, so a module first imported inside a block is patched too, and
  remembers which scopes built the model, for :func:`~modelpatch.patch_report`;
* ``PreTrainedModel.post_init`` fixes the output recorders of models built inside a block, binds the conversion
  rules in effect that fit them (so they save their original layout after the block) and swaps the tensor-parallel
  plan's entries of replaced modules for the replacements' own (:mod:`.tensor_parallel`; ``from_pretrained(...,
  tp_plan=...)`` that cannot be exact is refused there);
* ``PreTrainedModel.save_pretrained`` of a quantized model that carries conversion state (and only of such a
  model) computes the original layout first (:func:`~modelpatch.conversion.saving.quantized_original_layout`),
  so that a layout that cannot be written exactly is refused before anything is written, then lets Transformers
  write it as is;
* ``PreTrainedModel.set_use_kernels`` (hub kernels, ``kernels.kernelize``) is followed by
  :func:`~modelpatch.integrations.kernels.settle_kernels`: a hub kernel never silently replaces a patched forward.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
from contextvars import ContextVar
from types import ModuleType

import torch.nn as nn

from ..conversion import hooks as conversion_hooks
from ..conversion.buffers import restore_nonpersistent_buffers
from ..conversion.saving import (
    bind_conversion_rules,
    needs_quantized_original_layout,
    quantized_original_layout,
    serving_quantized_state_dict,
)
from ..conversion.unloaded import restore_pending_initial_values
from ..errors import ModelpatchRuntimeError
from ..lazy_imports import PostImportHook
from ..outputs import install_registry_extension, patch_output_recorders
from ..patching.provenance import BuildRecord, build_record, set_build_record
from ..patching.registry import is_strict_patching, registered_patch_mapping
from ..patching.scopes import PatchScope, active_scopes, refresh_catalog
from ..patching.upstream import fusion_conflicts_checked, in_fusion_discovery
from ..undo import UndoStack
from . import kernels as kernels_integration
from . import loaders as loaders_integration
from . import peft as peft_integration
from . import tensor_parallel as tensor_parallel_integration
from . import trainer as trainer_integration
from .tensor_parallel import adapt_tensor_parallel_plan, requested_tensor_parallelism

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
        token = _LOADING.set(name == "from_pretrained")
        tp_token = _TP_PLAN.set(requested_tensor_parallelism(kwargs) if name == "from_pretrained" else None)
        try:
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
        finally:
            _TP_PLAN.reset(tp_token)
            _LOADING.reset(token)

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
                scope._built_model(self)

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


TARGET_MODULE = "transformers.modeling_utils"

_installed = UndoStack()  # the wrappers on PreTrainedModel
_registry = UndoStack()  # the output-recorder registry extension
_install_lock = threading.RLock()  # install() may be re-entered (an integration that installs another)


def _wrap(module: ModuleType) -> None:
    """Wrap the methods of ``module.PreTrainedModel`` (idempotent)."""
    with _install_lock:
        if len(_installed):
            return
        pretrained = module.PreTrainedModel
        for name in ("from_pretrained", "_from_config"):
            original = vars(pretrained)[name].__func__
            _installed.setattr(pretrained, name, _build_wrapper(name, original), raw=True)
        _installed.setattr(pretrained, "__init__", _init_wrapper(vars(pretrained)["__init__"]), raw=True)
        _installed.setattr(pretrained, "post_init", _post_init_wrapper(vars(pretrained)["post_init"]), raw=True)
        _installed.setattr(pretrained, "save_pretrained", _save_wrapper(vars(pretrained)["save_pretrained"]), raw=True)
        if "set_use_kernels" in vars(pretrained):  # hub kernels never silently replace a patched forward: .kernels
            wrapper = kernels_integration.set_use_kernels_wrapper(vars(pretrained)["set_use_kernels"])
            _installed.setattr(pretrained, "set_use_kernels", wrapper, raw=True)


_hook = PostImportHook(TARGET_MODULE, _wrap)


def install() -> None:
    """Install the wrappers on ``PreTrainedModel`` (now, or right after ``transformers.modeling_utils`` is
    imported), the output-recorder registry extension, the conversion hooks, the PEFT integration (:mod:`.peft`),
    the checkpoint loaders of other libraries (:mod:`.loaders`) and the Trainer's optimizer checkpoint
    (:mod:`.trainer`) (idempotent; :mod:`modelpatch` calls it on import). Imports none of the libraries' modules
    it wraps: each is wrapped when it is imported."""
    with _install_lock:
        conversion_hooks.install()
        peft_integration.install()
        loaders_integration.install()
        trainer_integration.install()
        if not len(_registry):
            install_registry_extension(_registry)
        _hook.now_or_on_import()


def uninstall() -> None:
    """Remove everything :func:`install` put in place, exactly (``PreTrainedModel``'s class dictionary and the
    recorder registry's class are as before import), the import hooks, the conversion hooks, the PEFT and Trainer
    integrations and the loaders. Models built while installed keep what they recorded; a later :func:`install`
    puts everything back."""
    with _install_lock:
        _hook.disarm()
        _installed.undo()
        _registry.undo()
        conversion_hooks.uninstall()
        peft_integration.uninstall()
        loaders_integration.uninstall()
        trainer_integration.uninstall()
        tensor_parallel_integration.uninstall()


def installed() -> bool:
    """Whether :func:`install` is in effect (the wrappers in place, or the hook waiting for
    ``transformers.modeling_utils``)."""
    with _install_lock:
        if not len(_registry):
            return False
        if TARGET_MODULE not in sys.modules:
            return _hook.armed
        return len(_installed) > 0
