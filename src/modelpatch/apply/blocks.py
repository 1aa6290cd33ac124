"""``apply_patches``: one block that puts class replacements and conversion rules in force together.

The patch scope (:mod:`modelpatch.patching.scopes`) knows nothing of checkpoint conversion; this module,
above both :mod:`modelpatch.patching` and :mod:`modelpatch.conversion`, joins them: the conversion rules
of a block are a *companion* of its patch scope, entered and exited with it. ``Recipe.apply`` goes through
:func:`apply_patches` too, so a block and a recipe behave the same (``overwrite`` included).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from ..conversion.registry import rulesets_in_force, scoped_rulesets
from ..errors import ModelpatchValueError
from ..patching.registry import build_patch_mapping, registered_patch_mapping
from ..patching.scopes import PatchScope

if TYPE_CHECKING:
    from transformers.core_model_loading import WeightTransform

__all__ = ["apply_patches"]


def apply_patches(
    mapping: Mapping[str, type] | None = None,
    *,
    strict: bool = False,
    conversion_rules: Mapping[str, Sequence[WeightTransform]] | None = None,
    overwrite: bool | Collection[str] = False,
) -> PatchScope:
    """Context manager (and decorator): build models with class replacements inside the block, originals outside.

    Args:
        mapping: ``{key: replacement}`` to apply inside the block only, without touching the registry.
            ``None`` applies the registry (:func:`~modelpatch.register_patch_mapping`) as it is now.
        strict: on a normal exit, raise :class:`~modelpatch.UnmatchedPatchKeyError` if a key matched no class that
            was built in the block (otherwise a warning naming the key is logged); and a ``from_pretrained``
            inside the block raises :class:`~modelpatch.ConversionError` when parameters of replacement
            modules were not in the checkpoint or a rule of ``conversion_rules`` matched no checkpoint key
            (otherwise a warning names the modules or the rule).
        conversion_rules: ``{model_type_or_class_name: [WeightConverter | WeightRenaming, ...]}``
            checkpoint conversion rules in force inside the block only (see
            :func:`modelpatch.conversion.apply_conversion_rules`); Transformers' own rule classes are accepted.
        overwrite: ``True`` drops Transformers' built-in conversion rules of every name in ``conversion_rules``
            inside the block; a collection of names drops them for those names only.

    Returns:
        A :class:`~modelpatch.PatchScope`; ``with apply_patches() as scope`` gives access to ``scope.fired`` and
        ``scope.unmatched_keys``; ``scope.start()`` / ``scope.stop()`` open and close it without ``with``.

    Raises:
        TypeError, ValueError: ``mapping`` is invalid (see :func:`~modelpatch.register_patch_mapping`), or
            ``conversion_rules`` is not a dict of name -> list of rule instances (a list, or a rule *class* such as
            ``Concatenate`` instead of ``Concatenate(dim=0)``); nothing is entered then.

    Only the calling thread or asyncio task sees the replacements; on exit (normal, exception, or out
    of order) nothing remains to undo. Modules built inside the block keep their replacements.

    The call of Transformers 5.25's ``transformers.monkey_patching.apply_patches(mapping=None)`` works the same here
    (a mapping used instead of the registry, ``None`` for the registry, ``{}`` a no-op, exact names before
    patterns, patterns matched with :func:`re.search`, usable as a decorator), with one difference on purpose: a key
    that is a Python identifier is an exact class name only (see :mod:`modelpatch.patching.registry`).
    """
    resolved = registered_patch_mapping() if mapping is None else build_patch_mapping(mapping)
    companions: tuple[Callable[[], AbstractContextManager[object]], ...] = ()
    if conversion_rules is not None:
        rulesets = scoped_rulesets(conversion_rules, overwrite=overwrite, strict=strict)  # validated once, here
        if rulesets:
            companions = (functools.partial(rulesets_in_force, rulesets),)
    elif overwrite:
        raise ModelpatchValueError("apply_patches(overwrite=...) applies to conversion_rules, and none were given")
    return PatchScope(resolved, explicit=True, strict=strict, companions=companions)
