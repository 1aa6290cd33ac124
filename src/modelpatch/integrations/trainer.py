"""The Trainer's optimizer checkpoint in the original layout, so a run resumes across layouts.

A patched model's Trainer checkpoint already holds its weights in the original layout (``save_pretrained``), and
resuming loads them into a patched model through the ``load_state_dict`` hooks of :mod:`modelpatch.conversion.
statedict`. This module does the same for ``optimizer.pt``, by wrapping two methods of ``transformers.Trainer``:

* ``_save_optimizer_and_scheduler``: for a model with a layout of its own
  (:func:`~modelpatch.conversion.optimizer.carries_own_layout`), ``optimizer.pt`` is written in the original layout
  (:func:`~modelpatch.conversion.optimizer.original_optimizer_state_dict`): what an unpatched run of the same
  optimizer writes, so an unpatched Trainer resumes from it as from its own. The state is converted before anything
  is written; state that cannot be converted (Adafactor's factored state on a converted parameter) is written in
  the model's own layout, as without modelpatch, with a warning (the same recipe resumes from it).
* ``_load_optimizer_and_scheduler``: for such a model, the state dict read from ``optimizer.pt`` goes through
  :func:`~modelpatch.conversion.optimizer.optimizer_state_dict_in_model_layout` before the optimizer loads it, so
  a checkpoint of an unpatched run (or of a run with the same recipe, in either layout) resumes the patched model.

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

from ..conversion.errors import OptimizerStateError, StateDictLayoutError
from ..conversion.optimizer import (
    carries_own_layout,
    optimizer_state_dict_in_model_layout,
    original_optimizer_state_dict,
)
from ..lazy_imports import PostImportHook, pretrained_model_class
from ..undo import UndoStack

__all__ = ["install", "uninstall", "installed", "TARGET_MODULE", "check_fsdp_checkpoint_layout", "fsdp_checkpoint_keys"]

logger = logging.get_logger("modelpatch.integrations.trainer")

TARGET_MODULE = "transformers.trainer"
"""Transformers' module holding ``Trainer`` (imported lazily by ``transformers``)."""

_lock = threading.RLock()
_installed = UndoStack()


def _plain(trainer) -> bool:
    """Whether ``trainer`` saves and loads ``optimizer.pt`` with ``torch.save``/``load_state_dict`` of the whole
    optimizer state dict (no DeepSpeed/FSDP/SageMaker/XLA), and its model has a layout of its own."""
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
    try:
        return carries_own_layout(model)
    except Exception:  # noqa: BLE001 - a model modelpatch cannot inspect: Transformers' own path
        return False


def _save_wrapper(original):
    @functools.wraps(original)
    def _save_optimizer_and_scheduler(self, output_dir, *args, **kwargs):
        if not _plain(self):
            return original(self, output_dir, *args, **kwargs)
        try:
            state = original_optimizer_state_dict(self.model, self.optimizer)
        except OptimizerStateError as exc:
            logger.warning(
                f"modelpatch: optimizer.pt in {output_dir} keeps the layout of this {type(self.model).__name__} (an "
                f"unpatched run cannot resume from it; the same recipe can): {exc}"
            )
            return original(self, output_dir, *args, **kwargs)
        with UndoStack() as undo:
            undo.setattr(self.optimizer, "state_dict", lambda: state, raw=True)
            return original(self, output_dir, *args, **kwargs)

    return _save_optimizer_and_scheduler


def _load_wrapper(original):
    @functools.wraps(original)
    def _load_optimizer_and_scheduler(self, checkpoint, *args, **kwargs):
        if checkpoint is None or not _plain(self):
            return original(self, checkpoint, *args, **kwargs)
        optimizer, model = self.optimizer, self.model
        own = optimizer.load_state_dict

        def load_state_dict(state_dict):
            return own(optimizer_state_dict_in_model_layout(model, optimizer, state_dict))

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
