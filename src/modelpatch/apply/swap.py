"""The swap of one module by :func:`~modelpatch.apply.model_patch.patch_model`, in the order patch_model runs it.

1. refusals: wrappers (PEFT, DDP, FSDP, ``torch.compile``, ZeRO-3 partitions), accelerate hooks and offloaded
   tensors, quantized weights (:func:`refuse_wrappers`, :func:`refuse_dispatched`, :func:`refuse_quantized`);
2. targets: the modules a patch mapping replaces (:func:`find_targets`), with the unmatched-key messages;
3. constructor arguments recovered from the instance (:func:`constructor_arguments`);
4. validation on ``meta`` (:func:`validate_on_meta`): the replacement built on ``meta`` and meta stand-ins of the
   tensors moved through the rules, every key, shape, tie and inverse checked before anything is changed;
5. hand-over (:func:`swap_module`): the tensors converted, the replacement filled and put in place through an
   :class:`~modelpatch.undo.UndoStack`, the original's converted tensors freed; the :class:`Swap` it returns is what
   :meth:`~modelpatch.apply.model_patch.ModelPatch.revert` needs.
"""

from __future__ import annotations

import contextvars
import inspect
import sys
import weakref
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn as nn
from transformers.utils import logging

from ..conversion.errors import ConversionError, ConversionShapeError
from ..conversion.quantized import quantizer_label
from ..conversion.transfer import ModuleMove, TransferRules
from ..errors import ModelpatchError
from ..patching.catalog import is_modeling_module_name
from ..patching.interception import defining_init, unhooked_init
from ..patching.keys import names_a_known_class, resolve_classes, unmatched_key_hint
from ..patching.provenance import (
    KernelDecision,
    Replacement,
    hub_kernel_forward,
    provenance,
    set_kernel_decision,
    set_provenance,
)
from ..patching.registry import PatchMapping, PatchRule
from ..patching.scopes import UnmatchedPatchKeyError
from ..undo import UndoStack

__all__ = [
    "InstancePatchError",
    "InstancePatchRow",
    "Swap",
    "Target",
    "constructor_arguments",
    "find_targets",
    "owned_tensors",
    "refuse_dispatched",
    "refuse_quantized",
    "refuse_wrappers",
    "shared_tensors",
    "swap_module",
    "validate_on_meta",
]

logger = logging.get_logger("modelpatch")


class InstancePatchError(ModelpatchError, ValueError):
    """``patch_model`` cannot patch this model or module (the message names the module, the argument or the wrapper);
    the model was not modified."""


@dataclass(frozen=True)
class InstancePatchRow:
    """One module swapped by :func:`patch_model`.

    Attributes:
        path: the module's path in the model (as in ``model.named_modules()``).
        original: the original class; replacement: the replacement class; key: the patch key that chose it.
        key_map: ``{original state key: (new state keys, ...)}``, full model keys (``model.layers.0.self_attn.q_proj
            .weight -> ('model.layers.0.self_attn.qkv_proj.weight',)``): which new tensors each original parameter or
            buffer went into (an optimizer rebuilt over the new parameters follows it, see
            :meth:`ModelPatch.update_optimizer`).
    """

    path: str
    original: type
    replacement: type
    key: str
    key_map: Mapping[str, tuple[str, ...]]

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "path": self.path,
            "original": f"{self.original.__module__}.{self.original.__qualname__}",
            "replacement": f"{self.replacement.__module__}.{self.replacement.__qualname__}",
            "key": self.key,
            "key_map": {k: list(v) for k, v in self.key_map.items()},
        }


class _Gone:
    """A stand-in whose only reference dies at once: a dead weak reference after unpickling."""


def _dead_ref() -> weakref.ref[Any]:
    return weakref.ref(_Gone())


@dataclass
class Swap:
    """One replaced module and what its revert needs.

    ``pairs``: ``(original key, weak reference to the original parameter, [(new key, weak reference to a new
    parameter it went into), ...])`` for :meth:`~modelpatch.apply.model_patch.ModelPatch.update_optimizer`. The weak
    references travel through ``copy.deepcopy`` and ``pickle`` as strong ones (so a copy of the model refers to its
    own parameters) and are weak again afterwards.
    """

    path: str
    parent: nn.Module
    name: str
    original: nn.Module
    replacement: nn.Module | None
    row: InstancePatchRow
    sources: dict[str, torch.Tensor]  # full key -> the original's parameter / buffer object
    strides: dict[str, tuple[int, ...]]  # full key -> stride before the patch
    move: ModuleMove  # the conversion both ways (its forward tensors released once the replacement holds them)
    pairs: list[tuple[str, weakref.ref[nn.Parameter], list[tuple[str, weakref.ref[nn.Parameter]]]]] = field(
        default_factory=list
    )
    reversible: bool = True

    def __getstate__(self) -> dict[str, Any]:
        state = dict(vars(self))
        state["pairs"] = [(key, old(), [(k, r()) for k, r in new]) for key, old, new in self.pairs]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        def ref(value: Any) -> weakref.ref[Any]:
            return _dead_ref() if value is None else weakref.ref(value)

        pairs = [(key, ref(old), [(k, ref(p)) for k, p in new]) for key, old, new in state["pairs"]]
        vars(self).update({**state, "pairs": pairs})


def owned_tensors(
    tensors: dict[str, torch.Tensor], sources: Any = (), keep_ids: Collection[int] = frozenset()
) -> dict[str, torch.Tensor]:
    """``tensors`` where each value that shares storage with one of ``sources`` or with another value, or views only
    part of its storage, is replaced by a contiguous copy, so every result owns its memory (no hidden aliasing between
    parameters, and freeing a source really frees it). Values whose ``id`` is in ``keep_ids`` (tensors handed over as
    the same object) and meta tensors are kept as they are."""
    taken = {_storage_key(t) for t in sources if t.device.type != "meta"}
    out = {}
    for key, value in tensors.items():
        if id(value) in keep_ids or value.device.type == "meta":
            out[key] = value
            continue
        storage = _storage_key(value)
        whole = value.untyped_storage().nbytes() == value.numel() * value.element_size() and value.is_contiguous()
        if storage in taken or not whole:
            value = value.detach().clone(memory_format=torch.contiguous_format)
            storage = _storage_key(value)
        taken.add(storage)
        out[key] = value
    return out


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    return (str(tensor.device), tensor.untyped_storage().data_ptr())


# -- refusing what cannot be patched ----------------------------------------------------------------------------
_SUPPORTED = (
    "patch_model works on a plain model (a PreTrainedModel or any nn.Module holding Transformers modules), also one "
    "dispatched with accelerate (device_map) as long as the replaced modules carry no hook and no offloaded weight"
)


def refuse_wrappers(model: nn.Module) -> None:
    """Raise :class:`InstancePatchError` for wrappers whose bookkeeping a module swap would break."""
    if not isinstance(model, nn.Module):
        raise InstancePatchError(f"patch_model expects an nn.Module, got {type(model).__name__}")
    reasons: list[str] = []
    peft = sys.modules.get("peft")
    if peft is not None and isinstance(model, getattr(peft, "PeftModel", ())):
        reasons.append(
            f"{type(model).__name__} is a PEFT model: its adapters wrap the layers it targets; call patch_model on "
            "the base model before get_peft_model (or on model.merge_and_unload())"
        )
    wrappers: list[tuple[type, str]] = [
        (nn.DataParallel, "DataParallel"),
        (nn.parallel.DistributedDataParallel, "DistributedDataParallel"),
    ]
    if torch.distributed.is_available():
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        wrappers += [(FullyShardedDataParallel, "FSDP"), (FSDPModule, "FSDP2 (fully_shard)")]
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    if dynamo is not None:
        wrappers.append((dynamo.OptimizedModule, "torch.compile"))
    for path, module in model.named_modules():
        for cls, name in wrappers:
            if isinstance(module, cls):
                where = f" at '{path}'" if path else ""
                reasons.append(
                    f"the model is wrapped by {name}{where}: it keeps its own references to parameters (gradient "
                    "buckets, flat or sharded parameters, compiled graphs); call patch_model before wrapping"
                )
        if isinstance(module._modules.get("base_layer"), nn.Module):
            reasons.append(
                f"'{path}' is a PEFT adapter layer (it has a base_layer): call patch_model before get_peft_model"
            )
        partitioned = next((n for n, p in module.named_parameters(recurse=False) if hasattr(p, "ds_shape")), None)
        if partitioned is not None:
            name = f"{path}.{partitioned}" if path else partitioned
            reasons.append(
                f"its parameters are DeepSpeed ZeRO-3 partitions ('{name}' holds {tuple(module.get_parameter(partitioned).shape)} "
                "of its full shape): load the model patched instead, under ZeRO-3 too (`with recipe.apply(): "
                "from_pretrained(...)` after TrainingArguments(deepspeed=...))"
            )
        if reasons:
            break
    if reasons:
        raise InstancePatchError(f"cannot patch {type(model).__name__}: {reasons[0]}. {_SUPPORTED}.")


def refuse_dispatched(path: str, module: nn.Module) -> None:
    for sub_path, sub in module.named_modules():
        where = f"{path}.{sub_path}" if sub_path else path
        if "_hf_hook" in vars(sub):
            raise InstancePatchError(
                f"cannot patch '{path}': '{where}' carries an accelerate hook ({type(vars(sub)['_hf_hook']).__name__}, "
                "from device_map dispatch or offloading) that the swap would drop. Load the model patched instead "
                "(`with recipe.apply(): from_pretrained(..., device_map=...)`), or patch before dispatching. The model "
                f"was not modified. {_SUPPORTED}."
            )
    for key, tensor in module.state_dict(keep_vars=True).items():
        if tensor.device.type == "meta":
            raise InstancePatchError(
                f"cannot patch '{path}': '{path}.{key}' has no data (a meta tensor: offloaded or not materialised). "
                "The model was not modified."
            )


_QUANTIZER_MODULES = ("bitsandbytes", "optimum.quanto", "torchao")


def _quantizer_name(model: nn.Module) -> str | None:
    """The quantizer Transformers loaded ``model`` with (``"bitsandbytes 8-bit"``, ``"torchao Int8WeightOnlyConfig"``,
    ...), from ``model.hf_quantizer``, ``model.config.quantization_config`` or ``model.is_quantized``; ``None``: not
    loaded quantized."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and getattr(quantizer, "quantization_config", None) is not None:
        return quantizer_label(quantizer)
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    if config is not None:
        method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
        return str(getattr(method, "value", method) or type(config).__name__)
    if getattr(model, "is_quantized", False) is True:
        return "a quantizer"
    return None


def _quantized_parts(path: str, module: nn.Module) -> list[str]:
    """What in ``module`` (at ``path``) is held quantized: quantizer layer classes (bitsandbytes ``Linear8bitLt``,
    quanto ``QLinear``, ...) and parameters that are not plain floating-point tensors (``Int8Tensor``,
    ``Int8Params``, integer data)."""
    parts: list[str] = []
    for sub_path, sub in module.named_modules():
        where = f"{path}.{sub_path}" if sub_path else path
        cls = type(sub)
        if any(cls.__module__ == name or cls.__module__.startswith(name + ".") for name in _QUANTIZER_MODULES):
            parts.append(f"'{where}' ({cls.__name__})")
            continue
        for name, param in sub.named_parameters(recurse=False):
            if type(param) not in (torch.Tensor, nn.Parameter) or not param.is_floating_point():
                parts.append(f"'{where}.{name}' ({type(param).__name__}, {param.dtype})")
    return parts


def refuse_quantized(model: nn.Module, targets: Sequence[Target]) -> None:
    """Raise :class:`InstancePatchError` when ``model`` was loaded quantized by Transformers, or a module to replace
    holds quantized layers or weights: the conversion operations work on full-precision tensors (concatenating
    quantized rows, stacking ``Int8Tensor`` experts fail or are wrong), and a replacement built in full precision
    would leave those weights unquantized in a model its quantizer calls quantized."""
    label = _quantizer_name(model)
    parts = [part for target in targets for part in _quantized_parts(target.path, target.module)]
    if label is None and not parts:
        return
    what = f"it was loaded quantized ({label})" if label is not None else "it holds quantized weights"
    if parts:
        what += f"; the modules to replace hold {', '.join(parts[:3])}"
        what += f" and {len(parts) - 3} more" if len(parts) > 3 else ""
    raise InstancePatchError(
        f"cannot patch {type(model).__name__}: {what}. patch_model converts full-precision weights only, and "
        "builds full-precision replacements. Load the model patched and quantized in one go instead: `with "
        "recipe.apply(): AutoModelForCausalLM.from_pretrained(path, quantization_config=...)` (the quantizer then "
        "quantizes the replacements' weights), or call patch_model before quantizing. The model was not modified."
    )


# -- constructor arguments --------------------------------------------------------------------------------------
_MISSING: Any = object()
_SCALARS = (int, float, str, bool, type(None))


def constructor_arguments(module: nn.Module, model: nn.Module, path: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments ``type(module).__init__`` was (most likely) called with, recovered from the instance.

    For each parameter of the signature, in order: the instance attribute of that name (``self.config``,
    ``self.layer_idx``, ``self.intermediate_size``, ... as Transformers' modules store them); for ``config``, the
    ``config`` of the nearest enclosing ``PreTrainedModel`` (modules such as ``Qwen3MoeExperts`` read their config
    without keeping it); for a scalar such as ``layer_idx``, the one value the module's submodules store under that
    name (a decoder layer passes ``layer_idx`` to its attention); a parameter whose default is ``None``, that
    default. ``*args`` / ``**kwargs`` are not filled.

    Returns:
        ``(args, kwargs)``: positional-or-keyword parameters positionally, keyword-only ones by name.

    Raises:
        InstancePatchError: a parameter could not be recovered (the message names it and the fix: a
            ``from_module(cls, original)`` classmethod on the replacement).
    """
    cls = type(module)
    try:
        signature = inspect.signature(defining_init(cls.__init__))
    except (TypeError, ValueError) as exc:
        raise InstancePatchError(f"cannot read the signature of {cls.__qualname__}.__init__: {exc}") from None
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for parameter in list(signature.parameters.values())[1:]:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        value = _recover(module, model, path, parameter.name)
        if value is _MISSING:
            if parameter.default is None:
                value = None
            else:
                raise InstancePatchError(
                    f"cannot build a replacement for '{path}' ({cls.__qualname__}): constructor argument "
                    f"{parameter.name!r} of {cls.__qualname__}.__init__ could not be recovered from the instance (no "
                    f"attribute {parameter.name!r} on it{' or on an enclosing PreTrainedModel' if parameter.name == 'config' else ''}"
                    f"). Define a classmethod from_module(cls, original) on the replacement to build it from the "
                    "original module. The model was not modified."
                )
        if parameter.kind == parameter.KEYWORD_ONLY:
            kwargs[parameter.name] = value
        else:
            args.append(value)
    return tuple(args), kwargs


def _recover(module: nn.Module, model: nn.Module, path: str, name: str) -> Any:
    own = vars(module)
    if name in own and not name.startswith("_"):
        return own[name]
    for table in ("_modules", "_parameters", "_buffers"):
        if name in own.get(table, {}):
            return own[table][name]
    if name == "config":
        from transformers import PreTrainedModel

        parts = path.split(".") if path else []
        for depth in range(len(parts) - 1, -1, -1):
            ancestor = model.get_submodule(".".join(parts[:depth]))
            if isinstance(ancestor, PreTrainedModel):
                return ancestor.config
        return _MISSING
    values = []
    for sub in module.modules():
        value = vars(sub).get(name, _MISSING)
        if value is not _MISSING and isinstance(value, _SCALARS) and value not in values:
            values.append(value)
    return values[0] if len(values) == 1 else _MISSING


def _build(replacement: type, original: nn.Module, args: tuple, kwargs: dict, device: torch.device | str) -> nn.Module:
    """Build ``replacement`` on ``device`` in an empty context (no patch scope of the caller applies inside)."""

    def build() -> nn.Module:
        with torch.device(device):
            from_module = getattr(replacement, "from_module", None)
            if from_module is not None:
                built = from_module(original)
            else:
                built = cast(Any, replacement).__new__(replacement)
                unhooked_init(replacement)(built, *args, **kwargs)
        if not isinstance(built, nn.Module):
            raise InstancePatchError(
                f"{replacement.__qualname__}.from_module returned {type(built).__name__}, not an nn.Module"
            )
        return built

    return contextvars.Context().run(build)


# -- finding the modules to replace -----------------------------------------------------------------------------
@dataclass
class Target:
    path: str
    module: nn.Module
    rule: PatchRule
    replacement: nn.Module | None = None  # built on meta
    arguments: tuple[tuple[Any, ...], dict[str, Any]] = ((), {})
    real_build: bool = False  # some tensors of the replacement are not provided: build it on real memory
    tied_outside: set[str] = field(default_factory=set)  # full keys shared with parameters outside the module
    missing: set[str] = field(default_factory=set)  # full keys of the replacement no rule provides (init values)
    reversible: bool = True  # the inverse rules give the original tensors back (checked on meta)


def find_targets(model: nn.Module, mapping: PatchMapping, strict: bool) -> list[Target]:
    modules = list(model.named_modules())
    classes = {type(m) for _, m in modules if is_modeling_module_name(type(m).__module__)}
    resolution = resolve_classes(mapping, classes)
    for path, module in modules:
        found = provenance(module)
        rule = mapping.resolve(found.original.__name__) if found is not None else None
        if found is not None and rule is not None:
            raise InstancePatchError(
                f"'{path or '<root>'}' is already a replacement ({found.replacement.__qualname__} in place of "
                f"{found.original.__name__}, key {found.key!r}{', by patch_model' if found.via == 'patch_model' else ''})"
                f" and key {rule.key!r} would replace it again; revert that patch first, or patch a model built "
                "without it. The model was not modified."
            )
    targets: list[Target] = []
    nested: list[str] = []
    for path, module in modules:
        entry = resolution.get(type(module))
        if entry is None:
            continue
        if any(path.startswith(t.path + ".") for t in targets):
            nested.append(path)
            continue
        if path == "":
            raise InstancePatchError(
                f"key {entry[0].key!r} matches the model itself ({type(module).__name__}); patch_model replaces "
                "submodules. The model was not modified."
            )
        targets.append(Target(path, module, entry[0]))
    if nested:
        logger.warning(
            f"modelpatch: patch_model replaces {len(nested)} module(s) inside modules it also replaces, with them: "
            f"{nested[:4]}{' ...' if len(nested) > 4 else ''} (their containers' replacements build their own)"
        )
    _check_keys(mapping, resolution, strict, {type(m).__name__ for _, m in modules})
    return targets


def _check_keys(mapping: PatchMapping, resolution: dict, strict: bool, built: set[str]) -> None:
    matched = {key for _, keys in resolution.values() for key in keys}
    unused = [r for r in mapping.rules if r.key not in matched]
    if not unused:
        return
    typos = [r.key for r in unused if not names_a_known_class(r)]
    other = [r.key for r in unused if r.key not in typos]
    messages = []
    if typos:
        hints = "".join(unmatched_key_hint(key, built) for key in typos)
        messages.append(
            f"modelpatch: patch key(s) {typos} matched no module class of the model, nor any module class of "
            f"Transformers; check the class name (case-sensitive) or the pattern{hints}"
        )
    if other and not matched:
        messages.append(
            f"modelpatch: no patch key applies to this model: key(s) {other} name classes of another model family, or "
            "classes this model does not use"
        )
    elif other:
        logger.info(f"modelpatch: patch key(s) {other} not applicable to this model (classes it does not use)")
    if messages and strict:
        raise UnmatchedPatchKeyError("\n".join(messages) + ". The model was not modified.")
    for message in messages:
        logger.warning(message)


def shared_tensors(model: nn.Module) -> dict[int, list[str]]:
    """``{id(tensor): [every full key it is registered under]}`` for tensors registered more than once."""
    names: dict[int, list[str]] = {}
    for key, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(key)
    for key, buffer in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(buffer), []).append(key)
    return {k: v for k, v in names.items() if len(v) > 1}


def _device_of(module: nn.Module) -> torch.device:
    for tensor in module.state_dict(keep_vars=True).values():
        return tensor.device
    return torch.device("cpu")


def validate_on_meta(
    model: nn.Module, target: Target, transfer: TransferRules, ties: dict, strict: bool, keep_original: bool
) -> set[int]:
    """Build ``target``'s replacement on ``meta`` and move meta stand-ins of its tensors: every key, shape, tie and
    constructor argument is checked before anything is changed. Returns the ids of the rules that fired."""
    path, original, rule = target.path, target.module, target.rule
    replacement_cls = rule.replacement
    if getattr(replacement_cls, "from_module", None) is None:
        target.arguments = constructor_arguments(original, model, path)
    args, kwargs = target.arguments
    try:
        built = _build(replacement_cls, original, args, kwargs, "meta")
    except ModelpatchError:
        raise
    except Exception as exc:
        raise InstancePatchError(
            f"building {replacement_cls.__qualname__} for '{path}' ({type(original).__name__}) failed: "
            f"{type(exc).__name__}: {exc} (built with the original's constructor arguments: {len(args)} positional, "
            f"keywords {sorted(kwargs)}; a from_module(cls, original) classmethod builds it otherwise). The model was "
            "not modified."
        ) from exc
    target.replacement = built
    prefix = path + "."
    sources = {prefix + k: t for k, t in original.state_dict(keep_vars=True).items()}
    stand_ins = {k: torch.empty(t.shape, dtype=t.dtype, device="meta") for k, t in sources.items()}
    expected = {prefix + k: tuple(t.shape) for k, t in built.state_dict(keep_vars=True).items()}
    moved = transfer.move(stand_ins, expected, model)
    for key, tensor in moved.tensors.items():
        if key not in expected:
            raise ConversionError(
                f"moving '{path}' into {replacement_cls.__qualname__}: the rules produced '{key}' (from "
                f"{list(moved.origins[key])}), which is not a parameter or buffer of the replacement (it has "
                f"{sorted(k[len(prefix) :] for k in expected)}). The model was not modified."
            )
        if tuple(tensor.shape) != expected[key]:
            raise ConversionShapeError(key, tensor.shape, expected[key], f"patch_model of '{path}'")
    for owners in ties.values():
        names = [n for n in owners if n.startswith(prefix)]
        outside = [n for n in owners if not n.startswith(prefix)]
        if not names or not outside:
            continue
        target.tied_outside.update(names)
        for out_key, origin in moved.origins.items():
            if any(n in origin for n in names) and not any(moved.tensors[out_key] is stand_ins[n] for n in names):
                raise InstancePatchError(
                    f"cannot patch '{path}': '{names[0]}' is tied to {outside} outside the module, and the rules change "
                    f"its layout (into '{out_key}'); the tie could not be kept. The model was not modified."
                )
    _refuse_partly_frozen(path, built, sources, moved)
    missing = sorted(moved.extra)
    if missing:
        message = (
            f"modelpatch: patch_model of '{path}': {len(missing)} tensor(s) of {replacement_cls.__qualname__} are not "
            f"provided by the conversion rules ({[k[len(prefix) :] for k in missing[:6]]}); they get the values its "
            "__init__ gives them. If they should come from the original module, the layouts need conversion rules"
        )
        if strict:
            raise ConversionError(message + " (strict). The model was not modified.")
        logger.warning(message)
    target.missing = set(missing)
    target.reversible = moved.round_trips()
    if not target.reversible:
        message = (
            f"patch_model of '{path}': the inverse conversion rules do not give {type(original).__name__}'s tensors "
            "back, so revert could not write what is trained on the replacement back into it"
        )
        if not keep_original:
            raise InstancePatchError(
                message + "; pass keep_original=True to patch anyway (revert then swaps the untouched original "
                "back and drops the training), or add the rules that invert exactly. The model was not modified."
            )
        logger.info(message + " (keep_original=True: revert swaps the original back)")
    state_keys = set(built.state_dict(keep_vars=True))
    others = [k for k, _ in built.named_buffers() if k not in state_keys]  # non-persistent buffers: __init__ values
    target.real_build = bool(missing or others or _meta_attributes(built))
    return moved.fired


def _refuse_partly_frozen(path: str, built: nn.Module, sources: dict[str, torch.Tensor], moved: ModuleMove) -> None:
    """Raise :class:`InstancePatchError` when a new parameter of ``built`` is made from original parameters of which
    some are frozen (``requires_grad=False``) and some are not: one parameter cannot be frozen in part (training it
    would change the frozen ones, written back on revert)."""
    prefix = path + "."
    new_params = {prefix + k for k, _ in built.named_parameters(remove_duplicate=False)}
    for key, origin in moved.origins.items():
        if key not in new_params:
            continue
        params = [o for o in origin if isinstance(sources.get(o), nn.Parameter)]
        frozen = [o for o in params if not sources[o].requires_grad]
        trainable = [o for o in params if sources[o].requires_grad]
        if frozen and trainable:
            raise InstancePatchError(
                f"cannot patch '{path}': the new parameter '{key}' is made from frozen {frozen} "
                f"(requires_grad=False) and trainable {trainable}; one parameter cannot be frozen in part (training "
                "it would change the frozen values). Freeze all of its sources or none before patching, or freeze "
                f"'{key}' after patching. The model was not modified."
            )


def _meta_attributes(module: nn.Module) -> bool:
    """Whether a plain tensor attribute (not a parameter or buffer) of the module tree was built on ``meta``."""
    return any(
        isinstance(value, torch.Tensor) and value.device.type == "meta"
        for sub in module.modules()
        for value in vars(sub).values()
    )


def _cast_floating(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating-point parameters and buffers of ``module``'s tree to ``dtype``, in place."""
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for tensor in table.values():
                if tensor is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                    tensor.data = tensor.data.to(dtype)


def swap_module(
    model: nn.Module, target: Target, transfer: TransferRules, keep_original: bool, undo: UndoStack
) -> Swap:
    """Convert ``target``'s tensors, fill the replacement, put it in place (through ``undo``), free the original's
    converted tensors (unless ``keep_original`` or the module is not reversible). Returns what its revert needs."""
    path, original = target.path, target.module
    prefix = path + "."
    sources = {prefix + k: t for k, t in original.state_dict(keep_vars=True).items()}
    replacement = target.replacement
    assert replacement is not None
    expected = {prefix + k: tuple(t.shape) for k, t in replacement.state_dict(keep_vars=True).items()}
    with torch.no_grad():
        moved = transfer.move(sources, expected, model)
    if target.real_build:
        args, kwargs = target.arguments
        replacement = _build(target.rule.replacement, original, args, kwargs, _device_of(original))
        dtype = next((t.dtype for t in sources.values() if t.is_floating_point()), None)
        if dtype is not None:
            _cast_floating(replacement, dtype)
    # a tensor no rule changes is handed over as the same object, unless the original keeps its tensors (then only
    # tensors tied outside the module are shared: the tie wins)
    keep_all = keep_original or not target.reversible  # the original keeps its tensors
    keep_ids = {id(t) for k, t in sources.items() if not keep_all or k in target.tied_outside}
    tensors = owned_tensors(moved.tensors, sources=sources.values(), keep_ids=keep_ids)
    handed_over = {id(v) for v in tensors.values()} & {id(t) for t in sources.values()}
    pairs: dict[str, list[tuple[str, nn.Parameter]]] = {}
    with torch.no_grad():
        for key, value in tensors.items():
            owner_path, _, leaf = key[len(prefix) :].rpartition(".")
            owner = replacement.get_submodule(owner_path)
            if leaf in owner._parameters:
                if not isinstance(value, nn.Parameter):
                    grad = any(sources[o].requires_grad for o in moved.origins[key] if o in sources)
                    value = nn.Parameter(value, requires_grad=grad)
                owner._parameters[leaf] = value
                for origin in moved.origins[key]:
                    pairs.setdefault(origin, []).append((key, value))
            else:
                owner._buffers[leaf] = value.detach() if isinstance(value, nn.Parameter) else value
    leftovers = [k for k, t in replacement.state_dict(keep_vars=True).items() if t.device.type == "meta"]
    if leftovers:
        raise ConversionError(f"patch_model of '{path}': {leftovers} were left without data")
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    key_map = {k: tuple(n for n, o in moved.origins.items() if k in o) for k in sources}
    row = InstancePatchRow(path, type(original), type(replacement), target.rule.key, key_map)
    swap = Swap(
        path=path,
        parent=parent,
        name=name,
        original=original,
        replacement=replacement,
        row=row,
        sources=sources,
        strides={k: tuple(t.stride()) for k, t in sources.items()},
        move=moved,
        reversible=target.reversible,
        pairs=[
            (k, weakref.ref(sources[k]), [(n, weakref.ref(p)) for n, p in ps])
            for k, ps in pairs.items()
            if isinstance(sources.get(k), nn.Parameter)
        ],
    )
    set_provenance(
        replacement, Replacement(type(original), type(replacement), target.rule.key, target.arguments, "patch_model")
    )
    if hub_kernel_forward(original) is not None:  # the swap drops a hub kernel: the report says so
        layer = str(getattr(type(original), "kernel_layer_name", "?"))
        repo = vars(original).get("_kernel_repo")
        decision = KernelDecision(layer, str(repo) if repo is not None else "unknown repository", "patch")
        set_kernel_decision(replacement, decision)
    undo.setattr(parent, name, replacement)
    target.replacement = None
    moved.release()
    if not keep_all:
        freed: set[int] = set()
        for tensor in sources.values():
            if id(tensor) in handed_over or id(tensor) in freed:
                continue
            freed.add(id(tensor))
            tensor.grad = None
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return swap
