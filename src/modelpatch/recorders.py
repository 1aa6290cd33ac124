"""Output recorders that follow replacement classes, per model instance.

Transformers captures ``output_attentions``/``output_hidden_states``/``output_router_logits`` with
forward hooks on modules that are ``isinstance`` of the classes named in ``_can_record_outputs``, looked
up in ``transformers.utils.output_capturing._CAN_RECORD_REGISTRY`` (keyed by ``str(model class)``, and
reset from the class attribute each time a model of that class is built).

A replacement that is not a subclass of the original is not ``isinstance`` of it, so nothing would be
captured. ``transformers.monkey_patching.patch_output_recorders`` rewrites the *class* attribute, which
then stays wrong for every later unpatched model of that class. modelpatch instead keeps *additions*
per model instance (and per class, for :func:`register_output_recorder`) in weak dictionaries and
teaches the registry object to merge them in: the registry's class is swapped once for a subclass whose
``get(model)`` adds them. Models without additions get exactly what Transformers stored.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref

import torch.nn as nn
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import output_capturing as _capturing
from transformers.utils.output_capturing import OutputRecorder

from .scope import provenance

__all__ = ["patch_output_recorders", "register_output_recorder", "unregister_output_recorder", "OutputRecorder"]

_lock = threading.Lock()
_INSTANCE_EXTRA: "weakref.WeakKeyDictionary[nn.Module, dict[str, list]]" = weakref.WeakKeyDictionary()
_USER_INSTANCE: "weakref.WeakKeyDictionary[nn.Module, dict[str, list]]" = weakref.WeakKeyDictionary()
_USER_CLASS: "weakref.WeakKeyDictionary[type, dict[str, list]]" = weakref.WeakKeyDictionary()


def _as_list(specs) -> list:
    if specs is None:
        return []
    return list(specs) if isinstance(specs, list) else [specs]


class _InstanceAwareRegistry(_capturing._CanRecordRegistry):
    """Transformers' registry, plus modelpatch's per-instance and per-class additions."""

    def get(self, model):  # noqa: D102 - same contract as the parent
        base = super().get(model)
        additions = []
        for klass in reversed(type(model).__mro__):
            extra = _USER_CLASS.get(klass)
            if extra:
                additions.append(extra)
        for table in (_INSTANCE_EXTRA, _USER_INSTANCE):
            extra = table.get(model)
            if extra:
                additions.append(extra)
        if not additions:
            return base
        merged = dict(base)
        for extra in additions:
            for name, specs in extra.items():
                merged[name] = _as_list(merged.get(name)) + list(specs)
        return merged


def install_registry_extension() -> None:
    """Swap the class of Transformers' registry object for :class:`_InstanceAwareRegistry` (idempotent)."""
    registry = _capturing._CAN_RECORD_REGISTRY
    if type(registry) is _capturing._CanRecordRegistry:
        registry.__class__ = _InstanceAwareRegistry


def _target_and_recorder(name: str, spec):
    """(target class or None, spec as an OutputRecorder) for one recorder spec in any accepted form."""
    if isinstance(spec, OutputRecorder):
        return spec.target_class, spec
    if isinstance(spec, type):
        return spec, OutputRecorder(target_class=spec, index=0 if "hidden_states" in name else 1)
    return None, spec  # a string: matched against module paths, unaffected by class replacement


def _replaced_pairs(model: nn.Module) -> set[tuple[type, type]]:
    """(original, replacement) for replaced modules that do not wrap an instance of their original
    (a wrapper's inner original is captured already; recording the wrapper too would double entries)."""
    pairs = set()
    for module in model.modules():
        found = provenance(module)
        if found is not None and not any(isinstance(m, found.original) for m in module.modules()):
            pairs.add((found.original, type(module)))
    return pairs


def patch_output_recorders(model: nn.Module) -> None:
    """Make ``output_<name>=True`` capture from replacement modules of ``model`` (idempotent).

    For every ``PreTrainedModel`` in ``model`` and every entry of its ``_can_record_outputs`` whose
    target class was replaced in it by a class that is *not* a subclass of the original, an equivalent
    recorder for the replacement class is added for that instance only. Class attributes and other
    models of the same class are untouched. Called automatically after every patched build.
    """
    install_registry_extension()
    pairs = _replaced_pairs(model)
    submodels = [m for m in model.modules() if isinstance(m, PreTrainedModel)]
    for submodel in submodels:
        base = dict.get(_capturing._CAN_RECORD_REGISTRY, str(submodel.__class__)) or {}
        additions: dict[str, list] = {}
        for name, specs in base.items():
            for spec in _as_list(specs):
                target, recorder = _target_and_recorder(name, spec)
                if target is None:
                    continue
                for original, replacement in sorted(pairs, key=lambda p: p[1].__qualname__):
                    if issubclass(original, target) and not issubclass(replacement, target):
                        additions.setdefault(name, []).append(dataclasses.replace(recorder, target_class=replacement))
        with _lock:
            if additions:
                _INSTANCE_EXTRA[submodel] = additions
            else:
                _INSTANCE_EXTRA.pop(submodel, None)


def _install_now(model: nn.Module, name: str, recorders: list[OutputRecorder]) -> None:
    """Hooks for a recorder added after Transformers already hooked ``model`` (hooks are installed once)."""
    for submodel in [m for m in model.modules() if isinstance(m, PreTrainedModel)]:
        if not getattr(submodel, "_output_capturing_hooks_installed", False):
            continue
        for path, module in submodel.named_modules():
            for rec in recorders:
                if rec.target_class is not None and isinstance(module, rec.target_class):
                    if rec.layer_name is None or f".{rec.layer_name.strip('.')}." in f".{path}.":
                        _capturing.install_output_capuring_hook(module, name, rec.index, rec.capture_initial_hidden_state)


def register_output_recorder(model_or_class, name: str, recorder) -> None:
    """Let ``model(..., output_<name>=True)`` return the outputs ``recorder`` captures, as a tuple.

    Args:
        model_or_class: a ``PreTrainedModel`` instance (applies to it and its sub-models) or a
            ``PreTrainedModel`` subclass (applies to every instance, built before or after).
        name: the output name; ``output_<name>=True`` turns capture on and ``outputs.<name>`` holds it.
        recorder: an ``OutputRecorder(target_class, index=...)``, an ``nn.Module`` subclass (index 1,
            or 0 for names containing ``hidden_states``) or a list of those.

    Raises:
        TypeError: ``model_or_class`` is neither a ``PreTrainedModel`` nor a subclass of it; a recorder
            is not an ``OutputRecorder`` or ``nn.Module`` subclass.
        ValueError: ``name`` is not a Python identifier.

    Unlike writing into Transformers' private registry, the entry survives building other models of
    the same class. The outputs are returned by the model whose ``forward`` captures outputs
    (``@capture_outputs``, usually the base model such as ``model.model``).
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"Output recorder name {name!r} must be a Python identifier (used as output_<name>)")
    recorders = []
    for spec in _as_list(recorder):
        target, rec = _target_and_recorder(name, spec)
        if target is None or not (isinstance(target, type) and issubclass(target, nn.Module)):
            raise TypeError(f"Recorder {spec!r} for output {name!r} must be an OutputRecorder or nn.Module subclass")
        recorders.append(rec)
    install_registry_extension()
    with _lock:
        if isinstance(model_or_class, PreTrainedModel):
            for submodel in [m for m in model_or_class.modules() if isinstance(m, PreTrainedModel)]:
                _USER_INSTANCE.setdefault(submodel, {})[name] = list(recorders)
        elif isinstance(model_or_class, type) and issubclass(model_or_class, PreTrainedModel):
            _USER_CLASS.setdefault(model_or_class, {})[name] = list(recorders)
        else:
            raise TypeError(
                f"register_output_recorder needs a PreTrainedModel instance or subclass, got {model_or_class!r}"
            )
    if isinstance(model_or_class, PreTrainedModel):
        _install_now(model_or_class, name, recorders)


def unregister_output_recorder(model_or_class, name: str) -> None:
    """Remove an entry added by :func:`register_output_recorder`; raises ``KeyError`` if absent."""
    with _lock:
        if isinstance(model_or_class, PreTrainedModel):
            targets = [m for m in model_or_class.modules() if isinstance(m, PreTrainedModel)]
            tables = [(_USER_INSTANCE, t) for t in targets if name in _USER_INSTANCE.get(t, {})]
        else:
            tables = [(_USER_CLASS, model_or_class)] if name in _USER_CLASS.get(model_or_class, {}) else []
        if not tables:
            raise KeyError(f"No output recorder {name!r} registered for {model_or_class!r}")
        for table, key in tables:
            del table[key][name]
