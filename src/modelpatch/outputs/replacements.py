"""Output recorders that follow replacement classes, per model instance, and the registry extension that merges them
(and the user recorders of :mod:`.recorders`) in.

Transformers captures ``output_attentions``/``output_hidden_states``/``output_router_logits`` with forward hooks on
modules that are ``isinstance`` of the classes named in ``_can_record_outputs``, looked up in
``transformers.utils.output_capturing._CAN_RECORD_REGISTRY`` (keyed by ``str(model class)``, and reset from the class
attribute each time a model of that class is built).

A replacement that is not a subclass of the original is not ``isinstance`` of it, so nothing would be captured.
``transformers.monkey_patching.patch_output_recorders`` rewrites the *class* attribute, which then stays wrong for
every later unpatched model. modelpatch keeps *additions* on the model instance and teaches the registry object to
merge them in (its class is swapped once for a subclass whose ``get(model)`` adds them). Models without additions get
exactly what Transformers stored.
"""

from __future__ import annotations

import dataclasses

import torch.nn as nn
from transformers.utils import output_capturing as _capturing

from ..lazy_imports import pretrained_model_class
from ..patching.provenance import provenance
from ..undo import UndoStack
from .recorders import NO_HOOK, as_list, own_entries, require_extension, sync_hooks, target_and_recorder, user_recorders

__all__ = ["patch_output_recorders", "install_registry_extension", "InstanceAwareRegistry"]

_ADDITIONS_ATTR = "_modelpatch_recorder_additions"  # {name: [OutputRecorder]} for replacement classes


class InstanceAwareRegistry(_capturing._CanRecordRegistry):
    """Transformers' registry, plus modelpatch's per-instance additions and user recorders."""

    merges_modelpatch_recorders = True  # what :func:`.recorders.require_extension` checks

    def get(self, model):  # type: ignore[override]  # same contract as the parent's get(model)
        base = super().get(model)
        additions = own_entries(model, _ADDITIONS_ATTR)
        user = user_recorders(model)
        if not additions and not user:
            return base
        merged = dict(base)
        for name, specs in additions.items():
            merged[name] = as_list(merged.get(name)) + list(specs)
        for name in user:
            merged.setdefault(name, NO_HOOK)
        if user:
            sync_hooks(model, user)
        return merged


def install_registry_extension(undo: UndoStack) -> None:
    """Swap the class of Transformers' registry object for :class:`InstanceAwareRegistry` (idempotent); the swap
    is pushed on ``undo``."""
    registry = _capturing._CAN_RECORD_REGISTRY
    if type(registry) is _capturing._CanRecordRegistry:
        undo.setattr(registry, "__class__", InstanceAwareRegistry, raw=True)


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
    require_extension()
    pairs = _replaced_pairs(model)
    pretrained = pretrained_model_class()
    for submodel in [m for m in model.modules() if isinstance(m, pretrained)]:
        base = dict.get(_capturing._CAN_RECORD_REGISTRY, str(submodel.__class__)) or {}
        additions: dict[str, list] = {}
        for name, specs in base.items():
            for spec in as_list(specs):
                target, recorder = target_and_recorder(name, spec)
                if target is None:
                    continue
                for original, replacement in sorted(pairs, key=lambda p: p[1].__qualname__):
                    if issubclass(original, target) and not issubclass(replacement, target):
                        additions.setdefault(name, []).append(dataclasses.replace(recorder, target_class=replacement))
        submodel.__dict__[_ADDITIONS_ATTR] = additions
