"""After a load: parameters of replacement modules that the checkpoint did not provide.

A replacement with a different parameter layout and no (or wrong) conversion rules loads "successfully":
Transformers lists the keys as missing, in a table that is easy to miss, and re-initialises only what the model's
``_init_weights`` knows (standard layers): a replacement's own ``nn.Parameter``/buffers would keep uninitialised
memory, so modelpatch gives them the values the replacement's ``__init__`` gives them, as ``from_config`` would. For a
patched model that is almost always a missing rule. When the checkpoint *does* hold tensors under such a module
that no rule read (its keys come back unexpected or mismatched: a layout the rules cannot read, e.g. fused experts
tensors for a recipe of per-expert ones), loading raises :class:`~modelpatch.conversion.errors.ConversionError`
before the model is returned: the model would compute with ``__init__`` values, and ``save_pretrained`` would write
them as the checkpoint. :func:`allow_init_values` is the explicit opt-out. A replacement's own new parameters (no
checkpoint tensor under the module was left unread: a new gate, a new adapter) keep their ``__init__`` values with
a warning that names them, or raise when a strict patch scope (or registry-wide strict mode) is in force.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
from transformers.utils import logging

from ..patching.interception import unhooked_init
from ..patching.provenance import Replacement, provenance
from ..patching.registry import is_strict_patching
from ..patching.scopes import active_scopes
from ..undo import context_set
from .errors import ConversionError

logger = logging.get_logger("modelpatch")

__all__ = ["allow_init_values", "check_replacements_loaded", "restore_pending_initial_values"]

_ALLOW_INIT_VALUES: contextvars.ContextVar[bool] = contextvars.ContextVar("modelpatch_allow_init_values", default=False)


@contextlib.contextmanager
def allow_init_values() -> Iterator[None]:
    """Inside this block, loads keep replacement parameters the checkpoint did not fill at their ``__init__`` values
    (with a warning naming them) even where the checkpoint held tensors for those modules that no rule read, instead
    of raising :class:`~modelpatch.conversion.errors.ConversionError`: for re-initialising a module on purpose.
    Per context (thread / task), restored on exit.

    Example::

        with modelpatch.allow_init_values(), apply_patches({"LlamaAttention": MyAttention}):
            model = AutoModelForCausalLM.from_pretrained(path)
    """
    with context_set(_ALLOW_INIT_VALUES, True):
        yield


def _replaced_module_paths(model) -> dict[str, Replacement]:
    return {path: found for path, module in model.named_modules() if (found := provenance(module)) is not None}


def check_replacements_loaded(model, loading_info) -> None:
    """Warn (or raise when strict) if checkpoint keys missing for ``model`` belong to replacement modules.

    Args:
        model: the model being loaded.
        loading_info: Transformers' ``LoadStateDictInfo`` of that load (``missing_keys``, ``mismatched_keys``).

    Raises:
        ConversionError: some parameter of a replacement module was not loaded while the checkpoint held tensors
            under that module that were not read (unexpected or mismatched keys; outside :func:`allow_init_values`),
            or a strict scope is active and some parameter of a replacement module was not loaded.
    """
    missing = set(getattr(loading_info, "missing_keys", ()) or ())
    mismatched = {entry[0] for entry in getattr(loading_info, "mismatched_keys", ()) or ()}
    missing |= mismatched
    unread_keys = set(getattr(loading_info, "unexpected_keys", ()) or ()) | mismatched
    if not missing:
        return
    replaced = _replaced_module_paths(model)
    if not replaced:
        return
    hits: dict[str, list[str]] = {}
    for key in sorted(missing):
        owner = max((p for p in replaced if p and key.startswith(p + ".")), key=len, default=None)
        if owner is not None:
            hits.setdefault(owner, []).append(key[len(owner) + 1 :])
    if not hits:
        return
    lines = [
        f"{path} ({replaced[path].replacement.__name__} replacing {replaced[path].original.__name__}): "
        f"{', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''}"
        for path, keys in list(hits.items())[:6]
    ]
    count = sum(len(k) for k in hits.values())
    unread = {path: sorted(k for k in unread_keys if k.startswith(path + ".")) for path in hits}
    unread = {path: keys for path, keys in unread.items() if keys}
    if unread and not _ALLOW_INIT_VALUES.get():
        shown = [f"{path}: {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''}" for path, keys in unread.items()]
        raise ConversionError(
            f"modelpatch: {count} parameter(s) of {len(hits)} replacement module(s) were not loaded, while the "
            f"checkpoint holds tensors under {len(unread)} of those modules that no conversion rule read (a layout "
            "the patch's rules cannot read; the model would compute with __init__ values and save them as the "
            "checkpoint):\n  " + "\n  ".join(lines) + "\nunread checkpoint tensors:\n  " + "\n  ".join(shown) + "\n"
            "Load with a recipe (or conversion rules) that reads this layout, e.g. its *-linear-experts recipe for "
            "fused experts tensors; to keep the __init__ values on purpose, load inside modelpatch.allow_init_values()."
        )
    message = (
        f"modelpatch: {count} parameter(s) of {len(hits)} replacement module(s) were not in the checkpoint (or did "
        "not fit); they hold the values the replacement's own __init__ gives them, standard layers re-initialised by "
        "the model's _init_weights, as from_config builds them. If they should come from the checkpoint, its layout "
        "needs conversion rules for them:\n  " + "\n  ".join(lines)
    )
    if is_strict_patching() or any(scope.strict for scope in active_scopes()):
        raise ConversionError(message)
    # the missing tensors are materialised after this hook: rebuild them once from_pretrained has finished
    model.__dict__[_PENDING_ATTR] = [(path, replaced[path], names) for path, names in hits.items()]
    logger.warning(message)


_PENDING_ATTR = "_modelpatch_pending_initial_values"


def restore_pending_initial_values(model: nn.Module) -> None:
    """Called when ``from_pretrained`` returns: give the replacement parameters the checkpoint did not provide the
    values their ``__init__`` gives them (see :func:`_restore_initial_values`)."""
    pending = model.__dict__.pop(_PENDING_ATTR, None)
    for path, record, names in pending or ():
        _restore_initial_values(model.get_submodule(path), record, names)


def _restore_initial_values(module: nn.Module, record: Replacement, names: list[str]) -> None:
    """Give ``names`` (parameters/buffers of ``module``, relative to it) the values a fresh replacement gets from its
    own ``__init__``: ``from_pretrained`` allocates the module without running it on real memory, so a parameter the
    checkpoint does not provide would otherwise hold whatever that memory held (values like 1e34). Standard layers
    are then re-initialised by the model's ``_init_weights``, as Transformers does for every missing key.

    The fresh module is built on the CPU in an empty context (no patch scope applies to what it builds), with the
    arguments the replacement was built with; a replacement whose ``__init__`` cannot run again keeps the warning.
    """
    args, kwargs = record.arguments

    def build() -> nn.Module:
        cls: Any = record.replacement
        fresh = cls.__new__(cls)
        with torch.device("cpu"):
            unhooked_init(record.replacement)(fresh, *args, **kwargs)
        return fresh

    try:
        state = contextvars.Context().run(build).state_dict()
    except Exception as exc:  # noqa: BLE001 - user code: keep the load, say why the values could not be rebuilt
        logger.warning(f"modelpatch: could not rebuild the initial values of {record.replacement.__qualname__}: {exc}")
        return
    with torch.no_grad():
        for name in names:
            value = state.get(name)
            try:
                target: torch.Tensor = module.get_parameter(name)
            except AttributeError:
                try:
                    target = module.get_buffer(name)
                except AttributeError:
                    continue
            if value is None or target.device.type == "meta" or target.shape != value.shape:
                continue
            target.copy_(value.to(dtype=target.dtype))
