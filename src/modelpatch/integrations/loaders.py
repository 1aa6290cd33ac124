"""The checkpoint loaders of other libraries on models that carry conversion rules: each loads the original
(checkpoint) layout exactly, or refuses before anything is written.

``model.load_state_dict`` takes both layouts through the hooks of :mod:`modelpatch.conversion.statedict`; these
loaders need more than that, because they look at the keys themselves:

* ``transformers.trainer_utils.load_sharded_checkpoint`` (the Trainer's resume of a sharded checkpoint) checks the
  index's keys against ``model.state_dict()`` before loading, so ``strict=True`` refused an original-layout folder
  and ``strict=False`` reported ``qkv_proj`` missing and ``q_proj``/``k_proj``/``v_proj`` unexpected although they
  loaded. The wrapper runs the check in the caller's layout on the shards' headers
  (:func:`~modelpatch.conversion.loaders.analyse_checkpoint`: also the both-layouts and shape checks, across
  shards), then lets the original load shard by shard with ``strict=False`` (the hooks convert each shard; a group
  split across shards is placed into its rows) and returns the report in the caller's layout.
* accelerate's ``load_checkpoint_in_model`` (and so ``load_checkpoint_and_dispatch``) skips keys that are not the
  model's with a warning (``strict=False``) or fails on them, and with a ``device_map`` writes each tensor itself
  (``set_module_tensor_to_device``), never through ``load_state_dict``. The wrapper analyses the checkpoint's
  headers, then lets the original run while accelerate's ``load_state_dict`` (the one function it reads each file
  with) returns every file already in the model's layout (:class:`~modelpatch.conversion.loaders.
  CheckpointConversion`: a group split across files converted whole, once). ``strict=True`` refuses keys in neither
  layout before the first file is read; a checkpoint that gives a group only in part is refused with a
  ``device_map`` (there is no whole parameter to write).
* ``safetensors.torch.load_model`` loads with ``strict=False`` and checks afterwards: with ``strict=True`` the
  wrapper runs the check first, on the file's header, so a refused file leaves the model as it was.

Every wrapper calls the original unchanged for a model without conversion state, and for a checkpoint already in
the model's layout. The Trainer's resume (``Trainer._load_from_checkpoint``) goes through ``load_state_dict``
(one file) or ``load_sharded_checkpoint`` (as ``transformers.trainer`` imported it).

**Installation.** :func:`install` (called by :func:`modelpatch.apply.transformers.install`, on import of
modelpatch) replaces each function in its own module and in the modules that re-export it (``accelerate``,
``accelerate.utils``, ``accelerate.big_modeling``, ``accelerate.utils.bnb``, ``transformers.trainer``; those
imported later take the wrapper from the module they import it from). A module not imported yet is not imported
(``transformers.trainer_utils`` imports PEFT, bitsandbytes, ...: seconds and log lines): its function is wrapped
right after it is imported (:class:`~modelpatch.lazy_imports.PostImportHook`). Code that imported one of these names *before*
modelpatch keeps the original: import modelpatch first. Accelerate is optional: without it only the other
two are wrapped. A name someone wrapped again after us is left alone. :func:`uninstall` restores the originals
exactly, in every module that holds a wrapper.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import importlib.util
import inspect
import json
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from ..conversion.errors import StateDictLayoutError
from ..conversion.loaders import CheckpointConversion, analyse_checkpoint, loads_in_parts
from ..conversion.state import get_state
from ..lazy_imports import PostImportHook
from ..undo import context_set

__all__ = ["install", "uninstall", "installed"]

_lock = threading.RLock()
_originals: dict[str, Callable] = {}
_wrappers: dict[str, Callable] = {}
_CONVERSION: contextvars.ContextVar[CheckpointConversion | None] = contextvars.ContextVar(
    "modelpatch_accelerate_conversion", default=None
)


@dataclass(frozen=True)
class _Target:
    key: str
    module: str  # where the function is defined
    name: str
    reexports: tuple[str, ...]
    make: Callable[[Callable], Callable]
    optional: str | None = None  # the distribution that must be importable


def _model_name(model) -> str:
    return type(model).__name__


# -- transformers.trainer_utils.load_sharded_checkpoint ---------------------------------------------------------------


def _sharded_index(folder, prefer_safe: bool) -> str | None:
    """The index file ``load_sharded_checkpoint`` reads (its own choice between the two), ``None`` if none."""
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME

    index, safe_index = os.path.join(folder, WEIGHTS_INDEX_NAME), os.path.join(folder, SAFE_WEIGHTS_INDEX_NAME)
    index_present, safe_present = os.path.isfile(index), os.path.isfile(safe_index)
    if not index_present and not safe_present:
        return None
    return safe_index if safe_present and (prefer_safe or not index_present) else index


def _check_groups_load_across_files(analysis, file_of: dict, loader: str) -> None:
    """A group split across files must be placeable in parts (each file is one ``load_state_dict`` call)."""
    for group, _ in analysis.converted:
        files = sorted({file_of[s] for s in group.source_keys()})
        if len(files) > 1 and not loads_in_parts(group.rule):
            raise StateDictLayoutError(
                f"{loader}: the sources {list(group.source_keys())} of '{group.key}' are split across "
                f"{[os.path.basename(f) for f in files]}, and {group.rule!r} cannot be loaded in parts (one file at "
                "a time). Load the folder with modelpatch.load_converted_state_dict(model, folder) or "
                "from_pretrained. Nothing was loaded.",
                keys=list(group.source_keys()),
            )


def _make_load_sharded_checkpoint(original: Callable) -> Callable:
    @functools.wraps(original)
    def load_sharded_checkpoint(model, folder, strict=True, prefer_safe=True):
        if get_state(model) is None:
            return original(model, folder, strict, prefer_safe)
        index = _sharded_index(folder, prefer_safe)
        if index is None:
            return original(model, folder, strict, prefer_safe)  # raises its own error
        with open(index, encoding="utf-8") as fh:
            weight_map = json.load(fh)["weight_map"]
        files = [os.path.join(folder, name) for name in dict.fromkeys(weight_map.values())]
        analysis, file_of = analyse_checkpoint(model, files)  # raises before anything is loaded
        error = analysis.strict_error(_model_name(model))
        if strict and error is not None:
            raise error
        if not analysis.foreign:
            return original(model, folder, strict, prefer_safe)
        _check_groups_load_across_files(analysis, file_of, "load_sharded_checkpoint")
        original(model, folder, False, prefer_safe)  # shard by shard, through the load_state_dict hooks
        return torch.nn.modules.module._IncompatibleKeys(analysis.missing_in_caller_layout(), analysis.unexpected)

    return load_sharded_checkpoint


# -- safetensors.torch.load_model ---------------------------------------------------------------------------------


def _make_load_model(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def load_model(model, filename, *args, **kwargs):
        arguments = signature.bind(model, filename, *args, **kwargs).arguments
        if not arguments.get("strict", True) or get_state(model) is None:
            return original(model, filename, *args, **kwargs)
        analysis, _ = analyse_checkpoint(model, [filename])  # raises before anything is loaded
        error = analysis.strict_error(_model_name(model), tied_count_as_given=True)
        if error is not None:
            raise error
        return original(model, filename, *args, **kwargs)

    return load_model


# -- accelerate.utils.modeling.load_checkpoint_in_model -----------------------------------------------------------


def _accelerate_checkpoint_files(checkpoint) -> list[str] | None:
    """The files ``load_checkpoint_in_model`` reads for ``checkpoint`` (its own resolution), ``None`` where it
    raises (it then raises its own error)."""
    from accelerate.utils import SAFE_WEIGHTS_NAME, WEIGHTS_NAME

    path = os.fspath(checkpoint)
    if os.path.isfile(path):
        if not path.endswith(".json"):
            return [path]
        index = path
    elif os.path.isdir(path):
        names = os.listdir(path)
        for name in (WEIGHTS_NAME, SAFE_WEIGHTS_NAME):
            if name in names:
                return [os.path.join(path, name)]
        indexes = [name for name in names if name.endswith(".index.json")]
        if len(indexes) != 1:
            return None
        index = os.path.join(path, indexes[0])
    else:
        return None
    with open(index) as fh:
        weight_map = json.load(fh)
    weight_map = weight_map.get("weight_map", weight_map)
    folder = os.path.split(index)[0]
    return [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]


def _make_load_checkpoint_in_model(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def load_checkpoint_in_model(model, checkpoint, *args, **kwargs):
        if get_state(model) is None:
            return original(model, checkpoint, *args, **kwargs)
        arguments = signature.bind(model, checkpoint, *args, **kwargs).arguments
        files = _accelerate_checkpoint_files(checkpoint)
        if files is None:
            return original(model, checkpoint, *args, **kwargs)
        conversion = CheckpointConversion(model, files)  # the headers: raises before anything is loaded
        analysis = conversion.analysis
        if arguments.get("strict", False) and analysis.unexpected:
            error = analysis.strict_error(_model_name(model), missing=False)
            assert error is not None
            raise error
        if not analysis.foreign:
            return original(model, checkpoint, *args, **kwargs)
        if arguments.get("device_map") is not None and conversion.partial:
            raise StateDictLayoutError(
                f"load_checkpoint_in_model(device_map=...) writes whole parameters, and the checkpoint gives only "
                f"{conversion.partial} of the sources of {sorted({p.key for p in analysis.placements})} (the rest of "
                "each group is absent). Give the whole checkpoint, or load without device_map (the given rows are "
                "then placed into the fused parameter) and dispatch the model afterwards. Nothing was loaded.",
                keys=conversion.partial,
            )
        with context_set(_CONVERSION, conversion):
            return original(model, checkpoint, *args, **kwargs)

    return load_checkpoint_in_model


def _make_accelerate_load_state_dict(original: Callable) -> Callable:
    @functools.wraps(original)
    def load_state_dict(checkpoint_file, *args, **kwargs):
        tensors = original(checkpoint_file, *args, **kwargs)
        conversion = _CONVERSION.get()
        if conversion is None:
            return tensors
        return conversion.convert_file(checkpoint_file, tensors)

    return load_state_dict


# -- installation -------------------------------------------------------------------------------------------------

_ACCELERATE_REEXPORTS = ("accelerate", "accelerate.utils", "accelerate.big_modeling", "accelerate.utils.bnb")

_TARGETS = (
    _Target(
        "load_sharded_checkpoint",
        "transformers.trainer_utils",
        "load_sharded_checkpoint",
        ("transformers.trainer",),
        _make_load_sharded_checkpoint,
    ),
    _Target("load_model", "safetensors.torch", "load_model", (), _make_load_model),
    _Target(
        "load_checkpoint_in_model",
        "accelerate.utils.modeling",
        "load_checkpoint_in_model",
        _ACCELERATE_REEXPORTS,
        _make_load_checkpoint_in_model,
        optional="accelerate",
    ),
    _Target(
        "accelerate.load_state_dict",
        "accelerate.utils.modeling",
        "load_state_dict",
        (),
        _make_accelerate_load_state_dict,
        optional="accelerate",
    ),
)


def _wrap(target: _Target, home: ModuleType) -> None:
    """Wrap ``target`` in its (imported) module and in the re-exporting modules imported so far (idempotent).

    Not an :class:`~modelpatch.undo.UndoStack`: the wrappers are installed once per process, part of them later by an
    import hook, and the record of the originals must outlive :func:`uninstall` where another library has wrapped
    ours since (an undo would forget it, and the next :func:`install` would wrap that library's wrapper around ours:
    two conversions per load)."""
    with _lock:
        current = getattr(home, target.name)
        wrapper = _wrappers.get(target.key)
        if current is not wrapper:
            if target.key in _originals and current is not _originals[target.key]:
                return  # wrapped again by someone after us: their wrapper calls ours
            _originals[target.key] = current
            wrapper = _wrappers[target.key] = target.make(current)
            setattr(home, target.name, wrapper)
        for name in target.reexports:
            module = sys.modules.get(name)
            if module is not None and getattr(module, target.name, None) is _originals[target.key]:
                setattr(module, target.name, wrapper)


_hooks = {target.key: PostImportHook(target.module, functools.partial(_wrap, target)) for target in _TARGETS}


def install() -> None:
    """Wrap the loaders whose modules are imported; arm an import hook for the others (idempotent, thread-safe;
    re-entrant). Imports none of the modules."""
    with _lock:
        for target in _TARGETS:
            _hooks[target.key].now_or_on_import()


def uninstall() -> None:
    """Remove the import hooks; put the original functions back in every module that holds one of the wrappers."""
    with _lock:
        for target in _TARGETS:
            _hooks[target.key].disarm()
            wrapper, original = _wrappers.get(target.key), _originals.get(target.key)
            if wrapper is None or original is None:
                continue
            for name in (target.module, *target.reexports):
                module = sys.modules.get(name)
                if module is not None and getattr(module, target.name, None) is wrapper:
                    setattr(module, target.name, original)
            if getattr(sys.modules.get(target.module), target.name, None) is original:
                del _wrappers[target.key], _originals[target.key]


def installed() -> bool:
    """Whether every loader that can be wrapped here is (accelerate's only when it is installed): wrapped, or, its
    module not imported yet, with its import hook waiting."""
    with _lock:
        for target in _TARGETS:
            home = sys.modules.get(target.module)
            if home is None:
                if target.optional is not None and importlib.util.find_spec(target.optional) is None:
                    continue
                if not _hooks[target.key].armed:
                    return False
                continue
            if getattr(home, target.name, None) is not _wrappers.get(target.key):
                return False
        return True
