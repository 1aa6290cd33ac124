"""PEFT (pinned: 0.21.2) on patched models: adapters target the modules the patched model really has.

**The mechanism this fixes.** Transformers 5 fuses the experts of MoE models (``gate_up_proj``/``down_proj``
parameters); PEFT adapts to it in :mod:`peft.utils.transformers_weight_conversion`, for adapters trained on the
per-expert ``nn.Linear`` modules of Transformers 4, twice:

* ``convert_peft_config_for_transformers(peft_config, model, conversions)`` (called by ``inject_adapter``, i.e. by
  ``get_peft_model`` and ``PeftModel.from_pretrained``) rewrites the targets ``gate_proj``/``up_proj``/``down_proj``
  (Mixtral: ``w1``/``w3``/``w2``) into ``target_parameters`` ``gate_up_proj``/``down_proj`` whenever
  ``get_checkpoint_conversion_mapping(config.model_type)`` is not ``None``: it looks at the model *type*, never at
  the modules. On ``qwen3_moe``/``mixtral`` models with per-expert ``nn.Linear`` experts the experts are then not
  targeted (``NoMatchingPeftModuleError`` when nothing else is). (``qwen2_moe`` itself escapes by accident: PEFT
  looks ``model_type`` up in ``_MODEL_TO_CONVERSION_PATTERN``, which lists only the types *mapped to* it.)
* ``convert_peft_adapter_state_dict_for_transformers`` (called by ``set_peft_model_state_dict``, i.e. by
  ``PeftModel.from_pretrained``/``load_adapter``) takes the rules of ``get_model_conversion_mapping(base_model)``
  (Transformers' table, by class name and ``model_type``) and fuses every per-expert LoRA tensor of the adapter into
  tensors for the fused parameters; on a model that kept its experts per-expert, none of them names a parameter, so
  all expert LoRA weights are dropped with only PEFT's "Found missing adapter keys" warning.

Both ask Transformers' global table what layout a *model type* has; a patched model's own layout is what modelpatch
knows of the instance. Here a built-in ``WeightConverter`` counts as *in force* for a model only when the model
has its target layout (a parameter named like its target, seen through PEFT's wrappers); the wrappers below give
PEFT, for models built or loaded by modelpatch (conversion rules bound, or built inside a patch block), only the
rules in force: ``get_model_conversion_mapping`` as PEFT's module sees it drops the converters not in force
(renamings such as Mixtral's ``block_sparse_moe`` -> ``mlp`` stay, so adapters of Transformers 4 still load), and
``convert_peft_config_for_transformers`` leaves the config alone when no converter is in force. For every other
model both call PEFT's functions unchanged. The fused parameters of a model that kept them are converted as PEFT
does.

Transformers' own PEFT integration (``model.load_adapter``, ``from_pretrained`` of an adapter folder) builds its
adapter rules from the same table and loads through ``convert_and_load_state_dict_in_model``; its load hook
(:mod:`modelpatch.apply.transformers`) keeps, for a model modelpatch built, only the rules whose targets it has.

The third piece is a wrapper view (:mod:`modelpatch.conversion.wrappers`): PEFT's tuner layers (``base_layer``)
and auxiliary wrappers (``modules_to_save``: ``original_module``), so that ``save_pretrained`` of a patched base
model that still holds LoRA layers writes the original base layout; its merge view (:func:`peft_unmerged_wrappers`)
tells layers whose adapters ``merge_adapter()`` merged into the base weights from those whose adapters are missing.

**Installation.** :func:`install` (called by :func:`modelpatch.apply.transformers.install`, i.e. on import of
modelpatch) registers the view and, when ``peft.utils.transformers_weight_conversion`` is already imported, wraps its
two names like :mod:`modelpatch.apply.transformers` wraps Transformers' functions (the originals kept, a name someone
wrapped again after us left alone). PEFT imports that module lazily, on the first adapter injection, so until then
an import hook (:data:`sys.meta_path` finder answering for that one module name only, None for every other) wraps
it right after it is executed. :func:`uninstall` restores the originals and removes the finder. Importing modelpatch
never imports PEFT.
"""

from __future__ import annotations

import sys
import threading
from types import ModuleType
from typing import Any

import torch.nn as nn
from transformers import core_model_loading as _tcml
from transformers.utils import logging

from ..conversion.compose import built_by_modelpatch, transforms_in_force
from ..conversion.wrappers import register_wrapper_view, unwrapped_names, wrapper_bases
from ..errors import ModelpatchTypeError, ModelpatchValueError
from ..lazy_imports import PostImportHook
from ..undo import UndoStack
from ..versions import require

__all__ = [
    "install",
    "uninstall",
    "installed",
    "TARGET_MODULE",
    "builtin_converters_in_force",
    "peft_wrapper_bases",
    "peft_unmerged_wrappers",
    "add_adapter",
    "adapter_save_refusal",
    "transformers_adapter_gate",
]

logger = logging.get_logger("modelpatch.integrations.peft")

TARGET_MODULE = "peft.utils.transformers_weight_conversion"
"""PEFT's module holding the Transformers-5 weight conversion of adapters (imported lazily by PEFT)."""

_lock = threading.RLock()
_originals: dict = {}  # name -> PEFT's function our wrapper calls, while the wrapper may be called
_wrapped = UndoStack()  # the wrappers on PEFT's conversion module
_view = UndoStack()


# -- which built-in rules are in force -----------------------------------------------------------------------------
def builtin_converters_in_force(model, transforms) -> list:
    """``transforms`` (Transformers' rules for ``model``) without the ``WeightConverter`` s whose target layout the
    model does not have, seen through PEFT's wrappers (:func:`peft_wrapper_bases`). Renamings are kept."""
    return transforms_in_force(transforms, unwrapped_names(model.state_dict(), wrapper_bases(model)))


def _peft_transforms(model, original, *args, **kwargs) -> list:
    transforms = original(model, *args, **kwargs)
    if not built_by_modelpatch(model):
        return transforms
    return builtin_converters_in_force(model, transforms)


# -- the wrappers ----------------------------------------------------------------------------------------------------
def _get_model_conversion_mapping(model, *args, **kwargs):
    """``get_model_conversion_mapping`` as PEFT's module sees it: only the rules in force for a patched model."""
    return _peft_transforms(model, _originals["get_model_conversion_mapping"], *args, **kwargs)


def _expert_fusions(transforms) -> list:
    """The converters PEFT's adapter conversion knows: a single target ending in ``gate_up_proj`` or ``down_proj``
    (as in ``build_peft_weight_mapping``), i.e. Transformers' fusion of MoE experts."""
    return [
        t
        for t in transforms
        if isinstance(t, _tcml.WeightConverter)
        and len(t.target_patterns) == 1
        and t.target_patterns[0].endswith(("gate_up_proj", "down_proj"))
    ]


def _convert_peft_config_for_transformers(peft_config, model, conversions=None):
    """PEFT's config conversion (targets of per-expert modules rewritten into the fused expert parameters), skipped
    for a model modelpatch built on which no expert fusion of Transformers is in force: its experts are per-expert
    modules, which the targets name as they are."""
    original = _originals["convert_peft_config_for_transformers"]
    if built_by_modelpatch(model):
        transforms = _originals["get_model_conversion_mapping"](model)
        if _expert_fusions(transforms) and not _expert_fusions(builtin_converters_in_force(model, transforms)):
            logger.info(
                f"modelpatch: {type(model).__name__} does not have the fused experts of Transformers' built-in rules "
                "(per-expert modules); PEFT's rewriting of expert targets into fused parameters is skipped"
            )
            return None
    return original(peft_config, model, conversions)


_WRAPPERS = {
    "get_model_conversion_mapping": _get_model_conversion_mapping,
    "convert_peft_config_for_transformers": _convert_peft_config_for_transformers,
}


def _wrap(module: ModuleType) -> None:
    """Wrap the names of PEFT's conversion module (idempotent; see :mod:`modelpatch.apply.transformers`)."""
    with _lock:
        for name, wrapper in _WRAPPERS.items():
            current = getattr(module, name, None)
            if current is None or current is wrapper or (name in _originals and current is not _originals[name]):
                continue
            _originals[name] = _wrapped.wrap(module, name, wrapper)


def _unwrap() -> None:
    """Take our wrappers off where they are still the ones installed (see :meth:`UndoStack.wrap`); a wrapper that
    another library wrapped in turn stays, with the original it calls."""
    with _lock:
        _wrapped.undo()
        for name in list(_originals):
            if getattr(sys.modules.get(TARGET_MODULE), name, None) is _originals[name]:
                del _originals[name]


# -- the wrapper view --------------------------------------------------------------------------------------------
def peft_wrapper_bases(model: nn.Module) -> dict[str, str]:
    """``{module path: path of its base module inside it}`` for PEFT's tuner layers (``base_layer``, recursively)
    and auxiliary training wrappers (``original_module``) in ``model``; ``{}`` while PEFT is not imported."""
    if "peft" not in sys.modules:
        return {}
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    found: dict[str, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer):
            base = module.get_base_layer()
        elif isinstance(module, AuxiliaryTrainingWrapper):
            base = module.original_module
        else:
            continue
        relative = next((n for n, m in module.named_modules() if m is base and n), None)
        if relative is not None:
            found[name] = relative
    return found


def peft_unmerged_wrappers(model: nn.Module) -> list[str]:
    """Paths of PEFT's wrappers in ``model`` whose base module lacks adapter weights the model computes with: a tuner
    layer (``BaseTunerLayer``) with no merged adapter (``merged_adapters`` empty) or with an active adapter it holds
    (a key of one of its ``adapter_layer_names`` dicts) that is not among ``merged_adapters``; a
    ``ModulesToSaveWrapper`` (its trained copy is never merged into ``original_module``). Other auxiliary wrappers
    (``TrainableTokensWrapper``) count by the tuner layers inside them. ``[]`` while PEFT is not imported."""
    if "peft" not in sys.modules:
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import ModulesToSaveWrapper

    found: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, ModulesToSaveWrapper):
            found.append(name)
        elif isinstance(module, BaseTunerLayer):
            held: set[str] = set()
            for attr in module.adapter_layer_names:
                adapters = getattr(module, attr, None)
                if isinstance(adapters, (nn.ModuleDict, nn.ParameterDict)):
                    held.update(adapters.keys())
            merged = set(module.merged_adapters)
            pending = [a for a in module.active_adapters if a in held and a not in merged]
            if not merged or pending:
                found.append(name)
    return found


# -- adding an adapter on every Transformers release ----------------------------------------------------------------
def transformers_adapter_gate() -> tuple[bool, str, str]:
    """``(open, required, installed)``: whether Transformers' adapter methods (``add_adapter``, ``set_adapter``,
    ``active_adapters()``, ...) accept the installed PEFT: they refuse a PEFT older than Transformers'
    ``MIN_PEFT_VERSION`` (0.20.0 in 5.23, 0.22.0 from 5.24 on), while ``load_adapter`` and PEFT's own API
    (``get_peft_model``, ``inject_adapter_in_model``) work with it.

    Raises:
        MissingDependencyError: PEFT is not installed (``pip install 'modelpatch[peft]'``).
    """
    import importlib.metadata

    from packaging.version import Version
    from transformers.integrations.peft import MIN_PEFT_VERSION

    require("peft", "peft", "Adapters (PEFT)")
    installed = importlib.metadata.version("peft")
    return Version(installed) >= Version(MIN_PEFT_VERSION), MIN_PEFT_VERSION, installed


def add_adapter(model: Any, adapter_config: Any, adapter_name: str | None = None) -> str:
    """Add a fresh adapter to ``model`` (a ``PreTrainedModel``) and activate it, as ``model.add_adapter`` does, on
    every Transformers release modelpatch is tested with, whatever PEFT release Transformers' gate asks for.

    With a PEFT that Transformers accepts this is ``model.add_adapter(adapter_config, adapter_name)``. Transformers
    5.24+ require PEFT 0.22.0 there; with an older PEFT (0.21.2 is the newest this project's registry has) the same
    is done through PEFT's own API: ``peft.inject_adapter_in_model`` (what ``add_adapter`` calls), then every tuner
    layer's ``set_adapter``, and ``model.peft_config`` / ``_hf_peft_config_loaded`` set as ``add_adapter`` sets them
    (so ``save_pretrained``, ``iter_original_state_dict`` and the optimizer checkpoint see a model with adapters
    loaded through Transformers). Transformers' other adapter methods still refuse such a PEFT.

    Args:
        model: the model; patched or not.
        adapter_config: a ``peft.PeftConfig`` of a non-prompt-learning method (LoRA, IA3, ...).
        adapter_name: default ``"default"``.

    Returns:
        ``"transformers"`` or ``"peft"``: the path taken.

    Raises:
        MissingDependencyError: PEFT is not installed (``pip install 'modelpatch[peft]'``).
        ModelpatchTypeError: ``adapter_config`` is not a ``PeftConfig``.
        ModelpatchValueError: an adapter of that name exists.
    """
    gate_open, _, _ = transformers_adapter_gate()
    if gate_open:
        model.add_adapter(adapter_config, adapter_name)
        return "transformers"
    from peft import PeftConfig, inject_adapter_in_model
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    name = adapter_name or "default"
    if not isinstance(adapter_config, PeftConfig):
        raise ModelpatchTypeError(f"adapter_config must be a peft.PeftConfig, got {type(adapter_config).__name__}")
    loaded = getattr(model, "peft_config", {}) if getattr(model, "_hf_peft_config_loaded", False) else {}
    if name in loaded:
        raise ModelpatchValueError(f"{type(model).__name__} already has an adapter named {name!r}; pick another name")
    adapter_config.base_model_name_or_path = model.__dict__.get("name_or_path", None)
    inject_adapter_in_model(adapter_config, model, name)
    model._hf_peft_config_loaded = True  # noqa: SLF001 - the flag Transformers' own load_adapter sets
    # Transformers' save_pretrained / get_adapter_state_dict of such a model refuse this PEFT with a traceback:
    # modelpatch's save_pretrained wrapper refuses first, naming the versions and the way out (adapter_save_refusal)
    model.__dict__["_modelpatch_adapters_via_peft"] = name
    if not isinstance(getattr(model, "peft_config", None), dict):
        model.peft_config = {}
    model.peft_config.setdefault(name, adapter_config)
    for module in model.modules():
        if isinstance(module, (BaseTunerLayer, ModulesToSaveWrapper)):
            module.set_adapter(name)
    return "peft"


def adapter_save_refusal(model: Any) -> str | None:
    """Why ``model.save_pretrained`` cannot save adapters that :func:`add_adapter` added through PEFT's own API
    (Transformers saves adapters with its PEFT methods, which refuse the installed PEFT), with the way out; ``None``
    for any other model, or once Transformers accepts the installed PEFT."""
    name = model.__dict__.get("_modelpatch_adapters_via_peft")
    if name is None or not getattr(model, "_hf_peft_config_loaded", False):
        return None
    gate_open, required, installed = transformers_adapter_gate()
    if gate_open:
        return None
    import transformers

    return (
        f"save_pretrained of {type(model).__name__} with adapter {name!r} (added by "
        f"modelpatch.integrations.peft.add_adapter) needs peft >= {required} on Transformers "
        f"{transformers.__version__} (installed: peft {installed}): Transformers saves adapters through its PEFT "
        f"methods, which refuse this peft. Save them with peft instead: "
        f"safetensors.torch.save_file(peft.get_peft_model_state_dict(model, adapter_name={name!r}), "
        f"'DIR/adapter_model.safetensors') and model.peft_config[{name!r}].save_pretrained('DIR'); "
        f"model.load_adapter('DIR') loads them back"
    )


_hook = PostImportHook(TARGET_MODULE, _wrap)


def install() -> None:
    """Register the PEFT wrapper view and wrap PEFT's conversion module now or when it is imported (idempotent)."""
    with _lock:
        if not len(_view):
            register_wrapper_view("peft", peft_wrapper_bases, _view, unmerged=peft_unmerged_wrappers)
        _hook.now_or_on_import()


def uninstall() -> None:
    """Restore PEFT's functions (those still wrapped by us), remove the import hook and the wrapper view."""
    with _lock:
        _hook.disarm()
        _unwrap()
        _view.undo()


def installed() -> bool:
    """Whether :func:`install` is in effect (the view registered; the wrappers in place, or the hook waiting)."""
    with _lock:
        if not len(_view):
            return False
        module = sys.modules.get(TARGET_MODULE)
        if module is None:
            return _hook.armed
        return all(getattr(module, name, None) is wrapper for name, wrapper in _WRAPPERS.items())
