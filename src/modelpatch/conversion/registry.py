"""Registry of user conversion rules, keyed by ``model_type`` or class name, global or scoped.

Global entries live in a process-wide dict guarded by a lock (inside :func:`isolated_conversion_registry`, the CLI's
in-process sandbox, in a dict of the current thread / asyncio task instead); scoped entries (:func:`apply_conversion_rules`) live in a
``ContextVar`` stack and vanish when the block exits, also on error. Transformers' own rule table is never mutated
(in Transformers a user override of ``qwen2_moe`` survived ``clear_patch_mapping()`` and broke every later vanilla
load); built-in rules are read from it and composed at load/save time (see :mod:`.compose`).
"""

from __future__ import annotations

import difflib
import functools
import threading
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from copy import deepcopy
from dataclasses import dataclass

from transformers import __version__ as transformers_version
from transformers import conversion_mapping as _tcm
from transformers import core_model_loading as _tcml
from transformers.utils import logging

from ..errors import ModelpatchKeyError, ModelpatchRuntimeError, ModelpatchTypeError, ModelpatchValueError
from ..patching.catalog import CATALOG
from ..patching.registry import is_strict_patching, on_clear
from ..undo import context_set
from .overlap import drop_replaced_builtins
from .rules import WeightConverter, WeightRenaming, as_modelpatch_rule

logger = logging.get_logger("modelpatch")

__all__ = [
    "RuleSet",
    "register_checkpoint_conversion_mapping",
    "get_checkpoint_conversion_mapping",
    "unregister_checkpoint_conversion_mapping",
    "registered_conversion_mappings",
    "apply_conversion_rules",
    "lookup",
    "has_rules",
    "isolated_conversion_registry",
]


@dataclass(frozen=True)
class RuleSet:
    """Rules registered under one ``model_type`` or class name.

    ``overwrite=True`` drops every built-in Transformers rule of that name; otherwise a user rule replaces only the
    built-in rules touching the same parameters and the others keep working. ``strict=True`` turns the warning for a
    rule that matched no checkpoint key into an error.
    """

    name: str
    rules: tuple[WeightRenaming | WeightConverter, ...]
    overwrite: bool = False
    strict: bool = False

    def fresh_rules(self) -> list[WeightRenaming | WeightConverter]:
        return [deepcopy(rule) for rule in self.rules]


_lock = threading.RLock()
_global: dict[str, RuleSet] = {}
_cleared: set[str] = set()  # names removed by a clear, so a later unregister of them is a no-op
_scoped: ContextVar[tuple[Mapping[str, RuleSet], ...]] = ContextVar("modelpatch_conversion_scopes", default=())
# ``(rules, cleared)`` of the current context inside :func:`isolated_conversion_registry`, else ``None``
_isolated: ContextVar[tuple[dict[str, RuleSet], set[str]] | None] = ContextVar(
    "modelpatch_isolated_conversion_registry", default=None
)


def _store() -> tuple[dict[str, RuleSet], set[str]]:
    """``(registered rule sets, names removed by a clear)`` that the current context reads and writes."""
    isolated = _isolated.get()
    return (_global, _cleared) if isolated is None else isolated


@contextmanager
def isolated_conversion_registry() -> Iterator[None]:
    """Inside the block, the current thread / asyncio task (and only it) sees no globally registered user rule;
    registrations made inside are its own and are gone after the block. Other threads and tasks keep reading and
    writing the process-wide registry meanwhile, unchanged. Scoped :func:`apply_conversion_rules` blocks are not
    affected. What the CLI's in-process sandbox (:class:`modelpatch.cli.sandbox.CommandSandbox`) enters."""
    with context_set(_isolated, ({}, set())):
        yield


@functools.cache
def _class_names() -> frozenset[str]:
    """The class names Transformers exports (its lazy module's names: nothing is imported)."""
    import transformers

    return frozenset(n for n in dir(transformers) if n[:1].isupper())


def unknown_name_message(name: str) -> str | None:
    """``None`` when ``name`` is a ``model_type`` or a class name the installed Transformers knows (or a class
    modelpatch has catalogued, e.g. remote code); else why rules registered under it may never apply, with the
    closest known name (:func:`difflib.get_close_matches`)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if name in CONFIG_MAPPING_NAMES:
        return None
    if name[:1].isupper():
        if name in _class_names() or CATALOG.classes_named(name):
            return None
        candidates: Collection[str] = _class_names()
    else:
        candidates = CONFIG_MAPPING_NAMES.keys()
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.75)
    return (
        f"conversion rules registered under {name!r}, which is neither a model_type nor a class name of the installed "
        f"Transformers {transformers_version}"
        + (f": did you mean {close[0]!r}?" if close else "")
        + " (rules apply to a model or sub-model of that type or class only: remote code, or never)"
    )


def _make_ruleset(name: object, mapping: object, overwrite: object, strict: object) -> RuleSet:
    if not isinstance(name, str) or not name:
        raise ModelpatchTypeError(f"model_type_or_class_name must be a non-empty str, got {name!r}")
    if isinstance(mapping, (str, bytes)) or not isinstance(mapping, Sequence):
        raise ModelpatchTypeError(
            f"mapping for '{name}' must be a list of WeightConverter/WeightRenaming, got {mapping!r}"
        )
    ruleset = RuleSet(name, tuple(as_modelpatch_rule(rule) for rule in mapping), bool(overwrite), bool(strict))
    unknown = unknown_name_message(name)
    if unknown is not None:
        if strict or is_strict_patching():
            raise ModelpatchValueError(unknown + " (strict); nothing was registered")
        logger.warning(unknown)
    return ruleset


def register_checkpoint_conversion_mapping(
    model_type_or_class_name: str,
    mapping: Sequence[_tcml.WeightTransform],
    overwrite: bool = False,
    *,
    strict: bool = False,
) -> None:
    """Register conversion rules for a ``model_type`` (e.g. ``"qwen2_moe"``) or a class name (e.g.
    ``"LlamaForCausalLM"``; class names win over ``model_type``).

    Args:
        model_type_or_class_name: key the rules are looked up by, for the root model and for each sub-model
            (whose rules then only apply under its own prefix). A sub-model's class name applies beside the rules
            an ancestor has by ``model_type`` (``"LlamaModel"`` in a ``LlamaForCausalLM`` loaded with ``"llama"``
            rules); a rule of each touching the same parameters makes loads and saves raise ``ConversionError``
            naming both. A name no installed Transformers model type or class has is named in a warning with the
            closest known name.
        mapping: list of :class:`WeightConverter` / :class:`WeightRenaming` (Transformers' classes are accepted and
            rebuilt as modelpatch rules).
        overwrite: replace an earlier user registration of the same name and drop all built-in rules of that name.
            Without it, the rules are composed with the built-ins (a user rule replaces the built-in rules touching
            the same parameters).
        strict: a rule that matches no checkpoint key raises at load time instead of logging a warning.

    Raises:
        ValueError: the name is already registered by the user and ``overwrite`` is false, or it is a name no
            installed Transformers model type or class has and ``strict`` (or strict mode) is on (registry
            unchanged).
        TypeError: bad name or rule type (registry unchanged).
    """
    ruleset = _make_ruleset(model_type_or_class_name, mapping, overwrite, strict)
    require_hooks()
    with _lock:
        registered, cleared = _store()
        if model_type_or_class_name in registered and not overwrite:
            raise ModelpatchValueError(
                f"Conversion mapping for '{model_type_or_class_name}' is already registered; pass overwrite=True "
                "to replace it or unregister it first."
            )
        registered[model_type_or_class_name] = ruleset
        cleared.discard(model_type_or_class_name)


_HOOKS_INSTALLED = threading.Event()  # set by :mod:`modelpatch.apply.transformers`, which wraps the load/save functions


def set_hooks_installed(installed: bool) -> None:
    """Called by :func:`modelpatch.apply.transformers.install` / ``uninstall`` (this module does not import them)."""
    if installed:
        _HOOKS_INSTALLED.set()
    else:
        _HOOKS_INSTALLED.clear()


def require_hooks() -> None:
    """Raise unless the load/save wrappers are installed: rules registered without them would be ignored silently.

    Raises:
        ModelpatchRuntimeError: modelpatch's Transformers integration was uninstalled.
    """
    if not _HOOKS_INSTALLED.is_set():
        raise ModelpatchRuntimeError(
            "modelpatch's conversion hooks are not installed (modelpatch.apply.transformers.uninstall() was "
            "called): conversion rules would be ignored; call modelpatch.apply.transformers.install() first"
        )


def unregister_checkpoint_conversion_mapping(model_type_or_class_name: str, *, missing_ok: bool = False) -> None:
    """Remove the user rules registered globally under a name; the built-in rules of that name apply again.

    A name that was registered and then removed by :func:`clear_checkpoint_conversion_mappings` or
    :func:`~modelpatch.clear_patch_mapping` is already unregistered: unregistering it is a no-op, so clean-up code
    (``try: register ... finally: unregister``) works whichever clean-up runs first.

    Args:
        missing_ok: also accept a name that was never registered.

    Raises:
        KeyError: nothing was ever registered under that name and ``missing_ok`` is false (registry unchanged).
    """
    with _lock:
        registered, cleared = _store()
        if model_type_or_class_name not in registered:
            if missing_ok or model_type_or_class_name in cleared:
                cleared.discard(model_type_or_class_name)
                return
            raise ModelpatchKeyError(
                f"No conversion mapping registered for '{model_type_or_class_name}'; registered: {sorted(registered)}"
            )
        del registered[model_type_or_class_name]


def registered_conversion_mappings() -> dict[str, RuleSet]:
    """The user rules registered globally now: ``{model_type or class name: RuleSet}`` in registration order (a
    copy; scoped :func:`apply_conversion_rules` blocks are not part of it, Transformers' built-ins neither)."""
    with _lock:
        return dict(_store()[0])


def clear_checkpoint_conversion_mappings() -> None:
    """Remove every globally registered user rule (scoped blocks clean up themselves). A later
    :func:`unregister_checkpoint_conversion_mapping` of a name removed here is a no-op."""
    with _lock:
        registered, cleared = _store()
        cleared.update(registered)
        registered.clear()


on_clear(clear_checkpoint_conversion_mappings)  # clear_patch_mapping() clears user conversion rules too


def lookup(name: str | None) -> RuleSet | None:
    """The user :class:`RuleSet` in effect for ``name``: the rules of every enclosing scoped block (innermost first)
    and of the global registry, combined; an inner rule replaces the outer rules that produce the same parameters,
    the others keep working (nested recipes each bring their own rules). ``overwrite``/``strict`` apply if any of
    the combined sets asks for it."""
    if not name:
        return None
    sets = [scope[name] for scope in reversed(_scoped.get()) if name in scope]
    with _lock:
        registered = _store()[0]
        if name in registered:
            sets.append(registered[name])
    if len(sets) <= 1:
        return sets[0] if sets else None
    rules = list(sets[0].rules)
    for outer in sets[1:]:
        rules += drop_replaced_builtins(list(outer.rules), rules)
    return RuleSet(name, tuple(rules), any(s.overwrite for s in sets), any(s.strict for s in sets))


def has_rules() -> bool:
    """Whether any user rule is in effect in the current context."""
    return bool(_scoped.get()) or bool(_store()[0])


def builtin_rules(name: str | None) -> list[_tcml.WeightTransform] | None:
    """Transformers' built-in rules for ``name`` (a fresh copy), or ``None``."""
    if not name:
        return None
    rules: list[_tcml.WeightTransform] | None = _tcm.get_checkpoint_conversion_mapping(name)  # unannotated there
    return rules


def get_checkpoint_conversion_mapping(model_type_or_class_name: str) -> list[_tcml.WeightTransform] | None:
    """The effective rules for a name: the user's rules followed by the built-in rules they do not replace
    (only the user's with ``overwrite=True``), or the built-ins alone, or ``None``. Returns fresh copies."""
    user = lookup(model_type_or_class_name)
    builtins = builtin_rules(model_type_or_class_name)
    if user is None:
        return builtins
    rules: list[_tcml.WeightTransform] = list(user.fresh_rules())
    if builtins and not user.overwrite:
        rules += drop_replaced_builtins(builtins, rules)
    return rules


@contextmanager
def apply_conversion_rules(
    mapping: Mapping[str, Sequence[_tcml.WeightTransform]],
    *,
    overwrite: bool | Collection[str] = False,
    strict: bool = False,
) -> Iterator[None]:
    """Scoped form of :func:`register_checkpoint_conversion_mapping`: ``{name: [rules...]}`` apply to loads and saves
    inside the block (current thread/async context only) and are gone after it, also on error. Rules of nested
    blocks and global registrations of the same name are combined (see :func:`lookup`): an inner rule replaces only
    the outer rules producing the same parameters. A model loaded inside the block keeps its rules, so saving
    it after the block still writes the original layout.

    Args:
        mapping: ``{model_type_or_class_name: [WeightConverter | WeightRenaming, ...]}`` (Transformers' rule classes
            are accepted too).
        overwrite: ``True`` drops Transformers' built-in rules of every name in ``mapping``; a collection of names
            drops them for those names only (what a recipe mixing both needs).
        strict: a rule that matches no checkpoint key raises at load time instead of logging a warning.

    Raises:
        TypeError: ``mapping`` is not a dict of name -> list of rules, a name is not a str, or a rule is not a rule
            instance (nothing is entered).
        ValueError: ``overwrite`` names a name that is not in ``mapping``.
    """
    with rulesets_in_force(scoped_rulesets(mapping, overwrite=overwrite, strict=strict)):
        yield


@contextmanager
def rulesets_in_force(scope: Mapping[str, RuleSet]) -> Iterator[None]:
    """Put already validated rule sets (see :func:`scoped_rulesets`) in force for the block, in the current
    context only; what :func:`apply_conversion_rules` and ``apply_patches(conversion_rules=...)`` both enter.

    Raises:
        ModelpatchRuntimeError: the conversion hooks are uninstalled (see :func:`require_hooks`).
    """
    require_hooks()
    with context_set(_scoped, _scoped.get() + (scope,)):
        yield


def scoped_rulesets(
    mapping: Mapping[str, Sequence[_tcml.WeightTransform]],
    *,
    overwrite: bool | Collection[str] = False,
    strict: bool = False,
) -> dict[str, RuleSet]:
    """Validate the arguments of :func:`apply_conversion_rules` into ``{name: RuleSet}`` (raises as it documents)."""
    if not isinstance(mapping, Mapping):
        raise ModelpatchTypeError(
            "conversion_rules must be a dict {model_type_or_class_name: [WeightConverter | WeightRenaming, ...]}, "
            f"got {type(mapping).__name__}: e.g. conversion_rules={{'llama': [rule]}} instead of conversion_rules=[rule]"
        )
    if isinstance(overwrite, bool):
        overwritten = set(mapping) if overwrite else set()
    elif isinstance(overwrite, (str, bytes)) or not isinstance(overwrite, Collection):
        raise ModelpatchTypeError(f"overwrite must be a bool or a collection of names, got {overwrite!r}")
    else:
        overwritten = set(overwrite)
        unknown = sorted(overwritten - set(mapping))
        if unknown:
            raise ModelpatchValueError(
                f"overwrite names {unknown}, which have no rules in conversion_rules ({sorted(mapping)})"
            )
    return {name: _make_ruleset(name, rules, name in overwritten, strict) for name, rules in mapping.items()}
