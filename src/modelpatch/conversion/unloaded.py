"""After a load: parameters of replacement modules that the checkpoint did not provide.

A replacement with a different parameter layout and no (or wrong) conversion rules loads "successfully":
Transformers lists the keys as missing and initialises them at random, in a table that is easy to miss. For a
patched model that is almost always a missing rule, so modelpatch names the replaced modules concerned in a
warning, and raises :class:`~modelpatch.conversion.errors.ConversionError` when a strict patch scope (or
registry-wide strict mode) is in force, before the model is returned.
"""

from __future__ import annotations

from transformers.utils import logging

from ..patching.provenance import Replacement, provenance
from .errors import ConversionError

logger = logging.get_logger("modelpatch")

__all__ = ["check_replacements_loaded"]


def _replaced_module_paths(model) -> dict[str, Replacement]:
    return {path: found for path, module in model.named_modules() if (found := provenance(module)) is not None}


def check_replacements_loaded(model, loading_info) -> None:
    """Warn (or raise when strict) if checkpoint keys missing for ``model`` belong to replacement modules.

    Args:
        model: the model being loaded.
        loading_info: Transformers' ``LoadStateDictInfo`` of that load (``missing_keys``, ``mismatched_keys``).

    Raises:
        ConversionError: a strict scope is active and some parameter of a replacement module was not loaded.
    """
    missing = set(getattr(loading_info, "missing_keys", ()) or ())
    missing |= {entry[0] for entry in getattr(loading_info, "mismatched_keys", ()) or ()}
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
    message = (
        f"modelpatch: {sum(len(k) for k in hits.values())} parameter(s) of {len(hits)} replacement module(s) were not "
        "in the checkpoint (or did not fit) and are randomly initialised; the checkpoint layout needs conversion "
        "rules for them:\n  " + "\n  ".join(lines)
    )
    from ..patching.registry import is_strict_patching
    from ..patching.scopes import active_scopes

    if is_strict_patching() or any(scope.strict for scope in active_scopes()):
        raise ConversionError(message)
    logger.warning(message)
