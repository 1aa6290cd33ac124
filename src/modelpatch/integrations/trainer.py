"""The Trainer's optimizer checkpoint in the original layout, so a run resumes across layouts.

A patched model's Trainer checkpoint already holds its weights in the original layout (``save_pretrained``), and
resuming loads them into a patched model through the ``load_state_dict`` hooks of :mod:`modelpatch.conversion.
statedict`. This module does the same for ``optimizer.pt``, by wrapping two methods of ``transformers.Trainer``:

* ``_save_optimizer_and_scheduler``: for a model with a layout of its own
  (:func:`~modelpatch.conversion.optimizer.carries_own_layout`), ``optimizer.pt`` is written in the original layout
  (:func:`~modelpatch.conversion.optimizer.original_optimizer_state_dict`): what an unpatched run of the same
  optimizer writes, so an unpatched Trainer resumes from it as from its own. The state is converted before anything
  is written; state that cannot be converted (Adafactor's factored state on a converted parameter) is written in
  the model's own layout, as without modelpatch, with a warning (the same recipe resumes from it), and
  :data:`LAYOUT_FILE` next to it names that layout (model class, conversion rules, param group sizes).
* ``_load_optimizer_and_scheduler``: for such a model, the state dict read from ``optimizer.pt`` goes through
  :func:`~modelpatch.conversion.optimizer.optimizer_state_dict_in_model_layout` before the optimizer loads it, so
  a checkpoint of an unpatched run (or of a run with the same recipe, in either layout) resumes the patched model.
  For a model without a layout of its own (unpatched), the state dict's param groups are checked against the
  optimizer's first (:func:`check_optimizer_checkpoint_layout`): a patched run's own-layout ``optimizer.pt`` is
  refused with :class:`~modelpatch.conversion.errors.OptimizerStateError` naming both layouts, instead of torch's
  bare ``ValueError`` about a parameter group's size.

Under FSDP, ``_load_from_checkpoint`` is wrapped too: accelerate's resume files (``pytorch_model_fsdp.bin``,
``pytorch_model_fsdp_0/``) hold the trained model's own layout; a model of another layout (another recipe, or
none) resuming from them is refused before anything is loaded (:func:`check_fsdp_checkpoint_layout`), instead of
torch failing on a bare key after the model was sharded.

Only the plain path of both optimizer methods (one process or DDP) is changed (no DeepSpeed, FSDP, SageMaker or XLA, which keep
their own optimizer formats); every other model goes through Transformers' methods untouched. During the call the
Trainer's optimizer object has an instance attribute ``state_dict`` (save) or ``load_state_dict`` (load) in front of
its own method, removed when the call returns.

**Installation.** :func:`install` (called by :func:`modelpatch.apply.transformers.install`, i.e. on import of
modelpatch) wraps the methods on ``transformers.Trainer`` when ``transformers.trainer`` is already imported,
else right after it is imported (an import hook answering for that one module name only, as :mod:`.peft` does).
:func:`uninstall` restores the methods and removes the hook. Importing modelpatch never imports the Trainer.
"""

from __future__ import annotations

import functools
import sys
import threading
from types import ModuleType

from transformers.utils import logging

from ..conversion.compose import resolve_model_rules
from ..conversion.errors import OptimizerStateError, StateDictLayoutError
from ..conversion.optimizer import (
    carries_own_layout,
    optimizer_state_dict_in_model_layout,
    original_optimizer_state_dict,
)
from ..conversion.state import get_state
from ..lazy_imports import PostImportHook, pretrained_model_class
from ..undo import UndoStack

__all__ = [
    "install",
    "uninstall",
    "installed",
    "TARGET_MODULE",
    "LAYOUT_FILE",
    "check_fsdp_checkpoint_layout",
    "check_optimizer_checkpoint_layout",
    "fsdp_checkpoint_keys",
]

logger = logging.get_logger("modelpatch.integrations.trainer")

TARGET_MODULE = "transformers.trainer"
"""Transformers' module holding ``Trainer`` (imported lazily by ``transformers``)."""

_lock = threading.RLock()
_installed = UndoStack()


LAYOUT_FILE = "modelpatch_optimizer_layout.json"
"""Written next to ``optimizer.pt`` when it keeps the patched model's own layout: ``{"layout": "model", "model":
class name, "rules": names of the conversion rules' owners, "param_groups": parameters per group}``."""


def _plain(trainer, *, own_layout: bool = True) -> bool:
    """Whether ``trainer`` saves and loads ``optimizer.pt`` with ``torch.save``/``load_state_dict`` of the whole
    optimizer state dict (no DeepSpeed/FSDP/SageMaker/XLA), and (``own_layout``) its model has a layout of its own."""
    from transformers.utils import is_sagemaker_mp_enabled, is_torch_xla_available

    if is_torch_xla_available() or is_sagemaker_mp_enabled():
        return False
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
        return False
    model = trainer.model
    if trainer.optimizer is None or not isinstance(model, pretrained_model_class()):
        return False  # e.g. a PeftModel: its adapters keep their own layout
    if getattr(model, "_hf_peft_config_loaded", False):
        return False  # adapters loaded through Transformers (model.load_adapter): likewise
    if not own_layout:
        return True
    try:
        return carries_own_layout(model)
    except Exception:  # noqa: BLE001 - a model modelpatch cannot inspect: Transformers' own path
        return False


def _rule_names(model) -> list[str]:
    """Names of the rule sets (registry names) behind ``model``'s own layout, as far as known."""
    state = get_state(model)
    owner = state.owner if state is not None else getattr(resolve_model_rules(model), "owner", {})
    return sorted({str(name) for name in owner.values()})


def _layout_file(output_dir, content: dict | None) -> None:
    """Write :data:`LAYOUT_FILE` in ``output_dir`` (``content``), or remove a stale one (``None``)."""
    import json
    import os

    path = os.path.join(output_dir, LAYOUT_FILE)
    if content is None:
        if os.path.isfile(path):
            os.remove(path)
        return
    with open(path, "w") as f:
        json.dump(content, f)


def _save_wrapper(original):
    @functools.wraps(original)
    def _save_optimizer_and_scheduler(self, output_dir, *args, **kwargs):
        if not _plain(self):
            return original(self, output_dir, *args, **kwargs)
        should_save = getattr(self.args, "should_save", True)
        try:
            state = original_optimizer_state_dict(self.model, self.optimizer)
        except OptimizerStateError as exc:
            logger.warning(
                f"modelpatch: optimizer.pt in {output_dir} keeps the layout of this {type(self.model).__name__} (an "
                f"unpatched run cannot resume from it; the same recipe can): {exc}"
            )
            result = original(self, output_dir, *args, **kwargs)
            if should_save:
                _layout_file(
                    output_dir,
                    {
                        "layout": "model",
                        "model": type(self.model).__name__,
                        "rules": _rule_names(self.model),
                        "param_groups": [len(g["params"]) for g in self.optimizer.param_groups],
                    },
                )
            return result
        with UndoStack() as undo:
            undo.setattr(self.optimizer, "state_dict", lambda: state, raw=True)
            result = original(self, output_dir, *args, **kwargs)
        if should_save:
            _layout_file(output_dir, None)
        return result

    return _save_optimizer_and_scheduler


def check_optimizer_checkpoint_layout(model, optimizer, state_dict: dict, checkpoint) -> None:
    """Refuse to load ``state_dict`` (read from ``optimizer.pt`` of the Trainer checkpoint ``checkpoint``) into
    ``optimizer`` over the unpatched ``model`` when its param groups do not hold as many parameters as the
    optimizer's: the state of a patched run kept in that run's own layout (Adafactor's factored state, or any state
    modelpatch could not convert; :data:`LAYOUT_FILE` then names it), which torch would refuse with a bare
    ``ValueError`` about a parameter group's size. Nothing is loaded into the optimizer (nor, by the Trainer, the
    scheduler).

    Raises:
        OptimizerStateError: naming the checkpoint, its layout (model class and conversion rules, when
            :data:`LAYOUT_FILE` is there), this model's layout, the parameters of each param group on both sides
            and the first group that differs, and the way out (resume with the recipe the run was trained with).
    """
    import json
    import os

    theirs = [len(g["params"]) for g in state_dict.get("param_groups", [])]
    ours = [len(g["params"]) for g in optimizer.param_groups]
    if theirs == ours:
        return
    name = type(model).__name__
    path = os.path.join(checkpoint, LAYOUT_FILE)
    saved = None
    if os.path.isfile(path):
        with open(path) as f:
            saved = json.load(f)
    if saved is not None and saved.get("layout") == "model":
        rules = saved.get("rules") or []
        by = f" (conversion rule set(s) {', '.join(repr(r) for r in rules)})" if rules else ""
        layout = (
            f"the own layout of a patched {saved.get('model', name)}{by}, kept there because its state could not be "
            "converted to the original layout (modelpatch warned when it was saved)"
        )
    else:
        layout = "a layout other than this model's"
    if len(theirs) != len(ours):
        differs = f"{len(theirs)} param group(s) in the checkpoint, {len(ours)} here"
    else:
        g = next(i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b)
        differs = f"param group {g} has {theirs[g]} parameters in the checkpoint, {ours[g]} here"
    raise OptimizerStateError(
        f"resume_from_checkpoint={str(checkpoint)!r}: optimizer.pt holds {layout}, param groups of {theirs} "
        f"parameters; this {name} is unpatched (the original layout), param groups of {ours} parameters: "
        f"{differs}. Resume with the recipe (patch) the run was trained with, as the save-time warning said; "
        "a new run can start from the checkpoint's model.safetensors (original layout), which from_pretrained "
        "loads with or without a patch. Nothing was loaded into the optimizer or the scheduler."
    )


def _load_wrapper(original):
    @functools.wraps(original)
    def _load_optimizer_and_scheduler(self, checkpoint, *args, **kwargs):
        if checkpoint is None or not _plain(self, own_layout=False):
            return original(self, checkpoint, *args, **kwargs)
        optimizer, model = self.optimizer, self.model
        own = optimizer.load_state_dict
        try:
            own_layout = carries_own_layout(model)
        except Exception:  # noqa: BLE001 - a model modelpatch cannot inspect: Transformers' own path
            return original(self, checkpoint, *args, **kwargs)

        def load_state_dict(state_dict):
            if own_layout:
                return own(optimizer_state_dict_in_model_layout(model, optimizer, state_dict))
            check_optimizer_checkpoint_layout(model, optimizer, state_dict, checkpoint)
            return own(state_dict)

        with UndoStack() as undo:
            undo.setattr(optimizer, "load_state_dict", load_state_dict, raw=True)
            return original(self, checkpoint, *args, **kwargs)

    return _load_optimizer_and_scheduler


FSDP_MODEL_FILES = ("pytorch_model_fsdp.bin", "pytorch_model_fsdp_0")
"""accelerate's FSDP model resume files in a Trainer checkpoint: the full state dict (``FULL_STATE_DICT``) and the
torch.distributed.checkpoint folder (``SHARDED_STATE_DICT``), both written from ``model.state_dict()``."""


def fsdp_checkpoint_keys(checkpoint) -> tuple[str, set[str]] | None:
    """``(file name, keys)`` of accelerate's FSDP model resume file in the Trainer checkpoint folder
    ``checkpoint`` (the keys are read, not the tensors), or None when it has none."""
    import os

    import torch

    full = os.path.join(checkpoint, FSDP_MODEL_FILES[0])
    if os.path.isfile(full):
        return FSDP_MODEL_FILES[0], set(torch.load(full, map_location="cpu", weights_only=True, mmap=True))
    sharded = os.path.join(checkpoint, FSDP_MODEL_FILES[1])
    if os.path.isfile(os.path.join(sharded, ".metadata")):
        from torch.distributed.checkpoint import FileSystemReader

        metadata = FileSystemReader(sharded).read_metadata().state_dict_metadata
        return FSDP_MODEL_FILES[1], {k[len("model.") :] for k in metadata if k.startswith("model.")}
    return None


def check_fsdp_checkpoint_layout(model, checkpoint, state_dict_type: str) -> None:
    """Refuse to resume ``model`` under FSDP from the Trainer checkpoint ``checkpoint`` when accelerate's resume file
    holds some module in another layout than the model's (a run trained with another recipe, or without one):
    those files hold the trained model's own ``state_dict()``, which accelerate loads by key, so torch would
    fail on a bare key (or a missing key) after the model was sharded.

    Raises:
        StateDictLayoutError: naming ``resume_from_checkpoint``, the FSDP ``state_dict_type``, the file, and up to
            4 modules with the checkpoint's and the model's parameter names there.
    """
    found = fsdp_checkpoint_keys(checkpoint)
    if found is None:
        return
    name, saved = found
    own = set(model.state_dict().keys())
    missing, unexpected = own - saved, saved - own
    if not missing or not unexpected:
        return  # torch's own report (strict load / DCP planner) names a key missing on one side only

    def owners(key: str) -> list[str]:
        parts = key.split(".")[:-1]
        return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]

    under_unexpected = {owner for key in unexpected for owner in owners(key)}
    modules: dict[str, None] = {}
    for key in sorted(missing):
        owner = next((o for o in owners(key) if o in under_unexpected), "")
        modules.setdefault(owner, None)
    lines = []
    for path in list(modules)[:4]:
        cls = type(model.get_submodule(path)).__name__ if path else type(model).__name__
        relative = len(path) + 1 if path else 0
        theirs = sorted(k[relative:] for k in unexpected if not path or k.startswith(path + "."))
        ours = sorted(k[relative:] for k in missing if not path or k.startswith(path + "."))
        lines.append(
            f"{path or '(root)'} ({cls}): the checkpoint has {', '.join(theirs[:4])}{' ...' * (len(theirs) > 4)}, "
            f"the model {', '.join(ours[:4])}{' ...' * (len(ours) > 4)}"
        )
    raise StateDictLayoutError(
        f"resume_from_checkpoint={str(checkpoint)!r} under FSDP (state_dict_type {state_dict_type}): {name} holds "
        f"{len(modules)} module(s) in another layout than this {type(model).__name__}'s:\n  "
        + "\n  ".join(lines)
        + "\naccelerate's FSDP resume files hold the trained model's own state_dict(), read back by key: resume "
        "with the patch (recipe) the run was trained with. The checkpoint's model.safetensors (FULL_STATE_DICT) "
        "holds the original layout: from_pretrained loads it into either layout, for a new run.",
        keys=sorted(unexpected)[:8],
    )


def _load_checkpoint_wrapper(original):
    @functools.wraps(original)
    def _load_from_checkpoint(self, resume_from_checkpoint, *args, **kwargs):
        if getattr(self, "is_fsdp_enabled", False) and resume_from_checkpoint is not None:
            plugin = self.accelerator.state.fsdp_plugin
            check_fsdp_checkpoint_layout(self.model, resume_from_checkpoint, str(plugin.state_dict_type).split(".")[-1])
        return original(self, resume_from_checkpoint, *args, **kwargs)

    return _load_from_checkpoint


_WRAPPERS = {
    "_save_optimizer_and_scheduler": _save_wrapper,
    "_load_optimizer_and_scheduler": _load_wrapper,
    "_load_from_checkpoint": _load_checkpoint_wrapper,
}


def _wrap(module: ModuleType) -> None:
    """Wrap the methods of ``module.Trainer`` named in ``_WRAPPERS`` (idempotent)."""
    with _lock:
        trainer = getattr(module, "Trainer", None)
        if trainer is None or len(_installed):
            return
        for name, make in _WRAPPERS.items():
            if name in vars(trainer):  # a release without the method: nothing to wrap
                _installed.setattr(trainer, name, make(vars(trainer)[name]), raw=True)


_hook = PostImportHook(TARGET_MODULE, _wrap)


def install() -> None:
    """Wrap the Trainer's optimizer save and load and its FSDP resume now, or when ``transformers.trainer`` is
    imported (idempotent)."""
    with _lock:
        _hook.now_or_on_import()


def uninstall() -> None:
    """Restore the Trainer's methods (exactly: ``Trainer.__dict__`` as before) and remove the import hook."""
    with _lock:
        _hook.disarm()
        _installed.undo()


def installed() -> bool:
    """Whether :func:`install` is in effect (the methods wrapped, or the hook waiting for the import)."""
    with _lock:
        if TARGET_MODULE not in sys.modules:
            return _hook.armed
        return len(_installed) > 0
